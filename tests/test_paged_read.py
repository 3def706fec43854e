"""The sender's export read in one launch (kernels/paged_read.py, `paged.read_export`): on flash caches allocated every
way vLLM allocates them — one buffer (layer-major, block-major) or each layer its own allocation at uneven steps and in
either address order (negative offsets) — the kernel reads exactly what one `read_slots` per layer reads, stacked, for
slots in blocks out of order; its reference is that path; the worker's export hands the transport those K/V. The
kernel in its CPU interpreter here (it addresses raw pointers), compiled on CUDA in the GPU case."""

import collections
from types import SimpleNamespace

import pytest
import torch

from kernels.apply_map import HAVE_TRITON
from kernels.paged_read import read_layers, read_layers_ref, triton_unsupported
from src.serving.metadata import KVRelayMetadata, Save
from src.serving.paged import flash_halves, read_export, read_slots, slots_for
from tests.test_kernels_apply import interpreted  # noqa: F401  (the fixture)
from tests.test_paged_direct import ALLOCATIONS, SLOTS, _caches, _layers, _route, _worker, pair  # noqa: F401
from tests.test_vllm_parts import needs_vllm

interpreter = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (its CPU interpreter)")


def _filled(allocation: str, dtype=torch.float32, device: str = "cpu") -> list[torch.Tensor]:
    """Flash caches of 3 layers × 4 blocks × 2 heads × 32 slots × 2·16 channels, random (no two elements alike)."""
    caches, _ = _caches(allocation, device, dtype, heads=2)
    generator = torch.Generator().manual_seed(11)
    for kv in caches:
        kv.copy_(torch.randn(kv.shape, generator=generator).to(dtype))
    return caches


def _per_layer(caches: list[torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the export read before: one `read_slots` per layer, stacked → [L, H, T, d]."""
    pairs = [read_slots(kv, slots, "flash") for kv in caches]
    return torch.stack([k for k, _ in pairs]).transpose(1, 2), torch.stack([v for _, v in pairs]).transpose(1, 2)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_one_launch_reads_what_each_layers_read_reads(allocation, dtype, interpreted):  # noqa: F811
    caches = _filled(allocation, dtype)
    slots = slots_for([3, 1, 2], 32, 0, 70)  # [70]: blocks out of order, the last one partly, a tail past BLOCK_T
    keys, values = read_layers(*flash_halves(caches), slots, backend="triton")
    expected = _per_layer(caches, slots)
    assert keys.shape == (3, 2, 70, 16) and keys.is_contiguous()
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert torch.equal(keys, read_layers_ref(*flash_halves(caches), slots)[0])
    empty = read_layers(*flash_halves(caches), slots[:0], backend="triton")  # no tokens: empty, no launch
    assert all(t.shape == (3, 2, 0, 16) for t in empty)


def test_the_reference_is_each_layers_read_and_the_fallback_says_why():
    caches = _filled("apart-descending")
    halves, slots = flash_halves(caches), SLOTS
    assert all(torch.equal(a, b) for a, b in zip(read_layers(*halves, slots), _per_layer(caches, slots), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(read_export([], slots, "flash", halves), _per_layer(caches, slots),
                                                 strict=True))  # fmt: skip
    with pytest.raises(ValueError, match="backend must be"):
        read_layers(*halves, slots, backend="cuda")


@interpreter
def test_the_kernel_refuses_what_it_cannot_read_naming_it(interpreted):  # noqa: F811
    caches = _filled("apart")
    odd = [kv[..., :24] for kv in caches]  # 12 channels a half: not a power of two
    assert triton_unsupported(*flash_halves(caches)) is None
    with pytest.raises(ValueError, match="head dim 12 .* not a power of two"):
        read_layers(*flash_halves(odd), SLOTS, backend="triton")
    expected = _per_layer(odd, SLOTS)  # auto: the reference reads it
    assert all(torch.equal(a, b) for a, b in zip(read_layers(*flash_halves(odd), SLOTS), expected, strict=True))


@needs_vllm
@pytest.mark.parametrize("allocation", ["block-major", "apart-descending"])
def test_the_worker_exports_every_layers_kv_read_in_one_pass(pair, tmp_path, allocation):  # noqa: F811
    """register_kv_caches builds the flash halves once; `wait_for_save` hands the transport each layer's K/V at the
    request's slots, [L, H, T, d] — what the per-layer read gave."""
    caches = _filled(allocation)
    worker = _worker(caches, _route(pair, "torch"), 1e6, tmp_path)
    assert worker.halves is not None
    put = []
    worker.transport = SimpleNamespace(put=lambda export_id, keys, values, ids, *rest, **kw: put.append((keys, values)))
    worker.identity = SimpleNamespace(fingerprint="f" * 64, tokenizer_hash="t" * 64)
    worker._exports = collections.deque()
    save = Save("r", "e1", list(range(40)), [3, 1], None)
    worker._get_connector_metadata = lambda: KVRelayMetadata(saves=[save])
    worker.has_connector_metadata = lambda: True
    worker.wait_for_save()
    (keys, values), expected = put[0], _per_layer(caches, SLOTS)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_compiled_read_equals_each_layers_read_on_a_gpu(allocation):
    caches = _filled(allocation, torch.bfloat16, "cuda")
    slots = slots_for([3, 1, 2], 32, 0, 70, "cuda")
    keys, values = read_layers(*flash_halves(caches), slots, backend="triton")
    expected = _per_layer(caches, slots)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
