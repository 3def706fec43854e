"""The handoff policy around a mapped prefix: which target work stays native (`Levers`: sink, hold-back,
native layers, tokens recomputed in place), how the target's cache is spliced from native and mapped parts,
and deterministic rollback (`handoff`): every refusal becomes the target's own prefill, with the reason.
The router session (src/session.py) composes these per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from src.apply import KVTransfer
from src.forward import check_ids, prefill, prefill_layers
from src.maps import TransferError, cache_layers, dropped_tokens
from src.recompute import RULES, attention_scores, deviation_scores, recompute_in_place, select_tokens


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


@dataclass(frozen=True)
class Levers:
    """Target work kept native around a mapped prefix: the first `native_sink` tokens (exact — their K/V
    depend on those tokens alone, the attention sink), the last `hold_back` tokens (re-prefilled on top of
    the spliced prefix), the first `native_layers` target layers over the whole prefix (a target prefill
    stopped after that layer), and a `recompute` share of the prefix's tokens recomputed in place through
    every layer, chosen by `recompute_rule` (src/recompute.py); the deviation rule compares the first
    `recompute_layers` layers, computed natively over the prefix (and kept: they are exact)."""

    native_sink: int = 0
    hold_back: int = 0
    native_layers: int = 0
    recompute: float = 0.0
    recompute_rule: str = "deviation"
    recompute_layers: int = 1

    def __post_init__(self) -> None:
        if min(self.native_sink, self.hold_back, self.native_layers) < 0:
            raise ValueError(f"levers must be ≥ 0, got {self}")
        if not 0.0 <= self.recompute <= 1.0:
            raise ValueError(f"recompute is a share of the prefix in [0, 1], got {self.recompute}")
        if self.recompute_rule not in RULES:
            raise ValueError(f"recompute_rule must be one of {RULES}, not {self.recompute_rule!r}")
        if self.recompute_layers < 1:
            raise ValueError(f"recompute_layers must be ≥ 1, got {self.recompute_layers}")

    def clipped(self, prefix_len: int) -> Levers:
        """The levers a prefix of `prefix_len` tokens can take: the sink first, then the hold-back."""
        sink = min(self.native_sink, prefix_len)
        return replace(self, native_sink=sink, hold_back=min(self.hold_back, prefix_len - sink))

    def recomputed(self, prefix_len: int) -> int:
        """Mapped tokens recomputed in place: round(recompute · prefix_len), at most the mapped span."""
        c = self.clipped(prefix_len)
        return min(int(self.recompute * prefix_len + 0.5), prefix_len - c.native_sink - c.hold_back)

    def native_depth(self, prefix_len: int) -> int:
        """Leading target layers prefilled natively over the prefix: `native_layers`, or the deviation rule's
        `recompute_layers` when it runs."""
        deviation = self.recompute_rule == "deviation" and self.recomputed(prefix_len) > 0
        return max(self.native_layers, self.recompute_layers if deviation else 0)

    def prefill_fraction(self, prefix_len: int, num_layers: int, query_len: int = 0) -> float:
        """Share of the target's prefill compute (layer × token work) spent on a prefix of `prefix_len` tokens:
        sink and hold-back tokens in full, the mapped span in its native layers (`native_depth`), each
        recomputed token once more in full, and the attention rule's query pass (hold-back tokens and the
        `query_len` new-turn tokens, read once more to choose) in full."""
        if not prefix_len:
            return 1.0
        c = self.clipped(prefix_len)
        mapped = prefix_len - c.native_sink - c.hold_back
        recomputed = self.recomputed(prefix_len)
        layers = min(self.native_depth(prefix_len), num_layers) / num_layers
        queries = c.hold_back + query_len if self.recompute_rule == "attention" and recomputed else 0
        return (c.native_sink + c.hold_back + mapped * layers + recomputed + queries) / prefix_len

    def __bool__(self) -> bool:
        return bool(self.native_sink or self.hold_back or self.native_layers or self.recompute)


NO_LEVERS = Levers()  # pure transfer: every prefix token mapped


def spent(transfer: KVTransfer, levers: Levers) -> Levers:
    """The target work of a handoff with these levers: a token-feature mapper also prefills layer 0."""
    return replace(levers, native_layers=max(levers.native_layers, 1)) if transfer.token_features else levers


@torch.no_grad()
def spliced_cache(
    transfer: KVTransfer,
    source_cache,
    input_ids: torch.Tensor,
    levers: Levers,
    query_ids: torch.Tensor | None = None,
) -> DynamicCache:
    """Target cache for input_ids [B, T] that spends only the levers' target prefill (`Levers`).

    Tokens 0..s−1 are prefilled natively on the target; tokens s..T−w−1 are mapped from the source cache at
    their own positions, except in the first `native_depth` layers, which a stopped target prefill of
    0..T−w−1 fills; `recomputed` of the mapped tokens are then recomputed in place through every layer
    (src/recompute.py); the last w tokens are re-prefilled natively on top of the spliced prefix. The
    attention rule reads the new turn's queries: the hold-back tokens, then `query_ids` [B, Q] (the tokens
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
    if end == 0:
        return prefill(target, input_ids)
    cache = prefill(target, input_ids[:, :sink]) if sink else None
    if end > sink:
        middle = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(source_cache)]
        mapped = transfer(middle, positions=torch.arange(sink, end), input_ids=input_ids[:, sink:end])
        if cache is None:
            cache = mapped
        else:
            for layer, (own, new) in enumerate(zip(cache.layers, mapped.layers, strict=True)):
                cache.layers[layer].keys = torch.cat([own.keys, new.keys], dim=2)
                cache.layers[layer].values = torch.cat([own.values, new.values], dim=2)
        count, rule = levers.recomputed(total), levers.recompute_rule
        if count and rule == "deviation" and transfer.token_features and levers.recompute_layers < 2:
            raise ValueError(
                "a token-feature mapper makes layer 0 exact: the deviation rule needs recompute_layers ≥ 2"
            )
        native_layers = min(levers.native_depth(total), len(target.model.layers))
        if native_layers:
            early = prefill_layers(target, input_ids[:, :end], native_layers)
            if count and rule == "deviation":
                layers = min(levers.recompute_layers, native_layers)
                scores = deviation_scores(early, cache, layers, sink, end)  # [B, end − sink]
            for layer in range(native_layers):
                cache.layers[layer].keys, cache.layers[layer].values = (
                    early.layers[layer].keys,
                    early.layers[layer].values,
                )
        if count:
            if rule == "attention":
                queries = input_ids[:, end:] if query_ids is None else torch.cat([input_ids[:, end:], query_ids], 1)
                if queries.shape[1] == 0:
                    raise ValueError("the attention rule needs the new turn: hold_back > 0 or query_ids")
                scores = attention_scores(target, cache, queries, sink, end)  # [B, end − sink]
            elif rule == "recency":
                scores = torch.arange(end - sink, dtype=torch.float32).expand(input_ids.shape[0], -1)
            recompute_in_place(target, cache, input_ids[:, :end], select_tokens(scores, count, sink))
    if hold:
        target(input_ids[:, end:].to(transfer.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache
