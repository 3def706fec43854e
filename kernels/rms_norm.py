"""RMSNorm in one launch, as Hugging Face's Llama / Qwen2 / Qwen3 `RMSNorm.forward` computes it (the receiver engine's
norms, src/runtime/engine.py: a turn's forward is launch-bound, and HF's norm is six kernels):

    y = weight · (x / sqrt(mean(x²) + ε) rounded to x's dtype)        statistics in float32, one program per row

`rms_norm_ref` is that torch code and the fallback (CPU, no triton, rows wider than 16,384 channels).
"""

from __future__ import annotations

import torch

from kernels.jit import interpreting, jit, tl, triton, unavailable

MAX_COLUMNS = 16384


def _rms_norm_kernel(
    x_ptr,  # [R, C] rows, channels contiguous
    w_ptr,  # [C]
    out_ptr,  # [R, C] contiguous
    columns,
    eps,
    stride_x,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < columns
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + c, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / columns
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)  # HF: hidden.to(input_dtype)
    weight = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    out = weight * normed
    tl.store(out_ptr + row.to(tl.int64) * columns + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """x [..., C], weight [C] → [..., C] in the dtype of weight · x (HF's). backend: auto | triton | torch."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, not {backend!r}")
    columns = x.shape[-1]
    reason = unavailable(x)
    if reason is None and (columns > MAX_COLUMNS or x.stride(-1) != 1):
        reason = f"rows of {columns} channels (stride {x.stride(-1)}) are not one contiguous block ≤ {MAX_COLUMNS}"
    if backend == "triton" and reason is not None:
        raise ValueError(f"Triton RMSNorm unavailable: {reason}")
    if backend == "torch" or reason is not None:
        return rms_norm_ref(x, weight, eps)
    rows = x.reshape(-1, columns)  # [R, C] (a view for the engine's activations)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    jit(_rms_norm_kernel, interpreting())[(rows.shape[0],)](
        rows, weight, out, columns, eps, rows.stride(0), BLOCK=triton.next_power_of_2(columns)
    )
    return out.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm.forward."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)
