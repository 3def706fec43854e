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
from src.runtime.engine import KV, Engine, Recompute
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


def check_splice(levers: Levers, token_features: bool, prefix_len: int, queries: int, static: bool = False) -> None:
    """A ValueError for a lever setting the splice cannot run — raised before the receiver's cache is touched.
    levers: on the span (its sink and hold-back already realized); prefix_len: tokens the shares refer to; queries:
    the attention rule's query tokens (hold-back + new turn); static: the receiver is an `Engine`."""
    count, rule = levers.recomputed(prefix_len), levers.recompute_rule
    if count and rule == "attention" and static:
        raise ValueError("the attention rule is not built on the static engine (its selection pass): use deviation")
    if count and (rule == "turn" or levers.progressive < 1) and not static:
        raise ValueError("progressive selection / the turn rule are built on the static engine (src/runtime/engine.py):"
                         " splice onto an Engine, or use progressive=1 and another rule")  # fmt: skip
    if count and rule == "deviation" and token_features and levers.recompute_layers < 2:
        raise ValueError("a token-feature mapper makes layer 0 exact: the deviation rule needs recompute_layers ≥ 2")
    if count and rule in ("attention", "turn") and queries == 0:
        raise ValueError(f"the {rule} rule needs the new turn: hold_back > 0 or a turn")
    if count and levers.progressive < 1 and queries == 0:
        raise ValueError(
            "progressive selection reads the turn's logits past the shrinking set: hold_back > 0 or a turn"
        )


@torch.no_grad()
def splice(
    target: PreTrainedModel,
    cache: DynamicCache | Engine,
    ids: torch.Tensor,
    start: int,
    mapped: Sequence[DynamicCache],
    levers: Levers,
    prefix_len: int,
    token_features: bool,
    tail: torch.Tensor,
    queries: torch.Tensor,
    read: Callable[..., None],
) -> int:
    """Build the receiver's cache over ids [B, end] and read `tail` [B, n] on top; returns the tokens recomputed.

    cache holds the tokens 0..held−1 natively (held ≤ start); `read(x, part)` makes the receiver read ids x [B, n]
    natively on it, `part` "sink" or "tail" (the session keeps its provenance, logits and costs there). The tokens held..start−1 (the sink) are read natively,
    `mapped` (caches of consecutive pieces of start..end−1, at their own positions) appended, then the levers
    (on the span, shares of `prefix_len` tokens): the first `native_depth` target layers over 0..end−1 from a stopped
    native prefill (kept for the mapped slots: they are exact), `recomputed` mapped tokens recomputed in place through
    every layer (chosen by the rule; the attention rule reads `queries` [B, Q]), then `tail` read natively.

    On an `Engine` (B = 1) the mapped pieces are written into their slots and the recomputed tokens are read in the
    tail's own forward — fused recompute: `read(tail, "tail", recompute)` with the `Recompute` set (its positions [R]
    read first; `_splice_static`)."""
    if isinstance(cache, Engine):
        return _splice_static(cache, ids, start, mapped, levers, prefix_len, token_features, tail, queries, read)
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
            native, spliced = cache_layers(early)[:depth], cache_layers(cache)[:depth]
            scores = deviation_scores(
                native, spliced, min(levers.recompute_layers, depth), start, end
            )  # [B, end − start]
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


def _splice_static(
    engine: Engine,
    ids: torch.Tensor,
    start: int,
    mapped: Sequence[DynamicCache | tuple[int, int]],
    levers: Levers,
    prefix_len: int,
    token_features: bool,
    tail: torch.Tensor,
    queries: torch.Tensor,
    read: Callable[..., None],
) -> int:
    """`splice` on the static engine: the same steps, the recompute fused into the tail's forward (`Recompute`).
    Deviation and recency: the forward starts at the embeddings (the tail has no native layers), the set running the
    layers below the native depth too — exact there, and at progressive 1 the forward a graph replays. Turn: the
    stopped native prefill reads prefix + tail, its tail queries' attention at its last layer picks the set, and the
    forward starts at the native depth from its hidden states (no row redoes a native layer). Progressive < 1: past
    the native depth each layer keeps the set rows that deviate most there (`_deviating`)."""
    check_splice(levers, token_features, prefix_len, queries.shape[1], static=True)
    held, end = engine.length, ids.shape[1]
    if start > held:
        read(ids[:, held:start], "sink")
    low = start
    for piece in mapped:  # a cache to write, or (low, high): slots the map already wrote in place (`KVTransfer.into`)
        if isinstance(piece, tuple):
            low = piece[1]
            engine.commit(low)
            continue
        layers = cache_layers(piece)
        engine.write(torch.stack([k[0] for k, _ in layers]), torch.stack([v[0] for _, v in layers]), low)
        low += layers[0][0].shape[2]
    if engine.length != end:
        raise ValueError(f"the spliced engine holds {engine.length} tokens, the prefix {end}")
    count, rule, layers = levers.recomputed(prefix_len), levers.recompute_rule, engine.keys.shape[0]
    depth = min(levers.native_depth(prefix_len), layers)
    turn = count > 0 and rule == "turn"  # the stopped prefill reads the tail too: its queries choose
    if depth:  # the target's own first layers over 0..end−1 (exact), kept for the mapped slots (and the tail's)
        over = torch.cat([ids[0], tail[0].to(ids)]) if turn else ids[0]  # [end (+ n)]
        native = engine.native_prefix(over, depth, tail.shape[1] if turn else 0)  # keys [depth, H_kv, end (+ n), d]
        if count and rule == "deviation":
            own = [(native.keys[i, None], native.values[i, None]) for i in range(depth)]
            spliced = [(engine.keys[i, None], engine.values[i, None]) for i in range(depth)]
            scores = deviation_scores(own, spliced, min(levers.recompute_layers, depth), start, end)  # [1, S]
        high = over.numel()
        engine.keys[:depth, :, start:high], engine.values[:depth, :, start:high] = (
            native.keys[:, :, start:high],
            native.values[:, :, start:high],
        )
    recompute = None
    if count:
        if rule == "recency":
            scores = torch.arange(end - start, dtype=torch.float32)[None]  # [1, S]
        elif rule == "turn":
            scores = native.mass[None, start:end]  # [1, S]
        positions = select_tokens(scores, count, start)[0].cpu()  # [R]
        first = depth if turn else 0
        hidden = torch.cat([native.hidden[positions], native.hidden[end:]]) if turn else None  # [R + n, hidden]
        sizes = levers.layer_sizes(prefix_len, layers)[first:]
        recompute = Recompute(positions, first, hidden, sizes, _deviating if levers.progressive < 1 else None)
    if tail.shape[1] or recompute is not None:
        read(tail, "tail", recompute)
    return count


def _deviating(mapped: KV, fresh: KV, size: int) -> torch.Tensor:
    """The `size` rows [size] (ascending) of a recomputed set whose fresh K/V at a layer deviate most from the mapped
    K/V they replaced (`deviation_scores` at that layer alone) — progressive selection under every rule, the turn
    rule's too: the layer writes both anyway, so ranking is free, and it measures what recomputing a token changes in
    the cache the turn reads (the turn's attention at that layer would need the probabilities the fused kernel never
    forms)."""
    own, spliced = [(fresh[0][None], fresh[1][None])], [(mapped[0][None], mapped[1][None])]
    return select_tokens(deviation_scores(own, spliced, 1, 0, fresh[0].shape[1]), size, 0)[0]  # [size]


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


@torch.no_grad()
def engine_handoff(
    transfer: KVTransfer, engine: Engine, source_cache, input_ids: torch.Tensor, levers: Levers, turn: torch.Tensor
) -> torch.Tensor:
    """The routed turn on the static engine: the receiver's cache of input_ids [1, T] spliced from the source's
    cache (`splice`, recompute fused into the turn's forward), then the turn [1, N ≥ 1] read; returns the turn's
    last logits [1, V] — what the receiver's first token is chosen from. The engine is emptied first."""
    if input_ids.shape[0] != 1 or turn.shape[0] != 1 or turn.shape[1] == 0:
        raise ValueError(f"engine_handoff reads one conversation and a turn: ids [1, T], turn [1, N ≥ 1], got "
                         f"{tuple(input_ids.shape)} and {tuple(turn.shape)}")  # fmt: skip
    check_ids(transfer.target, input_ids)
    check_ids(transfer.target, turn)
    total, sink, hold = input_ids.shape[1], levers.native_sink, levers.hold_back
    if sink + hold > total:
        raise ValueError(f"native_sink={sink} + hold_back={hold} must fit in {total} tokens")
    end = total - hold
    conversation = torch.cat([input_ids, turn.to(input_ids)], 1)[0].cpu()  # [T + N]
    tail = conversation[None, end:]  # [1, hold + N]
    check_splice(levers, transfer.token_features, total, tail.shape[1], static=True)
    engine.truncate(0)
    logits = []

    def read(ids: torch.Tensor, part: str, recompute: Recompute | None = None) -> None:
        chosen = torch.zeros(0, dtype=torch.long) if recompute is None else recompute.positions  # [R]
        start = engine.length
        positions = torch.cat([chosen, torch.arange(start, start + ids.shape[1])])  # [R + n]
        ids = torch.cat([conversation[chosen], ids[0].cpu()])  # [R + n]
        logits.append(engine.forward(ids, positions, recompute=recompute))

    if end <= sink:
        read(conversation[None], "tail")
        return logits[-1]
    middle = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(source_cache)]
    transfer.into(engine.slots(sink, end), middle, positions=torch.arange(sink, end), input_ids=input_ids[:, sink:end])
    splice(transfer.target, engine, input_ids[:, :end].cpu(), sink, [(sink, end)], levers, total,
           transfer.token_features, tail, tail, read)  # fmt: skip
    return logits[-1]
