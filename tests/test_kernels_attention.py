"""Turn attention (`kernels.turn_attention`): the Triton kernel equals its torch reference on awkward shapes — in
Triton's CPU interpreter here, compiled on CUDA — and the reference is attention over the slots ≤ each position
(checked against sdpa with an explicit mask)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.jit import HAVE_TRITON
from kernels.turn_attention import split_count, turn_attention, turn_attention_ref

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreter = pytest.mark.skipif(not HAVE_TRITON or torch.cuda.is_available(), reason="interpreter runs without a GPU")

# name: (query heads, kv heads, queries, slots, head_dim, positions: "turn" (the last T), "scattered", "first")
SHAPES = {
    "turn-gqa3": (6, 2, 5, 70, 16, "turn"),
    "one-query-one-slot": (4, 4, 1, 1, 16, "first"),
    "recompute-scattered": (4, 2, 37, 200, 32, "scattered"),
    "many-splits": (2, 1, 3, 300, 16, "turn"),
    "decode-mha": (3, 3, 1, 129, 64, "turn"),
}


def _case(shape, dtype, device="cpu", seed=0):
    heads, kv_heads, queries, slots, dim, kind = shape
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, queries, dim, generator=generator).to(device, dtype)
    keys = torch.randn(kv_heads, slots + 3, dim, generator=generator).to(device, dtype)  # 3 slots past every position
    values = torch.randn(kv_heads, slots + 3, dim, generator=generator).to(device, dtype)
    if kind == "turn":
        positions = torch.arange(slots - queries, slots)
    elif kind == "first":
        positions = torch.zeros(queries, dtype=torch.long)
    else:
        positions = torch.randperm(slots, generator=generator)[:queries].sort().values
    return q, keys, values, positions.to(device)


def test_reference_is_masked_attention():
    q, keys, values, positions = _case(SHAPES["recompute-scattered"], torch.float32)
    group = q.shape[0] // keys.shape[0]
    mask = torch.arange(keys.shape[1])[None, :] <= positions[:, None]  # [T, S]
    expected = F.scaled_dot_product_attention(
        q, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0), attn_mask=mask, scale=0.25
    )
    assert (turn_attention_ref(q, keys, values, positions, 0.25) - expected).abs().max() < 1e-5


INTERPRETED = """
import json, sys, torch
from kernels.turn_attention import turn_attention, turn_attention_ref
from tests.test_kernels_attention import SHAPES, _case
errors = {}
for name in sorted(SHAPES):
    for dtype in (torch.float32, torch.bfloat16):
        q, keys, values, positions = _case(SHAPES[name], dtype)
        expected = turn_attention_ref(q, keys, values, positions, 0.3).float()
        for splits in (None, 1, 3):
            got = turn_attention(q, keys, values, positions, 0.3, backend="triton", splits=splits).float()
            errors[f"{name}/{dtype}/{splits}"] = float((got - expected).abs().max())
json.dump(errors, sys.stdout)
"""


@interpreter
def test_interpreted_kernel_equals_reference():
    """In a fresh process with TRITON_INTERPRET=1 from the start: the kernel calls triton.language's own jitted
    helpers (max, sum), which only an interpreter set before `import triton` runs."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    errors = json.loads(out.stdout)
    assert len(errors) == len(SHAPES) * 2 * 3
    for case, error in errors.items():
        assert error < (1e-5 if "float32" in case else 2e-2), (case, error)


def test_split_count_keeps_the_gpu_busy_and_steps_whole():
    assert split_count(12, 32, 16385) * 12 * 2 <= 1024 and split_count(12, 32, 16385) > 1
    assert split_count(12, 3000, 8192) == 1  # long query sets: the queries are the parallelism
    assert split_count(2, 1, 10) == 1


def test_refusals_name_the_problem():
    q, keys, values, positions = _case(SHAPES["turn-gqa3"], torch.float32)
    with pytest.raises(ValueError, match="backend"):
        turn_attention(q, keys, values, positions, 0.3, backend="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            turn_attention(q, keys, values, positions, 0.3, backend="triton")
    assert torch.equal(
        turn_attention(q, keys, values, positions, 0.3), turn_attention_ref(q, keys, values, positions, 0.3)
    )


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_on_cuda(name, dtype):
    q, keys, values, positions = _case(SHAPES[name], dtype, "cuda")
    expected = turn_attention_ref(q, keys, values, positions, 0.3).float()
    got = turn_attention(q, keys, values, positions, 0.3, backend="triton").float()
    assert (got - expected).abs().max() < (1e-4 if dtype == torch.float32 else 2e-2)


@cuda
@pytest.mark.gpu
def test_kernel_at_the_pairs_shapes_on_cuda():
    """The 1.5B receiver's turn (12 query heads over 2 KV heads, d 128) on a 16K buffer, and a fused recompute set."""
    for queries, kind in ((32, "turn"), (2048, "scattered")):
        q, keys, values, positions = _case((12, 2, queries, 16384, 128, kind), torch.bfloat16, "cuda")
        expected = turn_attention_ref(q, keys, values, positions, 128**-0.5).float()
        got = turn_attention(q, keys, values, positions, 128**-0.5, backend="triton").float()
        assert (got - expected).abs().max() < 2e-2
