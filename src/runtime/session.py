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
read it natively (the sender first; src/runtime/pieces.py), or re-prefilled on top of what it holds — by
`Policy.mode`: map, reprefill, or auto (the faster path by measured per-token costs; src/runtime/routing.py); the levers (`src.runtime.plan.Levers`) keep parts of the
mapped span native. The new turn is always read natively (with no new turn, the last unseen token is: the receiver
always has next-token logits, `session.logits`). Every refusal — a mapper refused at binding (artifact mismatch, a
warning when the session is built), a sliding-window receiver, no route (status `unsupported`), non-finite values,
a history beyond the mapper's verified length or positions beyond its calibration (the length guard, on by default),
a failed guard (`fallback_reprefill`) — re-prefills exactly as a session that never tried a transfer, so its caches
and greedy outputs are bit-identical; the record says why.
Each cache carries provenance per segment (native, or mapped from model X by mapper id; a model's holding is a
`Reader`, src/runtime/reader.py); `exact_prefix` exports only the model's own computation over an exact context, so
mapped KV is never served as an exact prefix hit.

Every input is checked before anything changes: token ids (integers, one conversation, inside the vocabulary of
every model that may read them), model names, lever settings the splice refuses, `generate`'s arguments. A call that
raises leaves the conversation, every cache, every segment list, the logits and the records exactly as they were
(the cost model keeps what it measured). Routes must be bound to the session's own models (same objects, or the same
fingerprint), checked once when the session is built.

A model may hold its conversation on the static receiver engine instead (`engines`: a capacity or an `Engine` per
name; src/runtime/engine.py): slot = position, the mapped pieces written straight into its slots, the recompute fused
into the tail's forward (where the turn rule and progressive selection run: a DynamicCache reader refuses them),
greedy decoding by one-token forwards (src/runtime/generation.py). The semantics are the DynamicCache path's — the
same records, provenance, rollback and all-or-nothing calls — within float tolerance, and `cache` / `exact_prefix`
hand out DynamicCache copies of its slots. What it refuses: the attention recompute rule (the splice's own refusal, before
anything changes), generate's keyword arguments and generation-config settings a greedy argmax does not reproduce,
and a conversation longer than the smallest engine's capacity (every model may come to read it). An engine serves one
session at a time: a session holds the engines it is given or builds (`Engine.claim`) until `close()`; another
session, a fork or `engine_handoff` is refused an engine a live session holds, and a closed session refuses to read
the engines it gave back. One handoff's cover — re-prefill, or plan, map and splice — is src/runtime/cover.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from numbers import Integral

import torch
from transformers import DynamicCache, PreTrainedModel

from src.forward import ids_problem
from src.runtime.cover import HandoffRecord, Switch, cover
from src.runtime.engine import Engine
from src.runtime.generation import check_engine_generation, check_generation, engine_decode, hf_generate
from src.runtime.reader import Reader, Score, Segment, State, clock, model_device
from src.runtime.routing import CostModel, Policy, Route, check_route


@dataclass
class _Saved:
    """What a failed call restores: the conversation, the records' count, and per reader its state (`Reader.save`)."""

    ids: torch.Tensor
    active: str | None
    records: int
    readers: dict[str, State]


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
        self.readers = {name: Reader(model) for name, model in models.items()}
        if not isinstance(engines, dict | None):
            raise ValueError(f"engines maps model names to a capacity or an Engine, not a {type(engines).__name__}")
        given = [engine for engine in (engines or {}).values() if isinstance(engine, Engine)]
        if len({id(engine) for engine in given}) < len(given):
            raise ValueError("one engine given for two models: each already holds another model's conversation")
        for engine in given:
            if engine.owner is not None:
                raise ValueError("an engine given already holds another session's conversation: close() it first")
        for name, engine in (engines or {}).items():
            self.readers[name].engine = self._engine(name, engine)
        capacities = [r.engine.capacity for r in self.readers.values() if r.engine is not None]
        self.capacity = min(capacities) if capacities else None  # the most tokens the conversation may hold
        self.routes = dict(routes or {})
        for key, route in self.routes.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ValueError(f"a route is keyed by (sender, receiver), not {key!r}")
            check_route(*key, route, models)
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
        self._claim()

    def _claim(self) -> None:
        """This session holds its engines (`Engine.claim`): no other session may take one until `close`."""
        for reader in self.readers.values():
            if reader.engine is not None:
                reader.engine.claim(self)

    def close(self) -> None:
        """Give the engines back (another session may take them; this one then refuses to read them)."""
        for reader in self.readers.values():
            if reader.engine is not None:
                reader.engine.release(self)

    def _engine(self, name: str, engine: object) -> Engine:
        """The reader's engine from a capacity or an Engine of the session's model; a ValueError otherwise."""
        model = self._reader(name).model
        if isinstance(engine, Engine):
            if engine.model is not model:
                raise ValueError(f"the engine given for {name!r} runs another model than the session's {name!r}")
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

    def _reader(self, model: str) -> Reader:
        if not isinstance(model, str) or model not in self.readers:
            raise ValueError(f"no model {model!r} in this session; it holds {sorted(self.readers)}")
        reader = self.readers[model]
        if reader.engine is not None and reader.engine.owner is not self:
            raise ValueError(f"{model!r}'s engine no longer holds this session's conversation (the session was closed)")
        return reader

    def holds(self, model: str) -> int:
        """Conversation tokens in the model's cache (a prefix of the conversation)."""
        return self._reader(model).length

    def cache(self, model: str, live: bool = False) -> DynamicCache | None:
        """A copy of the model's cache (None before it read anything; on an engine, a DynamicCache of slots
        0..length − 1). `live=True` returns the session's own cache: whatever is done to it is done to the session
        (src/routed_rollback.py poisons a source cache through it; on an engine only in-place writes to its tensors,
        which are views of the slots)."""
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
        if any(engine.owner is not None for engine in engines.values()):
            raise ValueError("a fork's engine already holds a session's conversation: close() that session first")
        twin = copy.copy(self)
        twin.readers = {name: reader.copy(engines.get(name)) for name, reader in self.readers.items()}
        twin._claim()
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
            return [reader.score(row) for row in rows]

    # --- every call is all or nothing ----------------------------------------------------------------------------

    def _conversation_ids(self, tokens: object) -> torch.Tensor:
        return token_ids(tokens, self.vocab, self._vocab_owner)

    def _save(self) -> _Saved:
        return _Saved(self._ids, self.active, len(self._records), {n: r.save() for n, r in self.readers.items()})

    def _restore(self, saved: _Saved) -> None:
        self._ids, self.active = saved.ids, saved.active
        del self._records[saved.records :]
        for name, state in saved.readers.items():
            self.readers[name].restore(state)

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

    def _current(self, name: str) -> Reader:
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
            logits = self._reader(model).read(ids)
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
        not reproduce (`GREEDY_NEUTRAL`, src/runtime/generation.py: e.g. a repetition penalty); the conversation must
        leave room for max_new_tokens."""
        reader = self._current(model)
        turn = self._conversation_ids(turn)
        check_generation(max_new_tokens, kwargs)
        if self._ids.numel() + turn.numel() == 0:
            raise ValueError("nothing to generate from: the conversation and the turn are empty")
        self._check_room(turn.numel() + max_new_tokens)
        if reader.engine is not None:
            check_engine_generation(model, reader.model, kwargs)
        with self._atomic():
            if reader.engine is not None:
                new = engine_decode(reader, turn, max_new_tokens, self.vocab)
            else:
                new = hf_generate(reader, self._ids, turn, max_new_tokens, self.vocab, kwargs)
            self._ids = torch.cat([self._ids, turn, new])
            self.active = model
            return new

    # --- the handoff ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def switch_to(self, model: str, turn=()) -> HandoffRecord:
        """Give `model` a cache of the whole conversation (module docstring), then read the new turn natively;
        returns the handoff record (the receiver's next-token logits are `session.logits`)."""
        reader = self._reader(model)
        turn = self._conversation_ids(turn)
        self._check_room(turn.numel())
        with self._atomic():
            device = model_device(reader.model)
            began = clock(device)
            held, total = reader.length, self._ids.numel()
            record = HandoffRecord(
                self.active, model, "hit", "applied", "the receiver holds the whole conversation", total, held,
                0, 0, turn.numel(), 0.0, 0.0, 0.0, 0,
            )  # fmt: skip
            if total > held:
                switch = Switch(self.readers, self.routes, self.policy, self.costs, self._ids, self.active, model, turn)
                record = cover(switch, record)
            elif turn.numel():
                reader.read(turn)
            record.ms = (clock(device) - began) * 1e3
            self._ids = torch.cat([self._ids, turn])
            self.active = model
            self._records.append(record)
            return replace(record)
