"""Attention of a few queries at explicit positions onto a static KV buffer: the receiver engine's turn, prefix hit,
decode step and fused recompute (src/runtime/engine.py), graph-capturable at any history length.

Slot s of the buffer holds conversation position s. Query t (position pos[t]) attends to every slot s ≤ pos[t]:

    out[h, t] = Σ_{s ≤ pos[t]} softmax_s(scale · q[h, t] · k[h // G, s]) · v[h // G, s]        G = H_q / H_kv

The positions are read from device memory, never from the host, so one captured CUDA graph serves every history
length that fits the buffer (as a server's FlashAttention reads `seqused_k` from a device tensor). Split-KV (flash
decoding): program (head, query block, split) runs an online softmax over its split's slots up to the block's
largest position — splits and blocks past it do nothing — and writes a partial (acc, max, sum); `_combine_kernel`
merges the splits with an online rescale. Many splits for a short turn (the slots are the parallelism), few for a
long query set (the queries are).

`turn_attention_ref` is the pure-torch reference and the fallback (CPU, no triton, head_dim not a power of two).
"""

from __future__ import annotations

import math

import torch

from kernels.jit import interpreting, jit, tl, unavailable

BLOCK_T = 16  # queries per program
BLOCK_N = 64  # slots per inner step
TARGET_PROGRAMS = 1024  # programs to aim for when choosing the split count (≈ 8 waves on 132 SMs)


def _turn_attention_kernel(
    q_ptr,  # [H_q, T, D] any strides, channels contiguous
    k_ptr,  # [H_kv, S, D] channels contiguous
    v_ptr,  # [H_kv, S, D]
    pos_ptr,  # [T] int: each query's position (= the last slot it may read)
    acc_ptr,  # [H_q, splits, T, D] float32 partial outputs
    m_ptr,  # [H_q, splits, T] float32 running max
    l_ptr,  # [H_q, splits, T] float32 running sum
    seq,
    scale,
    sqh,
    sqt,
    skh,
    sks,
    svh,
    svs,
    SPLIT_LEN: tl.constexpr,  # slots per split, a multiple of BLOCK_N (a compile-time trip count)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,  # the CPU interpreter multiplies bf16 wrongly: dot in float32 there
):
    t_blocks = (seq + BLOCK_T - 1) // BLOCK_T
    head, t_block = tl.program_id(0) // t_blocks, tl.program_id(0) % t_blocks
    split, splits = tl.program_id(1), tl.num_programs(1)
    t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_mask = t < seq
    d = tl.arange(0, HEAD_DIM)  # [D]
    pos = tl.load(pos_ptr + t, mask=t_mask, other=-1)  # [BLOCK_T]
    low = split * SPLIT_LEN
    high = tl.minimum(low + SPLIT_LEN, tl.max(pos, 0) + 1)  # no slot past the block's last position
    q = tl.load(q_ptr + head * sqh + t[:, None] * sqt + d[None, :], mask=t_mask[:, None], other=0.0)  # [BLOCK_T, D]
    if UPCAST:
        q = q.to(tl.float32)
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_T], 0.0, tl.float32)
    acc = tl.full([BLOCK_T, HEAD_DIM], 0.0, tl.float32)
    for step in range(0, SPLIT_LEN // BLOCK_N):  # steps past the block's last position skip
        start = low + step * BLOCK_N
        if start < high:
            s = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            s_mask = s < high
            k_t = tl.load(
                k_ptr + kv_head * skh + s[None, :] * sks + d[:, None], mask=s_mask[None, :], other=0.0
            )  # [D, N]
            if UPCAST:
                k_t = k_t.to(tl.float32)
            zero = tl.full(
                [BLOCK_T, BLOCK_N], 0.0, tl.float32
            )  # fp32 accumulators (the interpreter needs them explicit)
            if IEEE:
                qk = tl.dot(q, k_t, zero, input_precision="ieee")  # [BLOCK_T, BLOCK_N]
            else:
                qk = tl.dot(q, k_t, zero)
            visible = (s[None, :] <= pos[:, None]) & s_mask[None, :]
            qk = tl.where(visible, qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])  # [BLOCK_T, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_head * svh + s[:, None] * svs + d[None, :], mask=s_mask[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            if IEEE:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    row = (head * splits + split) * seq + t  # [BLOCK_T]
    tl.store(acc_ptr + row[:, None].to(tl.int64) * HEAD_DIM + d[None, :], acc, mask=t_mask[:, None])
    tl.store(m_ptr + row, m_i, mask=t_mask)
    tl.store(l_ptr + row, l_i, mask=t_mask)


def _combine_kernel(
    acc_ptr,  # [H_q, P, T, D] float32
    m_ptr,  # [H_q, P, T]
    l_ptr,  # [H_q, P, T]
    out_ptr,  # [H_q, T, D] the queries' dtype
    seq,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """out[h, t] = Σ_p acc_p · e^(m_p − M) / Σ_p l_p · e^(m_p − M) over the splits p, M = max_p m_p (online)."""
    head, t = tl.program_id(0) // seq, tl.program_id(0) % seq
    d = tl.arange(0, HEAD_DIM)
    top = tl.full([1], float("-inf"), tl.float32)
    total = tl.full([1], 0.0, tl.float32)
    out = tl.full([HEAD_DIM], 0.0, tl.float32)
    for split in range(0, SPLITS):
        row = (head * SPLITS + split) * seq + t
        m = tl.load(m_ptr + row + tl.arange(0, 1))  # [1]
        new_top = tl.maximum(top, m)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        scale, weight = tl.exp(top - safe), tl.exp(m - safe)
        total = total * scale + tl.load(l_ptr + row + tl.arange(0, 1)) * weight
        out = out * scale + tl.load(acc_ptr + row.to(tl.int64) * HEAD_DIM + d) * weight
        top = new_top
    tl.store(out_ptr + (head * seq + t).to(tl.int64) * HEAD_DIM + d, (out / total).to(out_ptr.dtype.element_ty))


def split_count(query_heads: int, queries: int, slots: int) -> int:
    """Splits of the slot axis: enough programs for the GPU (TARGET_PROGRAMS), none shorter than BLOCK_N slots."""
    blocks = query_heads * math.ceil(queries / BLOCK_T)
    return max(1, min(math.ceil(slots / BLOCK_N), TARGET_PROGRAMS // blocks))


def unsupported(q: torch.Tensor, keys: torch.Tensor) -> str | None:
    """Why the Triton path cannot run these inputs, or None."""
    if reason := unavailable(q):
        return reason
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two ≥ 16"
    if q.shape[0] % keys.shape[0]:
        return f"{q.shape[0]} query heads do not group over {keys.shape[0]} KV heads"
    return None


def turn_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    backend: str = "auto",
    splits: int | None = None,
) -> torch.Tensor:
    """q [H_q, T, D], keys / values [H_kv, S, D] (slot = position), positions [T] (each < S) → out [H_q, T, D] in
    q's dtype. backend "auto" (Triton where supported, else the reference), "triton" (raise if unsupported) or
    "torch". splits: of the slot axis (default `split_count`; fixed by the shapes, so a captured graph keeps it)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, not {backend!r}")
    reason = unsupported(q, keys)
    if backend == "triton" and reason is not None:
        raise ValueError(f"Triton turn attention unavailable: {reason}")
    if backend == "torch" or reason is not None:
        return turn_attention_ref(q, keys, values, positions, scale)
    query_heads, seq, head_dim = q.shape
    slots = keys.shape[1]
    splits = splits or split_count(query_heads, seq, slots)
    split_len = math.ceil(math.ceil(slots / splits) / BLOCK_N) * BLOCK_N
    acc = torch.empty(query_heads, splits, seq, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(query_heads, splits, seq, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    grid = (query_heads * math.ceil(seq / BLOCK_T), splits)
    for t in (q, keys, values):
        if t.stride(-1) != 1:
            raise ValueError("turn_attention needs channels contiguous (stride 1 on the last axis)")
    jit(_turn_attention_kernel, interpreting())[grid](
        q, keys, values, positions, acc, m, total,
        seq, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        SPLIT_LEN=split_len, GROUP=query_heads // keys.shape[0], HEAD_DIM=head_dim, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, UPCAST=not q.is_cuda,
    )  # fmt: skip
    out = torch.empty(query_heads, seq, head_dim, dtype=q.dtype, device=q.device)
    jit(_combine_kernel, interpreting())[(query_heads * seq,)](
        acc, m, total, out, seq, SPLITS=splits, HEAD_DIM=head_dim
    )
    return out


def turn_attention_weights(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The attention probabilities [H_q, T, S] of queries q [H_q, T, d] at positions [T] over slots keys [H_kv, S, d]
    (query head j reads KV head j // (H_q / H_kv)), each query over the slots s ≤ its position, in `dtype`."""
    group = q.shape[0] // keys.shape[0]
    slots = torch.arange(keys.shape[1], device=q.device)  # [S]
    visible = slots[None, :] <= positions.to(q.device)[:, None]  # [T, S]
    k = keys.to(dtype).repeat_interleave(group, 0)  # [H_q, S, D]
    scores = (q.to(dtype) @ k.transpose(1, 2)) * scale  # [H_q, T, S]
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)  # [H_q, T, S]


def turn_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Pure torch: softmax over slots s ≤ positions[t] in float32 (the kernel's definition), out in q's dtype."""
    weights = turn_attention_weights(q, keys, positions, scale)  # [H_q, T, S]
    v = values.float().repeat_interleave(q.shape[0] // keys.shape[0], 0)  # [H_q, S, D]
    return (weights @ v).to(q.dtype)  # [H_q, T, D]
