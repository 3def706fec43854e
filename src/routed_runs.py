"""The routed workloads' runs (src/routed.py): the `Run` every runner shares, its timing and scoring, and the runners
of one history per item (`single_turn`: fewshot / passage; `switches`). Each item goes through the routed session, the
all-re-prefill session (the native target: what a router does today) and the source alone, on the same token ids;
each yields per-choice scores, TTFT per path and the handoff records. The conversations are src/routed_multiturn.py's,
the rollback replay src/routed_rollback.py's.

TTFT, from "switch to the target" to its first token (argmax of the new turn's last logits), synchronized on CUDA, every
timed step under `torch.inference_mode` and never on cuDNN attention (`_timed`, `TIMED_ATTENTION`): routed = map (or re-prefill, by policy) + new turn; reprefill = the
target reads what it has not seen of the conversation (its own earlier reads kept, as the routed receiver's are: the
whole history in fewshot / passage, the chunks since its last turn in switches and multiturn); hit = the target
already holds its own history and reads the new turn. On every `same_work_every`-th scored item (conversation, in
multiturn) the routed session's handoff is also re-prefilled in a copy of that session, timed in the routed slot
(`ttft.same_work`): the baseline's own work on the same clock, which src/gate.py's harness criterion compares.
With `Run.read_error` (fewshot, passage, switches) each scored item's row also carries the receiver's read error,
spliced vs native history (src/eval/read_error.py), computed outside every clock from the native prefill already made.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from src.eval.accuracy import TaskScores, encode_pair
from src.eval.read_error import read_error
from src.eval.scoring import score_continuations
from src.runtime.engine import Engine
from src.runtime.reader import clock, model_device
from src.runtime.routing import CostModel, Policy, Route
from src.runtime.session import HandoffRecord, Session
from src.tasks import Item, choice_lengths
from src.workloads import Example, chunks, shot_ids

LENGTH_EDGES = (512, 2048, 8192, 32768)  # context-length buckets of refusals and TTFT (tokens)
# every timed step's attention backends: not cuDNN, whose SDPA builds a graph per new sequence length inside the clock
# (torch prefers it on sm90 — an H100 paid ≈ 40 ms on each re-prefill of a length its process had not run, and the
# same work, timed right after on that length, did not: results/gate-h100-2026-12-06, scripts/ttft_drift.py); a
# server's prefill (FlashAttention) has no per-length cost
TIMED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
T = TypeVar("T")


def bucket(tokens: int, edges=LENGTH_EDGES) -> str:
    """`le_<edge>` for the first edge ≥ tokens, else `gt_<last edge>`."""
    return next((f"le_{edge}" for edge in edges if tokens <= edge), f"gt_{edges[-1]}")


def _clock(model: PreTrainedModel) -> float:
    """The session clock (`reader.clock`), the device's peak memory counter reset for the step that follows."""
    device = model_device(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return clock(device)


def _peak_mb(model: PreTrainedModel) -> float:
    device = model_device(model)
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def _timed(model: PreTrainedModel, step: Callable[[], T]) -> tuple[T, float, float]:
    """step() under torch.inference_mode on the `TIMED_ATTENTION` backends, clocked from a device sync before it to its
    return (a step ends on a host read of the first token: a device sync): (its result, ms, GPU peak MB). Every TTFT
    is taken here."""
    began = _clock(model)
    with torch.inference_mode(), sdpa_kernel(TIMED_ATTENTION):
        result = step()
    return result, (time.perf_counter() - began) * 1e3, _peak_mb(model)


@dataclass
class Run:
    """What every runner shares: the models ("source", "target"), their bound routes, the routed policy, the
    tokenizer, untimed warm-up items, the same-work sampling rate (every k-th scored item), one cost model (every
    session's measurements), throughput counters, and whether single-turn runners diagnose the read error."""

    models: dict[str, PreTrainedModel]
    routes: dict[tuple[str, str], Route]
    policy: Policy
    tokenizer: object
    warmup: int
    same_work_every: int
    costs: CostModel = field(default_factory=CostModel)
    engines: dict[str, dict[str, Engine]] = field(default_factory=dict)  # kind → model → Engine, kept across items
    read_error: bool = False  # each scored item's receiver read error, spliced vs native (src/eval/read_error.py)
    open: dict[str, Session] = field(default_factory=dict)  # kind → its session now on its engines (`session`)
    seconds: dict[str, float] = field(default_factory=lambda: {"routed": 0.0, "reprefill": 0.0})
    tokens: int = 0
    items: int = 0

    def __post_init__(self) -> None:
        if type(self.same_work_every) is not int or self.same_work_every < 1:  # bool is not a rate
            raise ValueError(
                f"workload.same_work_every must be an integer ≥ 1 (every k-th scored item re-prefills in the routed "
                f"session: the gate's harness check), not {self.same_work_every!r}"
            )

    def sampled(self, n: int) -> bool:
        """Whether scored item (conversation) n also times the same work in the routed session."""
        return n % self.same_work_every == 0

    def session(self, kind: str) -> Session:
        """`routed`: the workload's policy; `reprefill`: a session that never tries a transfer. With engines, each
        kind's session holds its models on that kind's engines (emptied first: one session of a kind at a time, the
        previous one closed)."""
        engines = self.engines.get(kind)
        if kind in self.open:
            self.open.pop(kind).close()
        if kind == "routed":
            self.open[kind] = Session(self.models, self.routes, self.policy, self.costs, engines=engines)
        else:
            self.open[kind] = Session(self.models, {}, Policy(mode="reprefill"), self.costs, engines=engines)
        return self.open[kind]

    def warmed(self) -> None:
        """The warm-up turns are over: capture every engine's remaining graph buckets (a first use would capture inside
        a timed turn), then forget their clock (throughput) and their costs (the `auto` policy's line must not fit
        kernel compilation and first allocations)."""
        for engine in (e for kind in self.engines.values() for e in kind.values()):
            engine.capture_all()
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.costs = CostModel()

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)

    def groups(self, item: Item) -> list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]]:
        """(new-turn ids, [(choice, continuation ids)]) per distinct context, lm-eval's split (encode_pair)."""
        groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        for j, (context, continuation) in enumerate(zip(item.contexts, item.continuations, strict=True)):
            ids, more = encode_pair(self.tokenizer, context, continuation)
            groups.setdefault(tuple(ids), []).append((j, torch.tensor(more, dtype=torch.long)))
        return [(torch.tensor(ids, dtype=torch.long), choices) for ids, choices in groups.items()]

    def throughput(self) -> dict[str, float]:
        """Items and tokens per second of each session kind, and the counts they are made of (shards add up)."""
        return (
            {
                f"throughput.{kind}_{unit}": count / seconds
                for kind, seconds in self.seconds.items()
                if seconds
                for unit, count in (("items_per_s", self.items), ("tokens_per_s", self.tokens))
            }
            | {f"throughput.{kind}_seconds": seconds for kind, seconds in self.seconds.items()}
            | {
                "throughput.items": float(self.items),
                "throughput.tokens": float(self.tokens),
            }
        )


@torch.no_grad()
def _score(model: PreTrainedModel, cache: DynamicCache | None, drop: int, groups) -> list[list[float]]:
    """[ll, greedy] per choice: on a copy of the cache less its last `drop` tokens, each group's turn is read (but
    its last token) and its continuations scored after that token (src.eval.scoring)."""
    base = copy.deepcopy(cache) if cache is not None else DynamicCache(config=model.config)
    if drop:
        base.crop(-drop)
    device = model_device(model)
    scores: dict[int, list[float]] = {}
    for turn, choices in groups:
        own = copy.deepcopy(base)
        if turn.numel() > 1:
            model(turn[None, :-1].to(device), past_key_values=own, use_cache=True, logits_to_keep=1)
        results = score_continuations(model, own, int(turn[-1]), [ids for _, ids in choices])
        scores |= {j: [ll, float(greedy)] for (j, _), (ll, greedy) in zip(choices, results, strict=True)}
    return [scores[j] for j in sorted(scores)]


def first_token(session: Session, receiver: str, turn: torch.Tensor) -> tuple[HandoffRecord, float, float]:
    """Switch to the receiver with the new turn and take its first token: (record, TTFT ms, GPU peak MB)."""

    def switch():
        record = session.switch_to(receiver, turn)
        if session.logits is not None:  # no new turn (a confidence escalation): its token is read in scoring
            int(session.logits.argmax())  # the first token (a device sync)
        return record

    return _timed(session.readers[receiver].model, switch)


def same_work(
    session: Session, receiver: str, turn: torch.Tensor, engines: dict[str, Engine] | None = None
) -> tuple[float, float]:
    """This handoff re-prefilled in a copy of the session — its caches, its conversation, policy `reprefill`, a cost
    model of its own (the routed policy's costs stay untouched): the baseline's work, timed on the routed session's
    clock and harness. Returns (TTFT ms, wall seconds of the whole check, copy included: not the routed session's
    throughput). The session itself is left as it was; engine readers fork into `engines` (kept warm)."""
    began = time.perf_counter()
    twin = session.fork(engines)  # caches copied; policy and cost model replaced on the copy alone
    twin.policy, twin.costs = replace(session.policy, mode="reprefill"), CostModel()
    try:
        _, ms, _ = first_token(twin, receiver, turn)
    finally:
        twin.close()  # its warm engines go to the next check
    return ms, time.perf_counter() - began


def item_row(item: Item, history: int, turn: int, groups, scores: dict, ttft: dict, peaks: dict, record) -> dict:
    """One scored item's row of the run's items (`task_scores` reads it, as do src/gate_evidence.py and
    src/length_evidence.py)."""
    gold = next(ids for _, choices in groups for j, ids in choices if j == item.label)
    return {
        "task": item.task,
        "index": item.index,
        "label": item.label,
        "lengths": choice_lengths(item),
        "history_tokens": history,
        "turn_tokens": turn,
        "scores": scores,
        "nll": {mode: -s[item.label][0] / gold.numel() for mode, s in scores.items()},
        "ttft": ttft,
        "gpu_peak_mb": peaks,
        "handoff": asdict(record) if record is not None else None,
    }


def task_scores(rows: list[dict], mode: str) -> TaskScores:
    """One mode's scores of the rows (one task) in the protocol's format (src.eval.accuracy)."""
    routed = mode == "routed"
    return TaskScores(
        rows[0]["task"],
        [[s[0] for s in row["scores"][mode]] for row in rows],
        [[bool(s[1]) for s in row["scores"][mode]] for row in rows],
        [row["label"] for row in rows],
        [row["lengths"] for row in rows],
        [row["history_tokens"] + row["turn_tokens"] for row in rows],
        [row["handoff"]["prefill_fraction"] if routed and row["handoff"] else 1.0 for row in rows],
    )


def _natives(run: Run, history: torch.Tensor, groups) -> tuple[dict, dict, dict, DynamicCache | None]:
    """The all-re-prefill session and the source alone on the same ids: scores, TTFT (reprefill, hit), peaks, and
    with `run.read_error` a copy of the native target's cache (history + turn: the read error's reference)."""
    target, turn = run.models["target"], groups[0][0]
    began = time.perf_counter()
    native = run.session("reprefill")
    native.append("source", history)
    _, ttft, peak = first_token(native, "target", turn)
    scores = {"native_target": _score(target, native.cache("target"), turn.numel(), groups)}
    run.seconds["reprefill"] += time.perf_counter() - began
    engine = native.readers["target"].engine
    if engine is not None:  # the same hit on the engine: it holds its own history and reads the turn again
        held = native.holds("target") - turn.numel()
        positions = torch.arange(held, held + turn.numel())

        def hit() -> int:
            engine.truncate(held)
            return int(engine.forward(turn, positions).argmax())

    else:
        cache = copy.deepcopy(native.cache("target"))
        cache.crop(-turn.numel())  # the target holds its own history: a same-model prefix hit
        hit = lambda: int(target(turn[None].to(target.device), past_key_values=cache, logits_to_keep=1).logits.argmax())
    _, hit_ms, hit_peak = _timed(target, hit)
    scores["native_source"] = _score(run.models["source"], native.cache("source"), 0, groups)
    reference = native.cache("target") if run.read_error else None
    return scores, {"reprefill": ttft, "hit": hit_ms}, {"reprefill": peak, "hit": hit_peak}, reference


def _read_error(run: Run, reference: DynamicCache | None, routed: Session, history: int, turn: torch.Tensor) -> dict:
    """{"read_error": …} of a scored item (src/eval/read_error.py), untimed; {} unless the run diagnoses it."""
    if reference is None:
        return {}
    return {"read_error": read_error(run.models["target"], reference, routed.cache("target"), history, turn)}


def single_turn(run: Run, examples: list[Example]) -> tuple[list[dict], list[dict]]:
    """fewshot / passage: the source reads the history, the router switches to the target with the question."""
    rows, records = [], []
    for n, example in enumerate(examples[: run.warmup] + examples):
        history, groups = run.encode(example.history), run.groups(example.item)
        scores, ttft, peaks, reference = _natives(run, history, groups)
        began = time.perf_counter()
        routed = run.session("routed")
        routed.append("source", history)
        if n >= run.warmup and run.sampled(n - run.warmup):
            ttft["same_work"], checked = same_work(routed, "target", groups[0][0], run.engines.get("twin"))
            began += checked  # the check is not the routed session's throughput
        record, ttft["routed"], peaks["routed"] = first_token(routed, "target", groups[0][0])
        scores["routed"] = _score(run.models["target"], routed.cache("target"), groups[0][0].numel(), groups)
        if n < run.warmup:  # untimed: kernels, allocator
            run.warmed()
            continue
        run.seconds["routed"] += time.perf_counter() - began
        run.items, run.tokens = run.items + 1, run.tokens + history.numel() + groups[0][0].numel()
        row = item_row(example.item, history.numel(), groups[0][0].numel(), groups, scores, ttft, peaks, record)
        diagnosed = _read_error(run, reference, routed, history.numel(), groups[0][0])
        rows.append(row | {"shots": shot_ids(example.shots)} | diagnosed)
        records.append(asdict(record))
    return rows, records


def _alternate(session: Session, history: torch.Tensor, count: int) -> Session:
    """The history cut into `count` chunks read by alternating models, the last by the source, so that the target
    reads the question after `count` handoffs; returns the session."""
    for i, chunk in enumerate(chunks(history, count)):
        session.switch_to("target" if (count - i) % 2 == 0 else "source", chunk)
    return session


def switches(run: Run, examples: list[Example], counts) -> tuple[list[dict], list[dict], dict[int, list[dict]]]:
    """A→B→A…: the history cut into `s` chunks read by alternating models so that the target reads the question
    after `s` handoffs. The re-prefill baseline goes through the same switches in a session that never maps, so its
    final handoff reads what the routed one covers: the tokens the target has not seen (the last chunk). Rows per
    switch count (the last count's are the run's headline rows)."""
    per_count: dict[int, list[dict]] = {s: [] for s in counts}
    records = []
    for n, example in enumerate(examples[: run.warmup] + examples):
        history, groups = run.encode(example.history), run.groups(example.item)
        turn = groups[0][0]
        natives, whole, peaks, reference = _natives(run, history, groups)
        for count in counts:
            if count > history.numel():
                continue
            ttft = {"hit": whole["hit"]}
            _, ttft["reprefill"], peaks["reprefill"] = first_token(
                _alternate(run.session("reprefill"), history, count), "target", turn
            )
            routed = _alternate(run.session("routed"), history, count)
            if n >= run.warmup and run.sampled(n - run.warmup):
                ttft["same_work"], _ = same_work(routed, "target", turn)
            record, ttft["routed"], peaks["routed"] = first_token(routed, "target", turn)
            scores = natives | {"routed": _score(run.models["target"], routed.cache("target"), turn.numel(), groups)}
            if n >= run.warmup:
                row = item_row(example.item, history.numel(), turn.numel(), groups, scores, ttft, dict(peaks), record)
                diagnosed = _read_error(run, reference, routed, history.numel(), turn)
                per_count[count].append(row | {"switches": count} | diagnosed)
                records += [asdict(r) for r in routed.records]
        if n < run.warmup:
            run.warmed()
    return per_count[max(counts)], records, per_count
