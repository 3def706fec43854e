"""What the one splice (src/runtime/splice.py) does to a receiver's cache — the `Receiver` protocol — and its two
receivers here: the DynamicCache reference (`CacheReceiver`, Hugging Face's own forward) and the static engine
(`EngineReceiver`, src/runtime/engine.py: slot = position, the recompute fused into the tail's forward). What each
can run is data (`Capabilities`), checked once when the plan is built (src/runtime/plan.py), never by its type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from src.apply import KVTransfer
from src.forward import prefill_layers
from src.maps import MapFlags, TransferError, cache_layers
from src.runtime.engine import Engine
from src.runtime.plan import KV, Capabilities, Recompute
from src.runtime.recompute import RULES, attention_scores, recompute_in_place

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per target layer, each [B, H_kv, n, d]


class Piece(NamedTuple):
    """A mapped span, conversation positions start..end − 1: its K/V per target layer [B, H_kv, end − start, d] to
    write, or None where the map already wrote the receiver's slots in place (`KVTransfer.into`), and the map's
    device flags (None: checked already), decided by the splice (after the tail's launches, or before a recompute's
    choice)."""

    start: int
    end: int
    layers: Layers | None
    flags: MapFlags | None = None


class NativePrefix(NamedTuple):
    """A stopped native prefill over n tokens (`Receiver.native_prefix`)."""

    layers: Layers  # the target's own (keys, values) [B, H_kv, n, d] in each layer below the depth
    hidden: torch.Tensor | None  # [n, hidden] entering the layer at the depth (None: the receiver does not keep it)
    mass: torch.Tensor | None  # [n] the last queries' attention at the last native layer, or None


class Selected(NamedTuple):
    """The mapped tokens the tail's read recomputes first (fused recompute): their slots positions [B, R] (ascending)
    in the prefix ids [B, end]; the first layer the recompute runs and each row's hidden state entering it
    (hidden [R + n, hidden] with the tail's rows, None: the embeddings, first 0); the set's rows per layer from
    there (`Recompute.sizes`) and, where it shrinks, the pick of the rows that go on (`Recompute.keep`)."""

    positions: torch.Tensor
    ids: torch.Tensor
    first: int = 0
    hidden: torch.Tensor | None = None
    sizes: tuple[int, ...] = ()
    keep: Callable[[KV, KV, int], torch.Tensor] | None = None


class Receiver(Protocol):
    """A target's cache that a splice builds, over conversation positions (B conversations, the engine's B = 1).

    read          ids [B, n] read natively on top of what it holds; the last logits [B, V]
    map           a transfer's map of source layers [(K, V) [B, H_s, n, d_s]] at positions start..end − 1 (ids [B, n]
                  of them, or None where the mapper reads none) as a `Piece`: its K/V, or written into its slots in
                  place with its device flags (the engine: eagerly, or one replay of the span's CUDA graph)
    write         a mapped `Piece` into its slots (or the slots the map already wrote, committed)
    native_prefix the target's own K/V over ids [B, n] (positions 0..n − 1) in its first `depth` layers, from a
                  stopped prefill that leaves the cache untouched (and, queries > 0, the last `queries` tokens'
                  attention mass at the last of them)
    layers        its own (keys, values) of its first `depth` layers, [B, H_kv, ≥ end, d] views: the deviation rule
                  reads them, and the splice writes the native K/V into their mapped slots
    attention     the attention mass [B, end − start] that query ids [B, Q], read on top, put on slots start..end − 1
    read_tail     the tail ids [B, n] read natively on top, the `Selected` mapped tokens recomputed first; the last
                  logits [B, V] (None when n = 0)

    A receiver declares in `capabilities` what it cannot run, and a plan that needs it is refused when it is built
    (src/runtime/plan.py `check_splice`), before anything is mapped or touched: a rule outside `rules` (attention
    needs `attention`; turn needs `native_prefix`'s mass and the fused `read_tail`), a shrinking set without
    `progressive`, and without `forward` every operation but `write` — vLLM's paged blocks, written inside the
    connector's load hook, cannot run the target's forward there: no sink read past what it holds (a native prefix hit
    instead), no native layers, no recompute, and its own engine reads the tail after the load. `length` is the
    number of conversation tokens it holds."""

    capabilities: Capabilities

    @property
    def length(self) -> int: ...

    def read(self, ids: torch.Tensor) -> torch.Tensor: ...

    def map(self, transfer: KVTransfer, layers: Layers, start: int, end: int, ids: torch.Tensor | None) -> Piece: ...

    def write(self, piece: Piece) -> None: ...

    def native_prefix(self, ids: torch.Tensor, depth: int, queries: int) -> NativePrefix: ...

    def layers(self, depth: int) -> Layers: ...

    def attention(self, queries: torch.Tensor, start: int, end: int) -> torch.Tensor: ...

    def read_tail(self, tail: torch.Tensor, selected: Selected | None) -> torch.Tensor | None: ...


class CacheReceiver:
    """The DynamicCache reference: Hugging Face's forward on its own cache, the recompute in place
    (src/runtime/recompute.py) before the tail is read."""

    capabilities = Capabilities("a DynamicCache receiver", rules=frozenset(RULES) - {"turn"})

    def __init__(self, model: PreTrainedModel, cache: DynamicCache):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids.to(self.device), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]  # [B, V]

    def map(self, transfer: KVTransfer, layers: Layers, start: int, end: int, ids: torch.Tensor | None) -> Piece:
        mapped = transfer(layers, positions=torch.arange(start, end), input_ids=ids)  # its flags read: checked
        return Piece(start, end, cache_layers(mapped))

    def write(self, piece: Piece) -> None:
        if piece.layers is None:
            raise TransferError("a DynamicCache receiver has no slots a map writes in place: map into a cache")
        for layer, (keys, values) in enumerate(piece.layers):
            self.cache.update(keys, values, layer)  # appended at the piece's slots

    def native_prefix(self, ids: torch.Tensor, depth: int, queries: int) -> NativePrefix:
        return NativePrefix(cache_layers(prefill_layers(self.model, ids, depth))[:depth], None, None)

    def layers(self, depth: int) -> Layers:
        return cache_layers(self.cache)[:depth]

    def attention(self, queries: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return attention_scores(self.model, self.cache, queries, start, end)  # [B, end − start]

    def read_tail(self, tail: torch.Tensor, selected: Selected | None) -> torch.Tensor | None:
        if selected is not None:
            recompute_in_place(self.model, self.cache, selected.ids, selected.positions)
        return self.read(tail) if tail.shape[1] else None


class EngineReceiver:
    """The static engine (B = 1): mapped pieces written into their slots, the recompute fused into the tail's
    forward (`Recompute`), where the turn rule and progressive selection run."""

    capabilities = Capabilities("the static engine", rules=frozenset(RULES) - {"attention"}, progressive=True)

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def length(self) -> int:
        return self.engine.length

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.engine.length
        return self.engine.forward(ids[0].cpu(), torch.arange(start, start + ids.shape[1]))  # [1, V]

    def map(self, transfer: KVTransfer, layers: Layers, start: int, end: int, ids: torch.Tensor | None) -> Piece:
        return Piece(start, end, None, self.engine.map_span(transfer, layers, start, end, ids))  # decided later

    def write(self, piece: Piece) -> None:
        if piece.layers is None:  # the map wrote the slots in place
            self.engine.commit(piece.start, piece.end)
            return
        keys, values = (torch.stack([pair[c][0] for pair in piece.layers]) for c in (0, 1))  # [L, H_kv, T, d]
        self.engine.write(keys, values, piece.start)

    def native_prefix(self, ids: torch.Tensor, depth: int, queries: int) -> NativePrefix:
        native = self.engine.native_prefix(ids[0], depth, queries)  # keys [depth, H_kv, n, d]
        layers = [(native.keys[i, None], native.values[i, None]) for i in range(depth)]
        return NativePrefix(layers, native.hidden, native.mass)

    def layers(self, depth: int) -> Layers:
        return [(self.engine.keys[i, None], self.engine.values[i, None]) for i in range(depth)]  # [1, H_kv, N, d]

    def attention(self, queries: torch.Tensor, start: int, end: int) -> torch.Tensor:
        raise ValueError("the static engine has no attention pass over its cache (the plan refuses the rule)")

    def read_tail(self, tail: torch.Tensor, selected: Selected | None) -> torch.Tensor:
        start, count = self.engine.length, tail.shape[1]
        if selected is None:
            return self.read(tail)
        chosen = selected.positions[0].cpu()  # [R]
        recompute = Recompute(chosen, selected.first, selected.hidden, selected.sizes, selected.keep)
        ids = torch.cat([selected.ids[0].cpu()[chosen], tail[0].cpu()])  # [R + n]
        positions = torch.cat([chosen, torch.arange(start, start + count)])  # [R + n]
        return self.engine.forward(ids, positions, recompute=recompute)  # [1, V]
