"""The routed workloads (conf/workload/<name>.yaml) by name: how each one's items go through the sessions, the
(history, new turn) items it builds from the task data (src/workloads.py), and whether its conversation comes back to
the source. The routed job (src/routed.py) looks the configured workload up in `WORKLOADS`; a new workload is one entry
there and one YAML listing what differs from conf/workload/default.yaml (docs/extending.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from src.routed_multiturn import multiturn
from src.routed_runs import Run, single_turn, switches
from src.workloads import Example, calibration_files, fewshot, passage


def fewshot_examples(cfg: DictConfig) -> list[Example]:
    """k-shot prompts of every task of the workload; shots never from the calibration's files."""
    w, seen = cfg.workload, calibration_files(cfg.budget.corpus) if not cfg.budget.synthetic else frozenset()
    return [
        ex for task in w.tasks for ex in fewshot(cfg.paths.data, task, w.limit, w.shots[task], cfg.seed, seen, w.split)
    ]


def passage_examples(cfg: DictConfig) -> list[Example]:
    """Passage histories and their questions / final sentences, every task of the workload."""
    w = cfg.workload
    return [ex for task in w.tasks for ex in passage(cfg.paths.data, task, w.limit, w.split)]


def examples(cfg: DictConfig, name: str) -> list[Example]:
    """The (history, new turn) items of workload `name` (`WORKLOADS[name].examples`), every task of cfg.workload."""
    build = WORKLOADS[name].examples if name in WORKLOADS else None
    if build is None:
        having = sorted(key for key, workload in WORKLOADS.items() if workload.examples is not None)
        raise ValueError(f"workload {name!r} has no examples of its own: one of {having}")
    return build(cfg)


@dataclass
class Played:
    """A workload's items through the sessions: per-item rows, handoff records, turns scored, (history, new turn) ids
    to replay rollback on, the examples whose histories were mapped (the fidelity diagnosis; none for multiturn), and
    for switches the final turns after s switches, by s (the job scores each count apart)."""

    items: list[dict]
    records: list[dict]
    turns: int
    replays: list[tuple[torch.Tensor, torch.Tensor]]
    examples: list[Example] = field(default_factory=list)
    per_switches: dict[int, list[dict]] = field(default_factory=dict)


def _replays(run: Run, chosen: list[Example]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(run.encode(ex.history), run.groups(ex.item)[0][0]) for ex in chosen]


def check_shard(index: object, count: object) -> None:
    """A ValueError unless `count` ≥ 1 and 0 ≤ `index` < count are integers (bools are not)."""
    if type(count) is not int or count < 1 or type(index) is not int or not 0 <= index < count:
        raise ValueError(f"workload.shard must be an integer in [0, workload.shards) and workload.shards an integer "
                         f"≥ 1, got shard {index!r} of {count!r}")  # fmt: skip


def shard(chosen: list[Example], index: int, count: int) -> list[Example]:
    """Item shard `index` of `count`: per task, the examples at positions ≡ index (mod count) — the shards partition
    each task's items, and together they are the unsharded run's."""
    check_shard(index, count)
    seen: dict[str, int] = {}
    kept = []
    for ex in chosen:
        position = seen[ex.item.task] = seen.get(ex.item.task, -1) + 1
        if position % count == index:
            kept.append(ex)
    return kept


def play_single_turn(run: Run, cfg: DictConfig) -> Played:
    """Each example once: the source reads the history, the target answers the new turn (fewshot, passage); a sharded
    run (`workload.shards` > 1) plays its shard of them."""
    w = cfg.workload
    chosen = shard(examples(cfg, w.name), w.shard, w.shards)
    items, records = single_turn(run, chosen)
    return Played(items, records, len(items), _replays(run, chosen), chosen)


def play_switches(run: Run, cfg: DictConfig) -> Played:
    """The base workload's histories read in chunks by alternating models, the target reading the question after
    each switch count."""
    w = cfg.workload
    chosen = examples(cfg, w.base)
    items, records, per_count = switches(run, chosen, w.switch_counts)
    return Played(items, records, len(items), _replays(run, chosen), chosen, per_count)


def play_multiturn(run: Run, cfg: DictConfig) -> Played:
    """Conversations chained from the task items, escalating on the workload's schedule."""
    w = cfg.workload
    items, records, turns, replays = multiturn(run, cfg.paths.data, w.tasks, w.limit, w.turns, w.escalation, w.split)
    return Played(items, records, turns, replays)


@dataclass(frozen=True)
class Workload:
    """One routed workload: how its items go through the sessions (`play`), its own (history, new turn) items where
    it has them (`examples`: what switches' `base` and scripts/history_tokens.py read), and whether the conversation
    comes back to the source (`reverse`: the target → source mapper is fitted too), and what it supports: item shards
    over calls (`shards`), the static engine (`engine`), the read-error diagnosis (`read_error`)."""

    play: Callable[[Run, DictConfig], Played]
    examples: Callable[[DictConfig], list[Example]] | None = None
    reverse: bool = False
    shards: bool = False  # its items can be split over calls (`workload.shards`) and joined (src/routed_merge.py)
    engine: bool = False  # every session and timed path may run on the static engine (`workload.engine_capacity`)
    read_error: bool = False  # the routed and native receivers read the same history (`eval.diagnose.read_error`)


# The routed workloads, by conf/workload/<name>.yaml `name`. A new one: an entry here and a YAML (docs/extending.md).
WORKLOADS: dict[str, Workload] = {
    "fewshot": Workload(play_single_turn, fewshot_examples, shards=True, engine=True, read_error=True),
    "fewshot_long": Workload(  # shot counts cycling up to 32K-token histories
        play_single_turn, fewshot_examples, shards=True, engine=True, read_error=True
    ),
    "passage": Workload(play_single_turn, passage_examples, shards=True, engine=True, read_error=True),
    "switches": Workload(play_switches, reverse=True, read_error=True),
    "multiturn": Workload(play_multiturn, reverse=True),
}
