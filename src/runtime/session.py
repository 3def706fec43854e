"""A router's conversation held by several models, each with its own KV cache — the runtime a router imports.

    routes = {("small", "large"): bind(small, large, mapper, tokenizer_hash)}   # src/runtime/routing.py: verified once
    session = Session({"small": small, "large": large}, routes, Policy(mode="map", levers=Levers(native_sink=4)))
    session.append("small", history_ids)                 # small reads the history on its own cache
    record = session.switch_to("large", question_ids)    # large: reuse + map (or re-prefill), then the new turn
    answer = session.generate("large", [], max_new_tokens=32)   # HF greedy generate on large's cache

`switch_to` gives the receiver a cache of the whole conversation: the tokens it already holds are reused (a same-model
prefix hit); the tokens it has not seen are mapped at their own positions, segment by segment, each from a model that
read it natively (the sender first), or re-prefilled on top of what it holds — by `Policy.mode`: map, reprefill, or
auto (the faster path by measured per-token costs; src/runtime/routing.py); the levers (`src.runtime.levers.Levers`) keep parts of the
mapped span native. The new turn is always read natively. Every refusal — a mapper refused at binding (artifact mismatch), a sliding-window
receiver, no route (status `unsupported`), non-finite values, length beyond the mapper's calibration, a failed guard
(`fallback_reprefill`) — re-prefills exactly as a session that never tried a transfer, so its caches and greedy
outputs are bit-identical; the record says why. Each cache carries provenance per segment (native, or mapped from
model X by mapper id); `exact_prefix` exports only the model's own computation over an exact context, so mapped KV is
never served as an exact prefix hit.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache, PreTrainedModel

from src.apply import KVTransfer
from src.maps import TransferError, cache_layers
from src.runtime.levers import Levers, spent
from src.runtime.routing import CostModel, Policy, Route
from src.runtime.splice import splice

PATHS = ("hit", "map", "reprefill")
STATUSES = ("applied", "fallback_reprefill", "unsupported")


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
    """One `switch_to`: what the receiver reused, mapped and prefilled, at what cost, and why."""

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
    prefill_fraction: float  # share of the receiver's prefill of the unseen tokens spent (0 when none were unseen)
    ms: float  # the whole switch: reuse + map / prefill + the new turn's logits
    ms_map: float  # the mapper calls within it
    bytes: int  # K/V bytes read from the senders' caches for the mapped tokens
    recomputed: int = 0  # mapped tokens recomputed in place (Levers.recompute)


@dataclass
class _Reader:
    model: PreTrainedModel
    cache: DynamicCache | None = None
    segments: list[Segment] = field(default_factory=list)

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


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _ids(tokens) -> torch.Tensor:
    """Token ids [N] (long, CPU) from a list, a [N] or a [1, N] tensor."""
    ids = torch.as_tensor(tokens, dtype=torch.long).cpu()
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"a session holds one conversation: token ids [N] or [1, N], got {tuple(ids.shape)}")
    return ids


class Session:
    """One conversation (token ids) held by several models, each with its own `DynamicCache` (module docstring)."""

    def __init__(
        self,
        models: dict[str, PreTrainedModel],
        routes: dict[tuple[str, str], Route] | None = None,
        policy: Policy | None = None,
        costs: CostModel | None = None,
    ):
        self.readers = {name: _Reader(model) for name, model in models.items()}
        self.routes = dict(routes or {})
        for sender, receiver in self.routes:
            if sender not in models or receiver not in models:
                raise ValueError(f"route {sender} → {receiver} names a model the session does not hold")
        self.policy = policy if policy is not None else Policy()
        self.costs = costs if costs is not None else CostModel()
        self.ids = torch.zeros(0, dtype=torch.long)  # [T] the conversation
        self.active: str | None = None
        self.logits: torch.Tensor | None = None  # [1, V] after the last token read
        self.records: list[HandoffRecord] = []

    # --- what the session holds --------------------------------------------------------------------------------

    def _reader(self, model: str) -> _Reader:
        if model not in self.readers:
            raise ValueError(f"no model {model!r} in this session; it holds {sorted(self.readers)}")
        return self.readers[model]

    def holds(self, model: str) -> int:
        """Conversation tokens in the model's cache (a prefix of the conversation)."""
        return self._reader(model).length

    def cache(self, model: str) -> DynamicCache | None:
        return self._reader(model).cache

    def segments(self, model: str) -> list[Segment]:
        """Provenance of the model's cache, segment by segment."""
        return list(self._reader(model).segments)

    def exact_prefix(self, model: str) -> tuple[torch.Tensor, DynamicCache | None]:
        """The longest prefix whose K/V are the model's own computation over an exact context — what a prefix cache
        may serve as a hit: its ids [P] and a copy of the cache cut to it (None when P = 0). Mapped tokens, and
        tokens read after them, are never part of it."""
        reader = self._reader(model)
        length = 0
        for segment in reader.segments:
            if not segment.exact:
                break
            length = segment.end
        if length == 0:
            return self.ids[:0], None
        cache = copy.deepcopy(reader.cache)
        if length < reader.length:
            cache.crop(length - reader.length)
        return self.ids[:length], cache

    # --- reading and generating --------------------------------------------------------------------------------

    def _read(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The model reads ids [N] natively on its cache; returns the last logits [1, V]."""
        reader = self._reader(name)
        if reader.cache is None:
            reader.cache = DynamicCache(config=reader.model.config)
        start = reader.length
        out = reader.model(
            ids[None].to(_device(reader.model)), past_key_values=reader.cache, use_cache=True, logits_to_keep=1
        )
        reader.add(Segment(start, start + ids.numel(), "native", reader.exact))
        self.logits = out.logits[:, -1]  # [1, V]
        return self.logits

    def _current(self, name: str) -> _Reader:
        reader = self._reader(name)
        if reader.length != self.ids.numel():
            raise ValueError(
                f"{name!r} holds {reader.length} of the conversation's {self.ids.numel()} tokens: "
                f"switch_to({name!r}) first"
            )
        return reader

    @torch.no_grad()
    def append(self, model: str, tokens) -> torch.Tensor | None:
        """The model reads new tokens natively on its cache (it must hold the whole conversation); returns the last
        logits [1, V] (None for no tokens)."""
        self._current(model)
        ids = _ids(tokens)
        self.active = model
        if ids.numel() == 0:
            return None
        logits = self._read(model, ids)
        self.ids = torch.cat([self.ids, ids])
        return logits

    @torch.no_grad()
    def generate(self, model: str, turn, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """HF `generate` (greedy unless kwargs say otherwise) on the model's cache after the new turn; the turn and
        the generated tokens join the conversation (the last one read too, so the cache covers them all). Returns
        the generated ids [G]."""
        reader = self._current(model)
        turn = _ids(turn)
        if self.ids.numel() + turn.numel() == 0:
            raise ValueError("nothing to generate from: the conversation and the turn are empty")
        if turn.numel() == 0:  # HF reads at least one uncached token: re-read the last one (the crop is exact)
            turn = self.ids[-1:]
            self.ids = self.ids[:-1]
            reader.cache.crop(-1)
            last = reader.segments.pop()
            if last.end - 1 > last.start:
                reader.segments.append(replace(last, end=last.end - 1))
        if reader.cache is None:
            reader.cache = DynamicCache(config=reader.model.config)
        prompt = torch.cat([self.ids, turn])[None].to(_device(reader.model))  # [1, T + N]
        config = reader.model.generation_config
        settings = {"do_sample": False, "max_new_tokens": max_new_tokens}
        if config.pad_token_id is None:
            eos = config.eos_token_id
            settings["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        out = reader.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), past_key_values=reader.cache, **(settings | kwargs)
        )
        new = out[0, prompt.shape[1] :].cpu()  # [G]
        start = self.ids.numel()
        reader.add(Segment(start, start + turn.numel() + new.numel() - 1, "native", reader.exact))
        self.ids = torch.cat([self.ids, turn, new])
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
            refused = [r.refusal for (s, t), r in self.routes.items() if t == receiver and r.refusal]
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

    def _map(self, receiver: str, pieces: list[tuple[int, int, str]]) -> tuple[list[DynamicCache], int]:
        """Each piece mapped at its own positions; raises TransferError on any refusal (nothing is changed)."""
        mapped, read = [], 0
        for start, end, sender in pieces:
            route = self.routes[(sender, receiver)]
            limit = self.policy.max_length_factor
            if limit is not None and route.calibrated_length is not None and end > limit * route.calibrated_length:
                raise TransferError(
                    f"position {end - 1} is beyond {limit:g} × the mapper's calibration length "
                    f"{route.calibrated_length}"
                )
            layers = [(k[:, :, start:end], v[:, :, start:end]) for k, v in cache_layers(self.readers[sender].cache)]
            read += sum(t.numel() * t.element_size() for pair in layers for t in pair)
            cache = route.transfer(layers, positions=torch.arange(start, end), input_ids=self.ids[None, start:end])
            bound = self.policy.guard_max_abs
            if bound is not None:
                peak = float(torch.stack([t.abs().amax() for pair in cache_layers(cache) for t in pair]).max())
                if peak > bound:
                    raise TransferError(f"guard: mapped |K|, |V| reach {peak:.3g} > {bound:g}")
            mapped.append(cache)
        return mapped, read

    @torch.no_grad()
    def switch_to(self, model: str, turn=()) -> HandoffRecord:
        """Give `model` a cache of the whole conversation (module docstring), then read the new turn natively;
        returns the handoff record (the turn's last logits are `session.logits`)."""
        reader = self._reader(model)
        turn = _ids(turn)
        device = _device(reader.model)
        began = _clock(device)
        self.logits = None
        held, total = reader.length, self.ids.numel()
        unseen = total - held
        record = HandoffRecord(
            self.active, model, "hit", "applied", "the receiver holds the whole conversation", total, held,
            0, 0, turn.numel(), 0.0, 0.0, 0.0, 0,
        )  # fmt: skip
        if unseen:
            record = self._cover(model, record, turn)
        elif turn.numel():
            self._read(model, turn)
        record.ms = (_clock(device) - began) * 1e3
        self.ids = torch.cat([self.ids, turn])
        self.active = model
        self.records.append(record)
        return record

    def _reprefill(
        self, model: str, record: HandoffRecord, turn: torch.Tensor, status: str, reason: str
    ) -> HandoffRecord:
        """The receiver reads the unseen tokens and the turn in one forward: what a session without transfers does."""
        began = _clock(_device(self._reader(model).model))
        native = torch.cat([self.ids[record.hit :], turn])
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
        hold = min(levers.hold_back, total - sink_end)
        end = total - hold
        if end <= sink_end:
            return self._reprefill(model, record, turn, "applied", "the levers leave no token to map")
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
        mapped: list[DynamicCache],
        start: int,
        end: int,
        span: Levers,
        transfer: KVTransfer,
        turn: torch.Tensor,
    ) -> int:
        """Commit a map that passed every check through the one splice (src/runtime/splice.py): sink tokens read
        natively, the mapped pieces appended, the levers' native layers and recomputed tokens, then the hold-back
        tokens and the turn read natively in one forward. Returns how many mapped tokens were recomputed."""
        reader = self._reader(model)
        target = reader.model
        held, total = reader.length, self.ids.numel()
        if reader.cache is None:
            reader.cache = DynamicCache(config=target.config)
        native = torch.cat([self.ids[end:total], turn])[None]  # [1, hold-back + turn]
        mapped_segments = [
            Segment(low, high, "mapped", False, sender, self.routes[(sender, model)].mapper_id)
            for low, high, sender in pieces
        ]

        def read(ids: torch.Tensor, part: str) -> None:
            if part == "sink":
                self._read(model, ids[0])
                return
            for segment in mapped_segments:  # the span precedes the tail in the provenance
                reader.add(segment)
            mapped_segments.clear()
            began = _clock(_device(target))
            self._read(model, ids[0])
            self.costs.observe(model, "prefill", ids.shape[1], (_clock(_device(target)) - began) * 1e3)

        count = splice(
            target, reader.cache, self.ids[None, :end], start, mapped, span, total - held, transfer.token_features,
            native, native, read,
        )  # fmt: skip
        for segment in mapped_segments:  # no tail was read: the span ends the cache
            reader.add(segment)
        return count
