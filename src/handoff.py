"""The handoff policy around a mapped prefix: which target work stays native (`Levers`: sink, hold-back,
native layers), how the target's cache is spliced from native and mapped parts, and deterministic
rollback (`handoff`): every refusal becomes the target's own prefill, with the reason.
The router session (src/session.py) composes these per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from src.apply import KVTransfer
from src.forward import prefill, prefill_layers
from src.maps import TransferError, cache_layers


@dataclass
class Handoff:
    cache: DynamicCache
    mode: str  # "transfer" or "prefill"
    reason: str | None  # why the transfer was refused (mode == "prefill")


def handoff(transfer: KVTransfer, source_cache, input_ids: torch.Tensor) -> Handoff:
    """Mapped cache when the transfer is safe, else — deterministically — the target's own prefill."""
    try:
        return Handoff(cache=transfer(source_cache, input_ids=input_ids), mode="transfer", reason=None)
    except TransferError as refusal:
        return Handoff(cache=prefill(transfer.target, input_ids), mode="prefill", reason=str(refusal))


@dataclass(frozen=True)
class Levers:
    """Target work kept native around a mapped prefix: the first `native_sink` tokens (exact — their K/V
    depend on those tokens alone, the attention sink), the last `hold_back` tokens (re-prefilled on top of
    the spliced prefix), and the first `native_layers` target layers over the whole prefix (a target
    prefill stopped after that layer)."""

    native_sink: int = 0
    hold_back: int = 0
    native_layers: int = 0

    def __post_init__(self) -> None:
        if min(self.native_sink, self.hold_back, self.native_layers) < 0:
            raise ValueError(f"levers must be ≥ 0, got {self}")

    def clipped(self, prefix_len: int) -> Levers:
        """The levers a prefix of `prefix_len` tokens can take: the sink first, then the hold-back."""
        sink = min(self.native_sink, prefix_len)
        return Levers(sink, min(self.hold_back, prefix_len - sink), self.native_layers)

    def prefill_fraction(self, prefix_len: int, num_layers: int) -> float:
        """Share of the target's prefill compute (layer × token work) still spent on a prefix of
        `prefix_len` tokens: sink and hold-back tokens in full, the mapped span in its native layers."""
        c = self.clipped(prefix_len)
        mapped = prefix_len - c.native_sink - c.hold_back
        layers = min(c.native_layers, num_layers) / num_layers
        return (c.native_sink + c.hold_back + mapped * layers) / prefix_len if prefix_len else 1.0

    def __bool__(self) -> bool:
        return bool(self.native_sink or self.hold_back or self.native_layers)


NO_LEVERS = Levers()  # pure transfer: every prefix token mapped


def spent(transfer: KVTransfer, levers: Levers) -> Levers:
    """The target work of a handoff with these levers: a token-feature mapper also prefills layer 0."""
    return replace(levers, native_layers=max(levers.native_layers, 1)) if transfer.token_features else levers


@torch.no_grad()
def spliced_cache(transfer: KVTransfer, source_cache, input_ids: torch.Tensor, levers: Levers) -> DynamicCache:
    """Target cache for input_ids [B, T] that spends only the levers' target prefill (`Levers`).

    Tokens 0..s−1 are prefilled natively on the target; tokens s..T−w−1 are mapped from the source cache at
    their own positions, except in the first `native_layers` layers, which a stopped target prefill of
    0..T−w−1 fills; the last w tokens are re-prefilled natively on top of the spliced prefix."""
    total, sink, hold = input_ids.shape[1], levers.native_sink, levers.hold_back
    if sink + hold > total:
        raise ValueError(f"native_sink={sink} + hold_back={hold} must fit in {total} tokens")
    end = total - hold
    target = transfer.target
    native_layers = min(levers.native_layers, len(target.model.layers))
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
        if native_layers:
            early = prefill_layers(target, input_ids[:, :end], native_layers)
            for layer in range(native_layers):
                cache.layers[layer].keys, cache.layers[layer].values = (
                    early.layers[layer].keys,
                    early.layers[layer].values,
                )
    if hold:
        target(input_ids[:, end:].to(transfer.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache
