"""The multi-turn workload's run (src/routed.py; the `Run`, its clock and its scoring are src/routed_runs.py's):
conversations chained from each task's items, each turn answered by the source, or by the target when escalated (on a
schedule, or when the source's confidence in its pick is low), its pick joining the history as its answer. Each
conversation goes through the routed session, the all-re-prefill session (same escalation policy) and the source
alone; TTFT is taken as src/routed_runs.py defines it, and on every `same_work_every`-th conversation each handoff's
same work is timed too.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from src.routed_runs import Run, first_token, item_row, same_work
from src.runtime.session import HandoffRecord, Session
from src.tasks import METRICS, Item, choice_lengths
from src.workloads import Chat, conversations


def _pick(scores: list[list[float]], item: Item) -> tuple[int, float]:
    """The model's answer under the task's metric (acc_norm: per character) and its softmax confidence in it."""
    weights = torch.tensor([s[0] for s in scores], dtype=torch.float64)
    if METRICS[item.task][0] == "acc_norm":
        weights = weights / torch.tensor(choice_lengths(item), dtype=torch.float64)
    return int(weights.argmax()), float(weights.softmax(0).max())


def _session_scores(session: Session, reader: str, groups) -> list[list[float]]:
    """[ll, greedy] per choice, scored after the whole conversation (its turn included) on the reader's own state."""
    ((_, choices),) = groups
    return [[score.logprob, float(score.greedy)] for score in session.score(reader, [ids for _, ids in choices])]


def _converse(run: Run, session: Session, items: list[Item], escalation, escalate: bool, sample: bool = False):
    """One conversation: per turn the answering model (the source, or the target when escalated: every
    `escalation.every`-th turn, or when the source's confidence in its pick is below `escalation.threshold`)
    reads the user turn, its choices are scored, its pick joins the history as its answer. With `sample`, every
    handoff is also re-prefilled in a copy of the session first (`same_work`). Returns the turns and the wall seconds
    those checks took (not the session's throughput)."""
    chat, turns, checked = Chat(run.tokenizer), [], 0.0

    def switch(reader: str, turn) -> tuple[HandoffRecord, float, float | None]:
        nonlocal checked
        same = None
        if sample and session.active not in (None, reader):  # a handoff: the sender is another model
            same, seconds = same_work(session, reader, turn)
            checked += seconds
        record, ttft, _ = first_token(session, reader, turn)
        return record, ttft, same

    for i, item in enumerate(items):
        user = run.encode(chat.user(item.contexts[0]))
        answers = [chat.answer(c.removeprefix(" "), commit=False) for c in item.continuations]
        groups = [(user, [(j, run.encode(text)) for j, (text, _) in enumerate(answers)])]
        context = session.ids.numel()
        scheduled = escalate and escalation.policy == "schedule" and (i + 1) % escalation.every == 0
        reader = "target" if scheduled else "source"
        record, ttft, same = switch(reader, user)
        scores = _session_scores(session, reader, groups)
        pick, confidence = _pick(scores, item)
        if escalate and escalation.policy == "confidence" and confidence < escalation.threshold:
            reader = "target"
            record, ttft, same = switch(reader, [])
            scores = _session_scores(session, reader, groups)
            pick, _ = _pick(scores, item)
        text, tail = chat.answer(item.continuations[pick].removeprefix(" "))
        session.append(reader, torch.cat([run.encode(text), run.encode(tail)]))
        handoff = record.sender is not None and record.sender != record.receiver
        turns.append({"item": item, "reader": reader, "context": context, "turn": user.numel(), "groups": groups,
                      "scores": scores, "ttft": ttft, "same_work": same, "handoff": handoff, "record": record})  # fmt: skip
    return turns, checked


def multiturn(
    run: Run, data_root, tasks, limit, turns: int, escalation, split: str = "test"
) -> tuple[list[dict], list[dict], int, list]:
    """Conversations chained from each task's items: the routed session, the all-re-prefill session (same
    escalation policy) and the source answering alone. Returns rows, routed records, turn count, and
    (history, turn) ids of the first escalations (for the rollback replay)."""
    rows, records, replays = [], [], []
    chained = {task: conversations(data_root, task, limit, turns, split) for task in tasks}
    for items in [c[0] for c in chained.values() if c][: run.warmup]:  # untimed: kernels, allocator
        for kind in ("routed", "reprefill"):
            _converse(run, run.session(kind), items, escalation, True)
    run.warmed()
    scored = 0  # conversations so far: every same_work_every-th is sampled
    for task in tasks:
        for n, items in enumerate(chained[task]):
            began = time.perf_counter()
            routed = run.session("routed")
            mine, checked = _converse(run, routed, items, escalation, True, run.sampled(scored))
            run.seconds["routed"] += time.perf_counter() - began - checked
            scored += 1
            began = time.perf_counter()
            native, _ = _converse(run, run.session("reprefill"), items, escalation, True)
            run.seconds["reprefill"] += time.perf_counter() - began
            alone, _ = _converse(run, run.session("reprefill"), items, escalation, False)
            records += [asdict(r) for r in routed.records]
            run.items, run.tokens = run.items + len(items), run.tokens + routed.ids.numel()
            for r, t, s in zip(mine, native, alone, strict=True):
                scores = {"routed": r["scores"], "native_target": t["scores"], "native_source": s["scores"]}
                ttft = {"routed": r["ttft"]} if r["handoff"] else {}
                ttft |= {"same_work": r["same_work"]} if r["handoff"] and r["same_work"] is not None else {}
                ttft |= {"reprefill": t["ttft"]} if t["handoff"] else {"hit": t["ttft"]} if t["context"] else {}
                row = item_row(r["item"], r["context"], r["turn"], r["groups"], scores, ttft, {}, r["record"])
                rows.append(row | {"conversation": f"{task}#{n}", "escalated": r["reader"] == "target"})
                if r["handoff"] and r["reader"] == "target" and len(replays) < 4:
                    start = r["context"]
                    replays.append((routed.ids[:start], routed.ids[start : start + r["turn"]]))
    return rows, records, len(rows), replays
