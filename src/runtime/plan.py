"""What a handoff keeps native, and the splice that carries it out decided once. The `Levers` a user sets — the target
work kept native around a mapped span: sink, hold-back, native layers, tokens recomputed in place, a set that shrinks
with depth — and their cost as a share of the receiver's prefill (`Levers.prefill_fraction`). Per handoff, a frozen
`SplicePlan` (which tokens are read natively, which are mapped, the native depth, the recomputed set and its size per
layer) built by `plan_splice` from the levers and the receiver's `Capabilities`, after `check_splice` — every refusal
raised before the map runs and before the receiver is touched.
The one splice (src/runtime/splice.py) then only carries it out, and hands the static engine its recomputed set as a
`Recompute` (fused recompute: the mapped tokens a forward reads again first, with the tail; src/runtime/engine.py
checks it with `check_recompute` before any slot is written).

A fused recompute may also shrink with depth or start at a layer (`Recompute`, CacheBlend's progressive selection and
the turn rule, src/runtime/splice.py): the forward starts at layer `start` from given hidden states, and after a layer
where the set shrinks keeps only the set rows `keep` picks (from the K/V the layer wrote over the mapped ones) and
every tail row. Such a forward runs eagerly: its per-layer row counts are fixed by (R, progressive, depth) and the
pick is fixed-shape (top-k, gathers), so a graph per count tuple and tail bucket could be captured — but R = round(r·T)
changes with every history length (one capture per length unless the set is padded to buckets with pad rows that never
win the pick), and the turn rule's hidden-state input would need a static buffer of its own.
A pick that `keep` gets wrong — not the rows of its set, distinct and ascending — is clamped into the set for the
forward and flagged on the device (`picked`); the forward reads the flag once at its end, puts the set's held slots
back and raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from numbers import Integral, Real

import torch

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


@dataclass(frozen=True)
class Capabilities:
    """What a receiver (src/runtime/receivers.py) can run during a splice, as data the plan is checked against.

    forward: it runs the target's forward itself — the sink read, the native layers, the recompute and the tail; a
    receiver without one (vLLM's paged blocks inside a load hook) only takes mapped spans, and its own engine reads
    the tail afterwards. rules: the recompute rules it selects with (src/runtime/recompute.py RULES). progressive: a
    recomputed set that shrinks with depth. name: how refusals name it."""

    name: str
    forward: bool = True
    rules: frozenset[str] = frozenset(RULES)
    progressive: bool = False


@dataclass(frozen=True)
class SplicePlan:
    """One handoff's splice over conversation positions (module docstring).

    0..held − 1 the receiver holds already; held..start − 1 (the sink) it reads natively; start..end − 1 are mapped
    (written into its slots); end..end + tail − 1 — the hold-back, then the new turn — it reads natively on top. The
    first `depth` target layers over 0..end − 1 come from a stopped native prefill (kept for the mapped slots: exact;
    the deviation rule compares the first `compared` of them with the mapped K/V). `recomputed` mapped tokens, chosen
    by `rule`, are read again with the tail through layers first..L − 1 (`first`: the native depth for the turn rule,
    whose stopped prefill reads the tail too; else 0), sizes[i] rows of them in layer first + i (`progressive`: the
    set shrinks with depth)."""

    held: int
    start: int
    end: int
    hold_back: int
    tail: int
    depth: int
    compared: int
    recomputed: int
    rule: str
    first: int
    sizes: tuple[int, ...]
    progressive: bool

    @property
    def native_end(self) -> int:
        """The stopped native prefill reads 0..native_end − 1: the prefix, and the tail for the turn rule."""
        return self.end + self.tail if self.rule == "turn" and self.recomputed else self.end


def check_splice(levers: Levers, token_features: bool, prefix_len: int, queries: int, receiver: Capabilities) -> None:
    """A ValueError for a lever setting the splice cannot run on this receiver — raised before anything is touched.
    levers: on the span (its sink and hold-back already realized); prefix_len: tokens the shares refer to; queries:
    the attention and turn rules' query tokens (hold-back + new turn)."""
    count, rule = levers.recomputed(prefix_len), levers.recompute_rule
    if not receiver.forward and (levers.native_sink or levers.native_depth(prefix_len) or count):
        raise ValueError(
            f"{receiver.name} cannot run the target's forward inside the splice: a native sink past "
            "what it holds, native layers and recompute are refused (its engine reads the hold-back)"
        )
    if count and (rule == "turn" and rule not in receiver.rules or levers.progressive < 1 and not receiver.progressive):
        raise ValueError(
            "progressive selection / the turn rule are built on the static engine (src/runtime/"
            f"engine.py), not on {receiver.name}: splice onto an Engine, or use progressive=1 and another "
            "rule"
        )
    if count and rule not in receiver.rules:
        raise ValueError(f"the {rule} rule is not built on {receiver.name} (its selection pass): use deviation")
    if count and rule == "deviation" and token_features and levers.recompute_layers < 2:
        raise ValueError("a token-feature mapper makes layer 0 exact: the deviation rule needs recompute_layers ≥ 2")
    if count and rule in ("attention", "turn") and queries == 0:
        raise ValueError(f"the {rule} rule needs the new turn: hold_back > 0 or a turn")
    if count and levers.progressive < 1 and queries == 0:
        raise ValueError(
            "progressive selection reads the turn's logits past the shrinking set: hold_back > 0 or a turn"
        )


def plan_splice(
    levers: Levers,
    held: int,
    prefix_len: int,
    turn: int,
    layers: int,
    token_features: bool,
    receiver: Capabilities,
    queries: int | None = None,
) -> SplicePlan:
    """The plan of a receiver holding `held` tokens that is given the next `prefix_len` conversation tokens and then a
    new turn of `turn` tokens, with the levers on those `prefix_len` tokens (their sink and hold-back clipped to them;
    shares of them) over a target of `layers` layers — after `check_splice`. queries: the attention rule's query
    tokens, when more than the tail (offline scoring reads the tokens after the prefix too)."""
    span = levers.clipped(prefix_len)
    tail = span.hold_back + turn
    check_splice(span, token_features, prefix_len, tail if queries is None else queries, receiver)
    count, rule = span.recomputed(prefix_len), span.recompute_rule
    depth = min(span.native_depth(prefix_len), layers)
    first = depth if count and rule == "turn" else 0
    return SplicePlan(
        held=held,
        start=held + span.native_sink,
        end=held + prefix_len - span.hold_back,
        hold_back=span.hold_back,
        tail=tail,
        depth=depth,
        compared=min(span.recompute_layers, depth) if count and rule == "deviation" else 0,
        recomputed=count,
        rule=rule,
        first=first,
        sizes=span.layer_sizes(prefix_len, layers)[first:] if count else (),
        progressive=count > 0 and span.progressive < 1,
    )


KV = tuple[torch.Tensor, torch.Tensor]  # one layer's (keys, values) of some slots: [H_kv, s, d] each


@dataclass(frozen=True)
class Recompute:
    """Mapped tokens a forward reads again, first, with the tail (fused recompute; `Engine.forward`).

    positions [R]: their slots, ascending. start: the first layer the forward runs — the layers below hold native K/V
    in every slot it reads — and hidden [R + N, hidden]: each row's hidden state entering it (None: the embeddings,
    start 0). sizes: the set's rows in layers start..L − 1 (sizes[0] = R, non-increasing; () keeps all R). After a
    layer whose next size is smaller, keep(mapped, fresh, size) gets the set's K/V in its slots before (mapped)
    and after (fresh) the layer wrote them and returns the `size` set rows that go on (ascending indices into 0..s − 1);
    the others keep their fresh K/V up to that layer and the mapped K/V above. Every tail row runs every layer run."""

    positions: torch.Tensor
    start: int = 0
    hidden: torch.Tensor | None = None
    sizes: tuple[int, ...] = ()
    keep: Callable[[KV, KV, int], torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        """Every row through every layer from the embeddings: the forward a graph replays."""
        return self.start == 0 and self.hidden is None and all(size == self.sizes[0] for size in self.sizes)


def check_recompute(plan: Recompute, positions: torch.Tensor, rows: torch.Tensor | None, layers: int) -> None:
    """A ValueError for a `Recompute` the forward of host positions [T] over `layers` layers cannot run, before any
    slot is written."""
    size = plan.positions.numel()
    sizes = plan.sizes or (size,) * (layers - plan.start)
    if rows is not None or size >= positions.numel():
        raise ValueError("a recompute that starts at a layer or shrinks returns the last tail row's logits: "
                         f"rows must be None and a tail must follow the {size} recomputed rows")  # fmt: skip
    if not torch.equal(positions[:size], plan.positions.reshape(-1).cpu()):
        raise ValueError("the forward's first positions must be the recompute set's")
    if not 0 <= plan.start <= layers or len(sizes) != layers - plan.start or (sizes and sizes[0] != size):
        raise ValueError(f"recompute sizes {sizes} must give the set's rows in layers {plan.start}..{layers - 1}, "
                         f"starting at its {size} rows")  # fmt: skip
    if any(b > a for a, b in zip(sizes, sizes[1:], strict=False)) or (plan.keep is None and len(set(sizes)) > 1):
        raise ValueError(f"recompute sizes {sizes} must not grow, and shrinking needs `keep`")
    if (plan.start > 0) != (plan.hidden is not None) or (
        plan.hidden is not None and plan.hidden.shape[0] != positions.numel()
    ):
        raise ValueError("a recompute that starts past layer 0 needs the hidden states of every row, and only it")


def picked(pick: object, kept: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [kept] a `Recompute.keep` picked, clamped into 0..size − 1 so that no gather leaves the set, and a
    device flag [] set when they were not `kept` distinct ascending indices in range (read once, after the
    forward); a ValueError at once for what the host sees (not a [kept] integer tensor)."""
    if not isinstance(pick, torch.Tensor) or pick.dtype.is_floating_point or pick.dtype == torch.bool:
        raise ValueError(f"a recompute's `keep` must return integer row indices, not {pick!r:.60}")
    if tuple(pick.shape) != (kept,):
        raise ValueError(f"a recompute's `keep` must return [{kept}] rows, got shape {tuple(pick.shape)}")
    pick = pick.to(device, torch.long)  # [kept]
    bad = ((pick < 0) | (pick >= size)).any() | (pick[1:] <= pick[:-1]).any()  # []
    return pick.clamp(0, size - 1), bad
