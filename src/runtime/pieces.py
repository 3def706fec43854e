"""The unseen span of a handoff (`Session.switch_to`, src/runtime/session.py), piece by piece: which model covers each
piece — one that holds it with a usable route into the receiver, native segments first, the active model first
(`owners`) — and each piece mapped at its own positions on its route, into a cache or straight into an engine
receiver's slots (`map_pieces`), under the length guard and the magnitude guard (`Policy`, src/runtime/routing.py).
"""

from __future__ import annotations

import torch

from src.maps import MapFlags, TransferError, cache_layers, layer_flags
from src.runtime.reader import Reader
from src.runtime.receivers import Piece
from src.runtime.routing import Policy, Route, length_refusal


def owners(
    readers: dict[str, Reader],
    routes: dict[tuple[str, str], Route],
    active: str | None,
    receiver: str,
    start: int,
    end: int,
) -> list[tuple[int, int, str]] | str:
    """Pieces (start, end, sender) of tokens start..end−1, each from a model with a usable route to the receiver
    that holds it — native first, the active model first — or the reason there is none."""
    candidates = [
        name
        for name in sorted(readers, key=lambda n: n != active)
        if name != receiver and (name, receiver) in routes and routes[(name, receiver)].refusal is None
    ]
    if not candidates:
        refused = [f"route {s} → {t}: {r.refusal}" for (s, t), r in routes.items() if t == receiver and r.refusal]
        return refused[0] if refused else f"no mapper route into {receiver!r}"
    cuts = sorted(
        {start, end}
        | {
            edge
            for name in candidates
            for s in readers[name].segments
            for edge in (s.start, s.end)
            if start < edge < end
        }
    )
    pieces: list[tuple[int, int, str]] = []
    for low, high in zip(cuts[:-1], cuts[1:], strict=True):
        held = [
            (s.origin != "native", rank, name)
            for rank, name in enumerate(candidates)
            for s in readers[name].segments
            if s.start <= low and high <= s.end
        ]
        if not held:
            return f"no model with a route into {receiver!r} holds tokens {low}..{high - 1}"
        owner = min(held)[2]
        if pieces and pieces[-1][2] == owner:
            pieces[-1] = (pieces[-1][0], high, owner)
        else:
            pieces.append((low, high, owner))
    return pieces


def map_pieces(
    readers: dict[str, Reader],
    routes: dict[tuple[str, str], Route],
    policy: Policy,
    conversation: torch.Tensor,
    receiver: str,
    pieces: list[tuple[int, int, str]],
) -> tuple[list[Piece], int]:
    """Each piece of `conversation` [T] mapped at its own positions — its K/V, or on an engine receiver straight into
    the slots past what it holds (no host sync: `Engine.map_span`) — and the bytes read. What the host sees (the
    length guard, shapes, ids, on a DynamicCache receiver every flag) raises TransferError now, nothing changed; on an
    engine, non-finite values and the magnitude guard (`Policy.guard_max_abs`) stay device flags in the `Piece`,
    decided by the splice (after the tail's launches, or before a recompute's choice)."""
    mapped, read, bound = [], 0, policy.guard_max_abs
    for start, end, sender in pieces:
        route = routes[(sender, receiver)]
        if refusal := length_refusal(policy, route, conversation.numel(), end):
            raise TransferError(refusal)
        layers = readers[sender].layers(start, end)  # [(K, V) [1, H_kv, n, d]]
        read += sum(t.numel() * t.element_size() for pair in layers for t in pair)
        positions, ids = torch.arange(start, end), conversation[None, start:end]
        engine = readers[receiver].engine
        if engine is None:
            cache = cache_layers(route.transfer(layers, positions=positions, input_ids=ids))  # checked finite
            nonfinite, peak = layer_flags(cache)  # [L_t, 2], [L_t]
            beyond = peak > (float("inf") if bound is None else bound)  # [L_t]
            flags = MapFlags(nonfinite[:0], nonfinite.any(1), beyond, bound)
        else:  # a replay of the span bucket's CUDA graph on a graph engine, else `KVTransfer.into`
            cache, flags = None, engine.map_span(route.transfer, layers, start, end, ids, bound)
        mapped.append(Piece(start, end, cache, flags))
    return mapped, read
