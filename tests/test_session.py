"""The router session (src/runtime/session.py): segment bookkeeping across switches, each path (hit / map / re-prefill)
exact under an identity map and under the exact non-identity pair (tests/exact_pair.py, where a leak of the
receiver's native state shows: the wrong mapper must then differ), provenance, levers, the cost-aware policy, and
deterministic rollback — bit-identical caches and greedy `generate` outputs — for every refusal kind."""

import copy
import warnings
from dataclasses import replace

import pytest
import torch

from src.artifact import EVIDENCE
from src.eval.scoring import score_continuations
from src.forward import prefill
from src.length_evidence import evidence
from src.runtime.plan import Levers
from src.runtime.routing import MAX_LENGTH_FACTOR, CostModel, Policy, RouteRefusedWarning, bind
from src.runtime.session import Session
from src.runtime.splice import spliced_cache
from tests.conftest import tiny
from tests.exact_pair import _mapper, exact_pair, max_cache_diff
from tests.session_state import same, state

TOL = 1e-4  # float32 rounding of an exact map and of chunked forwards
VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture(scope="module")
def routes(pair):
    return both_ways(pair)


def both_ways(pair) -> dict:
    """Both directions of the exact pair: the target's cache is an exact map of the source's and (with the inverse
    coefficients) back."""
    inverse = replace(
        pair.exact,
        weight_k=torch.linalg.inv(pair.exact.weight_k.double()).float(),
        weight_v=torch.linalg.inv(pair.exact.weight_v.double()).float(),
        manifest=pair.exact.manifest
        | {"source_fingerprint": pair.exact.manifest["target_fingerprint"]}
        | {"target_fingerprint": pair.exact.manifest["source_fingerprint"], "method": "exact_inverse"},
    )
    return {
        ("a", "b"): bind(pair.source, pair.target, pair.exact, pair.tokenizer_hash),
        ("b", "a"): bind(pair.target, pair.source, inverse, pair.tokenizer_hash),
    }


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def session(pair, routes=None, **policy) -> Session:
    return Session({"a": pair.source, "b": pair.target}, routes, Policy(**policy))


def native(model, ids: torch.Tensor):
    return prefill(model, ids[None])


def test_map_path_is_exact_and_a_wrong_map_shows(pair, routes):
    history, turn = tokens(30, 1), tokens(7, 2)
    s = session(pair, routes)
    s.append("a", history)
    record = s.switch_to("b", turn)
    assert (record.sender, record.path, record.status, record.reason) == ("a", "map", "applied", "policy: map")
    assert (record.context, record.hit, record.mapped, record.prefilled, record.turn) == (30, 0, 30, 0, 7)
    assert record.prefill_fraction == 0.0 and record.bytes > 0 and record.ms >= record.ms_map > 0
    conversation = torch.cat([history, turn])
    assert torch.equal(s.ids, conversation)
    assert max_cache_diff(s.cache("b"), native(pair.target, conversation)) < TOL
    assert max_cache_diff(s.cache("a"), native(pair.target, history)) > 1e-2  # the pair really differs
    wrong = session(pair, {("a", "b"): bind(pair.source, pair.target, pair.wrong, pair.tokenizer_hash)})
    wrong.append("a", history)
    assert wrong.switch_to("b", turn).path == "map"
    assert max_cache_diff(wrong.cache("b"), native(pair.target, conversation)) > 1e-2  # no native state leaked


class Spy:
    """A KVTransfer that records the positions of every mapped piece."""

    def __init__(self, transfer, seen: list):
        self.transfer, self.seen, self.token_features = transfer, seen, transfer.token_features
        self.source, self.target = transfer.source, transfer.target

    def __call__(self, cache, positions=None, input_ids=None):
        self.seen.append(positions.tolist())
        return self.transfer(cache, positions=positions, input_ids=input_ids)


def identity_routes(pair):
    """The source paired with a copy of itself through the identity map (relocated positions must still be exact)."""
    twin = copy.deepcopy(pair.source)
    kv = pair.exact.weight_k.shape
    eye = torch.eye(kv[-1]).expand(kv).clone()
    mapper = lambda s, t: _mapper(s, t, pair.tokenizer_hash, eye, eye, "identity")
    models = {"a": pair.source, "b": twin}
    return models, {("a", "b"): bind(pair.source, twin, mapper(pair.source, twin), pair.tokenizer_hash),
                    ("b", "a"): bind(twin, pair.source, mapper(twin, pair.source), pair.tokenizer_hash)}  # fmt: skip


@pytest.mark.parametrize("kind", ["identity", "exact_pair"])
def test_switches_keep_segments_positions_and_every_path_exact(pair, routes, kind):
    models, routes = identity_routes(pair) if kind == "identity" else ({"a": pair.source, "b": pair.target}, routes)
    positions: list[list[int]] = []
    routes = {key: replace(route, transfer=Spy(route.transfer, positions)) for key, route in routes.items()}
    c0, c1, c2, turn = tokens(12, 3), tokens(9, 4), tokens(8, 5), tokens(5, 6)
    s = Session(models, routes)
    s.append("a", c0)
    first = s.switch_to("b", c1)
    second = s.switch_to("a", c2)
    third = s.switch_to("b", turn)
    again = s.switch_to("b")
    assert [(r.path, r.hit, r.mapped, r.prefilled, r.turn) for r in (first, second, third, again)] == [
        ("map", 0, 12, 0, 9),
        ("map", 12, 9, 0, 8),
        ("map", 21, 8, 0, 5),
        ("hit", 34, 0, 0, 0),
    ]
    assert positions == [list(range(0, 12)), list(range(12, 21)), list(range(21, 29))]
    a, b = s.segments("a"), s.segments("b")
    assert [(g.start, g.end, g.origin, g.exact, g.source) for g in a] == [
        (0, 12, "native", True, None),
        (12, 21, "mapped", False, "b"),
        (21, 29, "native", False, None),
    ]
    assert [(g.start, g.end, g.origin, g.source) for g in b] == [
        (0, 12, "mapped", "a"),
        (12, 21, "native", None),
        (21, 29, "mapped", "a"),
        (29, 34, "native", None),
    ]
    assert a[1].mapper == routes[("b", "a")].mapper_id and b[0].mapper == routes[("a", "b")].mapper_id
    assert s.exact_prefix("a")[0].tolist() == c0.tolist()  # mapped KV is never served as an exact prefix hit
    assert s.exact_prefix("b")[1] is None and s.exact_prefix("b")[0].numel() == 0
    whole = s.ids
    assert max_cache_diff(s.cache("b"), native(models["b"], whole)) < TOL
    assert max_cache_diff(s.cache("a"), native(models["a"], whole[:29])) < TOL


def test_hit_is_bit_exact_and_reprefill_is_native(pair, routes):
    history, turn = tokens(20, 7), tokens(6, 8)
    s = session(pair, routes, mode="reprefill")
    s.append("b", history[:10])
    held = copy.deepcopy(s.cache("b"))
    s.switch_to("a", history[10:])
    record = s.switch_to("b", turn)
    assert (record.path, record.status, record.hit, record.prefilled, record.prefill_fraction) == (
        "reprefill", "applied", 10, 10, 1.0
    )  # fmt: skip
    for own, before in zip(s.cache("b").layers, held.layers, strict=True):  # the held prefix is reused untouched
        assert torch.equal(own.keys[:, :, :10], before.keys) and torch.equal(own.values[:, :, :10], before.values)
    assert max_cache_diff(s.cache("b"), native(pair.target, s.ids)) < TOL
    assert s.exact_prefix("b")[0].numel() == 26  # everything native: all of it is exact
    ids, cache = s.exact_prefix("b")
    assert max_cache_diff(cache, s.cache("b")) == 0.0 and cache is not s.cache("b")


def test_levers_keep_their_tokens_native(pair, routes):
    history, turn = tokens(24, 9), tokens(4, 10)
    levers = Levers(native_sink=2, hold_back=3)
    wrong = {("a", "b"): bind(pair.source, pair.target, pair.wrong, pair.tokenizer_hash)}
    s = session(pair, wrong, levers=levers)
    s.append("a", history)
    record = s.switch_to("b", turn)
    assert (record.mapped, record.prefilled) == (19, 5)
    assert record.prefill_fraction == pytest.approx(5 / 24)
    assert [(g.start, g.end, g.origin) for g in s.segments("b")] == [
        (0, 2, "native"),
        (2, 21, "mapped"),
        (21, 28, "native"),
    ]
    assert s.exact_prefix("b")[0].numel() == 2  # the sink is the target's own, exact
    reference = spliced_cache(wrong[("a", "b")].transfer, native(pair.source, history), history[None], levers)
    cut = copy.deepcopy(s.cache("b"))
    cut.crop(-4)
    assert max_cache_diff(cut, reference) < TOL  # the same splice as the quality protocol's
    exact = session(pair, routes, levers=replace(levers, recompute=0.25, recompute_rule="recency", native_layers=1))
    exact.append("a", history[:10])
    exact.switch_to("b", history[10:])
    back = exact.switch_to("a", turn)  # levers on a span that starts at 10, above a held prefix
    assert (back.hit, back.mapped, back.prefilled, back.recomputed) == (10, 11, 3, 4)
    assert max_cache_diff(exact.cache("a"), native(pair.source, exact.ids)) < TOL


def test_auto_policy_takes_the_cheaper_path_and_says_why(pair, routes):
    history = tokens(16, 11)

    def run(costs: CostModel) -> str:
        s = Session({"a": pair.source, "b": pair.target}, routes, Policy(mode="auto"), costs)
        s.append("a", history)
        record = s.switch_to("b", history[:2])
        assert record.reason.startswith("auto:")
        return record.path

    assert run(CostModel()) == "map"  # nothing measured yet: map by default
    slow_map = CostModel()
    for n in (8, 32):
        slow_map.observe("b", "map", n, 100.0 + n)
        slow_map.observe("b", "prefill", n, 1.0 + 0.1 * n)
    assert run(slow_map) == "reprefill"
    fast_map = CostModel()
    for n in (8, 32):
        fast_map.observe("b", "map", n, 0.01 * n)
        fast_map.observe("b", "prefill", n, 10.0 + n)
    assert fast_map.estimate("b", "prefill", 20) == pytest.approx(30.0)
    assert fast_map.estimate("b", "map", 4) is not None and CostModel().estimate("b", "map", 4) is None
    assert run(fast_map) == "map"
    assert len(fast_map.samples[("b", "map")]) == 3  # the session's own handoff is measured too


def _overflowing(mapper):
    """Finite coefficients (the artifact checks pass) whose products overflow float32: non-finite mapped values."""
    weight = mapper.weight_v.clone()
    weight[1] = 3e38
    return replace(mapper, weight_v=weight)


REFUSALS = {  # kind → (how the route / policy / state is broken, expected status, words in the reason)
    "artifact_mismatch": ("artifact", "unsupported", "target fingerprint"),
    "nonfinite_map": ("nan_map", "fallback_reprefill", "not finite"),
    "nonfinite_source": ("nan_source", "fallback_reprefill", "NaN"),
    "beyond_length": ("length", "fallback_reprefill", "calibration length"),
    "beyond_evidence": ("evidence", "fallback_reprefill", "beyond the mapper's verified length 12"),
    "sliding_window": ("sliding", "unsupported", "sliding-window"),
    "failed_guard": ("guard", "fallback_reprefill", "guard"),
    "no_route": ("none", "unsupported", "no mapper route"),
}


def verified_to_12(mapper):
    """The mapper with length evidence (src/length_evidence.py) that verifies histories of up to 12 tokens."""
    row = {"bin": [0, 16], "length": 12, "items": 300, "loss_points_high": 0.0, "split": "valid", "run_id": "r",
           "record": "r/record.json"}  # fmt: skip
    block = evidence([row], [16], 1.0, 300, mapper.manifest.get("tensor_sha256"))  # bound to its coefficients
    return replace(mapper, manifest=mapper.manifest | {EVIDENCE: block})


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_every_refusal_rolls_back_bit_identically(pair, kind):
    how, status, words = REFUSALS[kind]
    source, target, mapper = pair.source, pair.target, pair.exact
    policy = {}
    if how == "artifact":
        mapper = replace(mapper, manifest=mapper.manifest | {"target_fingerprint": "0" * 64})
    elif how == "nan_map":
        mapper = _overflowing(mapper)
    elif how == "length":
        mapper = replace(mapper, manifest=mapper.manifest | {"calibration": {"seq_len": 8}})
        policy = {"max_length_factor": 2.0}
    elif how == "evidence":
        mapper = verified_to_12(mapper)
    elif how == "sliding":
        target = copy.deepcopy(target)
        target.config.sliding_window = 8
    elif how == "guard":
        policy = {"guard_max_abs": 1e-3}
    routes = {} if how == "none" else {("a", "b"): bind(source, target, mapper, pair.tokenizer_hash)}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        tried = Session({"a": source, "b": target}, routes, Policy(**policy))
    refused_at_binding = how in ("artifact", "sliding")  # warned once, when the session is built
    assert [str(w.message) for w in warned if w.category is RouteRefusedWarning] == (
        [f"route a → b was refused at binding ({routes[('a', 'b')].refusal}): every handoff on it re-prefills"]
        if refused_at_binding
        else []
    )
    never = Session({"a": source, "b": target}, {}, Policy(mode="reprefill"))
    history, turn, more = tokens(20, 12), tokens(5, 13), [tokens(4, seed) for seed in (14, 15, 16)]
    outputs = []
    for s in (tried, never):
        s.append("a", history)
        if how == "nan_source":
            s.cache("a", live=True).layers[1].keys[0, 0, 3, 0] = float("nan")
        record = s.switch_to("b", turn)
        generated = s.generate("b", more[0], max_new_tokens=6)
        s.switch_to("a", more[1])
        outputs.append((record, generated, s.generate("a", more[2], max_new_tokens=4), s.cache("b")))
    (record, *tried_out, tried_cache), (_, *never_out, never_cache) = outputs
    assert (record.path, record.status) == ("reprefill", status) and words in record.reason, record
    assert record.prefill_fraction == 1.0 and record.mapped == 0
    assert all(torch.equal(x, y) for x, y in zip(tried_out, never_out, strict=True))  # greedy outputs identical
    assert max_cache_diff(tried_cache, never_cache) == 0.0  # bit-identical caches
    assert tried.exact_prefix("b")[0].numel() == tried.holds("b")  # a fallback leaves only native, exact KV


def test_generate_reads_the_session_cache(pair, routes):
    history = tokens(25, 15)
    s = session(pair, routes)
    s.append("a", history)
    record = s.switch_to("b")  # no new turn: the last unseen token is read natively, for next-token logits
    assert (record.path, record.mapped, record.prefilled) == ("map", 24, 1)
    with torch.no_grad():
        assert torch.allclose(s.logits, pair.target(history[None]).logits[:, -1], atol=TOL)
    out = s.generate("b", [], max_new_tokens=5)
    x = history[None]
    with torch.no_grad():
        for _ in range(5):  # greedy by full forwards on the target
            x = torch.cat([x, pair.target(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.tolist() == x[0, 25:].tolist()
    assert s.holds("b") == s.ids.numel() == 30
    assert max_cache_diff(s.cache("b"), native(pair.target, s.ids)) < TOL


def test_errors_name_the_problem(pair, routes):
    s = session(pair, routes)
    s.append("a", tokens(5, 16))
    with pytest.raises(ValueError, match="switch_to"):
        s.append("b", tokens(2, 17))
    with pytest.raises(ValueError, match="no model 'c'"):
        s.switch_to("c")
    with pytest.raises(ValueError, match="names a model"):
        Session({"a": pair.source}, routes)
    with pytest.raises(ValueError, match="policy mode"):
        Policy(mode="fastest")
    with pytest.raises(ValueError, match="one conversation"):
        s.append("a", torch.zeros(2, 3, dtype=torch.long))


# --- Safe to fail II: every input checked before anything changes ------------------------------------------------


def conversation(pair, routes, **policy) -> Session:
    """a read a history, b was handed it (mapped) with a turn: both caches, segments, a record and logits to keep."""
    s = session(pair, routes, **policy)
    s.append("a", tokens(14, 20))
    s.switch_to("b", tokens(4, 21))
    return s


def test_a_route_bound_to_other_weights_is_refused_when_the_session_is_built(pair, routes):
    other = exact_pair("llama", seed=1)  # the same architecture, other weights
    for models, role in (({"a": pair.source, "b": other.target}, "receiver"), ({"a": other.source, "b": pair.target}, "sender")):  # fmt: skip
        with pytest.raises(ValueError, match=f"bound to another {role} than the session's"):
            Session(models, {("a", "b"): routes[("a", "b")]})
    twin = copy.deepcopy(pair.target)  # another object, the same fingerprint: the route's verification holds
    s = Session({"a": pair.source, "b": twin}, {("a", "b"): routes[("a", "b")]})
    s.append("a", tokens(10, 22))
    assert s.switch_to("b").path == "map"
    for bad, match in (({("a", "b"): "route"}, "not a Route"), ({("a", "b"): replace(routes[("a", "b")], transfer=None)}, "exactly one"),
                       ({"a": routes[("a", "b")]}, "keyed by")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Session({"a": pair.source, "b": pair.target}, bad)
    for models in ({"a": pair.source, "b": "weights.pt"}, {"a": pair.source, 2: pair.target}, {}):
        with pytest.raises(ValueError, match="model"):
            Session(models)


BAD_IDS = {  # ids → words in the error
    "floats": ([1.7, 2.2], "float"),
    "float tensor": (torch.tensor([3.0, 4.0]), "float"),
    "negative": ([3, -1], "outside the vocabulary"),
    "beyond the vocabulary": ([3, VOCAB], "outside the vocabulary"),
    "batch": (torch.zeros(2, 3, dtype=torch.long), "one conversation"),
    "bools": (torch.tensor([True, False]), "bool"),
    "text": ("hello", "sequence of integers"),
    "ragged": ([[1, 2], [3]], "sequence of integers"),
    "none": (None, "sequence of integers"),
    "huge": ([2**70], "sequence of integers"),
}


@pytest.mark.parametrize("kind", sorted(BAD_IDS))
def test_bad_ids_are_refused_at_every_entry_and_change_nothing(pair, routes, kind):
    ids, words = BAD_IDS[kind]
    s = conversation(pair, routes)
    before = state(s)
    calls = {
        "append": lambda: s.append("b", ids),
        "switch_to": lambda: s.switch_to("a", ids),
        "generate": lambda: s.generate("b", ids, max_new_tokens=2),
        "score": lambda: s.score("b", [tokens(2, 23), ids]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=words):
            call()
        assert same(state(s), before), name


def test_ids_must_be_read_by_every_model_of_the_session(pair):
    wide = tiny("llama", vocab_size=160)  # its head writes ids 96..159 the source cannot read
    s = Session({"a": pair.source, "b": wide})
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 96\) \('a' reads 96 ids"):
        s.append("b", [5, 120])
    s.append("b", tokens(6, 24))
    generated = s.generate("b", [], max_new_tokens=24)
    assert int(generated.max()) < VOCAB  # generation keeps to the ids every model reads
    s.switch_to("a")  # so the source can read the whole conversation
    assert s.score("b", [[150]])[0].tokens == 1  # a continuation only `b` reads: its own vocabulary


def test_a_lever_refusal_is_decided_before_mapping_and_changes_nothing(pair, routes):
    calls: list = []
    feature = replace(routes[("a", "b")], transfer=Spy(routes[("a", "b")].transfer, calls))
    feature.transfer.token_features = True  # the splice refuses the deviation rule on a token-feature mapper's span
    s = Session({"a": pair.source, "b": pair.target}, {("a", "b"): feature}, Policy(levers=Levers(recompute=0.5)))
    s.append("a", tokens(12, 25))
    before = state(s)
    with pytest.raises(ValueError, match="recompute_layers ≥ 2"):
        s.switch_to("b", tokens(3, 26))
    assert calls == [] and same(state(s), before)  # never mapped, nothing committed
    assert s.switch_to("a").path == "hit"  # a retry is not served the refused handoff's tokens


def test_a_failure_midway_through_a_switch_restores_the_session(pair, routes):
    s = conversation(pair, routes, levers=Levers(native_sink=2, hold_back=3))
    s.switch_to("a", tokens(5, 27))  # b holds 18 of 23 tokens; the next switch reads a sink, maps, then a tail
    before = state(s)

    def fail_on_the_tail(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 3 + 2:  # the hold-back and the turn, after the span was spliced
            raise RuntimeError("planted failure")

    handle = pair.target.model.register_forward_pre_hook(fail_on_the_tail, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            s.switch_to("b", tokens(2, 28))
    finally:
        handle.remove()
    assert same(state(s), before)
    record = s.switch_to("b", tokens(2, 28))
    assert (record.hit, record.mapped) == (18, 2) and max_cache_diff(s.cache("b"), native(pair.target, s.ids)) < TOL


def test_generate_is_all_or_nothing(pair, routes):
    s = conversation(pair, routes)
    before = state(s)
    for bad, match in [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer ≥ 1"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer ≥ 1"),
        (dict(max_new_tokens=True), "max_new_tokens must be an integer ≥ 1"),
        (dict(max_new_tokens=2, num_beams=2), "num_beams must be 1"),
        (dict(max_new_tokens=2, past_key_values=None), r"sets \[.past_key_values.\] itself"),
        (dict(max_new_tokens=2, not_a_generate_argument=1), "not_a_generate_argument"),  # raised inside HF
    ]:
        with pytest.raises(ValueError, match=match):
            s.generate("b", [], **bad)
        assert same(state(s), before), bad
    with pytest.raises(ValueError, match="switch_to"):
        s.generate("a", [], max_new_tokens=2)


def test_fork_and_original_evolve_independently(pair, routes):
    s = conversation(pair, routes)
    fork = s.fork()
    assert same(state(fork), state(s))
    before = state(s)
    fork.switch_to("a", tokens(3, 29))
    fork.generate("a", [], max_new_tokens=3)
    assert same(state(s), before)  # the fork moved, the original did not
    forked = state(fork)
    s.generate("b", tokens(2, 30), max_new_tokens=4)
    s.switch_to("a")
    assert same(state(fork), forked)  # and back
    for x in (s, fork):  # each is still a correct session of its own conversation
        assert max_cache_diff(x.cache("a"), native(pair.source, x.ids)) < TOL
    assert s.fork().routes == s.routes and s.fork().readers["a"].model is pair.source  # shared, not copied


def test_score_is_the_offline_scorer_on_the_models_state_and_changes_nothing(pair, routes):
    s = conversation(pair, routes)  # b's cache: mapped history + its own turn
    before = state(s)
    continuations = [tokens(3, 31), tokens(1, 32).tolist(), tokens(5, 33)]
    scores = s.score("b", continuations)
    assert same(state(s), before)
    reference = copy.deepcopy(s.cache("b"))
    reference.crop(-1)
    rows = [torch.as_tensor(c) for c in continuations]
    expected = score_continuations(pair.target, reference, int(s.ids[-1]), rows)  # the offline scorer, same state
    assert [x.logprob for x in scores] == pytest.approx([e[0] for e in expected], abs=1e-4)
    assert [x.greedy for x in scores] == [e[1] for e in expected] and [x.tokens for x in scores] == [3, 1, 5]
    with torch.no_grad():  # the exact pair: the mapped cache scores as the target's own full forward
        full = pair.target(torch.cat([s.ids, rows[0]])[None]).logits[0, -4:-1].log_softmax(-1)
    assert scores[0].logprob == pytest.approx(float(full.gather(-1, rows[0][:, None]).sum()), abs=1e-3)
    one = session(pair, routes)
    one.append("a", [7])
    with torch.no_grad():  # a one-token conversation: nothing to crop below it
        full = pair.source(torch.tensor([[7, 3, 4]])).logits[0, :2].log_softmax(-1)
    assert one.score("a", [[3, 4], [5]])[0].logprob == pytest.approx(float(full[0, 3] + full[1, 4]), abs=1e-4)
    for bad, match in (([], "non-empty list"), ([[]], "continuation 0 is empty"), ("ab", "non-empty list")):
        with pytest.raises(ValueError, match=match):
            s.score("b", bad)
    handle = pair.target.model.layers[-1].register_forward_pre_hook(lambda *_: 1 / 0)  # earlier layers cached
    try:
        with pytest.raises(ZeroDivisionError):
            s.score("b", continuations)
    finally:
        handle.remove()
    assert same(state(s), before)  # a failure midway is cropped back too
    with pytest.raises(ValueError, match="switch_to"):
        s.score("a", [[1]])


def test_what_the_session_shows_is_a_copy_unless_asked_live(pair, routes):
    s = conversation(pair, routes)
    before = state(s)
    s.cache("b").layers[0].keys.zero_()
    s.cache("b").crop(-3)
    s.ids.zero_(), s.logits.zero_(), s.exact_prefix("a")[0].zero_()
    s.records[0].path = "edited"
    assert same(state(s), before)
    assert s.cache("b", live=True) is s.cache("b", live=True)


def test_next_token_logits_after_every_switch(pair, routes):
    history = tokens(16, 34)
    s = session(pair, routes)
    s.append("a", history)
    assert s.switch_to("b").path == "map"
    with torch.no_grad():
        assert torch.allclose(s.logits, pair.target(history[None]).logits[:, -1], atol=TOL)
        assert s.switch_to("a").path == "hit"  # a holds everything and no turn: its own last logits
        assert torch.allclose(s.logits, pair.source(history[None]).logits[:, -1], atol=TOL)


def test_records_say_exactly_what_happened(pair, routes):
    history = tokens(10, 35)
    covered = session(pair, routes, levers=Levers(native_sink=6, hold_back=6))
    policy = session(pair, routes, mode="reprefill")
    records = []
    for s in (covered, policy):
        s.append("a", history)
        records.append(s.switch_to("b", tokens(2, 36)))
        records.append(s.switch_to("b", tokens(2, 37)))  # nothing unseen: a hit
    assert [(r.path, r.levers_cover_all, r.prefilled, r.prefill_fraction) for r in records] == [
        ("reprefill", True, 10, 1.0),
        ("hit", False, 0, 0.0),
        ("reprefill", False, 10, 1.0),
        ("hit", False, 0, 0.0),
    ]


def test_the_length_guard_is_on_by_default(pair):
    assert Policy().max_length_factor == MAX_LENGTH_FACTOR == 8.0
    short = replace(pair.exact, manifest=pair.exact.manifest | {"calibration": {"seq_len": 2}})  # guard: 16 tokens
    route = {("a", "b"): bind(pair.source, pair.target, short, pair.tokenizer_hash)}
    outcomes = []
    for policy in (Policy(), Policy(max_length_factor=None)):
        s = Session({"a": pair.source, "b": pair.target}, route, policy)
        s.append("a", tokens(20, 38))
        outcomes.append(s.switch_to("b", tokens(2, 39)))
    assert (outcomes[0].status, outcomes[1].status) == ("fallback_reprefill", "applied")
    assert "beyond 8 × the mapper's calibration length 2" in outcomes[0].reason


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_length_factor", float("nan")), ("max_length_factor", float("inf")), ("max_length_factor", 0.0),
     ("max_length_factor", True), ("guard_max_abs", float("nan")), ("guard_max_abs", -1.0), ("guard_max_abs", "1"),
     ("levers", {"native_sink": 2}), ("mode", None)],
)  # fmt: skip
def test_policy_numbers_that_would_disable_a_guard_are_refused(field, value):
    with pytest.raises(ValueError, match=field if field != "mode" else "policy mode"):
        Policy(**{field: value})
    assert Policy(guard_max_abs=0.0).guard_max_abs == 0.0 and Policy(max_length_factor=None).max_length_factor is None
