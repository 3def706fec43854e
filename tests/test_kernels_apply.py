"""Fused mapper application (`kernels.apply_map`): the reference equals `KVTransfer`; the Triton kernels equal the
reference — in Triton's CPU interpreter here, on CUDA where there is a GPU.

Tolerances, as a fraction of the reference's largest |entry| (outputs are O(1)–O(10)):
  fp32 coefficients, input_precision "ieee"  1e-4  (fp32 accumulation in another order; measured ~2e-7)
  fp32 coefficients, "tf32"                  5e-3  (10-bit mantissa inputs, fp32 accumulation)
  bf16 coefficients                          2⁻⁶   (the reference rounds the GEMM output to bf16 before RoPE and
                                                    again after; the kernel rounds once, so they differ by ≲ 2 ulp;
                                                    the interpreter also truncates fp32 → bf16 instead of rounding)
and, bf16 on CUDA, against an fp64 evaluation of the same rounded inputs: kernel error ≤ reference error + 2⁻⁹.
"""

import dataclasses
import itertools

import pytest
import torch

from kernels.apply_map import (
    HAVE_TRITON,
    CapturedMapCache,
    KernelConfig,
    default_config,
    derope_keys,
    map_cache,
    map_cache_ref,
    triton_unsupported,
)
from src.apply import KVTransfer
from src.artifact import Mapper
from src.forward import prefill
from src.maps import LayerViews
from src.models import describe_kv, fingerprint, vocabulary_hash
from src.rope import remove_rope, rope_cos_sin
from src.select import depth_layers
from src.support import head_assignment
from src.synthetic import synthetic_mapper
from tests.conftest import calibration_ids, tiny

TOLERANCE = {"ieee": 1e-4, "tf32": 5e-3, "bf16": 2**-6}
SMALL = KernelConfig(block_m=16, block_k=16, num_warps=4, num_stages=2)  # several token blocks at tiny T
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreter = pytest.mark.skipif(  # with a GPU the compiled kernels are tested instead (and older tritons leave
    not HAVE_TRITON or torch.cuda.is_available(),  # triton.language patched after an interpreted run)
    reason="needs triton's CPU interpreter, and no GPU",
)


@pytest.fixture
def interpreted(monkeypatch):
    """TRITON_INTERPRET=1 for one test; skips where this triton / numpy pair cannot interpret the builtins we use."""
    import triton
    import triton.language as tl

    def probe(out, N: tl.constexpr):  # tl.full, tl.dot, tl.where, tl.atomic_max: nothing of ours
        i = tl.arange(0, N)
        acc = tl.dot(
            tl.full((N, N), 1.0, tl.float32), tl.full((N, N), 2.0, tl.float32), tl.full((N, N), 0.0, tl.float32)
        )
        tl.store(out + i[:, None] * N + i[None, :], tl.where(acc > 0, 1, 0).to(tl.int32))
        tl.atomic_max(out + i, tl.full((N,), 2, tl.int32), mask=i < 4)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        out = torch.zeros(256, dtype=torch.int32)
        triton.jit(probe)[(1,)](out, N=16)
        assert out.sum() == 256 + 4, "interpreted probe computed the wrong result"
    except Exception as error:
        pytest.skip(f"the Triton interpreter does not run here: {error!r:.200}")


def _random_mapper(
    source_layers: int,
    target_layers: int,
    source_heads: int,
    target_heads: int,
    d_s: int,
    d_t: int,
    support: str = "local",
    k: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Mapper:
    """Depth-proportional layers, the support's head map, random coefficients of O(1) outputs."""
    generator = torch.Generator(device).manual_seed(0)  # drawn where used: 1 G values at paper scale
    heads = head_assignment(support, source_heads, target_heads)  # [H_t, f]
    width = k * heads.shape[1] * d_s
    draw = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)
    return Mapper(
        source_layers=depth_layers(source_layers, target_layers, k).to(device),  # [L_t, k]
        head_index=heads.to(device),
        weight_k=draw(target_layers, target_heads, width, d_t, scale=width**-0.5),  # [L_t, H_t, p, d_t]
        bias_k=draw(target_layers, target_heads, d_t, scale=0.5),  # [L_t, H_t, d_t]
        weight_v=draw(target_layers, target_heads, width, d_t, scale=width**-0.5),
        bias_v=draw(target_layers, target_heads, d_t, scale=0.5),
        manifest={},
    )


def _rope(positions: torch.Tensor, dim: int, rope_dim: int | None = None, theta: float = 10000.0):
    """HF-style cos, sin [B, 1, T, rope_dim] (cat(freqs, freqs)) for positions [B, T]."""
    rope_dim = rope_dim or dim
    inv_freq = theta ** -(torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)  # [rope_dim/2]
    freqs = positions[..., None].float() * inv_freq  # [B, T, rope_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, rope_dim]
    return emb.cos(), emb.sin()


def _case(shape: dict, seed: int = 0):
    """Random RoPE'd source layers, per-batch relocated positions and both models' cos/sin."""
    device, dtype = shape.get("device", "cpu"), shape.get("cache_dtype", torch.float32)
    generator = torch.Generator(device).manual_seed(seed)
    batch, seq = shape["batch"], shape["seq"]
    layers = lambda: [
        torch.randn(batch, shape["H_s"], seq, shape["d_s"], generator=generator, device=device).to(dtype)
        for _ in range(shape["L_s"])
    ]  # L_s × [B, H_s, T, d_s]
    positions = torch.arange(seq) + 5 + 17 * torch.arange(batch)[:, None]  # [B, T]
    source = _rope(positions, shape["d_s"], shape.get("rope_dim"))
    target = _rope(positions, shape["d_t"], theta=1e6)
    return layers(), layers(), [t.to(device) for t in (*source, *target)]


def _scaled_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.double() - reference.double()).abs().max() / reference.double().abs().max())


def _assert_match(ours, reference, tolerance: float) -> None:
    for name, a, b in zip(("keys", "values"), ours, reference, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert bool(torch.isfinite(a).all()), name
        error = _scaled_error(a, b)
        assert error <= tolerance, f"{name}: max |Δ| / max |ref| = {error:.2e} > {tolerance:.1e}"


# --------------------------------------------------------------------------- reference = KVTransfer (CPU)

PAIRS = {  # support, source overrides, target overrides: equal heads, Full-Head, GQA ownership (f = 2)
    "local": ("local", {}, {"num_hidden_layers": 5}),
    "full": ("full", {}, {"num_hidden_layers": 5}),
    "gqa": ("local", {"num_key_value_heads": 4}, {"num_hidden_layers": 4, "head_dim": 32}),
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_reference_equals_kvtransfer(pair):
    support, source_overrides, target_overrides = PAIRS[pair]
    source, target = tiny("qwen3", **source_overrides), tiny("llama", seed=1, **target_overrides)
    token_hash = vocabulary_hash(target)
    manifest = {
        "source_fingerprint": fingerprint(source),
        "target_fingerprint": fingerprint(target),
        "tokenizer_hash": token_hash,
    }
    mapper = synthetic_mapper(describe_kv(source), describe_kv(target), support, 2, manifest, seed=3)
    transfer = KVTransfer(mapper, source, target, token_hash)
    cache = prefill(source, calibration_ids(2, 13, seed=4))
    positions = torch.arange(40, 53)  # a relocated block
    expected = transfer(cache, positions=positions)
    tables = (*rope_cos_sin(source.model.rotary_emb, positions), *rope_cos_sin(target.model.rotary_emb, positions))
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    for source_keys, source_values in ((keys, values), (torch.stack(keys), torch.stack(values))):
        target_k, target_v = map_cache(source_keys, source_values, transfer.mapper, *tables, out_dtype=transfer.dtype)
        assert target_k.shape == (len(expected.layers), *expected.layers[0].keys.shape)  # [L_t, B, H_t, T, d_t]
        for index, layer in enumerate(expected.layers):
            torch.testing.assert_close(target_k[index], layer.keys, rtol=0, atol=1e-6)
            torch.testing.assert_close(target_v[index], layer.values, rtol=0, atol=1e-6)


def test_reasons_for_the_fallback(monkeypatch):
    shape = dict(L_s=3, L_t=4, H_s=2, H_t=2, d_s=16, d_t=16, batch=1, seq=5)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(3, 4, 2, 2, 16, 16)
    reason = lambda keys=keys[0], target_cos=tables[2], layouts=("half", "half"): triton_unsupported(
        keys, mapper, tables[0], target_cos, layouts
    )
    if not HAVE_TRITON:
        assert "not installed" in reason()
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in reason()
    with pytest.raises(ValueError, match="Triton path unavailable"):
        map_cache(keys, values, mapper, *tables, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert reason() is None
    assert "layouts" in reason(layouts=("half", "neox"))
    assert "partial rotary" in reason(target_cos=tables[2][..., :8])
    assert "multiple of 16" in reason(keys=torch.zeros(1, 2, 5, 24))


def test_nonfinite_flags_name_the_target_layers_fed_by_a_corrupt_source_layer():
    shape = dict(L_s=4, L_t=6, H_s=2, H_t=2, d_s=16, d_t=16, batch=1, seq=6)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(4, 6, 2, 2, 16, 16, k=1)
    values[2][0, 1, 3, 5] = float("nan")
    flags = torch.zeros(6, dtype=torch.int32)
    map_cache(keys, values, mapper, *tables, nonfinite=flags)
    assert flags.tolist() == (mapper.source_layers == 2).any(1).int().tolist() and flags.any()


# --------------------------------------------------------------------------- Triton interpreter (CPU)


@interpreter
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_interpreted_derope_equals_remove_rope(layout, interpreted):
    for rope_dim in (16, 8):  # full and partial rotary
        shape = dict(L_s=2, H_s=2, d_s=16, d_t=16, batch=2, seq=70, rope_dim=rope_dim)
        keys, _, (cos, sin, *_) = _case(shape)
        stacked = torch.stack(keys)  # [L_s, B, H_s, T, d_s]
        content = derope_keys(stacked, cos, sin, layout, torch.float32)  # [L_s, B, H_s, T, d_s]
        torch.testing.assert_close(content, remove_rope(stacked, cos, sin, layout), rtol=0, atol=1e-6)


INTERPRETED = {  # support, H_s, H_t, d_s, d_t, batch, seq, layout, coefficient dtype
    "local-half-fp32": ("local", 2, 2, 16, 32, 1, 21, "half", torch.float32),
    "full-interleaved-fp32-batch": ("full", 2, 2, 16, 16, 2, 9, "interleaved", torch.float32),
    "gqa-f2-half-bf16": ("local", 4, 2, 32, 16, 1, 18, "half", torch.bfloat16),
}


@interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # inf · 0 in masked lanes
@pytest.mark.parametrize("name", sorted(INTERPRETED))
@pytest.mark.parametrize(  # launch orders; both RoPE halves in one tl.dot
    "layers_inner, single_dot",
    [(True, False), (False, False), (True, True)],
    ids=["layers-inner", "layers-outer", "single-dot"],
)
def test_interpreted_kernel_equals_reference(name, layers_inner, single_dot, interpreted):
    support, source_heads, target_heads, d_s, d_t, batch, seq, layout, dtype = INTERPRETED[name]
    shape = dict(L_s=3, L_t=4, H_s=source_heads, H_t=target_heads, d_s=d_s, d_t=d_t, batch=batch, seq=seq)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(3, 4, source_heads, target_heads, d_s, d_t, support=support, dtype=dtype)
    flags = torch.ones(4, dtype=torch.int32)
    args = (keys, values, mapper, *tables, layout, layout, torch.float32)
    config = dataclasses.replace(SMALL, layers_inner=layers_inner, single_dot=single_dot)
    ours = map_cache(*args, nonfinite=flags, backend="triton", config=config, precision="ieee")
    _assert_match(ours, map_cache_ref(*args), TOLERANCE["ieee" if dtype == torch.float32 else "bf16"])
    assert flags.tolist() == [0, 0, 0, 0]
    values[1][0, 0, seq - 1, 0] = float("inf")
    map_cache(*args, nonfinite=flags, backend="triton", config=config, precision="ieee")
    assert flags.tolist() == (mapper.source_layers == 1).any(1).int().tolist()


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_kernel_at_the_real_pairs_capacity_shapes(dtype, interpreted):
    """Qwen2.5-Coder 0.5B → 1.5B at the capacity point (Head-Local k = 24: 1,536-wide designs, d_s 64 → d_t 128,
    2 KV heads each), the map the routed bf16 runs apply through Triton; two of the 28 target layers."""
    shape = dict(L_s=24, L_t=2, H_s=2, H_t=2, d_s=64, d_t=128, batch=1, seq=5)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(24, 2, 2, 2, 64, 128, support="local", k=24, dtype=dtype)
    args = (keys, values, mapper, *tables, "half", "half", torch.float32)
    ours = map_cache(*args, backend="triton", config=SMALL, precision="ieee")
    _assert_match(ours, map_cache_ref(*args), TOLERANCE["ieee" if dtype == torch.float32 else "bf16"])


# --------------------------------------------------------------------------- CUDA


def _exact(keys, values, mapper: Mapper, tables, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 GEMM over the inputs exactly as both paths round them (content keys in cache, then compute dtype)."""
    compute = mapper.weight_k.dtype
    content = remove_rope(torch.stack(keys), tables[0], tables[1], layout).to(compute).double()  # [L_s, B, H_s, T, d_s]
    weights = (mapper.weight_k, mapper.bias_k, mapper.weight_v, mapper.bias_v)
    wide = Mapper(mapper.source_layers, mapper.head_index, *(t.double() for t in weights), manifest={})
    identity = (torch.ones_like(tables[0]), torch.zeros_like(tables[1]))
    stacked_v = torch.stack(values).to(compute).double()
    return map_cache_ref(content, stacked_v, wide, *identity, *tables[2:], layout, layout, torch.float64)


CUDA_CASES = {  # support, H_s, H_t, d_s, d_t, batch, seq, layout, cache dtype, coefficient dtype, precision
    "local-bf16-T1": ("local", 4, 4, 64, 64, 1, 1, "half", torch.bfloat16, torch.bfloat16, "tf32"),
    "local-bf16-T77-B2": ("local", 4, 4, 64, 64, 2, 77, "half", torch.bfloat16, torch.bfloat16, "tf32"),
    "full-bf16-T300-interleaved": ("full", 4, 4, 64, 64, 1, 300, "interleaved", torch.bfloat16, torch.bfloat16, "tf32"),
    "gqa-f2-bf16-dt80": ("local", 8, 4, 128, 80, 1, 130, "half", torch.bfloat16, torch.bfloat16, "tf32"),
    "gqa-up-fp16": ("local", 2, 4, 64, 128, 2, 65, "interleaved", torch.float16, torch.float16, "tf32"),
    "local-fp32-ieee": ("local", 4, 4, 64, 64, 1, 200, "half", torch.float32, torch.float32, "ieee"),
    "full-fp32-tf32-B2": ("full", 4, 4, 64, 64, 2, 129, "half", torch.float32, torch.float32, "tf32"),
    "full-fp32cache-bf16": ("full", 4, 4, 128, 128, 1, 255, "half", torch.float32, torch.bfloat16, "tf32"),
}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
@pytest.mark.parametrize("single_dot", [False, True], ids=["two-dots", "single-dot"])
def test_cuda_kernel_equals_reference(name, single_dot):
    support, source_heads, target_heads, d_s, d_t, batch, seq, layout, cache, compute, precision = CUDA_CASES[name]
    shape = dict(L_s=5, L_t=7, H_s=source_heads, H_t=target_heads, d_s=d_s, d_t=d_t, batch=batch, seq=seq)
    keys, values, tables = _case(dict(shape, device="cuda", cache_dtype=cache))
    mapper = _random_mapper(
        5, 7, source_heads, target_heads, d_s, d_t, support=support, k=3, dtype=compute, device="cuda"
    )
    args = (keys, values, mapper, *tables, layout, layout, cache)
    config = dataclasses.replace(default_config(seq, compute), single_dot=single_dot)
    ours = map_cache(*args, backend="triton", precision=precision, config=config)
    reference = map_cache_ref(*args)
    _assert_match(ours, reference, TOLERANCE["bf16" if compute != torch.float32 else precision])
    if compute == torch.bfloat16:
        exact = _exact(keys, values, mapper, tables, layout)
        for a, b, e in zip(ours, reference, exact, strict=True):
            assert _scaled_error(a, e) <= _scaled_error(b, e) + 2**-9


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("support", ["local", "full"])
def test_cuda_paper_shape(support):
    """Qwen3-14B → 32B: L_s = 40, L_t = 64, 8 KV heads, head_dim 128, k = 8, 1,024 tokens, bf16."""
    shape = dict(L_s=40, L_t=64, H_s=8, H_t=8, d_s=128, d_t=128, batch=1, seq=1024)
    keys, values, tables = _case(dict(shape, device="cuda", cache_dtype=torch.bfloat16))
    mapper = _random_mapper(40, 64, 8, 8, 128, 128, support=support, k=8, dtype=torch.bfloat16, device="cuda")
    flags = torch.ones(64, dtype=torch.int32, device="cuda")
    args = (keys, values, mapper, *tables, "half", "half", torch.bfloat16)
    ours = map_cache(*args, nonfinite=flags, backend="triton")
    reference = map_cache_ref(*args)
    _assert_match(ours, reference, TOLERANCE["bf16"])
    assert not bool(flags.any())
    head = slice(0, 4)  # fp64 check on the first target layers
    weights = (mapper.weight_k, mapper.bias_k, mapper.weight_v, mapper.bias_v)
    sub = Mapper(mapper.source_layers[head], mapper.head_index, *(t[head] for t in weights), manifest={})
    exact = _exact(keys, values, sub, tables, "half")
    for a, b, e in zip(ours, reference, exact, strict=True):
        assert _scaled_error(a[head], e) <= _scaled_error(b[head], e) + 2**-9


@cuda
@pytest.mark.gpu
def test_cuda_graph_replays_map_cache():
    shape = dict(L_s=5, L_t=7, H_s=4, H_t=4, d_s=64, d_t=64, batch=1, seq=50, device="cuda", cache_dtype=torch.bfloat16)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(5, 7, 4, 4, 64, 64, k=3, dtype=torch.bfloat16, device="cuda")
    graphed = CapturedMapCache(keys, values, mapper, *tables, "half", "half", torch.bfloat16, backend="triton")
    for seed in (1, 2):
        keys, values, _ = _case(shape, seed=seed)
        expected = map_cache(keys, values, mapper, *tables, "half", "half", torch.bfloat16, backend="triton")
        for a, b in zip(graphed(keys, values), expected, strict=True):
            assert torch.equal(a, b)


@interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_map_writes_into_the_slots_of_a_static_cache(backend, interpreted):
    """`out`: the mapped K/V land in slots 7..7 + T − 1 of a [L_t, 1, H_t, N, d_t] buffer (strided views, as
    `Engine.blocks` holds), equal to the contiguous result; every other slot keeps its contents."""
    shape = dict(L_s=3, L_t=4, H_s=2, H_t=2, d_s=16, d_t=32, batch=1, seq=21)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(3, 4, 2, 2, 16, 32)
    args = (keys, values, mapper, *tables, "half", "half", torch.float32)
    expected = map_cache(*args, backend=backend, config=SMALL, precision="ieee")
    buffers = [torch.full((4, 2, 40, 32), 7.0) for _ in range(2)]  # [L_t, H_t, N, d_t] like Engine.keys
    views = tuple(b[:, None, :, 7:28] for b in buffers)  # [L_t, 1, H_t, T, d_t]
    returned = map_cache(*args, backend=backend, config=SMALL, precision="ieee", out=views)
    for buffer, view, want, got in zip(buffers, views, expected, returned, strict=True):
        assert got.data_ptr() == view.data_ptr()
        torch.testing.assert_close(view, want, rtol=0, atol=1e-6)
        assert bool((buffer[:, :, :7] == 7).all()) and bool((buffer[:, :, 28:] == 7).all())
    with pytest.raises(ValueError, match="out keys"):
        map_cache(*args, backend=backend, out=(buffers[0][:, None, :, :20], views[1]))


def uneven(allocations: list[torch.Tensor], count: int, descending: bool = True) -> list[torch.Tensor]:
    """`count` of these separate allocations in address order — descending: later layers at lower addresses
    (negative offsets) — whose steps are not all equal (no constant layer stride addresses them). Of count + 1
    allocations there is always such a choice (equal steps a, a and a, a + b would need b = 0)."""
    ordered = sorted(allocations, key=torch.Tensor.data_ptr, reverse=descending)
    for chosen in itertools.combinations(ordered, count):
        starts = [t.data_ptr() for t in chosen]
        if len({b - a for a, b in zip(starts, starts[1:], strict=False)}) > 1:
            return list(chosen)
    raise AssertionError(f"{len(allocations)} allocations hold no {count} at uneven steps")


@interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_map_writes_into_layers_allocated_apart(backend, interpreted):
    """`out` as `LayerViews`: each target layer its own [1, H_t, T, d_t] allocation, decoys between them and later
    layers at lower addresses (negative offsets), holds what the stacked result holds, bit for bit, and the
    reference's layer ℓ in layer ℓ (both paths address layers through the offsets: the reference places them); the
    decoys keep their contents."""
    shape = dict(L_s=3, L_t=4, H_s=2, H_t=2, d_s=16, d_t=32, batch=1, seq=21)
    keys, values, tables = _case(shape)
    mapper = _random_mapper(3, 4, 2, 2, 16, 32)
    args = (keys, values, mapper, *tables, "half", "half", torch.float32)
    expected = map_cache(*args, backend=backend, config=SMALL, precision="ieee")  # [L_t, 1, H_t, T, d_t] each
    layers, decoys = [], []
    for i in range(10):
        layers.append(torch.full((1, 2, 21, 32), 7.0))
        decoys.append(torch.full((50 + 90 * i,), 7.0))
    keys_out = uneven(layers, 4)
    out = (LayerViews.of(keys_out), LayerViews.of(uneven([t for t in layers if all(t is not k for k in keys_out)], 4)))
    for views in out:
        assert (views.offsets[1:] < 0).all() and len(set(views.offsets.diff().tolist())) > 1
    map_cache(*args, backend=backend, config=SMALL, precision="ieee", out=out)
    reference = map_cache(*args, backend="torch")  # [L_t, 1, H_t, T, d_t] each
    for views, want, placed in zip(out, expected, reference, strict=True):
        assert all(torch.equal(got, want[layer]) for layer, got in enumerate(views.views))
        for layer, got in enumerate(views.views):
            torch.testing.assert_close(got, placed[layer], rtol=0, atol=TOLERANCE["ieee"])
    assert all(bool((decoy == 7).all()) for decoy in decoys)


def test_layer_views_refuse_unlike_or_misaligned_layers_naming_which():
    """`LayerViews.of` on its own (the connector's `Writer.over` checks first): offsets are the element gaps from
    layer 0, any sign; a layer unlike layer 0 is a ValueError naming it (a fraction of an element away:
    tests/test_paged_direct.py)."""
    storage = torch.zeros(64)
    views = [storage[32:40].view(2, 4), storage[0:8].view(2, 4), storage[16:24].view(2, 4)]
    assert LayerViews.of(views).offsets.tolist() == [0, -32, -16]
    with pytest.raises(ValueError, match=r"layer 1's cache is not alike layer 0's: shape \(4, 2\)"):
        LayerViews.of([views[0], storage[0:8].view(4, 2)])
    with pytest.raises(ValueError, match="layer 1's cache is not alike layer 0's: dtype torch.float64"):
        LayerViews.of([views[0], torch.zeros(2, 4, dtype=torch.float64)])


def test_the_default_tile_is_one_dot_at_4_warps_for_16_bit_heads_of_at_most_128_channels():
    """The H100's sweep (2026-12-07) for 16-bit inputs at d_t = 128; wider heads keep two dots at 8 warps (one dot's
    128 × 256 fp32 accumulator over 4 warps spills), fp32 keeps its half-width channel steps."""
    one_dot = KernelConfig(block_m=128, block_k=64, num_warps=4, num_stages=3, layers_inner=True, single_dot=True)
    assert default_config(8192, torch.bfloat16) == one_dot == default_config(8192, torch.float16, 64)
    assert default_config(8192, torch.bfloat16, 256) == KernelConfig(block_m=128, block_k=64)
    assert default_config(8192, torch.float32) == KernelConfig(block_m=128, block_k=32)
    assert default_config(64, torch.bfloat16).block_m == 64
