"""RoPE on a forward's queries and keys, and its K/V written into their slots of the static cache, in one launch (the
receiver engine's per-layer bookkeeping, src/runtime/engine.py; as torch ops it is fourteen kernels a layer).

Per token t (position pos[t], slot slot[t]) and head h, with HF's rotate_half layout and its rounding (each product
and the sum rounded to the model's dtype, as `q * cos + rotate_half(q) * sin` does in that dtype):

    q_out[t, h]                  = rope(q[t, h], pos[t])
    keys[h, slot[t]]             = rope(k[t, h], pos[t])          values[h, slot[t]] = v[t, h]

One program per (token, head row), rows ordered [q heads | k heads | v heads]. `rope_write_ref` is the torch code and
the fallback (CPU, no triton, head_dim not a power of two).
"""

from __future__ import annotations

import torch

from kernels.jit import interpreting, jit, tl, unavailable
from src.rope import rotate


def _rope_write_kernel(
    q_ptr,  # [T, H_q, d] channels contiguous
    k_ptr,  # [T, H_kv, d]
    v_ptr,  # [T, H_kv, d]
    cos_ptr,  # [N, d] the model's dtype, row = position
    sin_ptr,
    pos_ptr,  # [T] int
    slot_ptr,  # [T] int
    q_out_ptr,  # [T, H_q, d] contiguous
    keys_ptr,  # [H_kv, N, d] one layer of the static cache
    values_ptr,
    sqt,
    sqh,
    skt,
    skh,
    svt,
    svh,
    slots,  # N
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0)
    row = tl.program_id(1)  # [0, H_q) queries, [H_q, H_q + H_kv) keys, then values
    i = tl.arange(0, HALF)
    position = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if row < Q_HEADS + KV_HEADS:
        if row < Q_HEADS:
            source = q_ptr + t * sqt + row * sqh
        else:
            source = k_ptr + t * skt + (row - Q_HEADS) * skh
        lo = tl.load(source + i)
        hi = tl.load(source + HALF + i)
        dtype = lo.dtype
        cos_lo = tl.load(cos_ptr + position * 2 * HALF + i).to(tl.float32)
        cos_hi = tl.load(cos_ptr + position * 2 * HALF + HALF + i).to(tl.float32)
        sin_lo = tl.load(sin_ptr + position * 2 * HALF + i).to(tl.float32)
        sin_hi = tl.load(sin_ptr + position * 2 * HALF + HALF + i).to(tl.float32)
        lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
        # rotate_half(x) = (−hi, lo); each product and the sum rounded to the dtype, as HF's expression in it
        out_lo = (lo32 * cos_lo).to(dtype).to(tl.float32) + (-hi32 * sin_lo).to(dtype).to(tl.float32)
        out_hi = (hi32 * cos_hi).to(dtype).to(tl.float32) + (lo32 * sin_hi).to(dtype).to(tl.float32)
        if row < Q_HEADS:
            target = q_out_ptr + (t * Q_HEADS + row) * 2 * HALF
        else:
            target = keys_ptr + ((row - Q_HEADS) * slots + slot) * 2 * HALF
        tl.store(target + i, out_lo.to(dtype))
        tl.store(target + HALF + i, out_hi.to(dtype))
    else:
        head = row - Q_HEADS - KV_HEADS
        source = v_ptr + t * svt + head * svh
        target = values_ptr + (head * slots + slot) * 2 * HALF
        tl.store(target + i, tl.load(source + i))
        tl.store(target + HALF + i, tl.load(source + HALF + i))


def rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """q [T, H_q, d], k / v [T, H_kv, d], cos / sin [N, d] (row = position, the model's dtype), positions / slots
    [T] → the rotated queries [T, H_q, d]; the rotated keys and the values are written into keys / values
    [H_kv, N, d] at `slots`. backend: auto | triton | torch."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, not {backend!r}")
    count, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    reason = unavailable(q)
    if reason is None and (dim < 32 or dim & (dim - 1)):
        reason = f"head_dim {dim} is not a power of two ≥ 32"
    elif reason is None and (
        any(t.stride(-1) != 1 for t in (q, k, v)) or not all(t.is_contiguous() for t in (cos, sin, keys, values))
    ):
        reason = "channels must be contiguous and the tables and the cache layer contiguous"
    if backend == "triton" and reason is not None:
        raise ValueError(f"Triton rope_write unavailable: {reason}")
    if backend == "torch" or reason is not None:
        return rope_write_ref(q, k, v, cos, sin, positions, slots, keys, values)
    q_out = torch.empty(count, q_heads, dim, dtype=q.dtype, device=q.device)
    jit(_rope_write_kernel, interpreting())[(count, q_heads + 2 * kv_heads)](
        q, k, v, cos, sin, positions, slots, q_out, keys, values,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), keys.shape[1],
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=dim // 2,
    )  # fmt: skip
    return q_out


def rope_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """HF's apply_rotary_pos_emb in the model's dtype, then index_copy_ of K and V into the slots."""
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # [T, 1, d]
    rotated_k = k * cos + rotate(k) * sin  # [T, H_kv, d]
    keys.index_copy_(1, slots, rotated_k.transpose(0, 1))
    values.index_copy_(1, slots, v.transpose(0, 1))
    return q * cos + rotate(q) * sin  # [T, H_q, d]
