"""Layer selection (§3.1): per target layer, rank source layers by the held-in R² of centered
single-source-layer OLS probes under the same head assignment, averaged over KV heads and K/V.

`depth` (one or k source layers nearest in relative depth: the simple linear map) and `identity`
(S_ℓ = {ℓ}, self-transfer) need no statistics.
"""

from __future__ import annotations

import torch

from src.stats import row_spans
from src.support import gather_features, head_assignment
from src.traces import Traces

SELECTIONS = ("r2", "depth", "identity")


def _probe_r2(source: torch.Tensor, target: torch.Tensor, head_index: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """source [L_s, H_s, n, d_s], target [L_t, H_t, n, d_t] → R² [L_t, L_s] averaged over target heads."""
    num_source, rows = source.shape[0], source.shape[2]
    all_layers = torch.arange(num_source)
    features = lambda span: torch.stack(
        [gather_features(source[:, :, span], all_layers[j : j + 1], head_index) for j in range(num_source)]
    ).double()  # [L_s, H_t, b, p]
    spans = row_spans(rows, chunk_rows)
    mean_x = sum(features(span).sum(2) for span in spans) / rows  # [L_s, H_t, p]
    mean_y = sum(target[:, :, span].double().sum(2) for span in spans) / rows  # [L_t, H_t, d_t]
    gram = cross = total = 0
    for span in spans:
        xc = features(span) - mean_x[:, :, None]  # [L_s, H_t, b, p]
        yc = target[:, :, span].double() - mean_y[:, :, None]  # [L_t, H_t, b, d_t]
        gram = gram + xc.transpose(-1, -2) @ xc  # [L_s, H_t, p, p]
        cross = cross + torch.einsum("jhbp,lhbd->jlhpd", xc, yc)  # [L_s, L_t, H_t, p, d_t]
        total = total + (yc * yc).sum((2, 3))  # [L_t, H_t]
    p = gram.shape[-1]
    jitter = (
        1e-9
        * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
        * torch.eye(p, dtype=gram.dtype, device=gram.device)
    )
    solution = torch.linalg.solve(gram + jitter, cross.permute(0, 2, 3, 1, 4).flatten(3))  # [L_s, H_t, p, L_t·d_t]
    explained = (cross.permute(0, 2, 3, 1, 4).flatten(3) * solution).sum(2)  # [L_s, H_t, L_t·d_t]
    explained = explained.unflatten(-1, (target.shape[0], -1)).sum(-1)  # [L_s, H_t, L_t]
    r2 = 1 - (total.T[None] - explained) / total.T[None].clamp_min(1e-300)  # [L_s, H_t, L_t]
    return r2.mean(1).T  # [L_t, L_s]


def probe_r2(traces: Traces, head_index: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Selection scores [L_t, L_s]: probe R², mean over target KV heads and K/V."""
    r2_k = _probe_r2(traces.source_k, traces.target_k, head_index, chunk_rows)
    r2_v = _probe_r2(traces.source_v, traces.target_v, head_index, chunk_rows)
    return (r2_k + r2_v) / 2


def depth_layers(source_layers: int, target_layers: int, k: int) -> torch.Tensor:
    """The k source layers nearest in relative depth to each target layer: [L_t, k]."""
    source_depth = torch.arange(source_layers) / max(source_layers - 1, 1)
    target_depth = torch.arange(target_layers) / max(target_layers - 1, 1)
    distance = (target_depth[:, None] - source_depth[None, :]).abs()  # [L_t, L_s]
    return distance.argsort(dim=1, stable=True)[:, :k].sort(dim=1).values


def select_layers(
    traces: Traces, head_index: torch.Tensor, k: int, method: str, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selected source layers S_ℓ [L_t, k] (ascending) and the scores that ranked them (r2 only)."""
    source_layers, target_layers = traces.source_k.shape[0], traces.target_k.shape[0]
    if not 1 <= k <= source_layers:
        raise ValueError(f"k={k} must be between 1 and the source's {source_layers} layers")
    if method == "identity":
        if source_layers != target_layers or k != 1:
            raise ValueError("identity selection needs equal layer counts and k=1")
        return torch.arange(target_layers)[:, None], None
    if method == "depth":
        return depth_layers(source_layers, target_layers, k), None
    if method != "r2":
        raise ValueError(f"unknown selection {method!r}; choose one of {SELECTIONS}")
    scores = probe_r2(traces, head_index, chunk_rows)
    chosen = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return chosen.sort(dim=1).values, scores


def layers_for_support(
    traces: Traces, support: str, k: int, method: str, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selection shared by all paired estimators: probes use all heads for `full`, the local map otherwise."""
    probe = "full" if support == "full" else "local"
    heads = head_assignment(probe, traces.source_k.shape[1], traces.target_k.shape[1])
    return select_layers(traces, heads, k, method, chunk_rows)
