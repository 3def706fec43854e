"""The map straight into vLLM's paged blocks (`paged_writer` "stacked" on FlashAttention's layout: `paged.Writer.over`,
`routes.Bound.map_into`): on a synthetic stacked flash cache (one buffer, layer-major or block-major: a layer stride
that is not the contiguous one), it stores bit for bit what mapping to scratch and `write_slots(..., "flash")`
write, leaves every other slot alone, and sets the magnitude guard's flags that the worker's check refuses on; the
worker end to end (`register_kv_caches` → `start_load_kv` → `get_block_ids_with_load_errors`) without an engine.
On the exact pair's wrong mapper (its target differs from its source); the Triton path in its CPU interpreter here,
compiled on CUDA, and against FlashAttention's own writer on a GPU."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from kernels.apply_map import HAVE_TRITON
from src.models import describe_kv
from src.pair_check import bound_mapper
from src.serving.config import connector_config
from src.serving.paged import Writer, read_slots, slots_for, stack_layers, write_slots
from src.serving.routes import Bound, load_refusal
from src.serving.timings import Timings
from tests.exact_pair import exact_pair
from tests.test_kernels_apply import interpreted  # noqa: F401  (the fixture)
from tests.test_vllm_parts import _Layer, _stacked_caches, needs_vllm

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"))]
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
    rotary = lambda model: copy.deepcopy(model.model.rotary_emb).to(device)  # noqa: E731
    return Bound(bound_mapper(pair.wrong, device, torch.float32), describe_kv(pair.source), describe_kv(pair.target),
                 rotary(pair.source), rotary(pair.target), backend)  # fmt: skip


def _span(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Source keys / values [L_s, H_s, n, d_s] of the span."""
    generator = torch.Generator().manual_seed(5)
    return tuple(torch.randn(3, 2, 40, 16, generator=generator).to(device) for _ in range(2))


def _flash(interleaved: bool, device: str = "cpu") -> tuple[list[torch.Tensor], torch.Tensor]:
    """This worker's flash caches (one head) as vLLM allocates them, every element 7, and their stacked view."""
    caches = _stacked_caches("flash", heads=1, d=16, interleaved=interleaved, device=device)
    stacked = stack_layers([_Layer(kv, "FLASH_ATTN", "flash") for kv in caches])
    stacked.fill_(7.0)  # [L, B, H, N, 2d]: the whole buffer
    return caches, stacked


@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "block-major"])
def test_the_map_stores_into_flash_blocks_what_a_stacked_write_of_its_scratch_writes(pair, backend, interleaved):
    name, device = backend
    route, (keys, values), slots = _route(pair, name, device), _span(device), SLOTS.to(device)
    _, ours = _flash(interleaved, device)
    _, theirs = _flash(interleaved, device)
    writer = Writer.over(ours, "flash")
    assert writer.stacked is None and writer.direct is not None
    assert Writer.over(ours, "cpu") == Writer(stacked=(ours, "cpu"))  # channel-major K: the map, then one write
    nonfinite, beyond = route.map_into(keys, values, START, HEADS, writer.direct, slots, 1e6)
    mapped_k, mapped_v, flags = route.map(keys, values, START, HEADS, torch.float32)  # [L_t, n, H, d_t]
    write_slots(theirs, mapped_k, mapped_v, slots, "flash")
    assert torch.equal(ours, theirs)  # bit for bit, every block
    assert not (nonfinite.any() or beyond.any() or flags.any())
    assert bool((ours[:, [0, 2]] == 7.0).all()) and bool((ours[:, 1, :, 8:] == 7.0).all())  # outside the span
    for layer, (k, v) in enumerate(zip(mapped_k, mapped_v, strict=True)):
        read = read_slots(ours[layer], slots, "flash")  # [n, H, d] each: K in the first half, V in the second
        assert torch.equal(read[0], k) and torch.equal(read[1], v)
    assert (mapped_k - mapped_v).abs().max() > 0.1 and (mapped_k - keys[:, HEADS].transpose(1, 2)).abs().max() > 0.1


def test_the_guard_flags_a_mapped_value_past_it_and_the_check_refuses_naming_it(pair, backend):
    name, device = backend
    route, (keys, values), slots = _route(pair, name, device), _span(device), SLOTS.to(device)
    mapped_k, mapped_v, _ = route.map(keys, values, START, HEADS, torch.float32)
    peak = torch.maximum(mapped_k.abs().amax(), mapped_v.abs().amax())
    for guard, refused in ((2 * float(peak), False), (float(peak) / 2, True), (None, False)):
        _, stacked = _flash(False, device)
        nonfinite, beyond = route.map_into(keys, values, START, HEADS, Writer.over(stacked, "flash").direct, slots,
                                           guard)  # fmt: skip
        assert bool(beyond.any()) == refused and not nonfinite.any()
        reason = load_refusal(nonfinite, beyond, None, guard)
        assert (reason is not None) == refused
        if refused:
            assert reason.startswith("guard: mapped |K|, |V| of target layer ") and f"exceed {guard:g}" in reason
    poisoned = values.clone()
    poisoned[1, 1, 4, 2] = float("nan")  # source layer 1 feeds target layer 1
    nonfinite, beyond = route.map_into(keys, poisoned, START, HEADS, Writer.over(stacked, "flash").direct, slots, 1e6)
    assert load_refusal(nonfinite, beyond, None, 1e6) == "mapped target layer 1 is not finite"


def test_the_refusal_reads_the_flags_of_either_path():
    clear, layer_2 = torch.zeros(3, dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32)
    assert load_refusal(clear, clear, None, 10.0) is None and load_refusal(clear, None, None, None) is None
    assert load_refusal(layer_2, clear, None, 10.0) == "mapped target layer 2 is not finite"
    assert load_refusal(clear, layer_2, None, 10.0) == "guard: mapped |K|, |V| of target layer 2 exceed 10"
    assert load_refusal(clear, None, torch.tensor(12.5), 10.0) == "guard: mapped |K|, |V| reach 12.5 > 10"
    assert load_refusal(clear, None, torch.tensor(9.5), 10.0) is None


@needs_vllm
@pytest.mark.parametrize("refused", [False, True], ids=["within-guard", "past-guard"])
def test_the_worker_maps_straight_into_flash_blocks_and_refuses_past_the_guard(pair, tmp_path, monkeypatch, refused):
    """register_kv_caches decides the direct map once (flash caches that stack, paged_writer "stacked"); a load is
    then timed as load, slots, map, check — no write, no guard pass — its blocks hold what the map and a stacked
    write give, and past the guard (half the mapped peak) its blocks are reported for recomputation."""
    from src.serving.metadata import KVRelayMetadata, Load
    from src.serving.vllm_connector import KVRelayConnector

    route, (keys, values) = _route(pair, "torch"), _span()
    mapped_k, mapped_v, _ = route.map(keys, values, START, HEADS, torch.float32)
    peak = float(torch.maximum(mapped_k.abs().amax(), mapped_v.abs().amax()))
    caches, _ = _flash(True)
    layers = {f"model.layers.{i}.self_attn.attn": _Layer(kv, "FLASH_ATTN", "flash") for i, kv in enumerate(caches)}
    worker = KVRelayConnector.__new__(KVRelayConnector)  # the worker role's state only: no engine
    worker._vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers),
                                          model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2))  # fmt: skip
    guard = peak / 2 if refused else 2 * peak
    worker.config = connector_config({"paged_writer": "stacked", "policy": {"guard_max_abs": guard}}, "recompute")
    worker.rank, worker.ranks, worker.block_size, worker.device = 1, 2, 32, torch.device("cpu")
    worker.bound, worker._started, worker._failed = {"m:1": route}, [], []
    worker.timings = Timings("worker", str(tmp_path / "timings.jsonl"))
    released = []
    lease = SimpleNamespace(release=lambda: released.append(True))
    worker.transport = SimpleNamespace(load=lambda *_: (keys, values, lease))
    worker.register_kv_caches({name: layer.kv_cache for name, layer in layers.items()})
    assert worker.writer.direct is not None and worker.heads == HEADS
    load = Load("r", "e1", "m:1", SimpleNamespace(start=START, end=START + 40), [3, 1])
    monkeypatch.setattr(worker, "_get_connector_metadata", lambda: KVRelayMetadata(loads=[load]))
    worker.start_load_kv(None)
    assert worker._failed == []
    assert worker.get_block_ids_with_load_errors() == ({3, 1} if refused else set()) and released == [True]
    lines = (tmp_path / "timings.jsonl").read_text().splitlines()
    assert [json.loads(line)["phase"] for line in lines] == ["load", "slots", "map", "check"]
    _, expected = _flash(True)
    write_slots(expected, mapped_k, mapped_v, SLOTS, "flash")
    assert torch.equal(stack_layers(list(layers.values())), expected)


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's FlashAttention cache writer)")
@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "block-major"])
def test_the_direct_map_is_what_vllms_flash_cache_writer_writes_of_the_mapped_scratch(pair, interleaved):
    """On a GPU, the compiled kernel's stores into bf16 flash blocks equal mapping to scratch and FlashAttention's
    own writer per layer (`reshape_and_cache_flash`, as `FlashAttentionImpl.do_kv_cache_update` calls it)."""
    from vllm import _custom_ops as ops

    route, (keys, values) = _route(pair, "triton", "cuda"), _span("cuda")
    slots = SLOTS.cuda()
    caches, ours = (_stacked_caches("flash", heads=1, d=16, dtype=torch.bfloat16, interleaved=interleaved,
                                    device="cuda") for _ in range(2))  # fmt: skip
    ours = stack_layers([_Layer(kv, "FLASH_ATTN", "flash") for kv in ours])
    nonfinite, beyond = route.map_into(keys, values, START, HEADS, Writer.over(ours, "flash").direct, slots, None)
    mapped_k, mapped_v, _ = route.map(keys, values, START, HEADS, torch.bfloat16)  # [L_t, n, H, d_t]
    one = torch.tensor(1.0, device="cuda")
    for kv, k, v in zip(caches, mapped_k, mapped_v, strict=True):
        key_cache, value_cache = kv.transpose(1, 2).split(16, dim=-1)  # FlashAttentionImpl's view: [B, N, H, d]
        ops.reshape_and_cache_flash(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, "auto", one, one)
    assert torch.equal(ours, stack_layers([_Layer(kv, "FLASH_ATTN", "flash") for kv in caches]))
    assert not (nonfinite.any() or beyond.any())
