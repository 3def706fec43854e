"""The map arithmetic every apply path shares (torch here, Triton in kernels/apply_map.py): which target
layers go together, how one group of target layers is computed from the source's content rows, and the
refusal type. Below both `src/apply.py` and `kernels/`, so neither imports the other's internals.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from src.artifact import Mapper
from src.support import gather_features, with_token_kv


class TransferError(ValueError):
    """This source cache cannot be mapped safely; the message names why. Callers roll back to prefill."""


def shares_heads(mapper: Mapper) -> bool:
    """True when every target head reads the same source heads (full / pca support)."""
    return bool((mapper.head_index == mapper.head_index[:1]).all())


GROUP_BYTES = 1 << 30  # target layers are mapped in groups whose gathered features fit in about 1 GiB


def map_layers(
    mapper: Mapper,
    group: slice,
    source_k: torch.Tensor,
    source_v: torch.Tensor,
    shared: bool,
    token_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content rows [L_s, H_s, n, d_s] (K and V) → mapped rows of target layers `group`: [g, H_t, n, d_t].
    `token_rows` [n, 2·H_t·d_t]: the target's token K/V rows, for a mapper fitted with token features.

    One gather and one batched GEMM per component for the whole group. When every target head reads
    the same source heads (full / pca support, `shared`) the features are gathered once per layer and
    all heads are one GEMM against W reshaped to [p, H_t·d_t]."""
    heads = mapper.head_index[:1] if shared else mapper.head_index  # [H_t or 1, f]
    layers = mapper.source_layers[group]  # [g, k]
    mapped = []
    for component, rows in (("k", source_k), ("v", source_v)):
        x = with_token_kv(gather_features(rows, layers, heads), token_rows).to(mapper.weight_k.dtype)  # [g, H_t or 1, n, p]
        weight = getattr(mapper, f"weight_{component}")[group]  # [g, H_t, p, d_t]
        bias = getattr(mapper, f"bias_{component}")[group]  # [g, H_t, d_t]
        if shared:
            w = weight.permute(0, 2, 1, 3).flatten(2)  # [g, p, H_t·d_t]
            y = torch.baddbmm(bias.flatten(1)[:, None, :], x[:, 0], w)  # [g, n, H_t·d_t]
            mapped.append(y.unflatten(2, bias.shape[1:]).transpose(1, 2))  # [g, H_t, n, d_t]
        else:
            g, h = weight.shape[:2]
            y = torch.baddbmm(bias.flatten(0, 1)[:, None, :], x.flatten(0, 1), weight.flatten(0, 1))  # [g·H_t, n, d_t]
            mapped.append(y.unflatten(0, (g, h)))  # [g, H_t, n, d_t]
    return mapped[0], mapped[1]


def layer_groups(mapper: Mapper, rows: int, shared: bool) -> list[slice]:
    """Slices of target layers whose gathered features stay under GROUP_BYTES."""
    target_layers, target_heads, width = mapper.weight_k.shape[:3]
    per_layer = (1 if shared else target_heads) * rows * width * mapper.weight_k.element_size()
    size = max(1, min(target_layers, GROUP_BYTES // max(per_layer, 1)))
    return [slice(start, min(start + size, target_layers)) for start in range(0, target_layers, size)]


def map_rows(
    mapper: Mapper, source_k: torch.Tensor, source_v: torch.Tensor, token_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content rows [L_s, H_s, n, d_s] (K and V) (+ token K/V rows [n, 2·H_t·d_t]) → mapped target content
    rows [L_t, H_t, n, d_t]."""
    shared = shares_heads(mapper)
    if mapper.token_features and token_rows is None:
        raise TransferError("this mapper reads the target's token features: pass them")
    groups = [
        map_layers(mapper, g, source_k, source_v, shared, token_rows)
        for g in layer_groups(mapper, source_k.shape[2], shared)
    ]
    return torch.cat([k for k, _ in groups]), torch.cat([v for _, v in groups])


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a DynamicCache or legacy tuple cache, each [batch, kv_heads, seq, head_dim]."""
    if isinstance(cache, DynamicCache):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [tuple(pair) for pair in cache]
