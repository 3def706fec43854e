"""The target work a handoff keeps native around a mapped span (`Levers`: sink, hold-back, native layers, tokens
recomputed in place, a set that shrinks with depth) and what it costs, as a share of the receiver's prefill
(`Levers.prefill_fraction`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    `recompute_layers` layers, computed natively over the prefix (and kept: they are exact), the turn rule
    reads the new turn's attention at the last of them (a stopped prefill over prefix + turn) and recomputes
    from there on. `progressive` (static engine) shrinks the set with depth, CacheBlend-style: past the
    native layers, only the `progressive` share of a layer's set that deviates most there goes on to the
    next layer (`layer_sizes`); 1 keeps every recomputed token through every layer."""

    native_sink: int = 0
    hold_back: int = 0
    native_layers: int = 0
    recompute: float = 0.0
    recompute_rule: str = "deviation"
    recompute_layers: int = 1
    progressive: float = 1.0

    def __post_init__(self) -> None:
        for name in ("native_sink", "hold_back", "native_layers", "recompute_layers"):
            object.__setattr__(self, name, count(name, getattr(self, name), 1 if name == "recompute_layers" else 0))
        object.__setattr__(self, "recompute", share("recompute", self.recompute))
        kept = share("progressive", self.progressive, "a layer's recomputed set kept into the next", positive=True)
        object.__setattr__(self, "progressive", kept)
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
        """Leading target layers prefilled natively over the prefix: `native_layers`, or the deviation or turn
        rule's `recompute_layers` when it runs."""
        compared = self.recompute_rule in ("deviation", "turn") and self.recomputed(prefix_len) > 0
        return max(self.native_layers, self.recompute_layers if compared else 0)

    def layer_sizes(self, prefix_len: int, num_layers: int) -> tuple[int, ...]:
        """Mapped tokens each of the `num_layers` target layers recomputes in the fused forward (|S_ℓ|): none
        below the native depth for the turn rule (its forward starts there), the whole set R below it for the
        others (their forward starts at the embeddings), then `shrinking` from R."""
        count, depth = self.recomputed(prefix_len), min(self.native_depth(prefix_len), num_layers)
        below = 0 if self.recompute_rule == "turn" else count
        return (below,) * depth + shrinking(count, self.progressive, num_layers - depth)

    def prefill_fraction(self, prefix_len: int, num_layers: int, query_len: int = 0) -> float:
        """Share of the target's prefill compute (layer × token work) spent on a prefix of `prefix_len` tokens
        (`prefill_share`): sink and hold-back tokens in full, the mapped span in its native layers
        (`native_depth`), each layer's recomputed tokens (`layer_sizes`), and the attention rule's query pass
        (hold-back tokens and the `query_len` new-turn tokens, read once more to choose) in full."""
        if not prefix_len:
            return 1.0
        c = self.clipped(prefix_len)
        mapped = prefix_len - c.native_sink - c.hold_back
        recomputed = self.recomputed(prefix_len)
        depth = min(self.native_depth(prefix_len), num_layers)
        queries = c.hold_back + query_len if self.recompute_rule == "attention" and recomputed else 0
        native = c.native_sink + c.hold_back + queries
        return prefill_share(native, mapped, depth, self.layer_sizes(prefix_len, num_layers), prefix_len)

    def __bool__(self) -> bool:
        return bool(self.native_sink or self.hold_back or self.native_layers or self.recompute)


def count(name: str, value: object, least: int) -> int:
    """value as an int ≥ least, or a ValueError naming the field (bools, floats and None are not counts)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer ≥ {least}, not {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} must be ≥ {least}, got {value}")
    return int(value)


def share(name: str, value: object, of: str = "the prefix", positive: bool = False) -> float:
    """value as a float in [0, 1] ((0, 1] if positive), or a ValueError naming the field (NaN, bools and None are
    not shares)."""
    number = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)
    if not number or not (0 < value <= 1 if positive else 0 <= value <= 1):
        raise ValueError(f"{name} is a share of {of} in {'(0' if positive else '[0'}, 1], not {value!r}")
    return float(value)


def shrinking(count: int, keep: float, layers: int) -> tuple[int, ...]:
    """Sizes of a recomputed set over `layers` layers that keeps a `keep` share into each next layer:
    |S_0| = count, |S_{i+1}| = ⌊keep · |S_i| + ½⌋ (half up; fixed by the counts alone, so the shapes are)."""
    sizes = []
    for _ in range(layers):
        sizes.append(count)
        count = int(keep * count + 0.5)
    return tuple(sizes)


def prefill_share(native: int, mapped: int, depth: int, sizes: Sequence[int], prefix_len: int) -> float:
    """Layer × token work over a full prefill's L · T, L = len(sizes), T = prefix_len:
    (native · L + mapped · depth + Σ_ℓ |S_ℓ|) / (L · T) — native tokens in every layer, the mapped span in the
    native layers, and the |S_ℓ| = sizes[ℓ] tokens layer ℓ recomputes."""
    layers = len(sizes)
    return (native + (mapped * depth + sum(sizes)) / layers) / prefix_len


NO_LEVERS = Levers()  # pure transfer: every prefix token mapped


def spent(transfer: KVTransfer, levers: Levers) -> Levers:
    """The target work of a handoff with these levers: a token-feature mapper also prefills layer 0."""
    return replace(levers, native_layers=max(levers.native_layers, 1)) if transfer.token_features else levers
