"""Feature probes for the V bottleneck (lever g): would a wider closed-form map fit V (or K) better?

Per target layer × KV head, the same centered ridge as the mapper (Eqs. 8–10, 23, uniform weights) on
the Head-Local design of the selected source layers, widened by one feature family per variant:
  own     the mapper's own features: the selected layers' rows of the component being fitted (baseline;
          equals a Head-Local uniform mapper's held-out R²)
  kv      + the same layers' rows of the other component (context the source cache already holds)
  token   + the target's own layer-0 content K and V of every head (a function of the token id alone:
          embedding → norm → projection; the mapper's `fit.token_features` design)
  relu    + ReLU(z·R): z the standardized own features, R a fixed Gaussian [p, width] (random features,
          a nonlinear map that stays closed-form)
R² on the fit rows and on held-out sequences, so capacity-limited and overfit-limited cases read apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from src.stats import ridge_solve, row_spans, streaming_moments
from src.support import gather_features, token_kv, with_token_kv
from src.traces import Traces

VARIANTS = ("own", "kv", "token", "relu")
OTHER = {"k": "v", "v": "k"}
Design = Callable[[Traces, slice], torch.Tensor]  # rows of a span → features [H_t, b, p]


def base_design(component: str, variant: str, layers: torch.Tensor, head_index: torch.Tensor) -> Design:
    """The linear part of a variant's design for one target layer (`relu` adds its features on top)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown probe variant {variant!r}; choose from {VARIANTS}")

    def design(traces: Traces, span: slice) -> torch.Tensor:
        rows = lambda name: getattr(traces, f"source_{name}")[:, :, span]  # [L_s, H_s, b, d_s]
        parts = [gather_features(rows(component), layers, head_index)]  # [H_t, b, k·f·d_s]
        if variant == "kv":
            parts.append(gather_features(rows(OTHER[component]), layers, head_index))
        x = torch.cat([p.double() for p in parts], -1)
        if variant == "token":  # the mapper's `fit.token_features` design
            return with_token_kv(x, token_kv(traces.target_k[0, :, span], traces.target_v[0, :, span]))
        return x

    return design


def random_features(design: Design, traces: Traces, width: int, chunk_rows: int, seed: int) -> Design:
    """design ⊕ ReLU(((x − μ)/σ)·R / √p), μ, σ per head from the fit rows, R ~ N(0, 1) [p, width] seeded."""
    spans = row_spans(traces.rows, chunk_rows)
    total = sum(design(traces, span).sum(1) for span in spans)  # [H_t, p]
    mean = total / traces.rows
    spread = sum(((design(traces, span) - mean[:, None]) ** 2).sum(1) for span in spans)
    scale = (spread / traces.rows).sqrt().clamp_min(1e-12)  # [H_t, p]
    generator = torch.Generator().manual_seed(seed)
    projection = torch.randn(mean.shape[-1], width, generator=generator, dtype=torch.float64).to(mean.device)
    projection /= mean.shape[-1] ** 0.5

    def widened(rows: Traces, span: slice) -> torch.Tensor:
        x = design(rows, span)  # [H_t, b, p]
        z = ((x - mean[:, None]) / scale[:, None]) @ projection  # [H_t, b, width]
        return torch.cat([x, torch.relu(z)], -1)

    return widened


def residual_and_spread(
    design: Design, weight: torch.Tensor, bias: torch.Tensor, traces: Traces, target: torch.Tensor, chunk_rows: int
) -> tuple[float, float]:
    """Σ‖y − ŷ‖² and Σ‖y − ȳ‖² over the rows of `traces` (ȳ their own mean), target [H_t, n, d_t]."""
    residual = total = square = 0.0
    for span in row_spans(traces.rows, chunk_rows):
        y = target[:, span].double()  # [H_t, b, d_t]
        predicted = design(traces, span) @ weight + bias[:, None]
        residual += float(((y - predicted) ** 2).sum())
        total = total + y.sum(1)
        square += float((y * y).sum())
    spread = square - float((total * total).sum()) / traces.rows  # Σy² − n·ȳ² per (head, channel), summed
    return residual, spread


def probe_layer(
    fit: Traces,
    heldout: Traces,
    component: str,
    layer: int,
    design: Design,
    lam: float,
    lam_relative: bool,
    chunk_rows: int,
) -> dict[str, float]:
    """One target layer × component: residual / spread sums on fit and held-out rows, and the width p."""
    target = lambda rows: getattr(rows, f"target_{component}")[layer]  # [H_t, n, d_t]
    chunk = lambda span: (design(fit, span), target(fit)[:, span], None)
    weight, bias = ridge_solve(streaming_moments(chunk, fit.rows, chunk_rows), lam, lam_relative)
    fit_residual, fit_spread = residual_and_spread(design, weight, bias, fit, target(fit), chunk_rows)
    held_residual, held_spread = residual_and_spread(design, weight, bias, heldout, target(heldout), chunk_rows)
    return {
        "fit_residual": fit_residual,
        "fit_spread": fit_spread,
        "heldout_residual": held_residual,
        "heldout_spread": held_spread,
        "width": float(weight.shape[1]),
    }


def probe_features(
    fit: Traces,
    heldout: Traces,
    source_layers: torch.Tensor,
    head_index: torch.Tensor,
    variants: list[str],
    lam: float,
    lam_relative: bool,
    chunk_rows: int,
    relu_width: int,
    seed: int,
) -> dict[str, float | list[float]]:
    """`<variant>.r2_<k|v>_{fit,heldout}` pooled over target layers (as `mapper_r2`), per-layer held-out
    lists (`…_layers`) and `<variant>.width_<k|v>` (features per target head)."""
    scores: dict[str, float | list[float]] = {}
    for variant in variants:
        for component in ("k", "v"):
            per_layer = []
            for layer in range(fit.target_k.shape[0]):
                design = base_design(
                    component, "own" if variant == "relu" else variant, source_layers[layer], head_index
                )
                if variant == "relu":
                    design = random_features(design, fit, relu_width, chunk_rows, seed + layer)
                per_layer.append(probe_layer(fit, heldout, component, layer, design, lam, lam_relative, chunk_rows))
            for split in ("fit", "heldout"):
                residual = sum(s[f"{split}_residual"] for s in per_layer)
                spread = sum(s[f"{split}_spread"] for s in per_layer)
                scores[f"{variant}.r2_{component}_{split}"] = 1 - residual / spread
            scores[f"{variant}.r2_{component}_heldout_layers"] = [
                1 - s["heldout_residual"] / s["heldout_spread"] for s in per_layer
            ]
            scores[f"{variant}.width_{component}"] = per_layer[0]["width"]
    return scores
