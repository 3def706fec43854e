"""The gemm map's epilogue in one Triton pass: the GEMM's output read once, written straight into the target cache.

`kernels.apply_map_gemm` computes, per target head h, Y_h = A_h · W_h  [B·T, L_t·d_t] (Eqs. 7, 11); the target's
layer ℓ is columns ℓ·d_t..(ℓ+1)·d_t. `_epilogue_kernel` finishes the map for one (token block, target layer ℓ,
batch row b, head h) per program:

    k̂ = RoPE_target(Y_h[b·T + t, ℓ] + b_K[h, ℓ])     (fp32, keys only),   v̂ = Y_h[b·T + t, ℓ] + b_V[h, ℓ]

cast to the cache dtype and stored where `_map_kernel` (kernels/apply_map.py) stores: layer ℓ at its offset from
the first layer (`LayerViews`), at token t's slot when slots are given; the non-finite / beyond flags set by atomics
as there. The torch epilogue (`map_cache_gemm`) stays the reference and the CPU path. Each program reads one head's
columns as the two members of every RoPE pair, as `_map_kernel` computes them, so the rotation needs no shuffle.

`rope_table` / `rope_pairs` are the host side of every RoPE epilogue here (`_map_kernel`'s and `_derope_kernel`'s
too); full rotary only on the target (`triton_unsupported` sends partial rotary to the torch epilogue).
"""

from __future__ import annotations

import torch

from kernels.jit import interpreting, jit, tl, triton
from src.maps import LayerViews

EPILOGUE_BLOCK_M = 32  # tokens per `_epilogue_kernel` program (memory bound: one read, one write per entry)


def _epilogue_kernel(
    y_ptr,  # [H_t, B·T, L_t·d_t] the GEMM's output (fp32 or the compute dtype), channels contiguous
    bias_ptr,  # [H_t, L_t, d_t] contiguous
    out_ptr,  # layer 0's [B, H_t, T, d_t], or with SLOTS [N_blocks, H_t, block_size, d_t]; channels contiguous
    offsets_ptr,  # [L_t] int64: target layer ℓ's first element − out's, in elements (any sign)
    cos_ptr,  # [B or 1, T, d_t] float32 (target RoPE; unused when not ROPE)
    sin_ptr,
    flag_ptr,  # [L_t] int32: set to 1 where a stored value is not finite (when CHECK)
    beyond_ptr,  # [L_t] int32: set to 1 where a stored |value| is finite and above `bound` (when CHECK)
    slot_ptr,  # [T] int64: token t's slot (when SLOTS)
    bound,
    block_size,
    seq,
    batch,
    target_layers,
    syh,
    syn,
    scb,
    sob,
    soh,
    sot,
    D_T: tl.constexpr,
    HALF: tl.constexpr,  # D_T // 2
    S_LO: tl.constexpr,
    D_HI: tl.constexpr,
    COS_HI: tl.constexpr,
    ROPE: tl.constexpr,
    CHECK: tl.constexpr,
    SLOTS: tl.constexpr,
    OFFSET_MULTIPLE: tl.constexpr,  # a power of two dividing every layer offset (LayerViews.multiple)
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """out[ℓ, b, h, t] = RoPE(Y[h, b·T + t, ℓ·d_t:(ℓ+1)·d_t] + bias[h, ℓ]), cast, stored; flags."""
    h, rows, blocks = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, layer = rows % batch, rows // batch
    t = blocks * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    t_mask, i_mask = t < seq, i < HALF
    mask = t_mask[:, None] & i_mask[None, :]  # [BLOCK_M, BLOCK_HALF]
    col_lo, col_hi = i * S_LO, i * S_LO + D_HI  # [BLOCK_HALF] columns of each pair's two members
    y_row = y_ptr + h.to(tl.int64) * syh + (b * seq + t).to(tl.int64)[:, None] * syn + layer * D_T  # [BLOCK_M, 1]
    bias_row = bias_ptr + (h * target_layers + layer) * D_T
    lo = tl.load(y_row + col_lo[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_HALF]
    hi = tl.load(y_row + col_hi[None, :], mask=mask, other=0.0).to(tl.float32)
    lo += tl.load(bias_row + col_lo, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    hi += tl.load(bias_row + col_hi, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    if ROPE:  # apply_rope in fp32: (lo, hi) → (lo·cos − hi·sin, hi·cos + lo·sin)
        c_row = b * scb + t[:, None] * D_T  # [BLOCK_M, 1]
        cos_lo = tl.load(cos_ptr + c_row + i[None, :], mask=mask, other=0.0)  # [BLOCK_M, BLOCK_HALF]
        sin_lo = tl.load(sin_ptr + c_row + i[None, :], mask=mask, other=0.0)
        cos_hi = tl.load(cos_ptr + c_row + COS_HI + i[None, :], mask=mask, other=0.0)
        sin_hi = tl.load(sin_ptr + c_row + COS_HI + i[None, :], mask=mask, other=0.0)
        lo, hi = lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi
    out_dtype = out_ptr.dtype.element_ty
    y_lo, y_hi = lo.to(out_dtype), hi.to(out_dtype)  # [BLOCK_M, BLOCK_HALF]
    if SLOTS:  # token t → its slot's block and row
        slot = tl.load(slot_ptr + t, mask=t_mask, other=0)  # [BLOCK_M] int64
        block, row = slot // block_size, slot % block_size
    else:
        block, row = (b + 0 * t).to(tl.int64), t.to(tl.int64)  # [BLOCK_M]
    offset = tl.multiple_of(tl.load(offsets_ptr + layer), OFFSET_MULTIPLE)  # without the hint: scalar stores
    out_layer = out_ptr + offset + h * soh  # layer ℓ's cache, wherever it was allocated
    out_row = out_layer + (block * sob + row * sot)[:, None]  # [BLOCK_M, 1]
    tl.store(out_row + col_lo[None, :], y_lo, mask=mask)
    tl.store(out_row + col_hi[None, :], y_hi, mask=mask)
    if CHECK:  # an atomic per non-finite (or too large) entry only
        z_lo, z_hi = tl.abs(y_lo.to(tl.float32)), tl.abs(y_hi.to(tl.float32))
        finite_lo, finite_hi = z_lo < float("inf"), z_hi < float("inf")  # NaN compares false
        at_layer = 0 * (t[:, None] + i[None, :])  # [BLOCK_M, BLOCK_HALF], all at flag[ℓ]
        ones = tl.full((BLOCK_M, BLOCK_HALF), 1, tl.int32)
        tl.atomic_max(flag_ptr + layer + at_layer, ones, mask=mask & ((finite_lo & finite_hi) == 0))
        large = (finite_lo & (z_lo > bound)) | (finite_hi & (z_hi > bound))
        tl.atomic_max(beyond_ptr + layer + at_layer, ones, mask=mask & large)


def rope_table(cos: torch.Tensor, seq: int) -> tuple[torch.Tensor, int]:
    """cos [B or 1, 1, T, rope_dim] (src.rope.rope_cos_sin) or [T, rope_dim] → fp32 [B or 1, T, rope_dim], and its
    batch stride."""
    table = cos.float().reshape(-1, seq, cos.shape[-1]).contiguous()  # [B or 1, T, rope_dim]
    return table, (0 if table.shape[0] == 1 else table.stride(0))


def rope_pairs(layout: str, half: int) -> dict[str, int]:
    """Channel offsets of RoPE pair i (lo = i·S_LO, hi = lo + D_HI) and the cos column of its hi member."""
    if layout == "half":
        return dict(S_LO=1, D_HI=half, COS_HI=half)
    return dict(S_LO=2, D_HI=1, COS_HI=0)  # src.rope._interleave: pair i uses cos[..., i] for both members


def pow2(n: int, floor: int = 16) -> int:
    """A tile extent: the next power of two ≥ n (at least `floor`), 0 for n = 0."""
    return max(floor, triton.next_power_of_2(n)) if n > 0 else 0


def store_mapped(
    y: torch.Tensor,
    bias: torch.Tensor,
    batch: int,
    rope: tuple[torch.Tensor, torch.Tensor, str] | None,
    out: LayerViews,
    flags: tuple[torch.Tensor, torch.Tensor, float] | None,
    slots: torch.Tensor | None,
) -> None:
    """One launch of `_epilogue_kernel`: the GEMM's output y [H_t, B·T, L_t·d_t] (channels contiguous) plus bias
    [H_t, L_t, d_t], RoPE'd when rope = (cos, sin, layout) (the target's, [B or 1, 1, T, d_t]) → out's L_t layers
    [B, H_t, T, d_t], or with slots [T] (B = 1) → out's L_t layers [N_blocks, H_t, block_size, d_t] at their slots;
    flags: (non-finite [L_t], beyond [L_t], bound), int32, zeroed by the caller, set here."""
    target_heads, target_layers, d_t = bias.shape
    seq = y.shape[1] // batch
    y = y if y.stride(-1) == 1 else y.contiguous()
    bias, half, base = bias.contiguous(), d_t // 2, out.base
    cos, sin, layout = rope if rope is not None else (base, base, "half")  # dummies: never read without ROPE
    stride = 0
    if rope is not None:
        cos, stride = rope_table(cos, seq)  # [B or 1, T, d_t]
        sin, _ = rope_table(sin, seq)
    nonfinite, beyond, bound = flags if flags is not None else (base, base, 0.0)  # dummies: untouched without CHECK
    block_size = base.shape[2] if slots is not None else seq
    grid = (target_heads, target_layers * batch, triton.cdiv(seq, EPILOGUE_BLOCK_M))
    jit(_epilogue_kernel, interpreting())[grid](
        y, bias, base, out.offsets, cos, sin, nonfinite, beyond, slots if slots is not None else out.offsets,
        bound, block_size, seq, batch, target_layers, y.stride(0), y.stride(1), stride, *base.stride()[:3],
        D_T=d_t, HALF=half, **rope_pairs(layout, half), ROPE=rope is not None, CHECK=flags is not None,
        SLOTS=slots is not None, OFFSET_MULTIPLE=out.multiple, BLOCK_M=EPILOGUE_BLOCK_M, BLOCK_HALF=pow2(half),
        num_warps=4,
    )  # fmt: skip
