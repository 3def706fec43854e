"""Safe to fail II, as properties: random sequences of append / switch_to / generate / fork / score / a fresh
session, with valid and invalid arguments (bad ids: floats, negatives, out of the vocabulary, 2-D batches, bools,
text, empty where nothing is to be read; unknown models; invalid levers and policies), on the exact non-identity pair
(tests/exact_pair.py, both directions exact, so a leaked native state or a misplaced token shows).

Invariants: an invalid call raises a ValueError (TransferError is one) that says what is wrong and leaves the ids,
every cache (bit for bit), every segment list, the logits and the records unchanged — a call is invalid exactly when
its arguments are, or it needs a model that does not hold the conversation; a valid call keeps every cache equal to
its model's own prefill of the ids it holds (float tolerance), `exact_prefix` free of mapped tokens, and `score`
changes nothing. A fork is untouched by what its original does after it. The same properties hold with both models on
the static engine (`Session(..., engines=...)`), whose levers are those the engine runs (no attention rule).

Profiles: the default is short and derandomized (the suite); `HYPOTHESIS_PROFILE=slow` runs ≥ 1,000 random examples.
"""

import functools
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from src.forward import prefill
from src.runtime.plan import Levers
from src.runtime.routing import Policy
from src.runtime.session import Session
from tests.exact_pair import exact_pair, max_cache_diff
from tests.session_state import same, state
from tests.test_session import VOCAB, both_ways

TOL = 1e-4
COMMON = dict(
    deadline=None, database=None, suppress_health_check=list(HealthCheck), phases=set(Phase) - {Phase.explain}
)
settings.register_profile("session-default", max_examples=800, derandomize=True, **COMMON)
settings.register_profile("session-slow", max_examples=3000, **COMMON)
PROFILE = settings.get_profile(f"session-{os.environ.get('HYPOTHESIS_PROFILE', 'default')}")
MODELS = ("a", "b")
ACTIVE = "the active model"  # resolved when the call is made: most calls then hold the conversation


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@functools.cache
def _exact():
    """The exact pair and its routes both ways, built once (a module fixture hypothesis would print in full)."""
    pair = exact_pair("llama", seed=0)
    return pair, both_ways(pair)


# ---------------------------------------------------------------- arguments: (value, is it invalid?)

ids_list = st.lists(st.integers(0, VOCAB - 1), max_size=8)
VALID_IDS = st.one_of(
    ids_list,
    ids_list.map(lambda x: torch.tensor(x, dtype=torch.long)),
    ids_list.map(lambda x: torch.tensor([x], dtype=torch.long)),  # [1, N]
    ids_list.map(lambda x: np.array(x, dtype=np.int32)),
)
INVALID_IDS = st.one_of(
    st.lists(st.floats(0.1, VOCAB - 1.1), min_size=1, max_size=4).filter(lambda x: any(v % 1 for v in x)),
    ids_list.filter(bool).map(lambda x: torch.tensor(x, dtype=torch.float32)),
    st.lists(st.integers(-(2**40), -1), min_size=1, max_size=3).map(lambda x: [1, *x]),
    st.lists(st.integers(VOCAB, 2**40), min_size=1, max_size=3).map(lambda x: [*x, 2]),
    st.integers(2, 3).map(lambda rows: torch.zeros(rows, 3, dtype=torch.long)),  # a batch
    st.just(torch.tensor([True, False])),
    st.just(torch.zeros(1, 2, 2, dtype=torch.long)),
    st.sampled_from(["hello", None, [[1, 2], [3]], 2**70, 7]),
)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """(value, is it invalid?): a valid value five times in six."""
    return st.one_of(*[valid.map(lambda x: (x, False))] * 5, invalid.map(lambda x: (x, True)))


IDS = mostly(VALID_IDS, INVALID_IDS)
MODEL = mostly(st.sampled_from([*MODELS, ACTIVE, ACTIVE]), st.sampled_from(["c", "", 3]))
MAX_NEW = mostly(st.integers(1, 3), st.sampled_from([0, -1, 2.5, True, None]))
CONTINUATIONS = mostly(
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), min_size=1, max_size=3),
    st.sampled_from([[], [[]], "ab", [[1], [VOCAB]], [[1.5]], [[-3]]]),
)
ENGINES = {"a": 256, "b": 256}  # room for any drawn conversation (≤ 12 calls of ≤ 11 tokens)


def policies(rules: list[str]) -> st.SearchStrategy:
    levers = st.builds(
        Levers,
        native_sink=st.integers(0, 5),
        hold_back=st.integers(0, 5),
        native_layers=st.integers(0, 3),
        recompute=st.sampled_from([0.0, 0.3, 1.0]),
        recompute_rule=st.sampled_from(rules),
        recompute_layers=st.integers(1, 3),
    )
    return st.builds(Policy, mode=st.sampled_from(["map", "reprefill", "auto"]), levers=levers)


POLICY = policies(["deviation", "attention", "recency"])
ENGINE_POLICY = policies(["deviation", "recency"])  # the static splice refuses the attention rule
BAD_POLICY = st.sampled_from([
    lambda: Levers(native_sink=2.5), lambda: Levers(hold_back=None), lambda: Levers(recompute=float("nan")),
    lambda: Levers(native_layers=True), lambda: Levers(recompute_layers=0), lambda: Levers(recompute_rule="random"),
    lambda: Policy(guard_max_abs=float("nan")), lambda: Policy(max_length_factor=float("nan")),
    lambda: Policy(max_length_factor=0), lambda: Policy(mode="fastest"), lambda: Policy(levers={"native_sink": 1}),
])  # fmt: skip


def operations(policy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("append"), MODEL, IDS),
        st.tuples(st.just("switch_to"), MODEL, IDS),
        st.tuples(st.just("generate"), MODEL, IDS, MAX_NEW),
        st.tuples(st.just("score"), MODEL, CONTINUATIONS),
        st.tuples(st.just("fork"), st.booleans()),  # go on with the fork (True) or the original
        st.tuples(st.just("fresh"), mostly(policy, BAD_POLICY)),
    )


# ---------------------------------------------------------------- one call and its invariants


def _count(ids) -> int:
    return torch.as_tensor(ids).numel()


def _expected_error(s: Session, op: tuple) -> bool:
    """Is the call invalid: its arguments, or a model that does not hold the conversation where it must?"""
    kind, (model, bad_model), *rest = op
    if bad_model or any(bad for _, bad in rest):
        return True
    behind = s.holds(model) != s.ids.numel()
    if kind in ("append", "generate", "score") and behind:
        return True
    if kind == "generate" and s.ids.numel() + _count(rest[0][0]) == 0:
        return True
    return kind == "score" and s.ids.numel() == 0


def _call(s: Session, op: tuple):
    kind, (model, _), *rest = op
    args = [value for value, _ in rest]
    if kind == "generate":
        return s.generate(model, args[0], max_new_tokens=args[1])
    return getattr(s, kind)(model, *args)


def _check_valid(s: Session, exact) -> None:
    """Every cache is its model's own prefill of the ids it holds; exact_prefix holds no mapped token."""
    models = {"a": exact.source, "b": exact.target}
    ids = s.ids
    for name, model in models.items():
        held, segments = s.holds(name), s.segments(name)
        assert held <= ids.numel() and [g.start for g in segments] == [0, *[g.end for g in segments]][: len(segments)]
        if held:
            assert max_cache_diff(s.cache(name), prefill(model, ids[None, :held])) < TOL
        exact_ids, exact_cache = s.exact_prefix(name)
        length = exact_ids.numel()
        assert all(g.exact and g.origin == "native" for g in segments if g.end <= length)
        assert all(not g.exact for g in segments if g.end > length)  # after the first mapped token, none is exact
        assert torch.equal(exact_ids, ids[:length])
        if length:
            assert exact_cache.get_seq_length() == length
            assert max_cache_diff(exact_cache, prefill(model, exact_ids[None])) < TOL


def _apply(s: Session, op: tuple, exact) -> Session:
    if op[1][0] == ACTIVE:
        op = (op[0], (s.active or "a", False), *op[2:])
    before, invalid = state(s), _expected_error(s, op)
    try:
        result = _call(s, op)
    except ValueError as error:  # TransferError included
        event(f"{op[0]}: refused")
        assert invalid, f"a valid call was refused: {error}"
        assert len(str(error)) > 10, "an error must say what is wrong"
        assert same(state(s), before), "an invalid call changed the session"
        return s
    assert not invalid, f"an invalid call was accepted: {op}"
    event(f"{op[0]}: done")
    if op[0] == "score":
        assert same(state(s), before), "score changed the session"
        assert [x.tokens for x in result] == [len(c) for c in op[2][0]]
        assert all(np.isfinite(x.logprob) and x.logprob <= 0 for x in result)
    _check_valid(s, exact)
    return s


@settings(PROFILE)
@given(policy=POLICY, ops=st.lists(operations(POLICY), min_size=3, max_size=12))
def test_every_call_is_valid_and_exact_or_refused_and_changes_nothing(policy, ops):
    _run(policy, ops, None)


@settings(PROFILE)
@given(policy=ENGINE_POLICY, ops=st.lists(operations(ENGINE_POLICY), min_size=3, max_size=12))
def test_on_the_static_engine_every_call_is_valid_and_exact_or_refused_and_changes_nothing(policy, ops):
    _run(policy, ops, ENGINES)


def _run(policy: Policy, ops: list, engines: dict | None) -> None:
    pair, routes = _exact()
    models = {"a": pair.source, "b": pair.target}
    s = Session(models, routes, policy, engines=engines)
    untouched = []  # (session, its state) no call reaches after a fork
    for op in ops:
        if op[0] == "fork":
            twin = s.fork()
            assert same(state(twin), state(s))
            other, s = (s, twin) if op[1] else (twin, s)
            untouched.append((other, state(other)))
        elif op[0] == "fresh":
            make, bad = op[1]
            if bad:
                with pytest.raises(ValueError, match=r"\w{4,}"):
                    make()
            else:
                s = Session(models, routes, make, engines=engines)
        else:
            s = _apply(s, op, pair)
    for other, before in untouched:
        assert same(state(other), before), "a session changed through its fork"
