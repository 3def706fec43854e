"""The sender's export read in one launch: K and V of every layer of FlashAttention's paged caches, at a request's
slots, into [L, H, T, d] — what `src.serving.paged.read_slots` reads layer by layer and the connector stacks:

    keys[ℓ, h, t] = K_ℓ[slot_t // N, h, slot_t % N],   values[ℓ, h, t] = V_ℓ[slot_t // N, h, slot_t % N]

(N slots a block.) Each layer's K and V halves may lie anywhere (`LayerViews`: a base view and per-layer offsets in
elements, as the map's direct stores address them — vLLM 0.26's GPU runner allocates each layer's cache on its own).
One program copies BLOCK_T tokens × d channels of one (layer, head); the per-layer path costs ≈ 3 launches a layer and
two stacking copies (≈ 80 launches at 24 layers, on the sender's step, before its output returns).

`read_layers_ref` is that torch path (one indexed read per layer, stacked) and the fallback: no triton, CPU tensors,
a head dim that is not a power of two, channels not contiguous, K and V views of different strides.
"""

from __future__ import annotations

import torch

from kernels.jit import interpreting, jit, tl, triton, unavailable
from src.maps import LayerViews

BLOCK_T = 64  # tokens per program: a memory-bound copy, small tiles


def _read_kernel(
    k_ptr,  # layer 0's K view [B, H, N, d] (any strides, channels contiguous); layer ℓ at + k_offsets[ℓ] elements
    v_ptr,  # layer 0's V view, alike
    k_offsets_ptr,  # [L] int64
    v_offsets_ptr,  # [L] int64
    slots_ptr,  # [T] int64: block · N + position in the block
    out_k_ptr,  # [L, H, T, d] contiguous
    out_v_ptr,
    seq,
    heads,
    block_size,
    s_b,  # strides of the views, in elements
    s_h,
    s_n,
    HEAD_DIM: tl.constexpr,
    OFFSET_MULTIPLE: tl.constexpr,  # a power of two dividing every layer offset (LayerViews.multiple)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(1)  # layer · heads + head
    layer, head = row // heads, row % heads
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    inside = t < seq
    slot = tl.load(slots_ptr + t, mask=inside, other=0)
    at = (slot // block_size) * s_b + head.to(tl.int64) * s_h + (slot % block_size) * s_n  # [BLOCK]
    c = tl.arange(0, HEAD_DIM)
    source = at[:, None] + c[None, :]  # [BLOCK, d]
    target = (row.to(tl.int64) * seq + t)[:, None] * HEAD_DIM + c[None, :]
    mask = inside[:, None]
    k_offset = tl.multiple_of(tl.load(k_offsets_ptr + layer), OFFSET_MULTIPLE)  # without the hint: scalar loads
    v_offset = tl.multiple_of(tl.load(v_offsets_ptr + layer), OFFSET_MULTIPLE)
    tl.store(out_k_ptr + target, tl.load(k_ptr + k_offset + source, mask=mask), mask=mask)
    tl.store(out_v_ptr + target, tl.load(v_ptr + v_offset + source, mask=mask), mask=mask)


def read_layers(
    keys: LayerViews, values: LayerViews, slots: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, H, T, d] of every layer's views [B, H, N, d] at slots [T] (int64, on their device). backend: auto
    (the kernel where it runs, else the reference) | triton | torch. No host sync."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, not {backend!r}")
    reason = triton_unsupported(keys, values)
    if backend == "triton" and reason is not None:
        raise ValueError(f"Triton paged read unavailable: {reason}")
    if backend == "torch" or reason is not None or slots.numel() == 0:  # no tokens: no launch of an empty grid
        return read_layers_ref(keys, values, slots)
    slots = slots.long().contiguous()  # int64 addresses (int32 slots would wrap on large caches), one stride
    base = keys.base  # [B, H, N, d]
    layers, (_, heads, size, d), seq = len(keys.views), base.shape, slots.numel()
    out_k = torch.empty(layers, heads, seq, d, dtype=base.dtype, device=base.device)
    out_v = torch.empty_like(out_k)
    grid = (triton.cdiv(seq, BLOCK_T), layers * heads)
    jit(_read_kernel, interpreting())[grid](
        base, values.base, keys.offsets, values.offsets, slots, out_k, out_v, seq, heads, size, *base.stride()[:3],
        HEAD_DIM=d, OFFSET_MULTIPLE=min(keys.multiple, values.multiple), BLOCK=BLOCK_T,
    )  # fmt: skip
    return out_k, out_v


def triton_unsupported(keys: LayerViews, values: LayerViews) -> str | None:
    """Why the kernel cannot read these views here, or None."""
    base = keys.base
    if reason := unavailable(base):
        return reason
    d = base.shape[-1]
    if d & (d - 1) or base.stride(-1) != 1:
        return f"head dim {d} (channel stride {base.stride(-1)}) is not a power of two with contiguous channels"
    if values.base.shape != base.shape or values.base.stride() != base.stride() or len(values.views) != len(keys.views):
        return "K and V views differ in shape, strides or layers"
    return None


def read_layers_ref(keys: LayerViews, values: LayerViews, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-layer path: views [B, H, N, d] indexed at slots [T], stacked → [L, H, T, d] (strided views)."""
    size = keys.base.shape[2]
    block, offset = slots // size, slots % size  # [T]
    read = lambda views: torch.stack([view[block, :, offset] for view in views.views]).transpose(1, 2)  # noqa: E731
    return read(keys), read(values)
