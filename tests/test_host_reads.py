"""The routed handoff on the static engine reads one device value on the host: the maps' flags (`map_refusal`).
Counted on the CPU by provenance (tests/host_syncs.py `DeviceReads`: the models, the mapper, the engine's cache and
the source cache live on the device; a tokenizer's ids on the host, or on the device where a test says so). Each
read is a device sync on a GPU — it drains the queue, so the host's launches and the device's work add up. Every
input check still refuses bad ids before the engine changes."""

import pytest
import torch

from src.apply import KVTransfer
from src.forward import prefill
from src.maps import cache_layers
from src.runtime.engine import Engine
from src.runtime.plan import Levers
from src.runtime.splice import engine_handoff
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair
from tests.host_syncs import DeviceReads

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine

FLAGS = "src/maps.py map_refusal"  # the one intended read: every map's device flags (after the turn's launches)
IDS = "runtime/splice.py engine_handoff"  # ids given on the device: the one copy of the conversation, checked there
CHOSEN = "runtime/receivers.py read_tail"  # a recompute: the chosen positions, which the engine's forward reads
PICK = "runtime/engine.py _layers"  # a shrinking set: the range check of its pick, once after the forward


@pytest.fixture(scope="module")
def setup():
    pair = exact_pair("llama", seed=0)
    ids = calibration_ids(1, 40, seed=32)
    transfer = KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash, backend="torch")
    return pair, transfer, ids[:, :32], ids[:, 32:], prefill(pair.source, ids[:, :32])


def _reads(setup, levers: Levers, ids_on_device: bool) -> list[str]:
    """The sites ("file function") of the device values one `engine_handoff` reads on the host; its logits equal
    those of an uncounted run."""
    pair, transfer, prefix, turn, source_cache = setup
    want = engine_handoff(transfer, Engine(pair.target, 64), source_cache, prefix, levers, turn)
    engine = Engine(pair.target, 64)
    device = [t for m in (pair.source, pair.target) for t in (*m.parameters(), *m.buffers())]
    device += [*transfer.mapper.tensors().values(), engine.keys, engine.values, engine.cos, engine.sin]
    device += [t for layer in cache_layers(source_cache) for t in layer]
    device += [prefix, turn] if ids_on_device else []
    with DeviceReads(*device, devices=(engine.device, transfer.device)) as reads:
        got = engine_handoff(transfer, engine, source_cache, prefix, levers, turn)
    assert torch.equal(got, want)
    return [f"{site.split(':')[0]} {site.split()[-1]}" for _, site in reads.sites]


TRANSFER = {
    "pure transfer": Levers(),
    "sink and hold-back": Levers(native_sink=4, hold_back=2),
    "native layers": Levers(native_sink=4, native_layers=1),
}


@pytest.mark.parametrize("name", TRANSFER)
def test_a_handoff_reads_only_the_maps_flags(setup, name):
    """Host ids (a tokenizer's): the flags are the one read — ids and positions are checked on the host."""
    assert _reads(setup, TRANSFER[name], ids_on_device=False) == [FLAGS]


@pytest.mark.parametrize("name", TRANSFER)
def test_ids_on_the_device_are_copied_to_the_host_once(setup, name):
    """Ids on the device: one copy of the whole conversation (checked there, and the only ids read on), instead of
    a read per check (six before: two per `ids_problem`, three calls)."""
    assert _reads(setup, TRANSFER[name], ids_on_device=True) == [IDS, FLAGS]


RECOMPUTE = {
    "deviation": (Levers(recompute=0.25), [FLAGS, CHOSEN]),
    "turn": (Levers(recompute=0.25, recompute_rule="turn"), [FLAGS, CHOSEN]),
    "progressive": (
        Levers(recompute=0.25, recompute_rule="turn", recompute_layers=2, progressive=0.5),
        [FLAGS, CHOSEN, PICK],
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", RECOMPUTE)
def test_a_recompute_reads_what_it_chose(setup, name):
    """A recompute reads the positions it chose on the device (the engine's forward checks them and builds the
    forward's slots on the host), after the flags; a shrinking set reads its pick's range check once at the end."""
    levers, want = RECOMPUTE[name]
    assert _reads(setup, levers, ids_on_device=False) == want


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda prefix, turn: (prefix, turn + 96), r"input_ids hold ids \d+\.\.\d+, outside the vocabulary \[0, 96\)"),
        (lambda prefix, turn: (prefix - 200, turn), r"input_ids hold ids -\d+\.\.-?\d+, outside the vocabulary"),
        (lambda prefix, turn: (prefix, turn + 0.5), "input_ids are torch.float32, expected integer token ids"),
        (lambda prefix, turn: (prefix.float(), turn), "input_ids are torch.float32"),
        (lambda prefix, turn: (prefix.to(torch.int32), turn + 2**32), r"hold ids \d+\.\.\d{10}, outside"),  # no wrap
    ],
)
def test_bad_ids_are_refused_before_the_engine_changes(setup, change, match):
    """Ids the target cannot read — outside its vocabulary (of the prefix or the turn: checked at once), floats
    (never truncated), a turn past the prefix's int32 (promoted, not wrapped into range) — a ValueError first."""
    pair, transfer, prefix, turn, source_cache = setup
    engine = Engine(pair.target, 64)
    engine.forward(prefix[0, :5], torch.arange(5))
    prefix, turn = change(prefix, turn)
    before = engine.keys.clone()
    with pytest.raises(ValueError, match=match):
        engine_handoff(transfer, engine, source_cache, prefix, Levers(), turn)
    assert engine.length == 5 and torch.equal(engine.keys, before)


@pytest.mark.parametrize("name", [*TRANSFER, *RECOMPUTE])
def test_the_flags_are_read_after_the_turns_launches_unless_a_recompute_chooses(setup, name, monkeypatch):
    """Without a recompute the engine holds the turn when the flags are read: its forward was launched over the
    map's unread work (on a GPU the launches' host time overlaps the map's device time). With one, the flags come
    first — the chosen positions are read on the host, never chosen from a refused map's values."""
    from src.runtime import splice

    pair, transfer, prefix, turn, source_cache = setup
    levers = TRANSFER[name] if name in TRANSFER else RECOMPUTE[name][0]
    engine, held = Engine(pair.target, 64), []
    real = splice.map_refusal
    monkeypatch.setattr(splice, "map_refusal", lambda flags: held.append(engine.length) or real(flags))
    engine_handoff(transfer, engine, source_cache, prefix, levers, turn)
    total = prefix.shape[1] + turn.shape[1]
    assert held == ([total] if name in TRANSFER else [prefix.shape[1]])
