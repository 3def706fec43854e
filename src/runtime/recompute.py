"""Selective recompute of mapped prefix tokens, in place (CacheBlend-style, on a cross-model map).

After the mapped prefix is spliced into the target's cache, a few of its tokens are recomputed through every
target layer: each at its own position, attending to the spliced cache up to itself and to the fresh K/V of the
earlier recomputed tokens in the same layer; its fresh K/V replace the mapped ones. Which tokens (`RULES`):
  deviation  largest mapped-vs-native K/V deviation in the first target layers, computed natively over the prefix
  attention  largest attention mass from the new turn's queries (read on top of the spliced cache) onto the prefix
  recency    the last ones (the hold-back baseline, recomputed in place)
  turn       largest attention mass from the new turn's queries onto the span at the last native layer, taken in
             the stopped native prefill over prefix + turn (static engine only: src/runtime/splice.py)
The mechanics: the selected tokens are appended as new tokens with their own position ids and a 4-D additive mask
over [cache slots | new tokens] that hides, for each, the cache slots at or after its position and every selected
slot (causal among the new tokens); the appended K/V are then scattered into their slots and the cache cut back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

RULES = ("deviation", "attention", "recency", "turn")
Pair = tuple[torch.Tensor, torch.Tensor]  # one layer's (keys, values) [B, H_t, T, d_t]
_MASKED_ATTENTION = ("eager", "sdpa")  # implementations that read an arbitrary 4-D mask


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _cut(cache: DynamicCache, length: int) -> None:
    """Drop every cache slot from `length` on, in every layer."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def deviation_scores(
    native: Sequence[Pair], spliced: Sequence[Pair], layers: int, start: int, end: int
) -> torch.Tensor:
    """Per-token deviation [B, end − start] of the spliced K/V from the native ones over the first `layers` layers
    (each a (keys, values) pair [B, H_t, ≥ end, d_t]): Σ_layers Σ_{K,V} ‖x_spliced − x_native‖² / mean_t ‖x_native‖²
    (each component on its own scale)."""
    score = 0.0
    for layer in range(layers):
        for component in (0, 1):
            own = native[layer][component][:, :, start:end].float()  # [B, H_t, S, d_t]
            mapped = spliced[layer][component][:, :, start:end].float()  # [B, H_t, S, d_t]
            scale = own.pow(2).sum((1, 3)).mean().clamp_min(torch.finfo(torch.float32).tiny)
            score = score + (mapped - own).pow(2).sum((1, 3)) / scale  # [B, S]
    return score


@torch.no_grad()
def attention_scores(
    model: PreTrainedModel, cache: DynamicCache, query_ids: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Attention mass [B, end − start] that the query tokens [B, Q], read on top of the cache, put on cache slots
    start..end − 1, summed over layers, heads and queries. Eager attention gives the probabilities; the model's
    own implementation and the cache's length are restored."""
    length, implementation = cache.get_seq_length(), model.config._attn_implementation
    if implementation != "eager":
        model.set_attn_implementation("eager")
    try:
        out = model(
            query_ids.to(_device(model)),
            past_key_values=cache,
            use_cache=True,
            output_attentions=True,
            logits_to_keep=1,
        )
    finally:
        if implementation != "eager":
            model.set_attn_implementation(implementation)
        _cut(cache, length)
    return sum(a[..., start:end].float().sum((1, 2)) for a in out.attentions)  # [B, Hq, Q, T+Q] → [B, S]


def select_tokens(scores: torch.Tensor, count: int, start: int) -> torch.Tensor:
    """Cache positions [B, count], ascending, of the `count` highest scores [B, S] of slots start..start + S − 1."""
    return start + scores.topk(count, dim=1).indices.sort(dim=1).values


@torch.no_grad()
def recompute_in_place(
    model: PreTrainedModel, cache: DynamicCache, input_ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """Recompute the tokens at `positions` [B, R] (distinct cache slots) of the cache of input_ids [B, T] through
    every layer of `model`, each at its own position: it reads the cache slots before it that are not recomputed
    and the fresh K/V of the recomputed tokens before it (and itself); its fresh K/V replace its slot's."""
    implementation = model.config._attn_implementation
    if implementation not in _MASKED_ATTENTION:
        raise ValueError(
            f"recompute needs an attention that reads a 4-D mask {_MASKED_ATTENTION}, not {implementation}"
        )
    if any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or ()):
        raise ValueError("recompute supports full attention only (the 4-D mask would bypass the sliding window)")
    batch, length = input_ids.shape
    if cache.get_seq_length() != length:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, input_ids {length}")
    device = _device(model)
    positions = positions.to(device).sort(dim=1).values  # [B, R]
    count = positions.shape[1]
    if count == 0:
        return
    selected = torch.zeros(batch, length, dtype=torch.bool, device=device).scatter_(1, positions, True)  # [B, T]
    slots = torch.arange(length, device=device)  # [T]
    see_cache = (slots[None, None, :] < positions[:, :, None]) & ~selected[:, None, :]  # [B, R, T]
    see_new = torch.ones(count, count, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)  # [B, R, R]
    visible = torch.cat([see_cache, see_new], dim=2)  # [B, R, T + R]
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    tokens = input_ids.to(device).gather(1, positions)  # [B, R]
    mask = mask[:, None]  # [B, 1, R, T + R]  additive: 0 visible, dtype min hidden
    model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        index = positions[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])  # [B, H_t, R, d_t]
        layer.keys = layer.keys[:, :, :length].scatter(2, index, layer.keys[:, :, length:])  # [B, H_t, T, d_t]
        layer.values = layer.values[:, :, :length].scatter(2, index, layer.values[:, :, length:])
