"""A router's conversation held by several models, each with its own KV cache — the runtime a router imports.

    routes = {("small", "large"): bind(small, large, mapper, tokenizer_hash)}   # src/runtime/routing.py: verified once
    session = Session({"small": small, "large": large}, routes, Policy(mode="map", levers=Levers(native_sink=4)))
    session.append("small", history_ids)                 # small reads the history on its own cache
    record = session.switch_to("large", question_ids)    # large: reuse + map (or re-prefill), then the new turn
    scores = session.score("large", [yes_ids, no_ids])   # log p of each continuation; the session is unchanged
    branch = session.fork()                              # an independent copy of the conversation and its caches
    answer = session.generate("large", [], max_new_tokens=32)   # HF greedy generate on large's cache
    served = Session(models, routes, policy, engines={"large": 16384})  # large on the static engine (opt-in)

`switch_to` gives the receiver a cache of the whole conversation: the tokens it already holds are reused (a same-model
prefix hit); the tokens it has not seen are mapped at their own positions, segment by segment, each from a model that
read it natively (the sender first), or re-prefilled on top of what it holds — by `Policy.mode`: map, reprefill, or
auto (the faster path by measured per-token costs; src/runtime/routing.py); the levers (`src.runtime.levers.Levers`) keep parts of the
mapped span native. The new turn is always read natively (with no new turn, the last unseen token is: the receiver
always has next-token logits, `session.logits`). Every refusal — a mapper refused at binding (artifact mismatch, a
warning when the session is built), a sliding-window receiver, no route (status `unsupported`), non-finite values,
a history beyond the mapper's verified length or positions beyond its calibration (the length guard, on by default),
a failed guard (`fallback_reprefill`) — re-prefills exactly as a session that never tried a transfer, so its caches
and greedy outputs are bit-identical; the record says why.
Each cache carries provenance per segment (native, or mapped from model X by mapper id); `exact_prefix` exports only
the model's own computation over an exact context, so mapped KV is never served as an exact prefix hit.

Every input is checked before anything changes: token ids (integers, one conversation, inside the vocabulary of
every model that may read them), model names, lever settings the splice refuses, `generate`'s arguments. A call that
raises leaves the conversation, every cache, every segment list, the logits and the records exactly as they were
(the cost model keeps what it measured). Routes must be bound to the session's own models (same objects, or the same
fingerprint), checked once when the session is built.

A model may hold its conversation on the static receiver engine instead (`engines`: a capacity or an `Engine` per
name; src/runtime/engine.py): slot = position, the mapped pieces written straight into its slots, the recompute fused
into the tail's forward (where the turn rule and progressive selection run: a DynamicCache reader refuses them),
greedy decoding by one-token forwards. The semantics are the DynamicCache path's — the same records, provenance,
rollback and all-or-nothing calls — within float tolerance, and `cache` / `exact_prefix` hand out DynamicCache copies
of its slots. What it refuses: the attention recompute rule (the splice's own refusal, before
anything changes), generate's keyword arguments and generation-config settings a greedy argmax does not reproduce,
and a conversation longer than the smallest engine's capacity (every model may come to read it).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import NamedTuple

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from src.apply import KVTransfer
from src.forward import ids_problem
from src.maps import TransferError, cache_layers
from src.models import fingerprint
from src.runtime.engine import Engine, Recompute
from src.runtime.levers import Levers, spent
from src.runtime.routing import CostModel, Policy, Route
from src.runtime.splice import check_splice, splice

PATHS = ("hit", "map", "reprefill")
STATUSES = ("applied", "fallback_reprefill", "unsupported")
RESERVED = ("input_ids", "inputs", "attention_mask", "past_key_values")  # generate's own: not a caller's kwargs
GREEDY_NEUTRAL = frozenset({  # generation-config fields an engine reader's greedy argmax honours or need not read
    "bos_token_id", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_p", "top_k", "min_p",
    "typical_p", "num_beams", "num_return_sequences", "max_length", "max_new_tokens", "use_cache",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "_from_model_config", "transformers_version",
})  # fmt: skip


class RouteRefusedWarning(UserWarning):
    """A session holds a route whose bind was refused: every handoff that needs it re-prefills (status unsupported)."""


@dataclass(frozen=True)
class Segment:
    """Conversation tokens start..end−1 in one model's cache and where their K/V came from."""

    start: int
    end: int
    origin: str  # "native" (this model read them) or "mapped"
    exact: bool  # the model's own computation over an exact context: servable as a prefix hit
    source: str | None = None  # the model they were mapped from
    mapper: str | None = None  # that route's mapper id


@dataclass
class HandoffRecord:
    """One `switch_to`: what the receiver reused, mapped and prefilled, at what cost, and why.

    prefill_fraction is the share of a full prefill of the unseen tokens that the receiver spent: 1.0 whenever it
    re-prefilled them (the policy, a refusal, or levers that cover every token: `levers_cover_all`), the levers'
    share on a map (`Levers.prefill_fraction`, plus the native layers over the held prefix), 0.0 on a hit (nothing
    unseen: nothing spent). The new turn, always read natively, is not part of it."""

    sender: str | None
    receiver: str
    path: str  # PATHS: how the unseen tokens were covered (hit: there were none)
    status: str  # STATUSES
    reason: str
    context: int  # conversation tokens before the new turn
    hit: int  # tokens reused from the receiver's own cache
    mapped: int  # tokens mapped from another model's cache
    prefilled: int  # unseen tokens the receiver read natively (sink, hold-back, or all of them)
    turn: int  # new-turn tokens read natively after them
    prefill_fraction: float  # see the class docstring
    ms: float  # the whole switch: reuse + map / prefill + the new turn's logits
    ms_map: float  # the mapper calls within it
    bytes: int  # K/V bytes read from the senders' caches for the mapped tokens
    recomputed: int = 0  # mapped tokens recomputed in place (Levers.recompute)
    levers_cover_all: bool = False  # path reprefill because the levers' sink and hold-back left no token to map


class Score(NamedTuple):
    """One continuation scored by `Session.score`."""

    logprob: float  # sum of log p over its tokens, each given the conversation and the tokens before it
    tokens: int
    greedy: bool  # every token is the model's argmax


@dataclass
class _Reader:
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

    def copy(self, engine: Engine | None = None) -> _Reader:
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
        return _Reader(self.model, copy.deepcopy(self.cache), list(self.segments), logits, engine)


@dataclass
class _Saved:
    """What a failed call restores: the conversation, the records' count, and per reader its cache object, every
    cache layer's state (tensors are never written in place below a reader's length, so the references are exact),
    its segments, logits and engine length (every call writes only slots ≥ the length it held when it began — reads
    past it, the map, the native layers and the recompute of the span past it — so truncating back is exact)."""

    ids: torch.Tensor
    active: str | None
    records: int
    readers: dict[str, tuple[DynamicCache | None, list[dict] | None, list[Segment], torch.Tensor | None, int | None]]


class _Vocabulary(LogitsProcessor):
    """Generation restricted to the first `size` ids: those every model of the session can read."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, torch.arange(self.size, scores.shape[-1], device=scores.device), float("-inf"))


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _vocabulary(model: PreTrainedModel) -> int:
    return model.get_input_embeddings().num_embeddings


def token_ids(tokens: object, vocab: int, readers: str) -> torch.Tensor:
    """Token ids [N] (long, CPU) from a sequence, a [N] or a [1, N] tensor of integer ids in [0, vocab) — `readers`
    names whose vocabulary that is — or a ValueError naming the problem (floats are never truncated; an empty
    sequence is no ids whatever its dtype)."""
    try:
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise ValueError(f"token ids must be a sequence of integers, not {type(tokens).__name__}: {error}") from error
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"a session holds one conversation: token ids [N] or [1, N], got {tuple(ids.shape)}")
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if problem := ids_problem(ids[None], vocab):
        raise ValueError(f"token ids {problem.removeprefix('input_ids ')} ({readers})")
    return ids.to("cpu", torch.long)


def _check_generation(max_new_tokens: object, kwargs: dict) -> None:
    """A ValueError for generate arguments a session cannot take (no new token, another batch, its own inputs)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, not {max_new_tokens!r}")
    if reserved := sorted(set(kwargs) & set(RESERVED)):
        raise ValueError(f"generate sets {reserved} itself from the session's conversation and cache")
    for name in ("num_beams", "num_return_sequences"):
        if kwargs.get(name, 1) != 1:
            raise ValueError(f"a session holds one conversation: {name} must be 1, not {kwargs[name]!r}")


class Session:
    """One conversation (token ids) held by several models, each with its own `DynamicCache` or, for the names in
    `engines`, a static `Engine`: a capacity (the session builds one, CUDA graphs on a GPU) or an Engine of that very
    model, which the session takes over (emptied first) — module docstring."""

    def __init__(
        self,
        models: dict[str, PreTrainedModel],
        routes: dict[tuple[str, str], Route] | None = None,
        policy: Policy | None = None,
        costs: CostModel | None = None,
        engines: dict[str, int | Engine] | None = None,
    ):
        if not isinstance(models, dict) or not models:
            raise ValueError("a session needs a dict of at least one named model")
        for name, model in models.items():
            if not isinstance(name, str) or not isinstance(model, PreTrainedModel):
                raise ValueError(f"model {name!r} must be a str naming a PreTrainedModel, not a {type(model).__name__}")
        self.readers = {name: _Reader(model) for name, model in models.items()}
        if not isinstance(engines, dict | None):
            raise ValueError(f"engines maps model names to a capacity or an Engine, not a {type(engines).__name__}")
        for name, engine in (engines or {}).items():
            self.readers[name].engine = self._engine(name, engine)
        capacities = [r.engine.capacity for r in self.readers.values() if r.engine is not None]
        self.capacity = min(capacities) if capacities else None  # the most tokens the conversation may hold
        self.routes = dict(routes or {})
        for key, route in self.routes.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ValueError(f"a route is keyed by (sender, receiver), not {key!r}")
            self._check_route(*key, route)
        self.policy = policy if policy is not None else Policy()
        self.costs = costs if costs is not None else CostModel()
        if not isinstance(self.policy, Policy) or not isinstance(self.costs, CostModel):
            raise ValueError("policy must be a Policy and costs a CostModel")
        sizes = {name: _vocabulary(model) for name, model in models.items()}
        self.vocab = min(sizes.values())  # ids the conversation may hold: every model may come to read them
        self._vocab_owner = (
            f"{min(sizes, key=sizes.get)!r} reads {self.vocab} ids; every model may read the conversation"
        )
        self._ids = torch.zeros(0, dtype=torch.long)  # [T] the conversation
        self.active: str | None = None
        self._records: list[HandoffRecord] = []

    def _engine(self, name: str, engine: object) -> Engine:
        """The reader's engine from a capacity or an Engine of the session's model; a ValueError otherwise."""
        model = self._reader(name).model
        if isinstance(engine, Engine):
            if engine.model is not model:
                raise ValueError(f"the engine given for {name!r} runs another model than the session's {name!r}")
            if any(reader.engine is engine for reader in self.readers.values()):
                raise ValueError(f"the engine given for {name!r} already holds another model's conversation")
            engine.truncate(0)
            return engine
        if isinstance(engine, bool) or not isinstance(engine, Integral):
            raise ValueError(f"engine {name!r} must be a capacity (an integer) or an Engine, not {engine!r}")
        try:
            return Engine(model, int(engine))
        except ValueError as problem:
            raise ValueError(f"model {name!r} cannot run on the static engine: {problem}") from problem

    def _check_room(self, tokens: int) -> None:
        """A ValueError when the conversation would grow by `tokens` past the smallest engine's capacity."""
        if self.capacity is not None and self._ids.numel() + tokens > self.capacity:
            raise ValueError(
                f"the conversation would hold {self._ids.numel() + tokens} tokens, past the engine capacity "
                f"{self.capacity} (every model may come to read it)"
            )

    def _check_route(self, sender: str, receiver: str, route: Route) -> None:
        """A ValueError unless the route joins two of the session's models and its transfer was bound to them (the
        same objects, or the same fingerprint); a route whose bind was refused warns (RouteRefusedWarning)."""
        if sender not in self.readers or receiver not in self.readers:
            raise ValueError(f"route {sender} → {receiver} names a model the session does not hold")
        if not isinstance(route, Route):
            raise ValueError(f"route {sender} → {receiver} is a {type(route).__name__}, not a Route (routing.bind)")
        if (route.transfer is None) == (route.refusal is None):
            raise ValueError(f"route {sender} → {receiver} needs a transfer or a refusal, exactly one (routing.bind)")
        if route.transfer is None:
            warnings.warn(
                f"route {sender} → {receiver} was refused at binding ({route.refusal}): every handoff on it re-prefills",
                RouteRefusedWarning,
                stacklevel=3,
            )
            return
        for role, name, bound in (
            ("sender", sender, route.transfer.source),
            ("receiver", receiver, route.transfer.target),
        ):
            held = self.readers[name].model
            if bound is not held and fingerprint(bound) != fingerprint(held):
                raise ValueError(
                    f"route {sender} → {receiver} was bound to another {role} than the session's {name!r}: "
                    f"fingerprint {fingerprint(bound)[:12]} ≠ {fingerprint(held)[:12]} (bind the route to this model)"
                )

    # --- what the session holds --------------------------------------------------------------------------------

    @property
    def ids(self) -> torch.Tensor:
        """The conversation's token ids [T] (a copy)."""
        return self._ids.clone()

    @property
    def logits(self) -> torch.Tensor | None:
        """The active model's next-token logits [1, V] after the conversation (a copy; None before any token)."""
        logits = self.readers[self.active].logits if self.active is not None else None
        return None if logits is None else logits.clone()

    @property
    def records(self) -> list[HandoffRecord]:
        """Every handoff so far (copies)."""
        return [replace(record) for record in self._records]

    def _reader(self, model: str) -> _Reader:
        if not isinstance(model, str) or model not in self.readers:
            raise ValueError(f"no model {model!r} in this session; it holds {sorted(self.readers)}")
        return self.readers[model]

    def holds(self, model: str) -> int:
        """Conversation tokens in the model's cache (a prefix of the conversation)."""
        return self._reader(model).length

    def cache(self, model: str, live: bool = False) -> DynamicCache | None:
        """A copy of the model's cache (None before it read anything; on an engine, a DynamicCache of slots
        0..length − 1). `live=True` returns the session's own cache: whatever is done to it is done to the session
        (src/routed_runs.py poisons a source cache through it; on an engine only in-place writes to its tensors, which
        are views of the slots)."""
        reader = self._reader(model)
        return reader.dynamic(reader.length, live)

    def segments(self, model: str) -> list[Segment]:
        """Provenance of the model's cache, segment by segment."""
        return list(self._reader(model).segments)

    def exact_prefix(self, model: str) -> tuple[torch.Tensor, DynamicCache | None]:
        """The longest prefix whose K/V are the model's own computation over an exact context — what a prefix cache
        may serve as a hit: its ids [P] and a copy of the cache cut to it (None when P = 0; on an engine reader, a
        DynamicCache built from its slots 0..P − 1). Mapped tokens, and tokens read after them, are never part of
        it."""
        reader = self._reader(model)
        length = 0
        for segment in reader.segments:
            if not segment.exact:
                break
            length = segment.end
        if length == 0:
            return self._ids[:0].clone(), None
        return self._ids[:length].clone(), reader.dynamic(length)  # on an engine: a DynamicCache of its slots

    def fork(self, engines: dict[str, Engine] | None = None) -> Session:
        """An independent copy of the conversation: caches, segments, logits and records copied; models, routes,
        policy and the cost model (measurements of the hardware) shared. Either then evolves without the other. An
        engine reader's fork copies its slots into `engines[name]` (an engine kept warm for forks: its CUDA graphs
        are already captured) or else into a new Engine of the same capacity: another full set of K/V buffers,
        2 · L · H_kv · (capacity + 1) · d elements, and its own graphs, captured on first use."""
        engines = engines or {}
        if set(engines) - {name for name, reader in self.readers.items() if reader.engine is not None}:
            raise ValueError(f"fork engines {sorted(engines)} name models that are not on an engine in this session")
        twin = copy.copy(self)
        twin.readers = {name: reader.copy(engines.get(name)) for name, reader in self.readers.items()}
        twin.routes = dict(self.routes)
        twin._ids = self._ids.clone()
        twin._records = self.records
        return twin

    @torch.no_grad()
    def score(self, model: str, continuations: list) -> list[Score]:
        """Log-likelihood of each continuation (a list of id sequences, each ≥ 1 token) given the conversation, on
        the model's own cache (it must hold the whole conversation) — the offline scorer's sums (src.eval.scoring),
        one continuation at a time: its first token from the model's next-token logits, the rest read on the cache,
        which is cropped back. The session is unchanged, bit for bit."""
        reader = self._current(model)
        if self._ids.numel() == 0:
            raise ValueError("nothing to score after: the conversation is empty")
        if not isinstance(continuations, list | tuple) or not continuations:
            raise ValueError("score a non-empty list of continuations (each a sequence of token ids)")
        rows = []
        for index, continuation in enumerate(continuations):
            row = token_ids(continuation, _vocabulary(reader.model), f"{model!r}'s vocabulary")
            if row.numel() == 0:
                raise ValueError(f"continuation {index} is empty: score at least one token")
            if reader.engine is not None and reader.length + row.numel() - 1 > reader.engine.capacity:
                raise ValueError(f"continuation {index} would read past {model!r}'s engine capacity "
                                 f"{reader.engine.capacity}")  # fmt: skip
            rows.append(row)
        with self._atomic():  # whatever happens, the crop-back is exact
            return [self._score(reader, row) for row in rows]

    @staticmethod
    def _score(reader: _Reader, row: torch.Tensor) -> Score:
        """(sum log p, tokens, greedy) of row [L] after the conversation the reader holds; its cache cropped back
        (an engine truncated back: the slots past its length are written before any query reads them)."""
        logits = reader.logits  # [1, V] the next token's
        if row.numel() > 1 and reader.engine is not None:
            held = reader.engine.length
            rows = torch.arange(row.numel() - 1)
            out = reader.engine.forward(row[:-1], held + rows, rows=rows)  # [L − 1, V]
            reader.engine.truncate(held)
            logits = torch.cat([logits, out])  # [L, V]
        elif row.numel() > 1:
            out = reader.model(row[None, :-1].to(logits.device), past_key_values=reader.cache, use_cache=True)
            reader.cache.crop(1 - row.numel())
            logits = torch.cat([logits, out.logits[0]])  # [L, V]
        logprobs = logits.float().log_softmax(-1)
        target = row.to(logits.device)
        greedy = bool((logprobs.argmax(-1) == target).all())
        return Score(float(logprobs.gather(-1, target[:, None]).sum()), row.numel(), greedy)

    # --- every call is all or nothing ----------------------------------------------------------------------------

    def _conversation_ids(self, tokens: object) -> torch.Tensor:
        return token_ids(tokens, self.vocab, self._vocab_owner)

    def _save(self) -> _Saved:
        readers = {
            name: (
                r.cache,
                None if r.cache is None else [dict(vars(layer)) for layer in r.cache.layers],
                list(r.segments),
                r.logits,
                None if r.engine is None else r.engine.length,
            )
            for name, r in self.readers.items()
        }
        return _Saved(self._ids, self.active, len(self._records), readers)

    def _restore(self, saved: _Saved) -> None:
        self._ids, self.active = saved.ids, saved.active
        del self._records[saved.records :]
        for name, (cache, layers, segments, logits, length) in saved.readers.items():
            reader = self.readers[name]
            reader.cache, reader.segments, reader.logits = cache, segments, logits
            if length is not None:  # a call never shortens an engine below the length it began with
                reader.engine.truncate(length)
            for layer, state in zip(cache.layers if cache is not None else [], layers or [], strict=True):
                vars(layer).clear()
                vars(layer).update(state)

    @contextmanager
    def _atomic(self) -> Iterator[None]:
        """Whatever raises inside leaves the session exactly as it was."""
        saved = self._save()
        try:
            yield
        except BaseException:
            self._restore(saved)
            raise

    # --- reading and generating --------------------------------------------------------------------------------

    def _read(self, name: str, ids: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        """The model reads ids [N] natively on its cache; returns the last logits [1, V]. recompute: held (mapped)
        conversation tokens an engine reads again in the same forward, first — fused recompute (`Recompute`)."""
        reader = self._reader(name)
        start = reader.length
        if reader.engine is not None:
            chosen = torch.zeros(0, dtype=torch.long) if recompute is None else recompute.positions  # [R]
            positions = torch.cat([chosen, torch.arange(start, start + ids.numel())])  # [R + N]
            both = torch.cat([self._ids[chosen], ids])  # [R + N]
            logits = reader.engine.forward(both, positions, recompute=recompute)  # [1, V]
        else:
            if reader.cache is None:
                reader.cache = DynamicCache(config=reader.model.config)
            out = reader.model(
                ids[None].to(_device(reader.model)), past_key_values=reader.cache, use_cache=True, logits_to_keep=1
            )
            logits = out.logits[:, -1]  # [1, V]
        reader.add(Segment(start, start + ids.numel(), "native", reader.exact))
        reader.logits = logits
        return reader.logits

    def _current(self, name: str) -> _Reader:
        reader = self._reader(name)
        if reader.length != self._ids.numel():
            raise ValueError(
                f"{name!r} holds {reader.length} of the conversation's {self._ids.numel()} tokens: "
                f"switch_to({name!r}) first"
            )
        return reader

    @torch.no_grad()
    def append(self, model: str, tokens) -> torch.Tensor | None:
        """The model reads new tokens natively on its cache (it must hold the whole conversation); returns the last
        logits [1, V] (None for no tokens)."""
        self._current(model)
        ids = self._conversation_ids(tokens)
        self._check_room(ids.numel())
        with self._atomic():
            self.active = model
            if ids.numel() == 0:
                return None
            logits = self._read(model, ids)
            self._ids = torch.cat([self._ids, ids])
            return logits.clone()

    @torch.no_grad()
    def generate(self, model: str, turn, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """HF `generate` (greedy unless kwargs say otherwise, one sequence) on the model's cache after the new turn,
        restricted to the ids every model of the session reads; the turn and the generated tokens join the
        conversation (the last one read too, so the cache covers them all). Returns the generated ids [G].
        max_new_tokens must be ≥ 1 (0 is a ValueError, nothing changed). On an engine reader: greedy decoding by
        one-token forwards, stopped by the generation config's eos ids as HF's is; sampling and every other
        keyword argument are refused (ValueError), as is a generation config whose settings a greedy argmax does
        not reproduce (`GREEDY_NEUTRAL`: e.g. a repetition penalty); the conversation must leave room for
        max_new_tokens."""
        reader = self._current(model)
        turn = self._conversation_ids(turn)
        _check_generation(max_new_tokens, kwargs)
        if self._ids.numel() + turn.numel() == 0:
            raise ValueError("nothing to generate from: the conversation and the turn are empty")
        self._check_room(turn.numel() + max_new_tokens)
        if reader.engine is not None:
            if kwargs:
                raise ValueError(f"an engine reader decodes greedily: generate takes no {sorted(kwargs)}")
            if unknown := sorted(set(reader.model.generation_config.to_diff_dict()) - GREEDY_NEUTRAL):
                raise ValueError(f"{model!r}'s generation config sets {unknown}, which the engine's greedy argmax "
                                 "does not apply")  # fmt: skip
        with self._atomic():
            if reader.engine is not None:
                return self._decode(model, reader, turn, max_new_tokens)
            return self._generate(model, reader, turn, max_new_tokens, kwargs)

    def _decode(self, model: str, reader: _Reader, turn: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding on the engine: the turn read, then one-token forwards, each token the argmax over the
        ids every model reads; stops after max_new_tokens or an eos id (kept). Returns the generated ids [G]."""
        logits = self._read(model, turn) if turn.numel() else reader.logits  # [1, V]
        eos = reader.model.generation_config.eos_token_id
        stop = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        new = []
        for _ in range(max_new_tokens):
            token = logits[0, : self.vocab].argmax().reshape(1).cpu()  # [1]
            new.append(token)
            logits = self._read(model, token)
            if int(token) in stop:
                break
        new = torch.cat(new)  # [G]
        self._ids = torch.cat([self._ids, turn, new])
        self.active = model
        return new

    def _generate(self, model: str, reader: _Reader, turn: torch.Tensor, max_new_tokens: int, kwargs: dict):
        if turn.numel() == 0:  # HF reads at least one uncached token: re-read the last one (the crop is exact)
            turn = self._ids[-1:]
            self._ids = self._ids[:-1]
            reader.cache.crop(-1)
            last = reader.segments.pop()
            if last.end - 1 > last.start:
                reader.segments.append(replace(last, end=last.end - 1))
        if reader.cache is None:
            reader.cache = DynamicCache(config=reader.model.config)
        prompt = torch.cat([self._ids, turn])[None].to(_device(reader.model))  # [1, T + N]
        config = reader.model.generation_config
        settings = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_new_tokens": max_new_tokens}
        if config.pad_token_id is None:
            eos = config.eos_token_id
            settings["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        if reader.model.config.get_text_config().vocab_size > self.vocab:  # its head writes ids another cannot read
            settings["logits_processor"] = LogitsProcessorList(
                [*kwargs.pop("logits_processor", []), _Vocabulary(self.vocab)]
            )
        out = reader.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), past_key_values=reader.cache, **(settings | kwargs)
        )
        new = out[0, prompt.shape[1] :].cpu()  # [G]
        if new.numel() == 0:
            raise ValueError("generate wrote no token (its stopping settings): the session is unchanged")
        start = self._ids.numel()
        reader.add(Segment(start, start + turn.numel() + new.numel() - 1, "native", reader.exact))
        self._ids = torch.cat([self._ids, turn, new])
        self._read(model, new[-1:])  # the cache covers the whole conversation again
        self.active = model
        return new

    # --- the handoff ---------------------------------------------------------------------------------------------

    def _owners(self, receiver: str, start: int, end: int) -> list[tuple[int, int, str]] | str:
        """Pieces (start, end, sender) of tokens start..end−1, each from a model with a usable route to the receiver
        that holds it — native first, the active model first — or the reason there is none."""
        candidates = [
            name
            for name in sorted(self.readers, key=lambda n: n != self.active)
            if name != receiver and (name, receiver) in self.routes and self.routes[(name, receiver)].refusal is None
        ]
        if not candidates:
            refused = [
                f"route {s} → {t}: {r.refusal}" for (s, t), r in self.routes.items() if t == receiver and r.refusal
            ]
            return refused[0] if refused else f"no mapper route into {receiver!r}"
        cuts = sorted(
            {start, end}
            | {
                edge
                for name in candidates
                for s in self.readers[name].segments
                for edge in (s.start, s.end)
                if start < edge < end
            }
        )
        pieces: list[tuple[int, int, str]] = []
        for low, high in zip(cuts[:-1], cuts[1:], strict=True):
            held = [
                (s.origin != "native", rank, name)
                for rank, name in enumerate(candidates)
                for s in self.readers[name].segments
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

    def _map(
        self, receiver: str, pieces: list[tuple[int, int, str]]
    ) -> tuple[list[DynamicCache | tuple[int, int]], int]:
        """Each piece mapped at its own positions — a cache, or on an engine receiver (low, high): its slots, written
        in place — and the bytes read; raises TransferError on any refusal (nothing is changed)."""
        mapped, read = [], 0
        for start, end, sender in pieces:
            route = self.routes[(sender, receiver)]
            if refusal := self._beyond_length(route, end):
                raise TransferError(refusal)
            layers = self.readers[sender].layers(start, end)  # [(K, V) [1, H_kv, n, d]]
            read += sum(t.numel() * t.element_size() for pair in layers for t in pair)
            positions, ids = torch.arange(start, end), self._ids[None, start:end]
            engine = self.readers[receiver].engine
            if engine is None:
                cache = route.transfer(layers, positions=positions, input_ids=ids)
                result = cache_layers(cache)
            else:  # straight into the slots past what the receiver holds: a refusal leaves its state unchanged
                route.transfer.into(engine.slots(start, end), layers, positions=positions, input_ids=ids)
                cache, result = (start, end), [(engine.keys[:, :, start:end], engine.values[:, :, start:end])]
            bound = self.policy.guard_max_abs
            if bound is not None:
                peak = float(torch.stack([t.abs().amax() for pair in result for t in pair]).max())
                if peak > bound:
                    raise TransferError(f"guard: mapped |K|, |V| reach {peak:.3g} > {bound:g}")
            mapped.append(cache)
        return mapped, read

    def _beyond_length(self, route: Route, end: int) -> str | None:
        """Why the length guard (`Policy.length_guard`, src/runtime/routing.py) refuses to map a piece ending at
        position end − 1 of the conversation on `route`, or None. The evidence bounds the history (the conversation
        before the new turn, what its measurements binned); the factor rule bounds the mapped positions."""
        guard, history = self.policy.length_guard, self._ids.numel()
        if guard == "evidence" and route.verified_length is not None:
            if history <= route.verified_length:
                return None
            shown = f"shown by {route.verified_by}" if route.verified_by else "no measured length passed"
            verified = route.verified_length
            return f"a history of {history} tokens is beyond the mapper's verified length {verified} ({shown})"
        limit = self.policy.max_length_factor
        if guard == "off" or limit is None or route.calibrated_length is None or end <= limit * route.calibrated_length:
            return None
        return f"position {end - 1} is beyond {limit:g} × the mapper's calibration length {route.calibrated_length}"

    @torch.no_grad()
    def switch_to(self, model: str, turn=()) -> HandoffRecord:
        """Give `model` a cache of the whole conversation (module docstring), then read the new turn natively;
        returns the handoff record (the receiver's next-token logits are `session.logits`)."""
        reader = self._reader(model)
        turn = self._conversation_ids(turn)
        self._check_room(turn.numel())
        with self._atomic():
            device = _device(reader.model)
            began = _clock(device)
            held, total = reader.length, self._ids.numel()
            record = HandoffRecord(
                self.active, model, "hit", "applied", "the receiver holds the whole conversation", total, held,
                0, 0, turn.numel(), 0.0, 0.0, 0.0, 0,
            )  # fmt: skip
            if total > held:
                record = self._cover(model, record, turn)
            elif turn.numel():
                self._read(model, turn)
            record.ms = (_clock(device) - began) * 1e3
            self._ids = torch.cat([self._ids, turn])
            self.active = model
            self._records.append(record)
            return replace(record)

    def _reprefill(
        self, model: str, record: HandoffRecord, turn: torch.Tensor, status: str, reason: str
    ) -> HandoffRecord:
        """The receiver reads the unseen tokens and the turn in one forward: what a session without transfers does."""
        began = _clock(_device(self._reader(model).model))
        native = torch.cat([self._ids[record.hit :], turn])
        self._read(model, native)
        self.costs.observe(model, "prefill", native.numel(), (_clock(_device(self._reader(model).model)) - began) * 1e3)
        unseen = record.context - record.hit
        return replace(record, path="reprefill", status=status, reason=reason, prefilled=unseen, prefill_fraction=1.0)

    def _cover(self, model: str, record: HandoffRecord, turn: torch.Tensor) -> HandoffRecord:
        policy, levers = self.policy, self.policy.levers
        held, total = record.hit, record.context
        if policy.mode == "reprefill":
            return self._reprefill(model, record, turn, "applied", "policy: reprefill")
        sink_end = min(max(levers.native_sink, held), total)  # conversation positions < native_sink stay native
        hold = min(max(levers.hold_back, 0 if turn.numel() else 1), total - sink_end)  # no turn: the last is read
        end = total - hold
        if end <= sink_end:
            covered = replace(record, levers_cover_all=True)
            return self._reprefill(model, covered, turn, "applied", "the levers leave no token to map")
        pieces = self._owners(model, sink_end, end)
        if isinstance(pieces, str):
            return self._reprefill(model, record, turn, "unsupported", pieces)
        unseen = total - held
        span = replace(levers, native_sink=sink_end - held, hold_back=hold)  # the levers on this span
        layers = self._reader(model).model.config.get_text_config().num_hidden_layers
        transfer = self.routes[(pieces[0][2], model)].transfer
        charged = spent(transfer, span)
        depth = min(span.native_depth(unseen), layers)
        spend = charged.prefill_fraction(unseen, layers, turn.numel()) * unseen + held * depth / layers
        if policy.mode == "auto":
            costs = self.costs
            native = round(spend) + turn.numel()
            estimate_map = [costs.estimate(model, "map", end - sink_end), costs.estimate(model, "prefill", native)]
            estimate_prefill = costs.estimate(model, "prefill", unseen + turn.numel())
            if None in estimate_map or estimate_prefill is None:
                reason = "auto: no cost measurements yet for this receiver, map by default"
            elif sum(estimate_map) >= estimate_prefill:
                reason = f"auto: re-prefill ≈ {estimate_prefill:.2f} ms ≤ map ≈ {sum(estimate_map):.2f} ms"
                return self._reprefill(model, record, turn, "applied", reason)
            else:
                reason = f"auto: map ≈ {sum(estimate_map):.2f} ms < re-prefill ≈ {estimate_prefill:.2f} ms"
        else:
            reason = "policy: map"
        static = self._reader(model).engine is not None
        check_splice(span, transfer.token_features, unseen, hold + turn.numel(), static)  # the splice's, first
        device = _device(self._reader(model).model)
        began = _clock(device)
        try:
            mapped, read = self._map(model, pieces)
        except TransferError as refusal:
            return self._reprefill(model, record, turn, "fallback_reprefill", str(refusal))
        ms_map = (_clock(device) - began) * 1e3
        self.costs.observe(model, "map", end - sink_end, ms_map)
        recomputed = self._splice(model, pieces, mapped, sink_end, end, span, transfer, turn)
        return replace(
            record,
            path="map",
            reason=reason,
            mapped=end - sink_end,
            prefilled=unseen - (end - sink_end),
            prefill_fraction=spend / unseen,
            ms_map=ms_map,
            bytes=read,
            recomputed=recomputed,
        )

    def _splice(
        self,
        model: str,
        pieces: list[tuple[int, int, str]],
        mapped: list[DynamicCache | tuple[int, int]],
        start: int,
        end: int,
        span: Levers,
        transfer: KVTransfer,
        turn: torch.Tensor,
    ) -> int:
        """Commit a map that passed every check through the one splice (src/runtime/splice.py): sink tokens read
        natively, the mapped pieces appended (on an engine: committed, `_map` wrote their slots), the levers' native
        layers and recomputed tokens (on an engine: read again in the tail's forward), then the hold-back tokens and
        the turn read natively in one forward (at least one token: `_cover`). Returns how many mapped tokens were
        recomputed."""
        reader = self._reader(model)
        target = reader.model
        held, total = reader.length, self._ids.numel()
        if reader.cache is None and reader.engine is None:
            reader.cache = DynamicCache(config=target.config)
        native = torch.cat([self._ids[end:total], turn])[None]  # [1, hold-back + turn]
        mapped_segments = [
            Segment(low, high, "mapped", False, sender, self.routes[(sender, model)].mapper_id)
            for low, high, sender in pieces
        ]

        def read(ids: torch.Tensor, part: str, recompute: Recompute | None = None) -> None:
            if part == "sink":
                self._read(model, ids[0])
                return
            for segment in mapped_segments:  # the span precedes the tail in the provenance
                reader.add(segment)
            began = _clock(_device(target))
            self._read(model, ids[0], recompute)  # an engine's recomputed tokens first, in the same forward
            layers = target.config.get_text_config().num_hidden_layers
            count = ids.shape[1] if recompute is None else round(recompute.work(ids.shape[1], layers))  # tokens
            self.costs.observe(model, "prefill", count, (_clock(_device(target)) - began) * 1e3)

        receiver = reader.cache if reader.engine is None else reader.engine
        return splice(
            target, receiver, self._ids[None, :end], start, mapped, span, total - held, transfer.token_features,
            native, native, read,
        )  # fmt: skip
