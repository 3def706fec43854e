"""The one splice: how a receiver's cache is built from native and mapped parts, used by the router session, offline
scoring, NLL and latency alike — sink read natively → mapped span written at its own positions → the levers' native
layers → tokens recomputed → hold-back (and the new turn) read natively, the maps' device flags decided before the
logits return (after the tail's launches; before the recomputed set is chosen). It carries
out a `SplicePlan` (src/runtime/plan.py: every refusal decided before anything is touched) on any `Receiver`
(src/runtime/receivers.py: the DynamicCache reference, the static engine). `handoff` is deterministic rollback:
every refusal becomes the target's own prefill, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from src.apply import KVTransfer
from src.forward import check_ids, ids_form_problem, prefill
from src.maps import TransferError, cache_layers, dropped_tokens, map_refusal
from src.runtime.engine import Engine
from src.runtime.plan import KV, Levers, SplicePlan, plan_splice
from src.runtime.receivers import CacheReceiver, EngineReceiver, NativePrefix, Piece, Receiver, Selected
from src.runtime.recompute import deviation_scores, select_tokens


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


@torch.no_grad()
def splice(
    plan: SplicePlan,
    receiver: Receiver,
    ids: torch.Tensor,
    pieces: Sequence[Piece],
    tail: torch.Tensor,
    queries: torch.Tensor,
) -> torch.Tensor | None:
    """Carry out `plan` on `receiver`, which holds the conversation's first plan.held tokens: ids [B, end] the prefix,
    `pieces` the mapped span start..end − 1 (consecutive, at their own positions), tail [B, n] the hold-back and the
    new turn, queries [B, Q] the attention rule's query tokens. Returns the tail's last logits [B, V] (None: no tail
    read). A TransferError — a map's flag set (`map_refusal`) — is raised before the logits are returned: the caller
    rolls the receiver back (its slots past plan.held are then garbage it does not hold). Without a recompute the
    flags are read after the tail's forward is launched (optimistic: on a device receiver its launches overlap the
    map instead of waiting for it; a refused map's tail is discarded with the rollback); with one, before the
    recomputed set is chosen."""
    if receiver.length != plan.held:
        raise ValueError(f"the receiver holds {receiver.length} tokens, the plan {plan.held}")
    if plan.start > plan.held:  # the sink
        receiver.read(ids[:, plan.held : plan.start])
    for piece in pieces:
        receiver.write(piece)
    if receiver.length != plan.end:
        raise ValueError(f"the spliced receiver holds {receiver.length} tokens, the prefix {plan.end}")
    native = scores = None
    if (
        plan.depth
    ):  # the target's own first layers over 0..end − 1 (exact), kept for the mapped slots (turn: the tail's)
        over = torch.cat([ids, tail.to(ids)], 1)[:, : plan.native_end]  # [B, end (+ n)]
        native = receiver.native_prefix(over, plan.depth, plan.tail if plan.first else 0)
        own = receiver.layers(plan.depth)
        if plan.compared:
            scores = deviation_scores(native.layers, own, plan.compared, plan.start, plan.end)  # [B, end − start]
        for (keys, values), (native_keys, native_values) in zip(own, native.layers, strict=True):
            keys[:, :, plan.start : plan.native_end] = native_keys[:, :, plan.start :]
            values[:, :, plan.start : plan.native_end] = native_values[:, :, plan.start :]
    flags = [piece.flags for piece in pieces if piece.flags is not None]
    selected = None
    if plan.recomputed:  # the chosen positions are read on the host: the flags first, so no garbage is chosen from
        if refusal := map_refusal(flags):
            raise TransferError(refusal)
        selected = _selected(plan, receiver, ids, native, scores, queries)
    logits = None
    if receiver.capabilities.forward and (plan.tail or selected is not None):
        logits = receiver.read_tail(tail, selected)  # [B, V]
    if not plan.recomputed and (refusal := map_refusal(flags)):  # the one host read, after the tail's launches:
        raise TransferError(refusal)  # their host time overlaps the map's device time; the caller rolls back
    return logits


def _selected(
    plan: SplicePlan,
    receiver: Receiver,
    ids: torch.Tensor,
    native: NativePrefix | None,
    scores: torch.Tensor | None,
    queries: torch.Tensor,
) -> Selected:
    """The plan's recomputed set, chosen by its rule (src/runtime/recompute.py): deviation (`scores` already), the
    attention of the queries read on top, recency, or the turn's attention at the last native layer."""
    if plan.rule == "attention":
        scores = receiver.attention(queries, plan.start, plan.end)  # [B, S]
    elif plan.rule == "recency":
        scores = torch.arange(plan.end - plan.start, dtype=torch.float32).expand(ids.shape[0], -1)  # [B, S]
    elif plan.rule == "turn":
        scores = native.mass[None, plan.start : plan.end]  # [1, S]
    positions = select_tokens(scores, plan.recomputed, plan.start)  # [B, R]
    hidden = None
    if plan.first:  # the forward starts at the native depth, from the stopped prefill's hidden states
        rows = positions[0].to(native.hidden.device)
        hidden = torch.cat([native.hidden[rows], native.hidden[plan.end :]])  # [R + n, hidden]
    return Selected(positions, ids, plan.first, hidden, plan.sizes, _deviating if plan.progressive else None)


def _deviating(mapped: KV, fresh: KV, size: int) -> torch.Tensor:
    """The `size` rows [size] (ascending) of a recomputed set whose fresh K/V at a layer deviate most from the mapped
    K/V they replaced (`deviation_scores` at that layer alone) — progressive selection under every rule, the turn
    rule's too: the layer writes both anyway, so ranking is free, and it measures what recomputing a token changes in
    the cache the turn reads (the turn's attention at that layer would need the probabilities the fused kernel never
    forms)."""
    own, spliced = [(fresh[0][None], fresh[1][None])], [(mapped[0][None], mapped[1][None])]
    return select_tokens(deviation_scores(own, spliced, 1, 0, fresh[0].shape[1]), size, 0)[0]  # [size]


def _split(levers: Levers, total: int) -> tuple[int, int]:
    """(sink, end) of a prefix of `total` tokens: tokens 0..sink − 1 native, sink..end − 1 mapped; a ValueError when
    the sink and the hold-back do not fit."""
    sink, hold = levers.native_sink, levers.hold_back
    if sink + hold > total:
        raise ValueError(f"native_sink={sink} + hold_back={hold} must fit in {total} tokens")
    return sink, total - hold


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
    total = input_ids.shape[1]
    sink, end = _split(levers, total)
    target = transfer.target
    if end <= sink:
        return prefill(target, input_ids)
    queries = input_ids[:, end:] if query_ids is None else torch.cat([input_ids[:, end:], query_ids.to(input_ids)], 1)
    receiver = CacheReceiver(target, DynamicCache(config=target.config))
    plan = plan_splice(levers, 0, total, 0, len(target.model.layers), transfer.token_features,
                       receiver.capabilities, queries.shape[1])  # fmt: skip
    middle = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(source_cache)]
    piece = receiver.map(transfer, middle, sink, end, input_ids[:, sink:end])
    splice(plan, receiver, input_ids[:, :end], [piece], input_ids[:, end:], queries)
    return receiver.cache


@torch.no_grad()
def engine_handoff(
    transfer: KVTransfer, engine: Engine, source_cache, input_ids: torch.Tensor, levers: Levers, turn: torch.Tensor
) -> torch.Tensor:
    """The routed turn on the static engine: the receiver's cache of input_ids [1, T] spliced from the source's
    cache (`splice`, recompute fused into the turn's forward), then the turn [1, N ≥ 1] read; returns the turn's
    last logits [1, V] — what the receiver's first token is chosen from. The engine is emptied first; the map writes
    its slots with no host sync, and a map refused by its flags raises TransferError before the turn's logits
    return, the engine emptied again. An engine that holds a session's conversation is refused (`Engine.claim`).

    Host reads (each a device sync on a GPU; tests/test_host_reads.py counts them): the ids are checked once, here,
    on one host copy of the conversation — free for a tokenizer's host-side ids, one copy for ids on the device —
    and only that copy is read on (the engine's forwards, a token-feature map; positions are built from ints on the
    host). Pure transfer, a sink, a hold-back, native layers: the maps' flags are the one read of a device value
    (`map_refusal`); a recompute adds the chosen positions (and a shrinking set its pick's range check)."""
    if input_ids.shape[0] != 1 or turn.shape[0] != 1 or turn.shape[1] == 0:
        raise ValueError(f"engine_handoff reads one conversation and a turn: ids [1, T], turn [1, N ≥ 1], got "
                         f"{tuple(input_ids.shape)} and {tuple(turn.shape)}")  # fmt: skip
    for t in (input_ids, turn):  # metadata before the copy: nothing converted (a float turn is not truncated)
        if problem := ids_form_problem(t):
            raise ValueError(problem)
    if engine.owner is not None:
        raise ValueError("this engine holds a session's conversation: engine_handoff would empty it")
    conversation = torch.cat([input_ids, turn.to(input_ids.device)], 1).cpu()  # [1, T + N] the one copy to the host
    check_ids(transfer.target, conversation)  # the ids' one check, of both at once (a host read of a host copy)
    total = input_ids.shape[1]
    sink, end = _split(levers, total)
    receiver = EngineReceiver(engine)
    plan = plan_splice(levers, 0, total, turn.shape[1], engine.keys.shape[0], transfer.token_features,
                       receiver.capabilities)  # fmt: skip
    engine.truncate(0)
    if end <= sink:
        return receiver.read(conversation)
    middle = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(source_cache)]
    span_ids = conversation[:, sink:end] if transfer.token_features else None  # checked above: read only for features
    piece = receiver.map(transfer, middle, sink, end, span_ids)  # one graph replay where the engine has graphs
    tail = conversation[:, end:]  # [1, hold + N]
    try:
        return splice(plan, receiver, conversation[:, :end], [piece], tail, tail)
    except TransferError:
        engine.truncate(0)
        raise
