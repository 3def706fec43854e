"""Multiple-choice scoring and greedy decoding on a native or transferred context cache.

A context of T_c tokens is prefilled ONCE without its last token — by the target (`native_target`), the
source (`native_source`), or the source and then mapped once by a `KVTransfer` (`transfer`). All
continuations are then read on that one cache in a single batched forward: row i feeds
[last context token, c_i[:-1]], so its first scored token is predicted from the last context token and
the native modes equal one full forward over context + continuation. Rows are right-padded; causal
attention keeps every real token from seeing the padding after it, so no attention mask is needed, and
the padding is masked out of the sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache, PreTrainedModel

from src.apply import KVTransfer
from src.forward import prefill
from src.models import Pair
from src.runtime.plan import NO_LEVERS, Levers
from src.runtime.splice import spliced_cache

MODES = ("native_source", "native_target", "transfer")


def check_mode(mode: str, pair: Pair, transfer: KVTransfer | None) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "transfer" and (
        transfer is None or transfer.source is not pair.source or transfer.target is not pair.target
    ):
        raise ValueError("mode 'transfer' needs a KVTransfer built on this pair's source and target models")


def reading_model(mode: str, pair: Pair) -> PreTrainedModel:
    """The model that reads the continuations: the source in `native_source`, else the target."""
    return pair.source if mode == "native_source" else pair.target


@torch.no_grad()
def context_cache(
    mode: str,
    pair: Pair,
    context_ids: torch.Tensor,
    transfer: KVTransfer | None = None,
    levers: Levers = NO_LEVERS,
) -> DynamicCache:
    """The reading model's cache of context_ids[:-1] (context_ids [T_c]): the one prefill (+ map) per context.

    In `transfer` mode the levers' tokens and layers are computed natively on the target (`spliced_cache`),
    clipped to the prefix (`Levers.clipped`). A one-token context leaves
    nothing to prefill or transfer: the cache is empty and the reading model reads that token itself. A
    source cache the transfer refuses raises `TransferError` (no silent rollback).
    """
    check_mode(mode, pair, transfer)
    if context_ids.numel() == 0:
        raise ValueError("the context must hold at least one token (lm-eval puts BOS/EOS in an empty one)")
    prefix = context_ids[None, :-1]  # [1, T_c − 1]
    if prefix.shape[1] == 0:
        return DynamicCache(config=reading_model(mode, pair).config)
    if mode == "transfer":
        clipped = levers.clipped(prefix.shape[1])
        source_cache = prefill(pair.source, prefix)
        return (
            spliced_cache(
                transfer, source_cache, prefix, clipped, query_ids=context_ids[None, -1:]
            )  # the token read on top
            if clipped
            else transfer(source_cache, input_ids=prefix)
        )
    return prefill(reading_model(mode, pair), prefix)


@torch.no_grad()
def score_continuations(
    model: PreTrainedModel, cache: DynamicCache, last_id: int, continuations: list[torch.Tensor]
) -> list[tuple[float, bool]]:
    """(sum log p, is greedy) of each continuation [L_i] after a cache of the context minus its last token
    `last_id`, all continuations in one forward. Consumes the cache (expanded along batch, then extended)."""
    if not continuations or any(c.numel() == 0 for c in continuations):
        raise ValueError("score at least one continuation, each of at least one token")
    device = next(model.parameters()).device
    lengths = torch.tensor([c.numel() for c in continuations], device=device)  # [N]
    targets = pad_sequence([c.to(device) for c in continuations], batch_first=True)  # [N, L], right-padded with 0
    first = torch.full((len(continuations), 1), last_id, dtype=targets.dtype, device=device)  # [N, 1]
    inputs = torch.cat([first, targets[:, :-1]], dim=1)  # [N, L]
    cache.batch_repeat_interleave(len(continuations))
    logits = model(inputs, past_key_values=cache, use_cache=True).logits  # [N, L, V]
    logprobs = logits.float().log_softmax(-1)  # [N, L, V]
    valid = torch.arange(targets.shape[1], device=device) < lengths[:, None]  # [N, L]
    token_logprobs = logprobs.gather(-1, targets[..., None]).squeeze(-1).masked_fill(~valid, 0.0)  # [N, L]
    greedy = ((logprobs.argmax(-1) == targets) | ~valid).all(-1)  # [N]
    return list(zip(token_logprobs.sum(-1).tolist(), greedy.tolist(), strict=True))


def choice_loglikelihoods(
    mode: str,
    pair: Pair,
    context_ids: torch.Tensor,
    continuations: list[torch.Tensor],
    transfer: KVTransfer | None = None,
    levers: Levers = NO_LEVERS,
) -> list[tuple[float, bool]]:
    """(sum log p, is greedy) of each continuation [L_i] given context_ids [T_c]; one prefill (+ map) in all."""
    cache = context_cache(mode, pair, context_ids, transfer, levers)
    return score_continuations(reading_model(mode, pair), cache, int(context_ids[-1]), continuations)


def shared_continuation_loglikelihoods(
    mode: str,
    pair: Pair,
    contexts: list[torch.Tensor],
    continuation: torch.Tensor,
    transfer: KVTransfer | None = None,
) -> list[tuple[float, bool]]:
    """(sum log p, is greedy) of one continuation [L] after each context [T_c,i] (WinoGrande: the options
    differ in the context); one prefill (+ map) per context."""
    return [choice_loglikelihoods(mode, pair, context, [continuation], transfer)[0] for context in contexts]


@torch.no_grad()
def greedy_decode(
    model: PreTrainedModel,
    cache: DynamicCache,
    last_id: int,
    max_new_tokens: int,
    stop: Callable[[list[int]], bool],
) -> list[int]:
    """Greedy tokens after a cache of the prompt minus its last token `last_id`, until `stop(tokens)` holds
    or max_new_tokens are out. Consumes the cache."""
    device = next(model.parameters()).device
    tokens: list[int] = []
    next_id = last_id
    while len(tokens) < max_new_tokens:
        step = model(torch.tensor([[next_id]], device=device), past_key_values=cache, use_cache=True)
        next_id = int(step.logits[0, -1].argmax())  # logits [1, 1, V]
        tokens.append(next_id)
        if stop(tokens):
            break
    return tokens
