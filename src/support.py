"""Mapper support: which source heads feed each target head, and how features are gathered.

A support is a head index [H_t, f] (f source heads per target head, per selected source layer):
  full    f = H_s: every source head (Eq. 7, Full-Head Mapping)
  local   one architecture-indexed head (Eq. 11, Head-Local); for unequal KV-head counts the map
          follows GQA group ownership: H_t = m·H_s → a(h) = ⌊h/m⌋; H_s = m·H_t → the m source heads
          m·h … m·h+m−1 of group h, concatenated (f = m)
  cyclic  the local assignment shifted by c source heads: a(h) = (h + c) mod H_s (a control)
  pca     all source heads of each selected layer, block-PCA-reduced to Head-Local's width (a control)

Any support can also read the target's token features (`fit.token_features`): the target's own layer-0
content K and V of the token, all heads [n, 2·H_t·d_t] — a function of the token id alone (embedding → norm
→ projection), computed exactly at handoff by a layer-0 target prefill — appended to every head's features.
"""

from __future__ import annotations

import torch

SUPPORTS = ("full", "local", "cyclic", "pca")


def head_assignment(support: str, source_heads: int, target_heads: int, shift: int = 0) -> torch.Tensor:
    """Source KV heads admitted for each target KV head: LongTensor [H_t, f]."""
    if support not in SUPPORTS:
        raise ValueError(f"unknown support {support!r}; choose one of {SUPPORTS}")
    if support in ("full", "pca"):
        return torch.arange(source_heads).expand(target_heads, source_heads).clone()
    heads = torch.arange(target_heads)
    if source_heads == target_heads:
        local = heads[:, None]
    elif target_heads % source_heads == 0:
        local = (heads // (target_heads // source_heads))[:, None]
    elif source_heads % target_heads == 0:
        group = source_heads // target_heads
        local = heads[:, None] * group + torch.arange(group)[None, :]
    else:
        raise ValueError(
            f"no architecture-indexed head map for {source_heads} source vs {target_heads} target KV heads "
            "(one count must divide the other); use support=full"
        )
    return (local + shift) % source_heads if support == "cyclic" else local


def gather_features(rows: torch.Tensor, layers: torch.Tensor, head_index: torch.Tensor) -> torch.Tensor:
    """rows [L_s, H_s, n, d_s] → features [H_t, n, k·f·d_s], ordered (layer j, head g, channel).

    layers [k] selects one target layer's sources; layers [g, k] gathers a group of target layers at
    once → [g, H_t, n, k·f·d_s]."""
    if layers.dim() == 1:
        return gather_features(rows, layers[None], head_index)[0]
    picked = rows[layers][:, :, head_index]  # [g, k, H_t, f, n, d_s]
    return picked.permute(0, 2, 4, 1, 3, 5).flatten(3)  # [g, H_t, n, k·f·d_s]


def token_kv(target_k0: torch.Tensor, target_v0: torch.Tensor) -> torch.Tensor:
    """The target's layer-0 content K, V [H_t, n, d_t] each → token features [n, 2·H_t·d_t] (K heads, V heads)."""
    return torch.cat([target_k0, target_v0], 0).permute(1, 0, 2).flatten(1)


def token_width(target_heads: int, d_t: int) -> int:
    """Width q of the token features: the target's layer-0 K and V of every head."""
    return 2 * target_heads * d_t


def with_token_kv(features: torch.Tensor, token_rows: torch.Tensor | None) -> torch.Tensor:
    """features [..., H, n, p] ⊕ token K/V rows [n, q] broadcast to every head → [..., H, n, p + q]."""
    if token_rows is None:
        return features
    return torch.cat([features, token_rows.to(features.dtype).expand(*features.shape[:-1], -1)], -1)


def coefficient_count(
    target_layers: int, target_heads: int, k: int, fan_in: int, d_s: int, d_t: int, token_width: int = 0
) -> int:
    """Non-bias coefficients over K and V: C(f) = 2·L_t·H_t·(k·f·d_s + q)·d_t (Eqs. 6, 12, 13; q = token width)."""
    return 2 * target_layers * target_heads * (k * fan_in * d_s + token_width) * d_t


def pca_basis(rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block PCA of all heads of each source layer: rows [L_s, H_s, n, d_s] →
    mean [L_s, H_s·d_s] and the top-`width` principal directions [L_s, H_s·d_s, width]."""
    blocks = rows.permute(0, 2, 1, 3).flatten(2).double()  # [L_s, n, H_s·d_s]
    mean = blocks.mean(dim=1)  # [L_s, H_s·d_s]
    centered = blocks - mean[:, None]
    covariance = centered.transpose(1, 2) @ centered  # [L_s, H_s·d_s, H_s·d_s]
    _, vectors = torch.linalg.eigh(covariance)  # ascending eigenvalues
    return mean, vectors[..., -width:].flip(-1)
