"""The one splice: how a receiver's cache is built from native and mapped parts, used by the router session, offline
scoring, NLL and latency alike — sink read natively → mapped span appended at its own positions → the levers'
native layers → tokens recomputed in place → hold-back (and the new turn) read natively. `check_splice` decides every
refusal before anything is touched. `handoff` is deterministic rollback: every refusal becomes the target's own
prefill, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from src.apply import KVTransfer
from src.forward import check_ids, prefill, prefill_layers
from src.maps import TransferError, cache_layers, dropped_tokens
from src.runtime.levers import Levers
from src.runtime.recompute import attention_scores, deviation_scores, recompute_in_place, select_tokens


@dataclass
class Handoff:
    cache: DynamicCache
    mode: str  # "transfer" or "prefill"
    reason: str | None  # why the transfer was refused (mode == "prefill")


def handoff(transfer: KVTransfer, source_cache, input_ids: torch.Tensor) -> Handoff:
    """Mapped cache when the transfer is safe, else — deterministically — the target's own prefill. Ids the target
    cannot read are refused by the transfer and then a ValueError from the fallback's prefill (`forward.check_ids`):
    no path could serve them."""
    try:
        return Handoff(cache=transfer(source_cache, input_ids=input_ids), mode="transfer", reason=None)
    except TransferError as refusal:
        return Handoff(cache=prefill(transfer.target, input_ids), mode="prefill", reason=str(refusal))


def check_splice(levers: Levers, token_features: bool, prefix_len: int, queries: int) -> None:
    """A ValueError for a lever setting the splice cannot run — raised before the receiver's cache is touched.
    levers: on the span (its sink and hold-back already realized); prefix_len: tokens the shares refer to; queries:
    the attention rule's query tokens (hold-back + new turn)."""
    count, rule = levers.recomputed(prefix_len), levers.recompute_rule
    if count and rule == "deviation" and token_features and levers.recompute_layers < 2:
        raise ValueError("a token-feature mapper makes layer 0 exact: the deviation rule needs recompute_layers ≥ 2")
    if count and rule == "attention" and queries == 0:
        raise ValueError("the attention rule needs the new turn: hold_back > 0 or a turn")


@torch.no_grad()
def splice(
    target: PreTrainedModel,
    cache: DynamicCache,
    ids: torch.Tensor,
    start: int,
    mapped: Sequence[DynamicCache],
    levers: Levers,
    prefix_len: int,
    token_features: bool,
    tail: torch.Tensor,
    queries: torch.Tensor,
    read: Callable[[torch.Tensor, str], None],
) -> int:
    """Build the receiver's cache over ids [B, end] and read `tail` [B, n] on top; returns the tokens recomputed.

    cache holds the tokens 0..held−1 natively (held ≤ start); `read(x, part)` makes the receiver read ids x [B, n]
    natively on it, `part` "sink" or "tail" (the session keeps its provenance, logits and costs there). The tokens held..start−1 (the sink) are read natively,
    `mapped` (caches of consecutive pieces of start..end−1, at their own positions) appended, then the levers
    (on the span, shares of `prefix_len` tokens): the first `native_depth` target layers over 0..end−1 from a stopped
    native prefill (kept for the mapped slots: they are exact), `recomputed` mapped tokens recomputed in place through
    every layer (chosen by the rule; the attention rule reads `queries` [B, Q]), then `tail` read natively."""
    check_splice(levers, token_features, prefix_len, queries.shape[1])
    held, end = cache.get_seq_length(), ids.shape[1]
    if start > held:
        read(ids[:, held:start], "sink")
    for piece in mapped:
        for layer, (keys, values) in enumerate(cache_layers(piece)):
            cache.update(keys, values, layer)  # appended at the piece's slots
    if cache.get_seq_length() != end:
        raise ValueError(f"the spliced cache holds {cache.get_seq_length()} tokens, the prefix {end}")
    count, rule = levers.recomputed(prefix_len), levers.recompute_rule
    depth = min(levers.native_depth(prefix_len), len(target.model.layers))
    if depth:  # the target's own first layers over 0..end−1 (exact), kept for the mapped slots
        early = prefill_layers(target, ids, depth)
        if count and rule == "deviation":
            scores = deviation_scores(early, cache, min(levers.recompute_layers, depth), start, end)  # [B, end − start]
        for layer in range(depth):
            own, new = cache.layers[layer], early.layers[layer]
            own.keys[:, :, start:end], own.values[:, :, start:end] = (
                new.keys[:, :, start:end],
                new.values[:, :, start:end],
            )
    if count:
        if rule == "attention":
            scores = attention_scores(target, cache, queries, start, end)  # [B, end − start]
        elif rule == "recency":
            scores = torch.arange(end - start, dtype=torch.float32).expand(ids.shape[0], -1)  # [B, end − start]
        recompute_in_place(target, cache, ids, select_tokens(scores, count, start))
    if tail.shape[1]:
        read(tail, "tail")
    return count


@torch.no_grad()
def spliced_cache(
    transfer: KVTransfer,
    source_cache,
    input_ids: torch.Tensor,
    levers: Levers,
    query_ids: torch.Tensor | None = None,
) -> DynamicCache:
    """Target cache for input_ids [B, T] that spends only the levers' target prefill (`Levers`), through `splice`:
    tokens 0..s−1 native, s..T−w−1 mapped from the source cache at their own positions (then the levers), the last w
    re-prefilled natively on top. The attention rule reads the hold-back tokens, then `query_ids` [B, Q] (the tokens
    that follow input_ids)."""
    check_ids(transfer.target, input_ids)
    if dropped := dropped_tokens(source_cache):  # its index i holds position dropped + i: slices would misplace
        raise TransferError(
            f"the source cache has dropped its first {dropped} tokens (sliding window): splicing needs the whole prefix"
        )
    total, sink, hold = input_ids.shape[1], levers.native_sink, levers.hold_back
    if sink + hold > total:
        raise ValueError(f"native_sink={sink} + hold_back={hold} must fit in {total} tokens")
    end = total - hold
    target = transfer.target
    if end <= sink:
        return prefill(target, input_ids)
    queries = input_ids[:, end:] if query_ids is None else torch.cat([input_ids[:, end:], query_ids.to(input_ids)], 1)
    check_splice(levers, transfer.token_features, total, queries.shape[1])
    middle = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(source_cache)]
    mapped = transfer(middle, positions=torch.arange(sink, end), input_ids=input_ids[:, sink:end])
    cache = DynamicCache(config=target.config)
    read = lambda x, _: target(x.to(transfer.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    splice(target, cache, input_ids[:, :end], sink, [mapped], levers, total, transfer.token_features,
           input_ids[:, end:], queries, read)  # fmt: skip
    return cache
