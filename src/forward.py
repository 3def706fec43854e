"""A model's own work on a prefix: the ordinary prefill, and a prefill stopped after its first layers."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


@torch.no_grad()
def prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> DynamicCache:
    """The ordinary path: the model's own cache for input_ids [B, T] (logits of the last token only)."""
    device = next(model.parameters()).device
    return model(input_ids.to(device), use_cache=True, logits_to_keep=1).past_key_values


class _StopForward(Exception):
    pass


def _raise_stop(*_) -> None:
    raise _StopForward


@torch.no_grad()
def prefill_layers(model: PreTrainedModel, input_ids: torch.Tensor, layers: int) -> DynamicCache:
    """The model's own cache of input_ids [B, T] in its first `layers` decoder layers only: the forward
    stops after layer `layers` − 1 (later cache layers stay empty)."""
    if not 1 <= layers <= len(model.model.layers):  # layers − 1 = −1 would hook the last layer: a full prefill
        raise ValueError(f"prefill_layers needs 1 ≤ layers ≤ {len(model.model.layers)}, got {layers}")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    handle = model.model.layers[layers - 1].register_forward_hook(_raise_stop)
    try:
        model(input_ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return cache
