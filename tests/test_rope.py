"""RoPE codec: exact round trips, equality with each model's own cached keys, layouts, partial rotary."""

import math

import pytest
import torch
from conftest import tiny

from src.models import describe_kv
from src.rope import RopeTable, apply_rope, remove_rope, rope_cos_sin
from src.traces import content_kv

ATOL = 1e-5
ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def _positions(seq: int = 32) -> torch.Tensor:
    """[2, T]: a relocated contiguous block (100..131) and a sorted sparse, gapped set."""
    generator = torch.Generator().manual_seed(3)
    sparse = torch.randperm(256, generator=generator)[:seq].sort().values
    return torch.stack([torch.arange(100, 100 + seq), sparse])


def _keys(shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.fixture(scope="module")
def rope_models() -> dict:
    return {name: tiny("llama", rope_parameters=dict(params)) for name, params in ROPE_TYPES.items()}


def test_rope_types_are_really_configured(rope_models):
    for name, model in rope_models.items():
        assert model.model.rotary_emb.rope_type == name
    assert rope_models["yarn"].model.rotary_emb.attention_scaling != 1.0
    assert rope_models["yarn"].model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    default_freq = rope_models["default"].model.rotary_emb.inv_freq
    assert not torch.allclose(rope_models["llama3"].model.rotary_emb.inv_freq, default_freq)
    # linear scaling with factor 2: position 2p of the scaled model is position p of the default one
    positions = torch.arange(0, 64, 2)
    linear = rope_cos_sin(rope_models["linear"].model.rotary_emb, positions)
    default = rope_cos_sin(rope_models["default"].model.rotary_emb, positions // 2)
    torch.testing.assert_close(linear, default, atol=ATOL, rtol=0)


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_rope_cos_sin_shape_dtype_and_norm(rope_models, rope_type):
    rotary = rope_models[rope_type].model.rotary_emb
    cos, sin = rope_cos_sin(rotary, torch.arange(100, 132))  # 1-D positions get a batch dim
    assert cos.shape == sin.shape == (1, 1, 32, 16)
    assert cos.dtype == sin.dtype == torch.float32
    cos, sin = rope_cos_sin(rotary, _positions())
    assert cos.shape == (2, 1, 32, 16)
    scale = float(rotary.attention_scaling)
    torch.testing.assert_close(cos * cos + sin * sin, torch.full_like(cos, scale**2), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_round_trips_at_arbitrary_positions(rope_models, rope_type):
    rotary = rope_models[rope_type].model.rotary_emb
    cos, sin = rope_cos_sin(rotary, _positions())
    x = _keys((2, 2, 32, 16))
    torch.testing.assert_close(apply_rope(remove_rope(x, cos, sin), cos, sin), x, atol=ATOL, rtol=0)
    torch.testing.assert_close(remove_rope(apply_rope(x, cos, sin), cos, sin), x, atol=ATOL, rtol=0)
    # the rotation itself preserves norms up to attention_scaling
    scale = float(rotary.attention_scaling)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1) * scale, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rope_type", [*sorted(ROPE_TYPES), "dynamic"])
def test_a_rope_table_gives_each_spans_cos_sin_bit_for_bit_as_the_rotary_module(rope_models, rope_type):
    """`RopeTable.at` slices one grown table (a handoff's RoPE without a rotary forward): every span equals
    `rope_cos_sin` of its positions exactly — before the table grows, across its growth, and after; a dynamic rope
    type (its table depends on the call's longest position) computes per call."""
    if rope_type == "dynamic":
        model = tiny("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    else:
        model = rope_models[rope_type]
    rotary = model.model.rotary_emb
    table = RopeTable(rotary)
    assert table.static == (rope_type != "dynamic")
    for start, count in ((0, 5), (1500, 700), (3, 4), (2100, 100)):  # 1,024 first, then grown past it
        expected = rope_cos_sin(rotary, torch.arange(start, start + count))
        for got, want in zip(table.at(start, count, "cpu"), expected, strict=True):
            assert got.shape == want.shape == (1, 1, count, 16)
            assert torch.equal(got, want), (rope_type, start, count)


def test_rotation_is_relative(rope_models):
    """q·k after RoPE depends only on the position offset: shifting both by 77 changes nothing."""
    rotary = rope_models["default"].model.rotary_emb
    q, k = _keys((1, 1, 1, 16), seed=1), _keys((1, 1, 1, 16), seed=2)
    dots = []
    for shift in (0, 77):
        cos_q, sin_q = rope_cos_sin(rotary, torch.tensor([9 + shift]))
        cos_k, sin_k = rope_cos_sin(rotary, torch.tensor([4 + shift]))
        dots.append((apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum())
    torch.testing.assert_close(dots[0], dots[1], atol=1e-4, rtol=0)


def _hf_cos_sin(seq: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style cos/sin [1, 1, T, dim] = cat(freqs, freqs), with an attention_scaling of 1.3."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    positions = torch.arange(seq).float() * 3 + 5
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * 1.3)[None, None], (emb.sin() * 1.3)[None, None]


def test_interleaved_layout_round_trip_and_reference():
    cos, sin = _hf_cos_sin(12, 16)
    x = _keys((2, 3, 12, 16))
    rotated = apply_rope(x, cos, sin, layout="interleaved")
    torch.testing.assert_close(remove_rope(rotated, cos, sin, layout="interleaved"), x, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        apply_rope(remove_rope(x, cos, sin, layout="interleaved"), cos, sin, layout="interleaved"),
        x,
        atol=ATOL,
        rtol=0,
    )
    # reference: each adjacent pair (x0, x1) is the complex number x0 + i·x1 times 1.3·e^{iθ}
    theta = torch.atan2(sin[..., :8], cos[..., :8])
    pairs = torch.view_as_complex(x.unflatten(-1, (8, 2)).contiguous())
    expected = torch.view_as_real(pairs * torch.polar(torch.full_like(theta, 1.3), theta)).flatten(-2)
    torch.testing.assert_close(rotated, expected, atol=ATOL, rtol=0)
    # same rotation as the "half" layout after moving pair members (2i, 2i+1) to (i, i + d/2)
    to_half = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2)))
    torch.testing.assert_close(rotated[..., to_half], apply_rope(x[..., to_half], cos, sin), atol=ATOL, rtol=0)
    assert not torch.allclose(rotated, apply_rope(x, cos, sin, layout="half"), atol=1e-3)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_partial_rotary_passes_trailing_channels_through(layout):
    cos, sin = _hf_cos_sin(10, 8)  # rope_dim 8 < head_dim 24
    x = _keys((2, 2, 10, 24))
    rotated = apply_rope(x, cos, sin, layout=layout)
    assert rotated.shape == x.shape
    assert torch.equal(rotated[..., 8:], x[..., 8:])
    torch.testing.assert_close(rotated[..., :8], apply_rope(x[..., :8], cos, sin, layout=layout), atol=0, rtol=0)
    assert not torch.allclose(rotated[..., :8], x[..., :8], atol=1e-3)
    restored = remove_rope(rotated, cos, sin, layout=layout)
    assert torch.equal(restored[..., 8:], x[..., 8:])
    torch.testing.assert_close(restored, x, atol=ATOL, rtol=0)


def test_low_precision_input_keeps_dtype():
    cos, sin = _hf_cos_sin(6, 16)
    x = _keys((1, 2, 6, 16)).to(torch.bfloat16)
    rotated = apply_rope(x, cos, sin)
    assert rotated.dtype == torch.bfloat16
    assert remove_rope(rotated, cos, sin).dtype == torch.bfloat16
    torch.testing.assert_close(rotated.float(), apply_rope(x.float(), cos, sin), atol=0.05, rtol=0.02)


class _PreRopeKeys:
    """Hooks that keep each layer's pre-RoPE (post QK-norm, where the model has it) keys [B, H_kv, T, d]."""

    def __init__(self, model, kv):
        self.keys, self.handles = {}, []
        for index, layer in enumerate(model.model.layers):
            module = layer.self_attn.k_norm if kv.qk_norm else layer.self_attn.k_proj
            self.handles.append(module.register_forward_hook(self._hook(index, kv)))

    def _hook(self, index, kv):
        def keep(module, inputs, output):
            batch, seq = output.shape[:2]
            self.keys[index] = output.reshape(batch, seq, kv.num_kv_heads, kv.head_dim).transpose(1, 2).detach()

        return keep

    def close(self):
        for handle in self.handles:
            handle.remove()


def _check_against_model_cache(model):
    kv = describe_kv(model)
    positions = _positions(16)
    ids = torch.randint(0, 96, positions.shape, generator=torch.Generator().manual_seed(5))
    capture = _PreRopeKeys(model, kv)
    try:
        with torch.no_grad():
            cache = model(ids, position_ids=positions, use_cache=True).past_key_values
    finally:
        capture.close()
    assert len(capture.keys) == len(cache.layers) == kv.num_layers
    cos, sin = rope_cos_sin(model.model.rotary_emb, positions)
    for index, layer in enumerate(cache.layers):
        torch.testing.assert_close(apply_rope(capture.keys[index], cos, sin), layer.keys, atol=ATOL, rtol=0)
    for index, (content_keys, values) in enumerate(content_kv(model, kv, cache, positions)):
        torch.testing.assert_close(content_keys, capture.keys[index], atol=ATOL, rtol=0)
        assert values is cache.layers[index].values
    return kv, capture.keys, cache


def test_apply_rope_reproduces_model_cache(family):
    kv, _, _ = _check_against_model_cache(tiny(family))
    assert kv.qk_norm == (family == "qwen3")


@pytest.mark.parametrize("rope_type", ["linear", "llama3", "yarn"])
def test_apply_rope_reproduces_scaled_model_cache(rope_models, rope_type):
    _check_against_model_cache(rope_models[rope_type])


def test_qwen3_yarn_cache(rope_models):
    model = tiny("qwen3", rope_parameters=dict(ROPE_TYPES["yarn"]))
    assert model.model.rotary_emb.attention_scaling != 1.0
    _check_against_model_cache(model)


def test_naive_derotation_is_off_by_attention_scaling(rope_models):
    """Rᵀ with the model's (scaled) cos/sin, without dividing by cos² + sin², returns content × scaling²."""
    model = rope_models["yarn"]
    scale = float(model.model.rotary_emb.attention_scaling)
    kv, content, cache = _check_against_model_cache(model)
    positions = _positions(16)
    cos, sin = rope_cos_sin(model.model.rotary_emb, positions)
    keys = cache.layers[1].keys
    naive = keys * cos - _rotate_half(keys) * sin
    torch.testing.assert_close(naive, content[1] * scale**2, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(naive, content[1], atol=1e-2)
    # with unit-norm cos/sin (scaling forgotten altogether) the content comes back × scaling
    unit = keys * (cos / scale) - _rotate_half(keys) * (sin / scale)
    torch.testing.assert_close(unit, content[1] * scale, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(remove_rope(keys, cos, sin, kv.rope_layout), content[1], atol=ATOL, rtol=0)
