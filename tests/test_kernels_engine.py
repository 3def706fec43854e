"""The receiver engine's per-layer kernels (`kernels.rms_norm`, `kernels.rope_write`) equal their torch references —
in Triton's CPU interpreter here (a fresh process: the kernels call triton.language's jitted helpers, which only an
interpreter set before `import triton` runs), compiled on CUDA — and the whole engine forward through every kernel
equals Hugging Face's forward (interpreter, tiny model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.jit import HAVE_TRITON
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rope_write import rope_write, rope_write_ref

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreter = pytest.mark.skipif(not HAVE_TRITON or torch.cuda.is_available(), reason="interpreter runs without a GPU")


def _rope_case(dtype, device="cpu", heads=(6, 2), count=7, dim=32, slots=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)
    q, k, v = draw(count, heads[0], dim), draw(count, heads[1], dim), draw(count, heads[1], dim)
    angles = torch.arange(slots)[:, None] * 0.37 ** torch.arange(dim // 2)[None]  # [N, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(device, dtype)  # [N, d]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(device, dtype)
    positions = torch.randperm(slots - 1, generator=generator)[:count].sort().values.to(device)
    slot_ids = positions.clone()
    slot_ids[-1] = slots - 1  # a padded query: writes the scratch slot
    return q, k, v, cos, sin, positions, slot_ids


def _rope_results(backend, dtype, device="cpu"):
    q, k, v, cos, sin, positions, slot_ids = _rope_case(dtype, device)
    keys = torch.full((2, 40, 32), 3.0, dtype=dtype, device=device)
    values = torch.full((2, 40, 32), 3.0, dtype=dtype, device=device)
    function = rope_write_ref if backend == "ref" else lambda *a: rope_write(*a, backend="triton")
    return function(q, k, v, cos, sin, positions, slot_ids, keys, values), keys, values


INTERPRETED = """
import json, sys, torch
from kernels.rms_norm import rms_norm, rms_norm_ref
from tests.test_kernels_engine import _rope_results, engine_errors
errors = {}
relative = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x, w = torch.randn(5, 3, 72).to(dtype), torch.randn(72).to(dtype)
    errors[f"rms_norm/{dtype}"] = relative(rms_norm(x, w, 1e-6, "triton"), rms_norm_ref(x, w, 1e-6))
    ours, want = _rope_results("triton", dtype), _rope_results("ref", dtype)
    errors[f"rope_write/{dtype}"] = max(relative(a, b) for a, b in zip(ours, want))
errors |= engine_errors()
json.dump(errors, sys.stdout)
"""


def engine_errors() -> dict[str, float]:
    """The engine through every kernel (interpreted) against HF on a tiny Qwen3 (qk-norm) and Llama, head_dim 32."""
    from src.runtime.engine import Engine
    from tests.conftest import calibration_ids, tiny

    errors = {}
    for family in ("qwen3", "llama"):
        model = tiny(family, head_dim=32)
        ids = calibration_ids(1, 24, seed=1)[0]
        native = model(ids[None], use_cache=True)
        engine = Engine(model, 32, backend="triton")
        engine.forward(ids[:20], torch.arange(20))
        logits = engine.forward(ids[20:], torch.arange(20, 24))
        cache = torch.stack([layer.keys[0] for layer in native.past_key_values.layers])  # [L, H, T, d]
        errors[f"engine/{family}/logits"] = float((logits - native.logits[0, -1:]).abs().max())
        errors[f"engine/{family}/keys"] = float((engine.keys[:, :, :24] - cache).abs().max())
    return errors


@interpreter
def test_interpreted_kernels_equal_their_references():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout)
    assert len(errors) == 8, errors
    for case, error in errors.items():
        bound = 2e-5 if "float32" in case or case.startswith("engine") else 2**-6  # bf16: the interpreter truncates
        assert error < bound, (case, error)


def test_references_are_the_torch_code():
    x, w = torch.randn(3, 10), torch.randn(10)
    hf = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, w, 1e-5), hf)  # CPU: the reference
    (q, keys, values) = _rope_results("ref", torch.float32)
    assert bool((keys[:, -1] != 3).all()) and bool((values[:, -1] != 3).all())  # the padded query's scratch slot


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_their_references_on_cuda(dtype):
    x, w = torch.randn(9, 1536, device="cuda", dtype=dtype), torch.randn(1536, device="cuda", dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    assert (rms_norm(x, w, 1e-6, "triton").float() - rms_norm_ref(x, w, 1e-6).float()).abs().max() < tolerance * 8
    ours, want = _rope_results("triton", dtype, "cuda"), _rope_results("ref", dtype, "cuda")
    for a, b in zip(ours, want, strict=True):
        assert (a.float() - b.float()).abs().max() < tolerance * 4
