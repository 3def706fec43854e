"""The map with no host sync (`KVTransfer.map_into` / `into`, kernels/apply_map.py): through a slot mapping into a
static cache's slots or paged blocks, equal to the synchronous map on the exact non-identity pair; no value read on
the host while mapping (tests/host_syncs.py); its finiteness and magnitude flags left on the device and decided
afterwards (`map_refusal`) — on the static engine after the turn's forward is launched, which a refusal then
discards with the rollback. The Triton path
runs in its CPU interpreter here, compiled on CUDA (the graph-capture test needs a GPU)."""

import copy

import pytest
import torch

from kernels.apply_map import HAVE_TRITON
from src.apply import KVTransfer
from src.forward import prefill
from src.maps import TransferError, cache_layers, map_refusal
from src.runtime import splice
from src.runtime.engine import Engine
from src.runtime.plan import Levers
from src.runtime.splice import engine_handoff
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair
from tests.host_syncs import HostReads
from tests.test_kernels_apply import interpreted  # noqa: F401  (the fixture)
from tests.test_session import _overflowing

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"))]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each apply path; Triton through its CPU interpreter (skipped where it cannot run), compiled on CUDA."""
    if request.param == "triton" and not torch.cuda.is_available():
        request.getfixturevalue("interpreted")
    return request.param


def _transfer(pair, backend: str, mapper=None) -> KVTransfer:
    return KVTransfer(mapper or pair.wrong, pair.source, pair.target, pair.tokenizer_hash, backend=backend)


def _span(pair, count: int = 13, seed: int = 31):
    """Source K/V of a span [L_s, H_s, T, d_s] each, its positions 7..7 + T − 1 and ids [1, T]."""
    ids = calibration_ids(1, 7 + count, seed=seed)
    layers = cache_layers(prefill(pair.source, ids))
    keys = torch.stack([k[0, :, 7:] for k, _ in layers])  # [L_s, H_s, T, d_s]
    values = torch.stack([v[0, :, 7:] for _, v in layers])
    return keys, values, torch.arange(7, 7 + count), ids[:, 7:]


def _paged(pair, blocks: int = 6, block_size: int = 4):
    """Destinations [L_t, blocks, H_t, block_size, d_t] filled with 7s, as a paged cache's blocks."""
    layers, heads, dim = (pair.target.config.num_hidden_layers, pair.target.config.num_key_value_heads,
                          pair.target.config.head_dim)  # fmt: skip
    return tuple(torch.full((layers, blocks, heads, block_size, dim), 7.0) for _ in range(2))


def test_map_into_writes_paged_blocks_at_their_slots(pair, backend):
    """Scattered slots over 6 blocks of 4 (block_id · block_size + offset, out of order): each token's mapped K/V is
    the synchronous map's at its own position, in its slot; every other slot keeps its contents."""
    transfer = _transfer(pair, backend)
    keys, values, positions, ids = _span(pair)
    want = cache_layers(transfer([(k[None], v[None]) for k, v in zip(keys, values, strict=True)], positions, ids))
    slots = torch.tensor([21, 3, 4, 9, 0, 17, 22, 8, 5, 13, 12, 2, 19])  # [13] distinct slots in blocks 0..5
    destination = _paged(pair)
    flags = transfer.map_into(keys, values, positions, slots, *destination)
    assert map_refusal([flags]) is None
    for component, got in enumerate(destination):
        expected = torch.stack([layer[component][0] for layer in want])  # [L_t, H_t, T, d_t]
        at_slots = got[:, slots // 4, :, slots % 4].permute(1, 2, 0, 3)  # [L_t, H_t, T, d_t]
        torch.testing.assert_close(at_slots, expected, rtol=0, atol=1e-5)
        untouched = torch.ones(6 * 4, dtype=torch.bool).index_fill_(0, slots, False)  # [24]
        rest = got.transpose(2, 3).flatten(1, 2)[:, untouched]  # [L_t, 11, H_t, d_t]
        assert bool((rest == 7.0).all()), component
    assert (destination[0][:, slots // 4, :, slots % 4] - 7.0).abs().max() > 0.1  # the slots were written


def test_the_map_reads_no_value_on_the_host(pair, backend):
    """`map_into` reads nothing on the host (on a GPU: no sync); `into` only validates its host-side positions and
    ids (free there); the decision reads every flag once."""
    transfer = _transfer(pair, backend)
    keys, values, positions, ids = _span(pair)
    destination = _paged(pair)
    with HostReads() as reads:
        flags = transfer.map_into(keys, values, positions, torch.arange(13), *destination)
    assert reads.sites == []
    with HostReads() as reads:
        transfer.into(destination, [(k[None], v[None]) for k, v in zip(keys, values, strict=True)], positions, ids,
                      slots=torch.arange(5, 18))  # fmt: skip
    assert {site.split()[-1] for _, site in reads.sites} <= {"_positions", "ids_problem"}, reads.sites
    with HostReads() as reads:
        assert map_refusal([flags]) is None
    assert len(reads.sites) == 1  # the common path: one read of every flag


def test_flags_are_left_on_the_device_and_decided_afterwards(pair, backend):
    """NaN in a source layer, a mapper that overflows, a value past the magnitude guard: the map writes and returns
    (no refusal while mapping); `map_refusal` then names what it found."""
    keys, values, positions, ids = _span(pair)
    poisoned = values.clone()
    poisoned[1, 0, 4, 2] = float("nan")
    cases = [
        (_transfer(pair, backend), poisoned, None, "source cache layer 1 values contains NaN or Inf"),
        (_transfer(pair, backend, _overflowing(pair.exact)), values, None, "mapped target layer 1 is not finite"),
        (_transfer(pair, backend), values, 1e-3, "guard: mapped |K|, |V| of target layer 0 exceed 0.001"),
        (_transfer(pair, backend), values, 1e6, None),
    ]
    for transfer, source_values, bound, refusal in cases:
        flags = transfer.map_into(keys, source_values, positions, torch.arange(13), *_paged(pair), bound=bound)
        assert flags.target.device == keys.device and flags.target.dtype == torch.bool
        got = map_refusal([flags])
        assert got == refusal or (refusal is not None and got.startswith(refusal)), got


def test_map_into_refuses_what_it_cannot_address(pair):
    transfer = _transfer(pair, "torch")
    keys, values, positions, _ = _span(pair)
    destination = _paged(pair)
    for args, match in [
        ((keys[:, :1], values, positions, torch.arange(13), *destination), "source keys"),
        ((keys, values, positions.float(), torch.arange(13), *destination), "positions"),
        ((keys, values, positions, torch.arange(12), *destination), "slots"),
        ((keys, values, positions, torch.arange(13), destination[0][:, :, :1], destination[1]), "keys"),
        ((keys, values, positions, torch.arange(13), destination[0].double(), destination[1]), "keys"),
    ]:
        with pytest.raises(TransferError, match=match):
            transfer.map_into(*args)
    assert all(bool((t == 7.0).all()) for t in destination)


def test_a_refused_map_on_the_engine_discards_the_turn_read_over_it(pair, monkeypatch):
    """The overflowing map writes the engine's slots without raising; the splice launches the turn's forward before
    it reads the flags (optimistic: no recompute), then refuses: the turn's logits never return, the engine is
    emptied again, and a clean handoff after it reads what a prefill reads."""
    ids = calibration_ids(1, 24, seed=32)
    prefix, turn = ids[:, :20], ids[:, 20:]
    transfer = _transfer(pair, "torch", _overflowing(pair.exact))
    engine, held = Engine(pair.target, 32), []  # the engine's own forward (not the modules'): its length tells
    monkeypatch.setattr(splice, "map_refusal", lambda flags: held.append(engine.length) or map_refusal(flags))
    with pytest.raises(TransferError, match="not finite"):
        engine_handoff(transfer, engine, prefill(pair.source, prefix), prefix, Levers(), turn)
    assert held == [24] and engine.length == 0  # the turn read over the garbage before the flags, then rolled back
    assert not torch.isfinite(engine.keys[:, :, :20]).all() or not torch.isfinite(engine.values[:, :, :20]).all()
    clean = engine_handoff(_transfer(pair, "torch", pair.exact), engine, prefill(pair.source, prefix), prefix,
                           Levers(), turn)  # fmt: skip
    assert (clean - pair.target(ids).logits[0, -1:]).abs().max() < 1e-4  # the slots are written again, then read


@cuda
@pytest.mark.gpu
def test_map_into_replays_as_a_cuda_graph_on_the_engine(pair):
    """No host sync: the map of a fixed span length captures once and replays at other positions and slots."""
    source, target = copy.deepcopy(pair.source).to("cuda"), copy.deepcopy(pair.target).to("cuda")
    transfer = KVTransfer(pair.wrong, source, target, pair.tokenizer_hash, backend="triton")
    engine = Engine(target, 64, graphs=False)
    keys, values, positions, _ = (t.to("cuda") for t in _span(pair))
    static = [keys.clone(), values.clone(), positions.clone(), positions.clone()]
    transfer.map_into(*static, *engine.blocks())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flags = transfer.map_into(*static, *engine.blocks())
    for start in (3, 30):
        moved = torch.arange(start, start + 13, device="cuda")
        static[2].copy_(moved)
        static[3].copy_(moved)
        graph.replay()
        want = tuple(t.to("cuda") for t in _paged(pair, blocks=1, block_size=65))  # the engine's 64 + 1 slots
        transfer.map_into(keys, values, moved, moved, *want)
        assert torch.equal(engine.keys[:, :, start : start + 13], want[0][:, 0, :, start : start + 13])
        assert map_refusal([flags]) is None
