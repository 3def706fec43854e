"""What one model of a router session (src/runtime/session.py) holds: its KV cache — a `DynamicCache`, or the static
receiver engine's slots (src/runtime/engine.py: slot = position) — the provenance of each segment of it, and its
next-token logits after the last token it read.

Each cache carries provenance per segment (native, or mapped from model X by mapper id); only the model's own
computation over an exact context (`Segment.exact`) may be served as an exact prefix hit. A reader reads tokens
natively, scores a continuation and crops back, copies itself for a fork, hands out DynamicCache copies (of its
slots, on an engine), and saves and restores its state for the session's all-or-nothing calls.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from src.maps import cache_layers
from src.runtime.engine import Engine
from src.runtime.receivers import CacheReceiver, EngineReceiver, Receiver

# what `Reader.restore` puts back: its cache object, every cache layer's state, segments, logits, engine length
State = tuple[DynamicCache | None, list[dict] | None, list["Segment"], torch.Tensor | None, int | None]


@dataclass(frozen=True)
class Segment:
    """Conversation tokens start..end−1 in one model's cache and where their K/V came from."""

    start: int
    end: int
    origin: str  # "native" (this model read them) or "mapped"
    exact: bool  # the model's own computation over an exact context: servable as a prefix hit
    source: str | None = None  # the model they were mapped from
    mapper: str | None = None  # that route's mapper id


class Score(NamedTuple):
    """One continuation scored by `Session.score`."""

    logprob: float  # sum of log p over its tokens, each given the conversation and the tokens before it
    tokens: int
    greedy: bool  # every token is the model's argmax


def model_device(model: PreTrainedModel) -> torch.device:
    """The device the model's parameters are on."""
    return next(model.parameters()).device


def clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished what it was given (a CUDA sync): every session clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Reader:
    """One model's holding of the conversation: its cache (or engine), segments and logits (module docstring)."""

    model: PreTrainedModel
    cache: DynamicCache | None = None  # None before it read anything, and always on an engine reader
    segments: list[Segment] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [1, V] after the last token it read (valid while it holds the conversation)
    engine: Engine | None = None  # the static engine holding its tokens in slots 0..length − 1 (engine.length)

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def exact(self) -> bool:
        return all(s.exact for s in self.segments)

    def add(self, segment: Segment) -> None:
        """Append a segment, merged into the last one when their provenance is the same."""
        last = self.segments[-1] if self.segments else None
        if last is not None and replace(last, start=segment.start, end=segment.end) == segment:
            self.segments[-1] = replace(last, end=segment.end)
        else:
            self.segments.append(segment)

    def layers(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) [1, H_kv, end − start, d] per layer of tokens start..end − 1: views of the cache or of the slots."""
        if self.engine is not None:
            keys, values = self.engine.keys[:, None, :, start:end], self.engine.values[:, None, :, start:end]
            return list(zip(keys, values, strict=True))
        return [(k[:, :, start:end], v[:, :, start:end]) for k, v in cache_layers(self.cache)]

    def dynamic(self, length: int, live: bool = False) -> DynamicCache | None:
        """Tokens 0..length − 1 as a DynamicCache (None when there are none, or before it read anything): a copy, or
        with `live` the session's own cache — on an engine reader, one whose tensors are views of the slots, so an
        in-place write reaches the engine (cache methods such as `crop` or `update` do not)."""
        if self.engine is None:
            if live or self.cache is None:
                return self.cache
            cache = copy.deepcopy(self.cache)
            if length < self.length:
                cache.crop(length - self.length)
            return cache
        if length == 0:
            return None
        layers = self.layers(0, length)  # [(K, V) [1, H_kv, length, d]] views
        cache = DynamicCache(layers, config=self.model.config)  # `update` copies them
        if live:
            for layer, (keys, values) in zip(cache.layers, layers, strict=True):
                layer.keys, layer.values = keys, values
        return cache

    def copy(self, engine: Engine | None = None) -> Reader:
        """The same model with its own copy of the cache (or its engine's slots up to the length copied into `engine`,
        else into a new engine of the same capacity: a second set of full-capacity buffers), segments and logits."""
        logits = None if self.logits is None else self.logits.clone()
        if self.engine is not None:
            own = self.engine
            if engine is None:
                engine = Engine(own.model, own.capacity, own.graphs_enabled, own.backend)
            elif engine is own or engine.model is not own.model or engine.capacity < own.capacity:
                raise ValueError("a fork's engine must be another Engine of the same model, at least as large")
            engine.truncate(0)
            if own.length:
                engine.write(own.keys[:, :, : own.length], own.values[:, :, : own.length], 0)
        return Reader(self.model, copy.deepcopy(self.cache), list(self.segments), logits, engine)

    def receiver(self) -> Receiver:
        """Its cache as the splice's `Receiver` (src/runtime/receivers.py): the engine, or the DynamicCache (made on
        first use)."""
        if self.engine is not None:
            return EngineReceiver(self.engine)
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        return CacheReceiver(self.model, self.cache)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The model reads ids [N] natively on its cache; returns the last logits [1, V]."""
        start = self.length
        self.logits = self.receiver().read(ids[None])  # [1, V]
        self.add(Segment(start, start + ids.numel(), "native", self.exact))
        return self.logits

    def score(self, row: torch.Tensor) -> Score:
        """(sum log p, tokens, greedy) of row [L] after the conversation the reader holds; its cache cropped back
        (an engine truncated back: the slots past its length are written before any query reads them)."""
        logits = self.logits  # [1, V] the next token's
        if row.numel() > 1 and self.engine is not None:
            held = self.engine.length
            rows = torch.arange(row.numel() - 1)
            out = self.engine.forward(row[:-1], held + rows, rows=rows)  # [L − 1, V]
            self.engine.truncate(held)
            logits = torch.cat([logits, out])  # [L, V]
        elif row.numel() > 1:
            out = self.model(row[None, :-1].to(logits.device), past_key_values=self.cache, use_cache=True)
            self.cache.crop(1 - row.numel())
            logits = torch.cat([logits, out.logits[0]])  # [L, V]
        logprobs = logits.float().log_softmax(-1)
        target = row.to(logits.device)
        greedy = bool((logprobs.argmax(-1) == target).all())
        return Score(float(logprobs.gather(-1, target[:, None]).sum()), row.numel(), greedy)

    def save(self) -> State:
        """What `restore` puts back after a failed call: its cache object, every cache layer's state (tensors are never
        written in place below a reader's length, so the references are exact), its segments, logits and engine length
        (every call writes only slots ≥ the length it held when it began — reads past it, the map, the native layers
        and the recompute of the span past it — so truncating back is exact)."""
        return (
            self.cache,
            None if self.cache is None else [dict(vars(layer)) for layer in self.cache.layers],
            list(self.segments),
            self.logits,
            None if self.engine is None else self.engine.length,
        )

    def restore(self, state: State) -> None:
        """Put back what `save` returned."""
        cache, layers, segments, logits, length = state
        self.cache, self.segments, self.logits = cache, segments, logits
        if length is not None:  # a call never shortens an engine below the length it began with
            self.engine.truncate(length)
        for layer, saved in zip(cache.layers if cache is not None else [], layers or [], strict=True):
            vars(layer).clear()
            vars(layer).update(saved)
