"""A model's own work on a prefix: the ordinary prefill, a prefill stopped after its first layers, and its greedy
continuation (calibration text written by the receiver itself)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def ids_problem(input_ids, vocab_size: int) -> str | None:
    """Why input_ids cannot be read by a model of this vocabulary — not a dense integer tensor [B, T ≥ 1] of ids in
    [0, vocab_size) — or None when they can. The values are read on the host once (one copy of both ends: a device
    sync for ids on a GPU, free for a tokenizer's host-side ids): check a handoff's ids once, where they enter."""
    if problem := ids_form_problem(input_ids):
        return problem
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one host read of both ends
    if low < 0 or high >= vocab_size:
        return f"input_ids hold ids {low}..{high}, outside the vocabulary [0, {vocab_size})"
    return None


def ids_form_problem(input_ids) -> str | None:
    """Why input_ids are not a dense integer tensor [B, T ≥ 1], or None: metadata only, no value read."""
    if not isinstance(input_ids, torch.Tensor):
        return f"input_ids is a {type(input_ids).__name__}, expected an integer tensor"
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        return f"input_ids are {input_ids.dtype}, expected integer token ids"
    if input_ids.is_nested or input_ids.layout != torch.strided or input_ids.device.type == "meta":
        return "input_ids must be a dense tensor with data"
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        return f"input_ids shape {tuple(input_ids.shape)}: expected [batch, tokens ≥ 1]"
    return None


def check_ids(model: PreTrainedModel, input_ids) -> None:
    """A clear ValueError for ids the model cannot read (instead of an embedding IndexError or a device assert)."""
    if problem := ids_problem(input_ids, model.get_input_embeddings().num_embeddings):
        raise ValueError(problem)


@torch.no_grad()
def prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> DynamicCache:
    """The ordinary path: the model's own cache for input_ids [B, T] (logits of the last token only)."""
    check_ids(model, input_ids)
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
    check_ids(model, input_ids)
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


@torch.no_grad()
def greedy_continuation(
    model: PreTrainedModel, input_ids: torch.Tensor, keep: int, vocab_size: int, batch_size: int = 64
) -> torch.Tensor:
    """input_ids [N, T] with tokens keep..T − 1 of each row replaced by the model's greedy continuation of tokens
    0..keep − 1 (argmax over the first `vocab_size` logits, the ids both models of a pair read; no stop token):
    [N, T] on the input's device. keep = T returns the ids unchanged."""
    total = input_ids.shape[1]
    if not 1 <= keep <= total:
        raise ValueError(f"greedy_continuation keeps 1..{total} tokens of each row, got {keep}")
    check_ids(model, input_ids)
    device, out = next(model.parameters()).device, input_ids.clone()
    for start in range(0, input_ids.shape[0], batch_size):
        tokens = input_ids[start : start + batch_size, :keep].to(device)  # [B, keep]
        cache = DynamicCache(config=model.config)
        written = []
        for _ in range(total - keep):
            logits = model(tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
            tokens = logits[:, -1, :vocab_size].argmax(-1, keepdim=True)  # [B, 1]
            written.append(tokens)
        if written:
            out[start : start + batch_size, keep:] = torch.cat(written, 1).to(out.device)
    return out
