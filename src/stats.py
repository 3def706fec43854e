"""Weighted sufficient statistics and the centered ridge solve (Eqs. 8–10, 20–23).

Two paths give the same W, b: `reference_moments` materializes the whole design X, Y; the streaming
`streaming_moments` sees rows in chunks of b through a callable, with scratch O(H·b·(2p + d)) (Eq. 22):
pass 1 reduces weighted means, pass 2 accumulates centered A_h, B_h. Centering before accumulating
keeps large offsets from cancelling; accumulation and solve are float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

RowChunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # X [H, b, p], Y [H, b, d], w [H, b]


@dataclass
class Moments:
    mean_x: torch.Tensor  # [H, p]   weighted mean x̄_w
    mean_y: torch.Tensor  # [H, d]   weighted mean ȳ_w
    xx: torch.Tensor  # [H, p, p]   A_h = Σ w (x − μx)(x − μx)ᵀ   (Eq. 20)
    xy: torch.Tensor  # [H, p, d]   B_h = Σ w (x − μx)(y − μy)ᵀ   (Eq. 21)
    yy: torch.Tensor  # [H]      Σ w ‖y − μy‖²  (for R²)
    rows: int


def _weighted(t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return t if w is None else t * w[..., None]


def reference_moments(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None) -> Moments:
    """Materialized Eq. 10: x [H, n, p], y [H, n, d], w [H, n] mean-one (None = uniform)."""
    x, y = x.double(), y.double()
    w = None if w is None else w.double()
    total = x.shape[1] if w is None else w.sum(-1)[:, None]
    mean_x = _weighted(x, w).sum(1) / total  # [H, p]
    mean_y = _weighted(y, w).sum(1) / total  # [H, d]
    xc, yc = x - mean_x[:, None], y - mean_y[:, None]
    return Moments(
        mean_x=mean_x,
        mean_y=mean_y,
        xx=_weighted(xc, w).transpose(1, 2) @ xc,
        xy=_weighted(xc, w).transpose(1, 2) @ yc,
        yy=_weighted(yc * yc, w).sum((1, 2)),
        rows=x.shape[1],
    )


def row_spans(rows: int, chunk_rows: int) -> list[slice]:
    """Consecutive row panels of at most b = chunk_rows rows covering 0..rows−1 (Eq. 22's b)."""
    return [slice(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def streaming_moments(chunk: Callable[[slice], RowChunk], rows: int, chunk_rows: int) -> Moments:
    """Two-pass Eqs. 20–21 over row chunks of size b; only one chunk's X, Y, w exist at a time."""
    spans = row_spans(rows, chunk_rows)
    sum_x = sum_y = total = None
    for span in spans:  # pass 1: weighted means, a fixed left-to-right reduction order
        x, y, w = chunk(span)
        x, y = x.double(), y.double()
        w = None if w is None else w.double()
        part_x, part_y = _weighted(x, w).sum(1), _weighted(y, w).sum(1)
        part_w = torch.full((x.shape[0],), float(x.shape[1]), dtype=torch.float64, device=x.device)
        part_w = part_w if w is None else w.sum(-1)
        sum_x = part_x if sum_x is None else sum_x + part_x
        sum_y = part_y if sum_y is None else sum_y + part_y
        total = part_w if total is None else total + part_w
    mean_x, mean_y = sum_x / total[:, None], sum_y / total[:, None]
    xx = xy = yy = 0
    for span in spans:  # pass 2: centered, weighted panels → head-batched GEMMs
        x, y, w = chunk(span)
        xc, yc = x.double() - mean_x[:, None], y.double() - mean_y[:, None]
        w = None if w is None else w.double()
        xx = xx + _weighted(xc, w).transpose(1, 2) @ xc
        xy = xy + _weighted(xc, w).transpose(1, 2) @ yc
        yy = yy + _weighted(yc * yc, w).sum((1, 2))
    return Moments(mean_x=mean_x, mean_y=mean_y, xx=xx, xy=xy, yy=yy, rows=rows)


def ridge_solve(moments: Moments, lam: float, relative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ŵ_h = (A_h + λI)⁻¹ B_h, b̂_h = μy − μx Ŵ_h (Eq. 23), float64 Cholesky.

    relative=True scales λ by the mean Gram diagonal of each head (λ·tr(A_h)/p). A Gram that is not
    numerically positive definite is retried with growing diagonal jitter; a non-finite result raises.
    """
    a, b = moments.xx.double(), moments.xy.double()
    p = a.shape[-1]
    eye = torch.eye(p, dtype=a.dtype, device=a.device)
    scale = a.diagonal(dim1=-2, dim2=-1).mean(-1) if relative else torch.ones(a.shape[0], dtype=a.dtype)
    ridge = (lam * scale.to(a.device))[:, None, None] * eye  # [H, p, p]
    jitter = 0.0
    for _ in range(6):
        factor, info = torch.linalg.cholesky_ex(a + ridge + jitter * eye)
        if int(info.max()) == 0:
            break
        jitter = max(jitter * 100, 1e-10 * float(a.diagonal(dim1=-2, dim2=-1).abs().mean()) + 1e-12)
    else:
        raise FloatingPointError("ridge Gram matrix is not positive definite even with jitter (NaN in traces?)")
    weight = torch.cholesky_solve(b, factor)  # [H, p, d]
    bias = moments.mean_y - (moments.mean_x[:, None, :] @ weight)[:, 0]  # [H, d]   Eq. 9
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise FloatingPointError("ridge solve produced non-finite coefficients")
    return weight, bias
