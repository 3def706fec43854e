"""The sender's export read in one launch (kernels/paged_read.py, `paged.read_export`): on flash caches allocated every
way vLLM allocates them — one buffer (layer-major, block-major) or each layer its own allocation at uneven steps and in
either address order (negative offsets) — the kernel reads exactly what one `read_slots` per layer reads, stacked, for
slots in blocks out of order; its reference is that path; the worker's export hands the transport those K/V. The
kernel in its CPU interpreter here (it addresses raw pointers), compiled on CUDA in the GPU case."""

import collections
import logging
from types import SimpleNamespace

import pytest
import torch

from kernels import paged_read
from kernels.apply_map import HAVE_TRITON
from kernels.paged_read import read_layers, read_layers_ref, triton_unsupported
from src.serving import paged
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

    def no_launch(*_):
        raise AssertionError("an export of no tokens launched the kernel")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_read, "jit", no_launch)
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


def _exported(worker) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V the worker's `wait_for_save` hands its transport for a 40-token prompt in blocks 3, 1."""
    from src.serving.metadata import KVRelayMetadata, Save  # vLLM's base class: the kernel's tests here run without it

    put = []
    worker.transport = SimpleNamespace(put=lambda export_id, keys, values, ids, *rest, **kw: put.append((keys, values)))
    worker.identity = SimpleNamespace(fingerprint="f" * 64, tokenizer_hash="t" * 64)
    worker._exports = collections.deque()
    save = Save("r", "e1", list(range(40)), [3, 1], None)
    worker._get_connector_metadata = lambda: KVRelayMetadata(saves=[save])
    worker.has_connector_metadata = lambda: True
    worker.wait_for_save()
    return put[0]


@needs_vllm
@pytest.mark.parametrize("path", ["reference", pytest.param("kernel", marks=interpreter)])
@pytest.mark.parametrize("allocation", ["block-major", "apart-descending"])
def test_the_worker_exports_every_layers_kv_read_in_one_pass(pair, tmp_path, allocation, path, request):  # noqa: F811
    """register_kv_caches builds the flash halves once; `wait_for_save` hands the transport each layer's K/V at the
    request's slots, [L, H, T, d] — what the per-layer read gave — through the kernel (interpreted) or its reference."""
    if path == "kernel":
        request.getfixturevalue("interpreted")
    caches = _filled(allocation)
    worker = _worker(caches, _route(pair, "torch"), 1e6, tmp_path)
    assert worker.halves is not None
    (keys, values), expected = _exported(worker), _per_layer(caches, SLOTS)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert keys.is_contiguous() == (path == "kernel")  # the kernel's own [L, H, T, d]; the reference's strided stack


@needs_vllm
def test_unlike_or_quantized_caches_and_a_failed_launch_read_each_layer_apart(pair, tmp_path, caplog, monkeypatch):  # noqa: F811
    """No halves for layers unlike each other (said) or quantized (as the per-layer read always read them); a launch
    that fails is said once, and that export and the later ones read each layer apart — the same K/V."""
    caches = _filled("apart")
    unlike = [*caches[:2], caches[2].half()]
    with caplog.at_level(logging.WARNING):
        assert _worker(unlike, _route(pair, "torch"), 1e6, tmp_path).halves is None
    assert "the export reads each layer apart: layer 2's cache is not alike layer 0's" in caplog.text
    quantized = [kv.to(torch.float8_e4m3fn) for kv in caches]
    assert _worker(quantized, _route(pair, "torch"), 1e6, tmp_path).halves is None
    worker = _worker(caches, _route(pair, "torch"), 1e6, tmp_path)

    def refused(*_):
        raise RuntimeError("the compiler refused")

    monkeypatch.setattr(paged, "read_layers", refused)
    with caplog.at_level(logging.WARNING):
        keys, values = _exported(worker)
    assert worker.halves is None and "one-launch read failed (the compiler refused)" in caplog.text
    expected = _per_layer(caches, SLOTS)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


@interpreter
def test_the_launch_hints_the_offsets_multiple_of_both_halves(interpreted, monkeypatch):  # noqa: F811
    """The alignment hint is the largest power of two dividing every K and V layer offset: 16 elements for caches
    allocated whole, 1 for layers at odd element offsets in one buffer — whose read is still exact."""
    launched = []
    real = paged_read.jit

    def spy(kernel, interpret):
        return _Spied(real(kernel, interpret), launched)

    monkeypatch.setattr(paged_read, "jit", spy)
    aligned = _filled("apart")
    read_layers(*flash_halves(aligned), SLOTS, backend="triton")
    buffer = torch.randn(3 * 4 * 32 * 2 * 32 + 8)
    size = 4 * 32 * 2 * 32
    odd = [buffer[1 + i * (size + 1) : 1 + i * (size + 1) + size].view(4, 32, 2, 32).transpose(1, 2) for i in range(2)]
    keys, values = read_layers(*flash_halves(odd), SLOTS, backend="triton")
    assert launched == [16, 1]
    expected = _per_layer(odd, SLOTS)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


class _Spied:
    """A jitted kernel whose launches record their OFFSET_MULTIPLE before running."""

    def __init__(self, launch, launched: list):
        self.launch, self.launched = launch, launched

    def __getitem__(self, grid):
        def run(*args, **constants):
            self.launched.append(constants["OFFSET_MULTIPLE"])
            return self.launch[grid](*args, **constants)

        return run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_compiled_read_equals_each_layers_read_on_a_gpu(allocation):
    caches = _filled(allocation, torch.bfloat16, "cuda")
    slots = slots_for([3, 1, 2], 32, 0, 70, "cuda")
    keys, values = read_layers(*flash_halves(caches), slots, backend="triton")
    expected = _per_layer(caches, slots)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
