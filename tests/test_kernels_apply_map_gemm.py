"""The map as one GEMM per target head (`kernels.apply_map_gemm`, `map_cache(backend="gemm")`) equals the reference
`map_cache_ref` — CPU, fp32, tolerance 1e-5 of the reference's largest |entry| — on a pair whose target differs from
its source in every size (L 5 → 7, H_s 2 → H_t 3, d 16 → 32): every target layer reading all source layers, or
fewer, in its own order; fan-in f = 2; both RoPE layouts; new tensors, `out`, `out` at slots in paged blocks,
`LayerViews`; the non-finite and beyond flags. Under Triton's CPU interpreter the same map finishes in the Triton
epilogue (`kernels.apply_map_epilogue.store_mapped`), which equals the torch epilogue (`map_cache_gemm`) into new
tensors, at slots in paged blocks and into layers allocated apart; its flags are the torch epilogue's."""

import dataclasses

import pytest
import torch

import kernels.apply_map
from kernels.apply_map import map_cache, map_cache_ref
from kernels.apply_map_gemm import gemm_worthwhile, map_cache_gemm, packed_weights
from src.apply import KVTransfer
from src.artifact import Mapper
from src.forward import prefill
from src.maps import LayerViews
from src.models import describe_kv, fingerprint, vocabulary_hash
from src.rope import remove_rope
from src.synthetic import synthetic_mapper
from tests.conftest import calibration_ids, tiny
from tests.test_kernels_apply import _case, _scaled_error, interpreted, interpreter, uneven  # noqa: F401  (fixture)

TOLERANCE = 1e-5
SHAPE = dict(L_s=5, L_t=7, H_s=2, H_t=3, d_s=16, d_t=32, batch=2, seq=9)
ORDERS = {  # S_ℓ per target layer: every source layer in a different order each, or three of them, in any order
    "all": [torch.randperm(5, generator=torch.Generator().manual_seed(layer)) for layer in range(7)],
    "some": [torch.tensor(s) for s in ([4, 0, 2], [1, 3, 0], [2, 1, 4], [0, 1, 2], [3, 4, 1], [4, 2, 0], [2, 3, 1])],
}
HEADS = {"f1": [[1], [0], [1]], "f2": [[0, 1], [1, 0], [1, 1]]}  # [H_t, f] source heads of each target head


def _mapper(order: str, fan_in: str, seed: int = 0) -> Mapper:
    layers, heads = torch.stack(ORDERS[order]), torch.tensor(HEADS[fan_in])  # [L_t, k], [H_t, f]
    width = layers.shape[1] * heads.shape[1] * SHAPE["d_s"]
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape, scale: torch.randn(*shape, generator=generator) * scale
    coefficients = lambda: draw(SHAPE["L_t"], SHAPE["H_t"], width, SHAPE["d_t"], scale=width**-0.5)
    biases = lambda: draw(SHAPE["L_t"], SHAPE["H_t"], SHAPE["d_t"], scale=0.5)
    return Mapper(layers, heads, coefficients(), biases(), coefficients(), biases(), manifest={})


def _call(mapper: Mapper, layouts=("half", "half"), **options):
    keys, values, tables = _case(SHAPE)
    return (keys, values, mapper, *tables, *layouts), options


def _assert_close(ours, reference) -> None:
    for name, a, b in zip(("keys", "values"), ours, reference, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        error = _scaled_error(a, b)
        assert error <= TOLERANCE, f"{name}: max |Δ| / max |ref| = {error:.2e}"


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("fan_in", sorted(HEADS))
@pytest.mark.parametrize("layouts", [("half", "half"), ("interleaved", "interleaved"), ("half", "interleaved")])
def test_gemm_equals_the_reference(order, fan_in, layouts):
    args, _ = _call(_mapper(order, fan_in), layouts)
    _assert_close(map_cache(*args, backend="gemm"), map_cache_ref(*args))


def test_a_held_packing_is_the_same_map_and_a_foreign_one_is_refused():
    mapper = _mapper("some", "f1")
    args, _ = _call(mapper)
    packed = packed_weights(mapper, SHAPE["L_s"])  # [H_t, L_s·f·d_s, L_t·d_t]
    assert packed.weight_k.shape == (3, 5 * 16, 7 * 32) and packed.bias_k.shape == (3, 7, 32)
    torch.testing.assert_close(map_cache(*args, backend="gemm", packed=packed), map_cache(*args, backend="gemm"))
    foreign = packed_weights(_mapper("some", "f2"), SHAPE["L_s"])
    with pytest.raises(ValueError, match="packed weights .* are not this mapper's"):
        map_cache(*args, backend="gemm", packed=foreign)


def test_unselected_source_layers_have_zero_rows():
    mapper = _mapper("some", "f1")
    weight = packed_weights(mapper, SHAPE["L_s"]).weight_k.unflatten(1, (5, 16)).unflatten(3, (7, 32))
    reads = torch.zeros(5, 7, dtype=torch.bool)  # [L_s, L_t]: source layer l feeds target layer ℓ
    for layer, selected in enumerate(ORDERS["some"]):
        reads[selected, layer] = True
    nonzero = weight.abs().amax(dim=(0, 2, 4)) > 0  # [L_s, L_t]
    assert torch.equal(nonzero, reads)


def test_out_slots_and_layer_views_hold_what_the_reference_maps():
    shape = dict(SHAPE, batch=1)
    keys, values, tables = _case(shape)
    mapper = _mapper("some", "f2")
    args = (keys, values, mapper, *tables)
    expected = map_cache_ref(*args)  # [L_t, 1, H_t, T, d_t] each
    out = tuple(torch.full((7, 1, 3, 9, 32), float("nan")) for _ in range(2))
    assert map_cache(*args, backend="gemm", out=out) is out
    _assert_close(out, expected)
    blocks = tuple(torch.zeros(7, 6, 3, 4, 32) for _ in range(2))  # [L_t, N_blocks, H_t, block_size, d_t]
    slots = torch.tensor([21, 3, 4, 5, 12, 13, 0, 22, 7])  # [T]
    map_cache(*args, backend="gemm", out=blocks, slots=slots)
    stored = tuple(b[:, slots // 4, :, slots % 4].permute(1, 2, 0, 3)[:, None] for b in blocks)  # [L_t, 1, H_t, T, d_t]
    _assert_close(stored, expected)
    separate = [torch.zeros(1, 3, 9, 32) for _ in range(14)]  # L_t allocations per component, anywhere
    views = (LayerViews.of(separate[::2]), LayerViews.of(separate[1::2]))
    map_cache(*args, backend="gemm", out=views)
    _assert_close(tuple(torch.stack(v.views) for v in views), expected)


def test_flags_name_exactly_the_target_layers_of_corrupt_coefficients_and_every_layer_for_a_corrupt_source():
    """Coefficients: a NaN in W_ℓh flags exactly layer ℓ, as the reference. A source: the reference flags the target
    layers that read the corrupt layer; one GEMM multiplies it by the zero rows of every other layer too (0 · NaN =
    NaN), so every target layer is flagged — a superset, and the same refusal (a map with any flag is refused whole)."""
    mapper = _mapper("some", "f1")
    (keys, values, *rest), _ = _call(mapper)
    weight_k = mapper.weight_k.clone()
    weight_k[4, 2, 7, 3] = float("nan")
    corrupt = dataclasses.replace(mapper, weight_k=weight_k)
    nonfinite, beyond = torch.full((7,), 5, dtype=torch.int32), torch.zeros(7, dtype=torch.int32)
    map_cache(keys, values, corrupt, *rest[1:], backend="gemm", nonfinite=nonfinite, beyond=beyond)
    assert nonfinite.tolist() == [0, 0, 0, 0, 1, 0, 0]
    reference = torch.zeros(7, dtype=torch.int32)
    values[3][1, 0, 4, 2] = float("nan")
    map_cache_ref(keys, values, *rest, nonfinite=reference)
    map_cache(keys, values, *rest, backend="gemm", nonfinite=nonfinite)
    readers = [int(3 in selected.tolist()) for selected in ORDERS["some"]]
    assert reference.tolist() == readers and 0 < sum(readers) < 7 and nonfinite.tolist() == [1] * 7
    values[3][1, 0, 4, 2] = 0.0
    reference_k, reference_v = map_cache_ref(keys, values, *rest)
    peaks = torch.maximum(reference_k.flatten(1).abs().amax(1), reference_v.flatten(1).abs().amax(1))  # [L_t]
    bound = float(peaks.sort().values[3:5].mean())  # halfway between two layers' peaks: no rounding decides
    map_cache(keys, values, *rest, backend="gemm", nonfinite=nonfinite, beyond=beyond, bound=bound)
    assert nonfinite.tolist() == [0] * 7 and beyond.tolist() == (peaks > bound).int().tolist()
    assert 0 < sum(beyond.tolist()) < 7


def test_a_mapper_with_token_features_is_refused_naming_why():
    mapper = _mapper("some", "f1")
    mapper = dataclasses.replace(mapper, manifest={"token_features": True})
    args, _ = _call(mapper)
    with pytest.raises(ValueError, match="token features"):
        map_cache(*args, backend="gemm")


def test_worthwhile_when_most_source_layers_are_read():
    assert gemm_worthwhile(_mapper("all", "f1"), 5) and not gemm_worthwhile(_mapper("some", "f1"), 5)


def test_kvtransfer_on_the_gemm_backend_equals_the_torch_backend():
    source, target = tiny("qwen3"), tiny("llama", seed=1, num_hidden_layers=5, head_dim=32)
    token_hash = vocabulary_hash(target)
    manifest = {"source_fingerprint": fingerprint(source), "target_fingerprint": fingerprint(target),
                "tokenizer_hash": token_hash}  # fmt: skip
    mapper = synthetic_mapper(describe_kv(source), describe_kv(target), "local", 2, manifest, seed=3)
    cache = prefill(source, calibration_ids(2, 13, seed=4))
    positions = torch.arange(40, 53)
    mapped = [KVTransfer(mapper, source, target, token_hash, backend=b)(cache, positions=positions)
              for b in ("torch", "gemm")]  # fmt: skip
    for ours, theirs in zip(mapped[1].layers, mapped[0].layers, strict=True):
        _assert_close((ours.keys, ours.values), (theirs.keys, theirs.values))


# --------------------------------------------------------------------------- the Triton epilogue (interpreter)


@pytest.fixture
def fused(interpreted, monkeypatch):  # noqa: F811  (the fixture)
    """The interpreter on, and the torch epilogue out of reach of `map_cache`: a result comes from `store_mapped`."""

    def refuse(*args, **kwargs):
        raise AssertionError("map_cache(backend='gemm') took the torch epilogue under the interpreter")

    monkeypatch.setattr(kernels.apply_map, "_map_gemm", refuse)


def _torch_epilogue(keys, values, mapper, tables, layouts=("half", "half"), **flags):
    """The stage-1 torch epilogue on the same content: `remove_rope`, then `map_cache_gemm`."""
    source_cos, source_sin, target_cos, target_sin = tables
    content = remove_rope(torch.stack(keys), source_cos, source_sin, layouts[0])  # [L_s, B, H_s, T, d_s]
    packed = packed_weights(mapper, SHAPE["L_s"])
    return map_cache_gemm(content, torch.stack(values), packed, target_cos, target_sin, layouts[1], torch.float32,
                          **flags)  # fmt: skip


@interpreter
@pytest.mark.parametrize("layouts", [("half", "half"), ("interleaved", "interleaved"), ("half", "interleaved")])
def test_interpreted_epilogue_equals_the_torch_epilogue(layouts, fused):
    """Batch 2, 40 tokens (two token blocks): new tensors and a stacked `out`, flags all clear."""
    keys, values, tables = _case(dict(SHAPE, seq=40))
    mapper = _mapper("all", "f2")
    args = (keys, values, mapper, *tables, *layouts)
    expected = _torch_epilogue(keys, values, mapper, tables, layouts)  # [L_t, 2, H_t, 40, d_t] each
    nonfinite, beyond = torch.ones(7, dtype=torch.int32), torch.ones(7, dtype=torch.int32)
    _assert_close(map_cache(*args, backend="gemm", nonfinite=nonfinite, beyond=beyond), expected)
    assert nonfinite.tolist() == [0] * 7 and beyond.tolist() == [0] * 7
    out = tuple(torch.full((7, 2, 3, 40, 32), float("nan")) for _ in range(2))
    assert map_cache(*args, backend="gemm", out=out) is out
    _assert_close(out, expected)


@interpreter
def test_interpreted_epilogue_stores_at_slots_and_into_layers_allocated_apart(fused):
    """Slots into paged blocks (rows no slot names keep their contents), and `LayerViews` of separate allocations
    at uneven steps, later layers at lower addresses."""
    shape = dict(SHAPE, batch=1, seq=40)
    keys, values, tables = _case(shape)
    mapper = _mapper("some", "f2")
    args = (keys, values, mapper, *tables, "interleaved", "half")
    expected = _torch_epilogue(keys, values, mapper, tables, ("interleaved", "half"))  # [L_t, 1, H_t, 40, d_t]
    blocks = tuple(torch.full((7, 13, 3, 4, 32), 7.0) for _ in range(2))  # [L_t, N_blocks, H_t, block_size, d_t]
    slots = torch.randperm(52, generator=torch.Generator().manual_seed(1))[:40]  # [T]
    map_cache(*args, backend="gemm", out=blocks, slots=slots)
    stored = tuple(b[:, slots // 4, :, slots % 4].permute(1, 2, 0, 3)[:, None] for b in blocks)  # [L_t, 1, H_t, T, d_t]
    _assert_close(stored, expected)
    unused = torch.ones(52, dtype=torch.bool)
    unused[slots] = False
    assert all(bool((b.transpose(2, 3).flatten(1, 2)[:, unused] == 7).all()) for b in blocks)
    layers = [torch.full((1, 3, 40, 32), 7.0) for _ in range(16)]
    keys_out = uneven(layers, 7)
    rest = [t for t in layers if all(t is not k for k in keys_out)]
    views = (LayerViews.of(keys_out), LayerViews.of(uneven(rest, 7)))
    assert all((v.offsets[1:] < 0).all() and len(set(v.offsets.diff().tolist())) > 1 for v in views)
    map_cache(*args, backend="gemm", out=views)
    _assert_close(tuple(torch.stack(v.views) for v in views), expected)


@interpreter
def test_interpreted_epilogue_flags_are_the_torch_epilogues(fused):
    """A NaN coefficient of W_K at target layer 4 flags layer 4 only; a bound between two layers' peaks flags
    beyond exactly where the torch epilogue does (some layers, not all)."""
    keys, values, tables = _case(SHAPE)
    mapper = _mapper("some", "f1")
    expected = [torch.zeros(7, dtype=torch.int32) for _ in range(2)]
    reference_k, reference_v = _torch_epilogue(keys, values, mapper, tables)
    peaks = torch.maximum(reference_k.flatten(1).abs().amax(1), reference_v.flatten(1).abs().amax(1))  # [L_t]
    bound = float(peaks.sort().values[3:5].mean())
    _torch_epilogue(keys, values, mapper, tables, nonfinite=expected[0], beyond=expected[1], bound=bound)
    nonfinite, beyond = torch.full((7,), 5, dtype=torch.int32), torch.full((7,), 5, dtype=torch.int32)
    map_cache(keys, values, mapper, *tables, backend="gemm", nonfinite=nonfinite, beyond=beyond, bound=bound)
    assert nonfinite.tolist() == [0] * 7 and beyond.tolist() == expected[1].tolist()
    assert 0 < sum(beyond.tolist()) < 7
    weight_k = mapper.weight_k.clone()
    weight_k[4, 2, 7, 3] = float("nan")
    corrupt = dataclasses.replace(mapper, weight_k=weight_k)
    map_cache(keys, values, corrupt, *tables, backend="gemm", nonfinite=nonfinite, beyond=beyond)
    assert nonfinite.tolist() == [0, 0, 0, 0, 1, 0, 0] and beyond.tolist() == [0] * 7


# --------------------------------------------------------------------------- the Triton epilogue compiled (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layouts", [("half", "half"), ("interleaved", "half")])
def test_compiled_epilogue_stores_at_slots_what_the_torch_epilogue_maps_and_flags_alike(layouts, monkeypatch):
    """On CUDA `map_cache(backend="gemm")` finishes in the compiled `store_mapped` (the torch epilogue out of reach):
    at slots into paged blocks it stores what the torch epilogue maps on the CPU, rows no slot names keep their
    contents, the flags clear; a NaN coefficient of W_K at target layer 4 flags layer 4 only."""

    def refuse(*args, **kwargs):
        raise AssertionError("map_cache(backend='gemm') took the torch epilogue on CUDA")

    monkeypatch.setattr(kernels.apply_map, "_map_gemm", refuse)
    keys, values, tables = _case(dict(SHAPE, batch=1, seq=40))
    mapper = _mapper("all", "f2")
    expected = _torch_epilogue(keys, values, mapper, tables, layouts)  # [L_t, 1, H_t, 40, d_t] each, CPU
    cuda = lambda tensors: [t.cuda() for t in tensors]
    args = (cuda(keys), cuda(values), mapper.to("cuda", torch.float32), *cuda(tables), *layouts)
    blocks = tuple(torch.full((7, 13, 3, 4, 32), 7.0, device="cuda") for _ in range(2))  # [L_t, N, H_t, 4, d_t]
    slots = torch.randperm(52, generator=torch.Generator().manual_seed(1))[:40]  # [T]
    nonfinite, beyond = (torch.ones(7, dtype=torch.int32, device="cuda") for _ in range(2))
    map_cache(*args, backend="gemm", out=blocks, slots=slots.cuda(), nonfinite=nonfinite, beyond=beyond)
    stored = tuple(b.cpu()[:, slots // 4, :, slots % 4].permute(1, 2, 0, 3)[:, None] for b in blocks)
    _assert_close(stored, expected)
    unused = torch.ones(52, dtype=torch.bool)
    unused[slots] = False
    assert all(bool((b.cpu().transpose(2, 3).flatten(1, 2)[:, unused] == 7).all()) for b in blocks)
    assert nonfinite.tolist() == [0] * 7 and beyond.tolist() == [0] * 7
    weight_k = mapper.weight_k.clone()
    weight_k[4, 2, 7, 3] = float("nan")
    corrupt = dataclasses.replace(mapper, weight_k=weight_k).to("cuda", torch.float32)
    map_cache(args[0], args[1], corrupt, *args[3:], backend="gemm", nonfinite=nonfinite, beyond=beyond)
    assert nonfinite.tolist() == [0, 0, 0, 0, 1, 0, 0] and beyond.tolist() == [0] * 7
