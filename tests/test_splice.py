"""The one splice over the `Receiver` protocol (src/runtime/splice.py, receivers.py) and its plan (plan.py): the plan
is decided once from the levers and the receiver's capabilities (data, not its type), refusing what the receiver
cannot run before anything is touched; the splice body reaches a receiver only through the protocol — a receiver that
wraps the DynamicCache reference builds the cache `spliced_cache` builds — and a receiver without a forward (vLLM's
paged blocks, written inside a load hook) takes the mapped span alone."""

from dataclasses import FrozenInstanceError

import pytest
import torch
from transformers import DynamicCache

from src.apply import KVTransfer
from src.forward import prefill
from src.maps import cache_layers
from src.runtime.plan import Capabilities, Levers, SplicePlan, check_splice, plan_splice
from src.runtime.receivers import CacheReceiver, EngineReceiver, Piece
from src.runtime.splice import splice, spliced_cache
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair, max_cache_diff

PAGED = Capabilities("vLLM's paged blocks", forward=False, rules=frozenset())  # the connector's receiver

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture(scope="module")
def wrong(pair):
    return KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash)


def test_the_plan_is_decided_once_from_the_levers():
    levers = Levers(native_sink=2, hold_back=3, recompute=0.25, recompute_layers=2)
    plan = plan_splice(levers, 4, 20, 5, 3, False, EngineReceiver.capabilities)
    assert plan == SplicePlan(held=4, start=6, end=21, hold_back=3, tail=8, depth=2, compared=2, recomputed=5,
                              rule="deviation", first=0, sizes=(5, 5, 5), progressive=False)  # fmt: skip
    assert plan.native_end == 21
    turn = plan_splice(Levers(recompute=0.5, recompute_rule="turn", progressive=0.5), 0, 20, 4, 3, False,
                       EngineReceiver.capabilities)  # fmt: skip
    assert (turn.first, turn.depth, turn.sizes, turn.native_end, turn.progressive) == (1, 1, (10, 5), 24, True)
    assert plan_splice(Levers(hold_back=30), 0, 20, 1, 3, False, PAGED).end == 0  # clipped to the prefix
    with pytest.raises(FrozenInstanceError):
        plan.depth = 0


@pytest.mark.parametrize(
    "levers, receiver, words",
    [
        (Levers(recompute=0.2, recompute_rule="attention"), EngineReceiver.capabilities, "attention rule is not built"),
        (Levers(recompute=0.2, recompute_rule="turn"), CacheReceiver.capabilities, "the turn rule are built on"),
        (Levers(recompute=0.2, progressive=0.5), CacheReceiver.capabilities, "progressive selection"),
        (Levers(native_sink=2), PAGED, "cannot run the target's forward"),
        (Levers(native_layers=1), PAGED, "cannot run the target's forward"),
        (Levers(recompute=0.2, recompute_rule="recency"), PAGED, "cannot run the target's forward"),
    ],
)
def test_what_a_receiver_cannot_run_is_refused_when_the_plan_is_built(levers, receiver, words):
    with pytest.raises(ValueError, match=words):
        check_splice(levers, False, 20, 3, receiver)
    check_splice(Levers(hold_back=2), False, 20, 3, receiver)  # the hold-back fits every receiver


class Recording:
    """A receiver that is the DynamicCache reference seen only through the protocol, recording each operation."""

    def __init__(self, receiver: CacheReceiver):
        self.inner, self.calls = receiver, []
        self.capabilities = receiver.capabilities

    @property
    def length(self) -> int:
        return self.inner.length

    def __getattr__(self, name):
        operation = getattr(self.inner, name)
        return lambda *args: self.calls.append(name) or operation(*args)


@pytest.mark.parametrize(
    "levers, calls",
    [
        (Levers(native_sink=2, hold_back=3, native_layers=1, recompute=0.3, recompute_layers=2),
         ["read", "write", "native_prefix", "layers", "read_tail"]),
        (Levers(hold_back=2, recompute=0.2, recompute_rule="attention"), ["write", "attention", "read_tail"]),
    ],
)  # fmt: skip
def test_the_splice_reaches_a_receiver_through_the_protocol_alone(pair, wrong, levers, calls):
    ids, query = calibration_ids(1, 24, seed=50), calibration_ids(1, 2, seed=51)
    want = spliced_cache(wrong, prefill(pair.source, ids), ids, levers, query_ids=query)
    receiver = Recording(CacheReceiver(pair.target, DynamicCache(config=pair.target.config)))
    plan = plan_splice(levers, 0, 24, 0, 3, False, receiver.capabilities, queries=levers.hold_back + 2)
    sink, end = plan.start, plan.end
    mapped = wrong(prefill(pair.source, ids), positions=None, input_ids=ids)
    span = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(mapped)]
    splice(plan, receiver, ids[:, :end], [Piece(sink, end, span)], ids[:, end:], torch.cat([ids[:, end:], query], 1))
    assert receiver.calls == calls
    assert max_cache_diff(receiver.inner.cache, want) < 1e-6


class WriteOnly:
    """A receiver that only takes mapped spans (vLLM's paged blocks inside the connector's load hook)."""

    capabilities = PAGED

    def __init__(self, held: int):
        self.length, self.written = held, []

    def write(self, piece: Piece) -> None:
        self.written.append((piece.start, piece.end))
        self.length = piece.end

    def __getattr__(self, name):
        raise AssertionError(f"the splice asked a receiver without a forward to {name}")


def test_a_receiver_without_a_forward_takes_the_mapped_span_alone(pair, wrong):
    """The hold-back plan (the sink as a prefix hit: 4 tokens held) writes the span and reads nothing: its engine
    reads the tail after the load."""
    ids = calibration_ids(1, 24, seed=52)
    plan = plan_splice(Levers(hold_back=3), 4, 20, 2, 3, False, PAGED)
    receiver = WriteOnly(held=4)
    mapped = cache_layers(wrong(prefill(pair.source, ids)))
    piece = Piece(4, 21, [(k[:, :, 4:21], v[:, :, 4:21]) for k, v in mapped])
    assert splice(plan, receiver, ids[:, :21], [piece], ids[:, 21:], ids[:, 21:]) is None
    assert receiver.written == [(4, 21)]
