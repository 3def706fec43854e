"""Fused recompute on the static engine (src/runtime/engine.py): the mapped tokens a forward reads again first, with
the tail (`Recompute`), checked before any slot is written (`check_recompute`).

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
