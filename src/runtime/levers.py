"""The target work a handoff keeps native around a mapped span (`Levers`: sink, hold-back, native layers, tokens
recomputed in place) and what it costs, as a share of the receiver's prefill (`Levers.prefill_fraction`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from numbers import Integral, Real

from src.apply import KVTransfer
from src.runtime.recompute import RULES


@dataclass(frozen=True)
class Levers:
    """Target work kept native around a mapped prefix: the first `native_sink` tokens (exact — their K/V
    depend on those tokens alone, the attention sink), the last `hold_back` tokens (re-prefilled on top of
    the spliced prefix), the first `native_layers` target layers over the whole prefix (a target prefill
    stopped after that layer), and a `recompute` share of the prefix's tokens recomputed in place through
    every layer, chosen by `recompute_rule` (src/runtime/recompute.py); the deviation rule compares the first
    `recompute_layers` layers, computed natively over the prefix (and kept: they are exact)."""

    native_sink: int = 0
    hold_back: int = 0
    native_layers: int = 0
    recompute: float = 0.0
    recompute_rule: str = "deviation"
    recompute_layers: int = 1

    def __post_init__(self) -> None:
        for name in ("native_sink", "hold_back", "native_layers", "recompute_layers"):
            object.__setattr__(self, name, count(name, getattr(self, name), 1 if name == "recompute_layers" else 0))
        object.__setattr__(self, "recompute", share("recompute", self.recompute))
        if not isinstance(self.recompute_rule, str) or self.recompute_rule not in RULES:
            raise ValueError(f"recompute_rule must be one of {RULES}, not {self.recompute_rule!r}")

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


def count(name: str, value: object, least: int) -> int:
    """value as an int ≥ least, or a ValueError naming the field (bools, floats and None are not counts)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer ≥ {least}, not {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} must be ≥ {least}, got {value}")
    return int(value)


def share(name: str, value: object) -> float:
    """value as a float in [0, 1], or a ValueError naming the field (NaN, bools and None are not shares)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} is a share of the prefix in [0, 1], not {value!r}")
    return float(value)


NO_LEVERS = Levers()  # pure transfer: every prefix token mapped


def spent(transfer: KVTransfer, levers: Levers) -> Levers:
    """The target work of a handoff with these levers: a token-feature mapper also prefills layer 0."""
    return replace(levers, native_layers=max(levers.native_layers, 1)) if transfer.token_features else levers
