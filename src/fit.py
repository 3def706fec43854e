"""Fit the mapper: per target layer × head × component, a weighted centered ridge map (Eqs. 8–10).

The support decides the features (full / local / cyclic gather, or block-PCA of all heads), the
weighting decides w (uniform, or Attn-Repair with α* per layer × head × component), the statistics
come from one of three backends (`fit.statistics`), all feeding the same float64 ridge solve:
  generic    `stats.reference_moments`: X, Y materialized in float64 — the reference
  streaming  `stats.streaming_moments`: Eq. 22 chunks of b rows, float64
  fused      `kernels.fused_fit` (Fused-Fit, §3.4): gathered by a static schedule, exact int8-digit Grams on
             CUDA; on CPU (or without triton) the same integer arithmetic emulated in torch — the GPU path's
             numbers at several times the streaming cost, for checks. Gathered supports only (not pca / tokens).
"""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from kernels.fused_fit import fused_moments
from src.artifact import Mapper
from src.models import describe_kv, fingerprint
from src.select import layers_for_support
from src.stats import reference_moments, ridge_solve, streaming_moments
from src.support import (
    coefficient_count,
    gather_features,
    head_assignment,
    pca_basis,
    token_kv,
    token_width,
    with_token_kv,
)
from src.traces import Traces
from src.weighting import attn_repair_weights

STATISTICS = ("generic", "streaming", "fused")
V_SPACES = ("token", "attention")  # V rows as they are | as the target's attention mixes them (fit.v_space)


def _design(
    rows: torch.Tensor,
    layers: torch.Tensor,
    head_index: torch.Tensor,
    pca: tuple | None,
    span: slice,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Features of one row span [H_t, b, p] (PCA-projected to k·d_s when `pca` is given; ⊕ token features)."""
    x = gather_features(rows[:, :, span], layers, head_index)  # [H_t, b, k·f·d_s]
    if pca is None:
        return with_token_kv(x, None if token_rows is None else token_rows[span])
    mean, basis = pca  # [L_s, H_s·d_s], [L_s, H_s·d_s, w]
    blocks = x.double().unflatten(-1, (layers.numel(), -1)) - mean[layers]  # [H_t, b, k, H_s·d_s]
    return torch.einsum("hbkc,kcw->hbkw", blocks, basis[layers]).flatten(2)  # [H_t, b, k·w]


def _mixed(rows: torch.Tensor, mix: torch.Tensor | None, span: slice) -> torch.Tensor:
    """Rows [H_t, b, p] of whole sequences (t rows each) as the target's attention mixes them: row t ↦ Σ_s M_ts·x_s,
    mix [H_t, S, t, t] — the V fit then weighs an error as the receiver's attention output carries it. No mix: the
    rows as they are."""
    if mix is None:
        return rows
    t = mix.shape[-1]
    blocks = mix[:, span.start // t : span.stop // t].to(rows.dtype)  # [H_t, b/t, t, t]
    return (blocks @ rows.unflatten(1, (-1, t))).flatten(1, 2)


def _fold_pca(weight: torch.Tensor, bias: torch.Tensor, layers: torch.Tensor, pca: tuple):
    """A map on PCA coordinates as the same map on all-head features: W_full = blockdiag(P_j)·W."""
    mean, basis = pca
    width = basis.shape[-1]
    per_layer = weight.unflatten(1, (layers.numel(), width))  # [H_t, k, w, d_t]
    full = torch.einsum("kcw,hkwd->hkcd", basis[layers], per_layer)  # [H_t, k, H_s·d_s, d_t]
    shift = torch.einsum("kc,hkcd->hd", mean[layers], full)  # [H_t, d_t]
    return full.flatten(1, 2), bias - shift


def fit_mapper(
    traces: Traces,
    source_layers: torch.Tensor,
    head_index: torch.Tensor,
    support: str,
    weighting: str,
    lam: float,
    lam_relative: bool,
    chunk_rows: int,
    statistics: str | bool = "streaming",
    alpha_cap: float = 1.0,
    token_features: bool = False,
    v_space: str = "token",
) -> Mapper:
    """Fit K and V maps for every target layer from traces; returns the Mapper (manifest partly filled).
    statistics: "generic" | "streaming" | "fused" (module docstring); a bool is the former `reference` flag
    (True = generic, False = streaming). token_features=True appends the target's token features (layer-0
    content K/V) to every design. v_space="attention" fits V on rows mixed by the target's attention (`_mixed`,
    traces collected with mixing): the same affine artifact, its error weighed where the receiver reads it."""
    statistics = {True: "generic", False: "streaming"}.get(statistics, statistics)
    if statistics not in STATISTICS:
        raise ValueError(f"unknown statistics {statistics!r}; choose one of {STATISTICS}")
    if v_space not in V_SPACES:
        raise ValueError(f"unknown v_space {v_space!r}; choose one of {V_SPACES}")
    if v_space == "attention" and traces.mix is None:
        raise ValueError("v_space=attention needs traces collected with the target's attention mixing (mixing=True)")
    if v_space == "attention" and (statistics == "fused" or support == "pca" or token_features):
        raise ValueError("v_space=attention is offered for gathered supports with generic / streaming statistics")
    if statistics == "fused" and (support == "pca" or token_features):
        raise ValueError("statistics=fused gathers head blocks only: use streaming for support=pca or token features")
    if weighting == "attn_repair" and traces.attn_k is None:
        raise ValueError("attn_repair weighting needs traces collected with attention_boundaries > 0")
    if token_features and support == "pca":
        raise ValueError("token features are not offered with the block-PCA control (support=pca)")
    token_rows = token_kv(traces.target_k[0], traces.target_v[0]) if token_features else None  # [n, 2·H_t·d_t]
    num_target_layers, target_heads = traces.target_k.shape[:2]
    source_dim = traces.source_k.shape[-1]
    pcas = {}
    if support == "pca":
        pcas = {"k": pca_basis(traces.source_k, source_dim), "v": pca_basis(traces.source_v, source_dim)}
    coefficients: dict[str, list[torch.Tensor]] = {name: [] for name in ("weight_k", "bias_k", "weight_v", "bias_v")}
    alpha_stats: dict[str, list] = {"k": [], "v": []}
    for layer in tqdm(range(num_target_layers), desc="fit target layers", unit="layer"):
        layers = source_layers[layer]
        for component, source_rows, target_rows, raw in (
            ("k", traces.source_k, traces.target_k[layer], traces.attn_k),
            ("v", traces.source_v, traces.target_v[layer], traces.attn_v),
        ):
            pca = pcas.get(component)
            width = _design(source_rows, layers, head_index, pca, slice(0, 1), token_rows).shape[-1]
            weights = None
            if weighting == "attn_repair":
                weights, stats = attn_repair_weights(raw[layer], width, alpha_cap)  # [H_t, n]
                alpha_stats[component].append(stats["alpha"])
            mix = traces.mix[layer] if component == "v" and v_space == "attention" else None  # [H_t, S, t, t]
            chunk = lambda span, rows=source_rows, y=target_rows, w=weights, ls=layers, pc=pca, m=mix: (
                _mixed(_design(rows, ls, head_index, pc, span, token_rows), m, span),
                _mixed(y[:, span], m, span),
                None if w is None else w[:, span],
            )
            if statistics == "generic":
                moments = reference_moments(*chunk(slice(0, traces.rows)))
            elif statistics == "streaming":  # panels of whole sequences when rows are mixed
                per = 1 if mix is None else mix.shape[-1]
                moments = streaming_moments(chunk, traces.rows, max(per, chunk_rows // per * per))
            else:
                moments = fused_moments(source_rows, target_rows, weights, layers, head_index, chunk_rows)
            weight, bias = ridge_solve(moments, lam, lam_relative)
            if pca is not None:
                weight, bias = _fold_pca(weight, bias, layers, pca)
            coefficients[f"weight_{component}"].append(weight.float())
            coefficients[f"bias_{component}"].append(bias.float())
    return fitted_mapper(
        coefficients,
        source_layers,
        head_index,
        support=support,
        weighting=weighting,
        lam=lam,
        lam_relative=lam_relative,
        alpha_cap=alpha_cap,
        token_features=token_features,
        statistics=statistics,
        v_space=v_space,
        alpha=alpha_stats if weighting == "attn_repair" else None,
        fitted_width=width if support == "pca" else None,
        calibration=dict(traces.meta),
    )


def fitted_mapper(
    coefficients: dict[str, list[torch.Tensor]],
    source_layers: torch.Tensor,
    head_index: torch.Tensor,
    *,
    support: str,
    weighting: str,
    lam: float,
    lam_relative: bool,
    alpha_cap: float,
    token_features: bool,
    statistics: str,
    alpha: dict | None,
    fitted_width: int | None,
    calibration: dict,
    v_space: str = "token",
) -> Mapper:
    """Per-target-layer coefficients (lists of [H_t, p, d_t] / [H_t, d_t]) → the Mapper with its method manifest
    (shared by fit_mapper and the sharded fit in src/distributed.py)."""
    manifest = {
        "support": support,
        "weighting": weighting,
        "lambda": lam,
        "lambda_relative": lam_relative,
        "alpha_cap": alpha_cap,
        "token_features": token_features,
        "statistics": statistics,
        "v_space": v_space,
        "alpha": alpha,
        "k": int(source_layers.shape[1]),
        "fan_in": int(head_index.shape[1]),
        "fitted_width": fitted_width,
        "source_layers": source_layers.tolist(),
        "head_index": head_index.tolist(),
        "calibration": calibration,
    }
    return Mapper(
        source_layers=source_layers.clone(),
        head_index=head_index.clone(),
        **{name: torch.stack(values) for name, values in coefficients.items()},
        manifest=manifest,
    )


def fit_transfer(
    source: PreTrainedModel,
    target: PreTrainedModel,
    traces: Traces,
    tokenizer_hash: str,
    support: str = "local",
    k: int = 8,
    selection: str = "r2",
    weighting: str = "uniform",
    lam: float = 0.01,
    lam_relative: bool = False,
    shift: int = 0,
    chunk_rows: int = 4096,
    alpha_cap: float = 1.0,
    token_features: bool = False,
    statistics: str = "streaming",
    v_space: str = "token",
) -> Mapper:
    """Select layers and fit a mapper for this model pair; the manifest identifies pair and method."""
    source_kv, target_kv = describe_kv(source), describe_kv(target)
    head_index = head_assignment(support, source_kv.num_kv_heads, target_kv.num_kv_heads, shift)
    source_layers, scores = layers_for_support(traces, support, k, selection, chunk_rows)
    mapper = fit_mapper(
        traces,
        source_layers,
        head_index,
        support,
        weighting,
        lam,
        lam_relative,
        chunk_rows,
        statistics,
        alpha_cap=alpha_cap,
        token_features=token_features,
        v_space=v_space,
    )
    fan_in = source_kv.num_kv_heads if support == "pca" else head_index.shape[1]
    mapper.manifest.update(
        method=f"{support}+{weighting}"
        + ("+tokens" if token_features else "")
        + ("+vattn" if v_space != "token" else ""),
        selection=selection,
        shift=shift,
        selection_scores=None if scores is None else scores.tolist(),
        coefficient_count=coefficient_count(
            target_kv.num_layers,
            target_kv.num_kv_heads,
            k,
            fan_in,
            source_kv.head_dim,
            target_kv.head_dim,
            token_width(target_kv.num_kv_heads, target_kv.head_dim) if token_features else 0,
        ),
        source_fingerprint=fingerprint(source),
        target_fingerprint=fingerprint(target),
        tokenizer_hash=tokenizer_hash,
        source_kv=source_kv.to_dict(),
        target_kv=target_kv.to_dict(),
    )
    return mapper
