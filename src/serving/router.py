"""One conversation over several vLLM engines (one model each, `LLM` objects with the kvrelay connector), with the
router session's semantics (src/runtime/session.py): a model reads or generates on the conversation it holds, and
`switch_to` gives another model the whole conversation — reused where it already holds it, mapped from the active
model's export along a route, or re-prefilled — then reads the new turn.

    router = Router({"small": small_llm, "large": large_llm}, {("small", "large"): mapper_id})
    router.append("small", history_ids)              # small reads the history (its prompt is exported)
    answer = router.generate("small", question, 32)  # greedy; the conversation grows by the turn and the answer
    record = router.switch_to("large", follow_up)    # a HandoffRecord: hit / map / reprefill, and why
    answer = router.generate("large", [], 32)        # continues on large's mapped cache (its prefix keys)

Each call is one vLLM request on one engine (greedy, `logprobs` top entries kept as `router.logprobs`), whose
prompt is the whole conversation: an engine's prefix cache serves what it computed before. Every request exports
its prompt's K/V; a switch first brings the sender's export up to the whole conversation (a request that hits the
sender's own cache and computes only the rest), and, with `sink` > 0, makes the receiver read the first `sink`
tokens natively if it does not hold them (the connector serves a sink only as a native prefix hit). Once a model
holds a mapped span, its later requests name it (`params.Mapped`) so its prefix-cache keys — and hits — stay those
of the handoff. A handoff into a model that holds none of the conversation, with no sink, carries the
conversation's provenance salt (`cache_salt`, src/serving/provenance.py), and so does every later request of that
model: vLLM then keys its blocks apart itself and the connector re-keys nothing. Refusals are the connector's: the
request is then an ordinary prefill, and the record says why.
Checked before any request: model names, token ids (integers inside every engine's vocabulary), routes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from src.runtime.session import HandoffRecord
from src.serving.params import KEY, Handoff, Mapped, prompt, request_params
from src.serving.provenance import provenance_salt


@dataclass(frozen=True)
class Reply:
    """What one request returned: generated ids, vLLM's cached-token count, the connector's record, top logprobs."""

    tokens: list[int]
    cached: int
    record: dict
    logprobs: list[dict[int, float]]


class Router:
    """A conversation over vLLM engines (module docstring)."""

    def __init__(
        self, engines: dict, routes: dict[tuple[str, str], str] | None = None, sink: int = 0, logprobs: int = 5
    ):
        if not isinstance(engines, dict) or not engines:
            raise ValueError("a router needs a dict of at least one named vLLM engine")
        self.engines = dict(engines)
        self.routes = dict(routes or {})
        for (sender, receiver), mapper in self.routes.items():
            if sender not in self.engines or receiver not in self.engines or not isinstance(mapper, str):
                raise ValueError(f"route {sender} → {receiver} must join two of {sorted(self.engines)} by a mapper id")
        if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
            raise ValueError(f"sink must be an integer ≥ 0, not {sink!r}")
        self.sink, self.top = sink, logprobs
        self.vocab = min(llm.llm_engine.model_config.get_vocab_size() for llm in self.engines.values())
        self.ids: list[int] = []
        self.active: str | None = None
        self.holds = {name: 0 for name in self.engines}  # conversation tokens each model has been given
        self.exports: dict[str, tuple[str, int]] = {}  # model → (its newest export id, tokens it holds)
        self.mapped: dict[str, Mapped] = {}  # model → the mapped span its cache holds (keys, exports)
        self.salts: dict[str, str] = {}  # model → the cache_salt of its requests (module docstring)
        self.logprobs: list[dict[int, float]] = []
        self.records: list[HandoffRecord] = []
        self.last: Reply | None = None  # the newest request's reply

    def _tokens(self, tokens: object) -> list[int]:
        ids = list(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str) else None
        if ids is None or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab for i in ids):
            raise ValueError(f"token ids must be a sequence of integers in [0, {self.vocab}), not {tokens!r:.80}")
        return ids

    def _model(self, name: object) -> str:
        if name not in self.engines:
            raise ValueError(f"no model {name!r} in this router; it holds {sorted(self.engines)}")
        return name

    def _current(self, name: object) -> str:
        model = self._model(name)
        if self.holds[model] != len(self.ids):
            raise ValueError(f"{model!r} holds {self.holds[model]} of the conversation's {len(self.ids)} tokens: "
                             f"switch_to({model!r}) first")  # fmt: skip
        return model

    def _request(self, model: str, ids: list[int], max_tokens: int, handoff: Handoff | None = None) -> Reply:
        from vllm import SamplingParams

        params = request_params(export=True, handoff=handoff, mapped=self.mapped.get(model))
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=self.top, detokenize=False,
                                  extra_args={"kv_transfer_params": params})  # fmt: skip
        output = self.engines[model].generate([prompt(ids, self.salts.get(model))], sampling, use_tqdm=False)[0]
        record = (output.kv_transfer_params or {}).get(KEY, {})
        completion = output.outputs[0]
        logprobs = [{t: entry.logprob for t, entry in step.items()} for step in completion.logprobs or []]
        if record.get("export"):
            self.exports[model] = (record["export"], len(ids))
        self.last = Reply(list(completion.token_ids), output.num_cached_tokens or 0, record, logprobs)
        return self.last

    def append(self, model: str, tokens) -> Reply:
        """The model reads new tokens on the conversation it holds (one token is sampled and dropped)."""
        model, ids = self._current(model), self._tokens(tokens)
        if not self.ids and not ids:
            raise ValueError("nothing to read: the conversation and the tokens are empty")
        reply = self._request(model, self.ids + ids, 1)
        self._advance(model, ids, reply)
        return reply

    def generate(self, model: str, turn, max_new_tokens: int) -> list[int]:
        """Greedy tokens after the turn on the conversation the model holds; both join the conversation."""
        model, ids = self._current(model), self._tokens(turn)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer ≥ 1, not {max_new_tokens!r}")
        if not self.ids and not ids:
            raise ValueError("nothing to generate from: the conversation and the turn are empty")
        reply = self._request(model, self.ids + ids, max_new_tokens)
        self._advance(model, ids + reply.tokens, reply)
        return reply.tokens

    def _advance(self, model: str, tokens: list[int], reply: Reply) -> None:
        self.ids += tokens
        self.holds[model], self.active, self.logprobs = len(self.ids), model, reply.logprobs

    def switch_to(self, model: str, turn=()) -> HandoffRecord:
        """Give `model` the whole conversation, then read the turn (module docstring); returns the handoff record."""
        model, ids = self._model(model), self._tokens(turn)
        if not self.ids and not ids:
            raise ValueError("nothing to switch to: the conversation and the turn are empty")
        began, held, total = time.perf_counter(), self.holds[model], len(self.ids)
        sender = self.active
        mapper = self.routes.get((sender, model)) if sender is not None else None
        if held == total:
            path, status, reason, handoff = "hit", "applied", "the receiver holds the whole conversation", None
        elif mapper is None:
            path, status, reason, handoff = "reprefill", "unsupported", f"no route {sender} → {model}", None
        else:
            handoff = Handoff(self._export(sender), mapper)
            if self.sink and self.holds[model] < self.sink <= total:  # a sink is served as a native prefix hit
                self._request(model, self.ids[: self.sink], 1)
            if not held and not self.sink:  # nothing native to keep: vLLM keys the blocks apart itself
                self.salts.setdefault(model, provenance_salt(handoff.export_id, mapper))
        reply = self._request(model, self.ids + ids, 1, handoff)
        done = reply.record.get("handoff", {})
        hit, mapped = done.get("hit", min(reply.cached, total)), done.get("mapped", 0)
        if handoff is not None and done.get("status") == "mapped":
            path, status, reason = "map", "applied", done["reason"]
            span = self.mapped.get(model)
            start, end = done["start"], done["end"]
            self.mapped[model] = (
                Mapped(start, end, mapper) if span is None else Mapped(span.start, max(span.end, end), span.mapper_id)
            )
        elif handoff is not None:
            path, status, reason = "reprefill", "fallback_reprefill", done.get("reason", reply.record.get("error", "?"))
        unseen = max(total - hit, 0)
        record = HandoffRecord(sender, model, path, status, reason, total, hit, mapped, unseen - mapped, len(ids),
                               (unseen - mapped) / unseen if unseen else 0.0, (time.perf_counter() - began) * 1e3,
                               0.0, 0)  # fmt: skip
        self._advance(model, ids, reply)
        self.records.append(record)
        return record

    def _export(self, sender: str) -> str:
        """The sender's export of the whole conversation: its newest, or one made now (its own prefix hit)."""
        export = self.exports.get(sender)
        if export is None or export[1] < len(self.ids):
            self._request(sender, self.ids, 1)
            export = self.exports.get(sender)
        if export is None:
            raise ValueError(f"{sender!r} exported nothing: is its engine started with the kvrelay connector?")
        return export[0]
