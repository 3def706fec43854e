"""Which run of an operating point the gate judges: the pre-registered one, never the latest or the best.

An operating point is what a verdict is about beside its workload and direction: the history length the run timed,
the models' dtype, the shot count, the levers (src/runtime/plan.py, the mapper's own V space, target-written
calibration), a session policy other than `map` and a receiver runtime other than HF eager. Runs of one point are
re-runs of each other; re-running until one passes would make PASS mean nothing, so a point is judged on the run a
plan named before it ran: an entry of conf/gate/plans.yaml (id, `registered` time, workload, direction, the config
keys and tags that name the run), committed before the run starts (the commit history of that file is the audit
trail). The first finished test-item run that matches an entry and started after its registration is the entry's run;
later runs of the point are counted and reported, never judged. A point no entry names is reported on its latest run
with the verdict UNREGISTERED — so is every run that started before pre-registration began (`since`): it predates
plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from src.gate_evidence import Evidence

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def lever_names(params: dict[str, str]) -> list[str]:
    """The levers a run set, in words (none: pure transfer): the session's (native sink, hold-back, native layers,
    recompute with its rule and progressive selection), the mapper's V fitted in attention space, calibration the
    target wrote."""
    unset = (None, "0", "0.0")
    levers = [
        f"{name}={params[f'policy.levers.{name}']}"
        for name in ("native_sink", "hold_back", "native_layers", "recompute")
        if params.get(f"policy.levers.{name}") not in unset
    ]
    if levers and params.get("policy.levers.recompute") not in unset:
        levers.append(f"rule={params.get('policy.levers.recompute_rule')}")
        if params.get("policy.levers.progressive") not in (None, "1", "1.0"):  # the set shrinks with depth
            levers.append(f"progressive={params['policy.levers.progressive']}")
    if params.get("fit.v_space", "token") != "token":  # the mapper fitted where the receiver reads
        levers.append(f"V fit in {params['fit.v_space']} space")
    if params.get("budget.continuation") not in unset:  # calibration the target wrote
        levers.append(f"calibration {float(params['budget.continuation']):.0%} target-greedy")
    return levers


def history_regime(metrics: dict[str, float]) -> str:
    """`≤ N tokens` for the longest history-length bucket with routed TTFTs in the run (src/routed.py timing), or
    `any length` when it logged none."""
    found = (key.split(".") for key in metrics if key.startswith("ttft.routed.") and key.endswith("_ms_p50"))
    edges = [parts[2].removesuffix("_ms_p50") for parts in found if len(parts) == 3]
    if not edges:
        return "any length"
    longest = max(edges, key=lambda edge: (edge.startswith("gt_"), int(edge[3:])))
    return f"{'>' if longest.startswith('gt_') else '≤'} {int(longest[3:])} tokens"


def shots(run: Evidence) -> str:
    """'N shots' (or per task) over the run's tasks where its workload sets shot counts; '' where it does not."""
    tasks = sorted(
        key[len("task.") : -len(".loss_points")]
        for key in run.metrics
        if key.startswith("task.") and key.endswith(".loss_points") and key != "task.mean.loss_points"
    )
    counts = {task: run.params[f"workload.shots.{task}"] for task in tasks if f"workload.shots.{task}" in run.params}
    if not counts:
        return ""
    if len(set(counts.values())) == 1:
        return f"{next(iter(counts.values()))} shots"
    return " / ".join(f"{task} {count}" for task, count in counts.items()) + " shots"


def operating_point(run: Evidence, on_test: bool = True) -> str:
    """What the run's verdict is about beside its workload and direction: history length (any length for runs off
    the test items), dtype, shot count, levers, a session policy other than `map`, a receiver other than HF eager."""
    parts = [history_regime(run.metrics) if on_test else "any length"]
    dtype = run.params.get("pair.dtype")
    parts += [DTYPES.get(dtype, dtype)] if dtype else []
    parts += [count] if (count := shots(run)) else []
    parts.append(", ".join(lever_names(run.params)) or "pure transfer")
    policy = run.tags.get("policy", "map")  # a session that chooses per handoff: its own point
    parts += [] if policy == "map" else [f"policy {policy}"]
    engine = run.tags.get("engine", "hf")  # the receiver runtime
    parts += [] if engine == "hf" else [f"engine {engine}"]
    return ", ".join(parts)


@dataclass(frozen=True)
class Plan:
    """One pre-registered run: the first test-item run of `workload` × `direction` carrying every `config` param and
    `tags` value that started after `registered`."""

    id: str
    registered: int  # ms since the epoch
    workload: str
    direction: str
    config: dict[str, str]
    tags: dict[str, str]


@dataclass(frozen=True)
class Plans:
    since: int  # ms: when pre-registration began; a run started before predates plans
    entries: tuple[Plan, ...]


def _ms(text: object, where: str) -> int:
    try:
        moment = datetime.fromisoformat(str(text))
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not an ISO time (e.g. 2026-12-06T02:00:00+00:00)") from None
    if moment.tzinfo is None:
        raise ValueError(f"{where}: {text!r} has no time zone (write +00:00)")
    return int(moment.timestamp() * 1000)


def _value(value: object) -> str:
    """A config value as a run's params spell it (YAML 200 → '200', a list → its repr)."""
    return str(value)


def load_plans(path: Path) -> Plans:
    """conf/gate/plans.yaml (or `path`), checked: a ValueError naming the file, the entry and what is wrong."""
    where = str(path)
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{where}: cannot read the gate's plans: {error}") from None
    if not isinstance(document, dict) or not {"since", "plans"} <= document.keys():
        raise ValueError(f"{where}: needs `since` (when pre-registration began) and `plans` (a list, may be empty)")
    entries, seen = [], set()
    for n, entry in enumerate(document["plans"] or []):
        at = f"{where} plans[{n}]"
        if not isinstance(entry, dict) or not {"id", "registered", "workload", "direction", "config"} <= entry.keys():
            raise ValueError(f"{at}: an entry needs id, registered, workload, direction and config")
        if entry["id"] in seen:
            raise ValueError(f"{at}: id {entry['id']!r} is registered twice")
        seen.add(entry["id"])
        config, tags = entry["config"] or {}, entry.get("tags") or {}
        if not isinstance(config, dict) or not isinstance(tags, dict):
            raise ValueError(f"{at}: config and tags map keys to values")
        entries.append(
            Plan(
                str(entry["id"]),
                _ms(entry["registered"], at),
                str(entry["workload"]),
                str(entry["direction"]),
                {str(k): _value(v) for k, v in config.items()},
                {str(k): _value(v) for k, v in tags.items()},
            )
        )
    return Plans(_ms(document["since"], f"{where} since"), tuple(entries))


def _same(param: str | None, wanted: str) -> bool:
    """A param equals the plan's value, as text or as a number (a run logs 0.4 as '0.4', 200 as '200')."""
    if param is None:
        return False
    try:
        return param == wanted or math.isclose(float(param), float(wanted))
    except ValueError:
        return False


def planned(plan: Plan, run: Evidence) -> bool:
    """The run is one the entry names: its workload, direction, every config param and tag, on test items, started
    after the registration."""
    tags = run.tags
    return (
        tags.get("workload") == plan.workload
        and tags.get("direction") == plan.direction
        and tags.get("split") == "test"
        and run.start_time > plan.registered
        and all(_same(run.params.get(key), value) for key, value in plan.config.items())
        and all(tags.get(key) == value for key, value in plan.tags.items())
    )


@dataclass(frozen=True)
class Pick:
    """The run judged for one operating point, and what else there is: how many runs of the point, the plan entry
    whose run it is (None: unregistered, its latest run shown), how many runs came after it."""

    judged: Evidence
    runs: int
    plan: Plan | None
    later: int

    def predates(self, plans: Plans) -> bool:
        return self.judged.start_time < plans.since


def registered(runs: list[Evidence], plans: Plans) -> dict[str, Plan]:
    """run id → the plan entry whose run it is: each entry's first matching run over all `runs` (so a re-run never
    takes its place, whichever operating point it lands in)."""
    ordered = sorted(runs, key=lambda run: (run.start_time, run.run_id))
    found = {}
    for plan in plans.entries:
        named = next((run for run in ordered if planned(plan, run)), None)
        if named is not None:
            found.setdefault(named.run_id, plan)
    return found


def pick(runs: list[Evidence], entries: dict[str, Plan]) -> Pick:
    """The judged run among the runs of one operating point: the earliest that is an entry's run (`registered`),
    else the latest run, unregistered."""
    ordered = sorted(runs, key=lambda run: (run.start_time, run.run_id))
    for n, run in enumerate(ordered):
        if run.run_id in entries:
            return Pick(run, len(ordered), entries[run.run_id], len(ordered) - 1 - n)
    return Pick(ordered[-1], len(ordered), None, 0)
