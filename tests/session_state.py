"""Everything a router session holds, read through its public surface, and a bitwise comparison of two readings —
for tests that an invalid or failed call leaves a session exactly as it was."""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from src.maps import cache_layers
from src.runtime.session import Session


class State(NamedTuple):
    ids: torch.Tensor
    active: str | None
    logits: torch.Tensor | None
    records: list
    caches: dict  # model → [(K, V)] per layer, or None
    segments: dict  # model → [Segment]


def state(session: Session) -> State:
    names = sorted(session.readers)
    caches = {name: session.cache(name) for name in names}
    logits = session.logits
    return State(  # copies, so that a session handing out its own objects is still caught changing them
        session.ids.clone(),
        session.active,
        None if logits is None else logits.clone(),
        copy.deepcopy(session.records),
        {name: None if cache is None else cache_layers(cache) for name, cache in caches.items()},
        {name: session.segments(name) for name in names},
    )


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() + str((t.dtype, tuple(t.shape))).encode()


def same(a: State, b: State) -> bool:
    """Bit for bit (NaN included): ids, active model, logits, records, every cache layer and segment list."""
    tensors = lambda x: None if x is None else _bits(x)
    caches = lambda s: {
        name: None if layers is None else [(_bits(k), _bits(v)) for k, v in layers] for name, layers in s.caches.items()
    }
    return (
        tensors(a.ids) == tensors(b.ids)
        and a.active == b.active
        and tensors(a.logits) == tensors(b.logits)
        and a.records == b.records
        and caches(a) == caches(b)
        and a.segments == b.segments
    )
