"""Every input class the static engine (src/runtime/engine.py) cannot serve is refused with an error naming it, before
any of its state changes (slots, length): duplicate positions, float ids, a batch of ids, ids outside the vocabulary or
without data, a write that would leave a gap, K/V of another head count or of different lengths, a fused recompute
whose pick leaves its set (the held slots it rewrote are put back), and one engine handed to two sessions."""

import pytest
import torch

from src.runtime.engine import Engine
from src.runtime.plan import Recompute
from src.runtime.session import Session
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture
def engine(pair):
    """An engine holding 8 tokens."""
    engine = Engine(pair.target, 32)
    engine.forward(calibration_ids(1, 8, seed=40)[0], torch.arange(8))
    return engine


def _state(engine: Engine) -> tuple:
    return engine.keys.clone(), engine.values.clone(), engine.length


def _unchanged(engine: Engine, before: tuple, held: bool = False) -> bool:
    """Every slot as before (held: the slots it holds; those past its length are garbage it never reads)."""
    keys, values, length = before
    upto = length if held else keys.shape[2]
    same = torch.equal(engine.keys[:, :, :upto], keys[:, :, :upto]) and torch.equal(
        engine.values[:, :, :upto], values[:, :, :upto]
    )
    return same and engine.length == length


def _kv(engine: Engine, count: int, heads: int | None = None) -> torch.Tensor:
    layers, kv_heads, _, dim = engine.keys.shape
    return torch.randn(layers, heads or kv_heads, count, dim)  # [L, H_kv, T, d]


FORWARDS = {  # class → (ids, positions, words of the error)
    "duplicate positions": ([1, 2, 3], [2, 2, 8], "distinct and ascending"),
    "positions out of order": ([1, 2, 3], [5, 2, 8], "distinct and ascending"),
    "float ids": (torch.tensor([1.7, 2.2]), [8, 9], "integers only"),
    "bool ids": (torch.tensor([True, False]), [8, 9], "integers only"),
    "a batch of ids": (torch.tensor([[1, 2], [3, 4]]), [8, 9, 10, 11], "one sequence"),
    "out of the vocabulary": ([1, 96], [8, 9], "outside the vocabulary"),
    "negative ids": ([-1, 3], [8, 9], "outside the vocabulary"),
    "meta ids": (torch.zeros(2, dtype=torch.long, device="meta"), [8, 9], "dense tensor with data"),
    "float positions": ([1, 2], torch.tensor([8.0, 9.0]), "integers only"),
}


@pytest.mark.parametrize("kind", sorted(FORWARDS))
def test_a_forward_refuses_what_it_cannot_read_before_writing(engine, kind):
    ids, positions, words = FORWARDS[kind]
    before = _state(engine)
    with pytest.raises(ValueError, match=words):
        engine.forward(torch.as_tensor(ids), torch.as_tensor(positions))
    assert _unchanged(engine, before)


WRITES = {  # class → (keys, values, start of the write, words of the error) from the engine holding 8 tokens
    "a gap of unwritten slots": (lambda e: (_kv(e, 3), _kv(e, 3), 10), "it holds 8 tokens"),
    "another head count": (lambda e: (_kv(e, 3, heads=4), _kv(e, 3, heads=4), 8), "KV heads"),
    "keys and values of different lengths": (lambda e: (_kv(e, 3), _kv(e, 2), 8), "differ"),
    "past the capacity": (lambda e: (_kv(e, 30), _kv(e, 30), 8), "capacity"),
}


@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_write_refuses_what_would_leave_a_wrong_cache_before_writing(engine, kind):
    make, words = WRITES[kind]
    keys, values, start = make(engine)
    before = _state(engine)
    with pytest.raises(ValueError, match=words):
        engine.write(keys, values, start)
    assert _unchanged(engine, before)
    engine.write(_kv(engine, 3), _kv(engine, 3), 8)  # a write that continues the conversation is taken
    assert engine.length == 11


def test_a_commit_refuses_a_gap(engine):
    before = _state(engine)
    with pytest.raises(ValueError, match="continues at slot 8"):
        engine.commit(10, 12)
    assert _unchanged(engine, before)
    engine.commit(8, 12)
    assert engine.length == 12


@pytest.mark.parametrize("pick", ["out of range", "repeated", "not a row tensor"])
def test_a_fused_recompute_whose_pick_leaves_its_set_puts_the_held_slots_back(engine, pair, pick):
    """The set's held slots are rewritten layer by layer before the pick: a wrong pick is refused and they are put
    back bit for bit (the tail's slots past the length were written: garbage the engine does not hold)."""
    wrong = {"out of range": torch.tensor([0, 5]), "repeated": torch.tensor([1, 1]), "not a row tensor": [0, 1]}
    recompute = Recompute(torch.tensor([2, 4, 6]), sizes=(3, 2, 2), keep=lambda mapped, fresh, size: wrong[pick])
    before = _state(engine)
    ids, positions = calibration_ids(1, 5, seed=41)[0], torch.tensor([2, 4, 6, 8, 9])
    with pytest.raises(ValueError, match="keep"):
        engine.forward(ids, positions, recompute=recompute)
    assert _unchanged(engine, before, held=True)
    fine = Recompute(torch.tensor([2, 4, 6]), sizes=(3, 2, 2), keep=lambda mapped, fresh, size: torch.tensor([0, 2]))
    engine.forward(ids, positions, recompute=fine)
    assert engine.length == 10


def test_one_engine_serves_one_session_at_a_time(pair):
    """A second session is refused the engine while the first holds it; once the first is closed it is taken, and
    the first refuses to read it (its cache would have changed under it)."""
    models = {"a": pair.source, "b": pair.target}
    shared = Engine(pair.target, 32)
    first = Session(models, engines={"b": shared})
    first.append("b", calibration_ids(1, 6, seed=42)[0])
    before = _state(shared)
    with pytest.raises(ValueError, match="already holds another session's conversation"):
        Session(models, engines={"b": shared})
    assert _unchanged(shared, before) and first.holds("b") == 6
    first.close()
    second = Session(models, engines={"b": shared})
    assert shared.owner is second and shared.length == 0
    with pytest.raises(ValueError, match="already holds another session's conversation"):
        shared.claim(Owner())  # the engine's own check, behind the session's
    with pytest.raises(ValueError, match="no longer holds this session's conversation"):
        first.append("b", [1, 2])
    spare = Engine(pair.target, 32)
    third = Session(models, engines={"b": spare})
    with pytest.raises(ValueError, match="already holds a session's conversation"):
        second.fork(engines={"b": spare})
    third.close()
    assert second.fork(engines={"b": spare}).readers["b"].engine is spare


class Owner:
    """Anyone who may hold an engine (a session, in practice)."""
