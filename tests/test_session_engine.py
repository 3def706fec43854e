"""The router session on the static engine (`Session(..., engines=...)`, src/runtime/session.py): on the exact
non-identity pair (tests/exact_pair.py, CPU float32, eager) an engine-backed session equals the DynamicCache session —
records, caches, logits, greedy outputs, scores, provenance — across append / switch_to (map and re-prefill, every
lever the engine runs) / generate / score / fork; the exact map gives the receiver's own prefill and the wrong one
shows; every refusal rolls back bit-identically to an engine-backed re-prefill session; a failure after the splice
wrote slots, or a conversation past the capacity, leaves the session exactly as it was."""

import contextlib
import copy
from dataclasses import replace

import pytest
import torch

from src.forward import prefill
from src.runtime.engine import Engine
from src.runtime.plan import Levers
from src.runtime.routing import Policy, RouteRefusedWarning, bind
from src.runtime.session import Session
from src.runtime.splice import engine_handoff
from tests.conftest import tiny
from tests.exact_pair import exact_pair, max_cache_diff
from tests.session_state import same, state
from tests.test_session import REFUSALS, Spy, _overflowing, both_ways, tokens, verified_to_12

TOL = 1e-4  # float32 rounding: the engine's own layers against HF's forward
BOTH = {"a": 64, "b": 64}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture(scope="module")
def routes(pair):
    return both_ways(pair)


def models(pair) -> dict:
    return {"a": pair.source, "b": pair.target}


def native(model, ids: torch.Tensor):
    return prefill(model, ids[None])


def _record(r) -> tuple:
    return (r.sender, r.receiver, r.path, r.status, r.reason, r.context, r.hit, r.mapped, r.prefilled, r.turn,
            r.prefill_fraction, r.bytes, r.recomputed, r.levers_cover_all)  # fmt: skip


def _workload(s: Session) -> list:
    """append / switch_to both ways / generate / a hit / score / fork: what each call showed, in order."""
    shown = []
    s.append("a", tokens(14, 40))
    shown.append(("logits", s.logits))
    shown.append(("record", s.switch_to("b", tokens(4, 41))))
    shown.append(("logits", s.logits))
    shown.append(("record", s.switch_to("a", tokens(5, 42))))
    shown.append(("generated", s.generate("a", tokens(2, 43), max_new_tokens=4)))
    shown.append(("record", s.switch_to("b")))  # no turn: the last unseen token read natively
    shown.append(("scores", s.score("b", [tokens(3, 44), [5]])))
    twin = s.fork()
    shown.append(("generated", twin.generate("b", [], max_new_tokens=3)))
    shown.append(("record", s.switch_to("b", tokens(2, 45))))  # the original goes on: a hit with a turn
    for x in (s, twin):
        shown += [("ids", x.ids), ("logits", x.logits)]
        for name in ("a", "b"):
            ids, exact = x.exact_prefix(name)
            shown += [("cache", x.cache(name)), ("segments", x.segments(name)), ("ids", ids), ("cache", exact)]
    return shown


def _equal(dynamic: list, static: list) -> None:
    assert [kind for kind, _ in dynamic] == [kind for kind, _ in static]
    for (kind, x), (_, y) in zip(dynamic, static, strict=True):
        if kind == "record":
            assert _record(x) == _record(y)
        elif kind in ("generated", "ids"):
            assert torch.equal(x, y), (kind, x, y)
        elif kind == "logits":
            assert (x - y).abs().max() < TOL
        elif kind == "scores":
            assert [(a.tokens, a.greedy) for a in x] == [(b.tokens, b.greedy) for b in y]
            assert [a.logprob for a in x] == pytest.approx([b.logprob for b in y], abs=TOL)
        elif kind == "cache":
            assert (x is None) == (y is None) and (x is None or max_cache_diff(x, y) < TOL)
        else:
            assert x == y, kind


POLICIES = {  # name → (policy, the first handoff's path)
    "map": (Policy(), "map"),
    "sink+hold": (Policy(levers=Levers(native_sink=2, hold_back=3)), "map"),
    "native layers": (Policy(levers=Levers(native_sink=1, native_layers=1)), "map"),
    "deviation": (Policy(levers=Levers(native_sink=2, hold_back=1, recompute=0.3, recompute_layers=2)), "map"),
    "recency": (Policy(levers=Levers(recompute=0.25, recompute_rule="recency", native_layers=1)), "map"),
    "reprefill": (Policy(mode="reprefill"), "reprefill"),
    "levers cover all": (Policy(levers=Levers(native_sink=8, hold_back=8)), "reprefill"),
}


@pytest.mark.parametrize("mapper", ["exact", "wrong"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_engine_session_equals_the_dynamic_cache_session(pair, routes, name, mapper):
    """The exact map hides what the levers do (recomputing an exact token changes nothing): the wrong one shows it."""
    policy, path = POLICIES[name]
    if mapper == "wrong":
        routes = routes | {("a", "b"): bind(pair.source, pair.target, pair.wrong, pair.tokenizer_hash)}
    dynamic = _workload(Session(models(pair), routes, policy))
    static = _workload(Session(models(pair), routes, policy, engines=BOTH))
    _equal(dynamic, static)
    assert next(r for kind, r in static if kind == "record").path == path


def test_an_engine_session_mixes_with_dynamic_cache_readers(pair, routes):
    """Only the receiver on an engine: the sender's DynamicCache is mapped into its slots, and back."""
    policy = POLICIES["deviation"][0]
    dynamic = _workload(Session(models(pair), routes, policy))
    static = _workload(Session(models(pair), routes, policy, engines={"b": 64}))
    _equal(dynamic, static)


def test_the_exact_map_lands_in_the_slots_and_the_wrong_map_shows(pair, routes):
    history, turn = tokens(30, 46), tokens(6, 47)
    wrong = {("a", "b"): bind(pair.source, pair.target, pair.wrong, pair.tokenizer_hash)}
    for mapping, exact in ((routes, True), (wrong, False)):
        s = Session(models(pair), mapping, Policy(levers=Levers(native_sink=2)), engines=BOTH)
        s.append("a", history)
        assert s.switch_to("b", turn).path == "map"
        conversation = torch.cat([history, turn])
        diff = max_cache_diff(s.cache("b"), native(pair.target, conversation))
        assert diff < TOL if exact else diff > 1e-2  # the receiver's own prefill, only through the map
        full = pair.target(conversation[None]).logits[:, -1]
        assert ((s.logits - full).abs().max() < TOL) == exact
        assert s.exact_prefix("b")[0].numel() == 2  # the sink alone: mapped K/V is never an exact prefix hit
    assert max_cache_diff(s.cache("a"), native(pair.target, history)) > 1e-2  # the pair really differs


@pytest.mark.parametrize("kind", sorted(set(REFUSALS) - {"sliding_window"}))
def test_every_refusal_rolls_back_bit_identically_on_the_engine(pair, kind):
    how, status, words = REFUSALS[kind]
    mapper, policy = pair.exact, {}
    if how == "artifact":
        mapper = replace(mapper, manifest=mapper.manifest | {"target_fingerprint": "0" * 64})
    elif how == "nan_map":
        mapper = _overflowing(mapper)
    elif how == "length":
        mapper = replace(mapper, manifest=mapper.manifest | {"calibration": {"seq_len": 8}})
        policy = {"max_length_factor": 2.0}
    elif how == "evidence":
        mapper = verified_to_12(mapper)
    elif how == "guard":
        policy = {"guard_max_abs": 1e-3}
    routes = {} if how == "none" else {("a", "b"): bind(pair.source, pair.target, mapper, pair.tokenizer_hash)}
    with pytest.warns(RouteRefusedWarning) if how == "artifact" else contextlib.nullcontext():
        tried = Session(models(pair), routes, Policy(**policy), engines=BOTH)
    never = Session(models(pair), {}, Policy(mode="reprefill"), engines=BOTH)
    history, turn, more = tokens(20, 12), tokens(5, 13), [tokens(4, seed) for seed in (14, 15, 16)]
    outputs = []
    for s in (tried, never):
        s.append("a", history)
        if how == "nan_source":  # through the live cache: views of a's slots
            s.cache("a", live=True).layers[1].keys[0, 0, 3, 0] = float("nan")
            assert torch.isnan(s.readers["a"].engine.keys[1, 0, 3, 0])
        record = s.switch_to("b", turn)
        generated = s.generate("b", more[0], max_new_tokens=6)
        s.switch_to("a", more[1])
        outputs.append((record, generated, s.generate("a", more[2], max_new_tokens=4), s.cache("b"), s.logits))
    (record, *tried_out, tried_logits), (_, *never_out, never_logits) = outputs
    assert (record.path, record.status) == ("reprefill", status) and words in record.reason, record
    assert record.prefill_fraction == 1.0 and record.mapped == 0
    assert torch.equal(tried_out[0], never_out[0]) and torch.equal(tried_out[1], never_out[1])  # greedy outputs
    assert max_cache_diff(tried_out[2], never_out[2]) == 0.0  # bit-identical caches
    torch.testing.assert_close(tried_logits, never_logits, rtol=0, atol=0, equal_nan=True)  # a's: NaN when poisoned
    assert tried.exact_prefix("b")[0].numel() == tried.holds("b")  # a fallback leaves only native, exact KV


def test_a_model_the_engine_cannot_run_is_refused_when_the_session_is_built(pair):
    sliding = tiny("mistral", sliding_window=8, use_sliding_window=True)
    with pytest.raises(ValueError, match="'b' cannot run on the static engine: sliding-window"):
        Session({"a": pair.source, "b": sliding}, engines={"b": 64})
    with pytest.raises(ValueError, match="capacity must be ≥ 1"):
        Session(models(pair), engines={"b": 0})
    for bad, match in (({"b": 2.5}, "capacity"), ({"b": True}, "capacity"), ({"c": 8}, "no model 'c'"),
                       ({"b": Engine(pair.source, 8)}, "another model"), ([("b", 8)], "engines maps")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Session(models(pair), engines=bad)
    given = Engine(pair.target, 32)
    given.forward(tokens(3, 48), torch.arange(3))
    s = Session(models(pair), engines={"b": given})
    assert s.readers["b"].engine is given and given.length == 0 and s.capacity == 32  # taken over, emptied
    with pytest.raises(ValueError, match="already holds another model's conversation"):
        Session({"a": pair.target, "b": pair.target}, engines={"a": given, "b": given})


def test_the_attention_rule_is_refused_on_the_engine_before_anything_changes(pair, routes):
    calls: list = []
    spied = {key: replace(route, transfer=Spy(route.transfer, calls)) for key, route in routes.items()}
    policy = Policy(levers=Levers(recompute=0.3, recompute_rule="attention"))
    s = Session(models(pair), spied, policy, engines={"b": 64})
    s.append("a", tokens(12, 49))
    before = state(s)
    with pytest.raises(ValueError, match="attention rule is not built on the static engine"):
        s.switch_to("b", tokens(3, 50))
    assert calls == [] and same(state(s), before)  # never mapped, nothing committed
    dynamic = Session(models(pair), spied, policy)
    dynamic.append("a", tokens(12, 49))
    assert dynamic.switch_to("b", tokens(3, 50)).recomputed == 4  # the DynamicCache path runs the rule


ENGINE_ONLY = {
    "turn rule": Levers(native_sink=2, hold_back=1, recompute=0.5, recompute_rule="turn", progressive=0.5),
    "progressive": Levers(hold_back=2, recompute=0.4, progressive=0.5),  # sizes 10, 10, 5
}


@pytest.mark.parametrize("name", sorted(ENGINE_ONLY))
def test_the_engine_only_selection_reaches_the_session(pair, name):
    """The turn rule and progressive selection pass through the session's splice as through `engine_handoff` (same
    logits, same cache, the work charged), on the wrong map where they show; a DynamicCache reader refuses them
    before anything changes."""
    levers = ENGINE_ONLY[name]
    wrong = {("a", "b"): bind(pair.source, pair.target, pair.wrong, pair.tokenizer_hash)}
    history, turn = tokens(24, 60), tokens(5, 61)
    s = Session(models(pair), wrong, Policy(levers=levers), engines=BOTH)
    s.append("a", history)
    record = s.switch_to("b", turn)
    engine = Engine(pair.target, 64)
    transfer = wrong[("a", "b")].transfer
    want = engine_handoff(transfer, engine, native(pair.source, history), history[None], levers, turn[None])
    assert (s.logits - want).abs().max() < TOL
    assert (want - pair.target(torch.cat([history, turn])[None]).logits[:, -1]).abs().max() > 1e-3  # the map shows
    assert torch.equal(s.readers["b"].engine.keys[:, :, :29], engine.keys[:, :, :29])
    assert record.recomputed == levers.recomputed(24) > 0
    assert record.prefill_fraction == pytest.approx(levers.prefill_fraction(24, 3))
    dynamic = Session(models(pair), wrong, Policy(levers=levers))
    dynamic.append("a", history)
    before = state(dynamic)
    with pytest.raises(ValueError, match="progressive selection / the turn rule are built on the static engine"):
        dynamic.switch_to("b", turn)
    assert same(state(dynamic), before)


def test_a_failure_after_the_splice_wrote_slots_restores_the_session(pair, routes):
    """The map, the native layers and the fused recompute write slots of the span; a failure in the tail's forward,
    after all of them, truncates back to a session bit-identical to before — slots below its length untouched."""
    levers = Levers(native_sink=2, hold_back=3, native_layers=1, recompute=0.5, recompute_layers=2)
    s = Session(models(pair), routes, Policy(levers=levers), engines=BOTH)
    s.append("a", tokens(14, 51))
    s.switch_to("b", tokens(4, 52))
    s.switch_to("a", tokens(5, 53))  # b holds 18 of 23 tokens: the next switch writes slots 18..
    before, slots = state(s), s.readers["b"].engine.keys.clone()

    def fail_on_the_tail(module, args):
        if args[0].shape[0] == 2 + 3 + 2:  # 2 recomputed tokens, the hold-back and the turn: the tail's forward
            raise RuntimeError("planted failure")

    handle = pair.target.model.layers[-1].mlp.register_forward_pre_hook(fail_on_the_tail)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            s.switch_to("b", tokens(2, 54))
    finally:
        handle.remove()
    engine = s.readers["b"].engine
    assert not torch.equal(engine.keys[:, :, 18:23], slots[:, :, 18:23])  # the splice did write the span's slots
    assert engine.length == 18  # truncated back: the committed span is forgotten
    assert torch.equal(engine.keys[:, :, :18], slots[:, :, :18]) and same(state(s), before)
    record = s.switch_to("b", tokens(2, 54))
    assert (record.hit, record.mapped, record.recomputed) == (18, 2, 2)
    assert max_cache_diff(s.cache("b"), native(pair.target, s.ids)) < TOL


def test_a_failure_midway_through_generate_or_score_restores_the_session(pair, routes):
    s = Session(models(pair), routes, engines=BOTH)
    s.append("a", tokens(10, 55))
    s.switch_to("b", tokens(3, 56))
    before = state(s)
    calls = []

    def fail_late(module, args):
        calls.append(1)
        if len(calls) == 3:  # the turn and a first token read, then the third forward fails
            raise RuntimeError("planted failure")

    handle = pair.target.model.layers[-1].mlp.register_forward_pre_hook(fail_late)
    try:
        for call in (
            lambda: s.generate("b", tokens(2, 57), max_new_tokens=5),
            lambda: s.score("b", [[1, 2], [3, 4], [5, 6]]),
        ):
            calls.clear()
            with pytest.raises(RuntimeError, match="planted"):
                call()
            assert same(state(s), before) and s.readers["b"].engine.length == s.holds("b") == 13
    finally:
        handle.remove()
    assert max_cache_diff(s.cache("b"), native(pair.target, s.ids)) < TOL


def test_a_conversation_past_the_capacity_is_refused_before_anything_changes(pair, routes):
    s = Session(models(pair), routes, engines={"b": 20})
    assert s.capacity == 20
    s.append("a", tokens(12, 58))  # a reads on a DynamicCache: the conversation is still bound by b's engine
    s.switch_to("b", tokens(4, 59))
    before = state(s)
    for call in (
        lambda: s.append("b", tokens(5, 60)),
        lambda: s.switch_to("a", tokens(5, 60)),
        lambda: s.generate("b", tokens(1, 60), max_new_tokens=4),
        lambda: s.generate("b", [], max_new_tokens=5),
    ):
        with pytest.raises(ValueError, match="past the engine capacity 20"):
            call()
        assert same(state(s), before)
    with pytest.raises(ValueError, match="continuation 1 would read past 'b'.s engine capacity 20"):
        s.score("b", [[1], [1, 2, 3, 4, 5, 6]])
    assert same(state(s), before)
    assert s.score("b", [[1, 2, 3, 4, 5]])[0].tokens == 5  # reads positions 16..19: the last slot
    assert s.generate("b", [], max_new_tokens=4).numel() <= 4 and s.holds("b") <= 20


def test_engine_generate_refuses_what_its_greedy_argmax_does_not_apply(pair, routes):
    s = Session(models(pair), routes, engines=BOTH)
    s.append("b", tokens(6, 61))
    before = state(s)
    with pytest.raises(ValueError, match=r"greedily: generate takes no \['do_sample', 'top_k'\]"):
        s.generate("b", [], max_new_tokens=2, do_sample=True, top_k=5)
    penalised = copy.deepcopy(pair.target)
    penalised.generation_config.repetition_penalty = 1.05
    t = Session({"b": penalised}, engines={"b": 16})
    t.append("b", tokens(6, 61))
    with pytest.raises(ValueError, match=r"sets \['repetition_penalty'\]"):
        t.generate("b", [], max_new_tokens=2)
    assert same(state(s), before)


def test_engine_generate_stops_at_eos_as_hf_does(pair):
    history = tokens(8, 62)
    x = history[None]
    with torch.no_grad():
        for _ in range(6):  # greedy by full forwards on the target
            x = torch.cat([x, pair.target(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    greedy = x[0, 8:]
    model = copy.deepcopy(pair.target)
    model.generation_config.eos_token_id = [int(greedy[2]), 999]
    stop = next(i for i, t in enumerate(greedy.tolist()) if t == greedy[2]) + 1
    outputs = []
    for engines in (None, {"b": 64}):
        s = Session({"b": model}, engines=engines)
        s.append("b", history)
        outputs.append(s.generate("b", [], max_new_tokens=6))
    assert outputs[0].tolist() == outputs[1].tolist() == greedy[:stop].tolist()


def test_fork_copies_the_slots_into_a_new_engine(pair, routes):
    s = Session(models(pair), routes, POLICIES["deviation"][0], engines=BOTH)
    s.append("a", tokens(14, 63))
    s.switch_to("b", tokens(3, 64))
    twin = s.fork()
    assert twin.readers["b"].engine is not s.readers["b"].engine and same(state(twin), state(s))
    assert twin.readers["b"].engine.keys.data_ptr() != s.readers["b"].engine.keys.data_ptr()
    before = state(s)
    twin.generate("b", tokens(2, 65), max_new_tokens=3)
    twin.switch_to("a")
    assert same(state(s), before)
    forked = state(twin)
    s.switch_to("a", tokens(4, 66))
    assert same(state(twin), forked)
    for x in (s, twin):
        assert max_cache_diff(x.cache("a"), native(pair.source, x.ids)) < TOL


def test_fork_into_warm_engines_reuses_them(pair, routes):
    """fork(engines=…): the slots are copied into the given engines (kept warm: their graphs already captured), the
    twin equals a fork into new engines, and an engine that cannot hold the twin is refused before anything changes."""
    s = Session(models(pair), routes, POLICIES["deviation"][0], engines=BOTH)
    s.append("a", tokens(14, 63))
    s.switch_to("b", tokens(3, 64))
    spare = {"b": Engine(pair.target, s.readers["b"].engine.capacity)}
    spare["b"].forward(tokens(30, 70), torch.arange(30))  # stale, longer than the conversation: emptied first
    twin = s.fork(engines=spare)
    assert twin.readers["b"].engine is spare["b"] and same(state(twin), state(s.fork()))
    fresh = s.fork()
    for x in (twin, fresh):
        x.switch_to("a", tokens(2, 71))
        x.switch_to("b", tokens(2, 72))
    clocks = lambda x: [replace(r, ms=0.0, ms_map=0.0) for r in x.records]  # the clock differs, nothing else
    assert same(state(twin)._replace(records=clocks(twin)), state(fresh)._replace(records=clocks(fresh)))
    before = state(s)
    for bad in (
        {"b": s.readers["b"].engine},
        {"b": Engine(pair.source, 64)},
        {"b": Engine(pair.target, 8)},
        {"c": spare["b"]},
    ):
        with pytest.raises(ValueError, match="fork|Engine"):
            s.fork(engines=bad)
    assert same(state(s), before)


def test_engine_generate_keeps_to_the_ids_every_model_reads(pair):
    wide = tiny("llama", vocab_size=160)  # its head writes ids 96..159 the source cannot read
    outputs = []
    for engines in (None, {"b": 64}):
        s = Session({"a": pair.source, "b": wide}, engines=engines)
        s.append("b", tokens(6, 24))
        outputs.append(s.generate("b", [], max_new_tokens=24))
    assert torch.equal(*outputs) and int(outputs[1].max()) < 96
