"""Calibration weights: uniform, or Attn-Repair (Eqs. 17–19) with the Kish effective-sample-size floor.

The raw sensitivities r^K, r^V (Eqs. 14–16) come from `traces.attention_sensitivity`; here they are
mean-normalized per target layer × head × component and shrunk toward uniform by α*.
"""

from __future__ import annotations

import torch

WEIGHTINGS = ("uniform", "attn_repair")


def kish_alpha(cv2: torch.Tensor, rows: int, width: int, cap: float = 1.0) -> torch.Tensor:
    """α* = 1 if CV² = 0 else min{1, √((n/τ − 1)/CV²)}, τ = min(n, 2p) (Eq. 19); optionally capped lower."""
    tau = min(rows, 2 * width)
    safe = torch.where(cv2 > 0, cv2, torch.ones_like(cv2))
    alpha = torch.where(
        cv2 > 0, torch.sqrt(torch.tensor(rows / tau - 1.0, dtype=cv2.dtype) / safe), torch.ones_like(cv2)
    )
    return alpha.clamp(max=1.0).clamp(max=cap)


def kish_ess(w: torch.Tensor) -> torch.Tensor:
    """n_eff = (Σw)² / Σw² (Eq. 18), over the last dim."""
    return w.sum(-1) ** 2 / (w * w).sum(-1)


def attn_repair_weights(raw: torch.Tensor, width: int, cap: float = 1.0) -> tuple[torch.Tensor, dict]:
    """raw [H, n] nonnegative sensitivities → mean-one weights w(α*) [H, n] (Eq. 17) and α statistics."""
    mean = raw.mean(-1, keepdim=True)
    r = torch.where(mean > 0, raw / mean.clamp_min(torch.finfo(raw.dtype).tiny), torch.ones_like(raw))
    cv2 = ((r - 1) ** 2).mean(-1)  # [H]
    alpha = kish_alpha(cv2, raw.shape[-1], width, cap)
    w = 1 + alpha[:, None] * (r - 1)
    stats = {"alpha": alpha.tolist(), "cv2": cv2.tolist(), "n_eff": kish_ess(w).tolist()}
    return w, stats
