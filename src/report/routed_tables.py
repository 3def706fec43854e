"""The routed-workload tables (src/routed.py runs): one row per run, per task, after s switches, and levers paired on
the same items; each run's gate verdict (src/gate.py) beside its numbers."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from omegaconf import OmegaConf

from src.gate import ROOT, Decision, decide, summary_table
from src.gate_criteria import DEFAULTS, Verdict, judge_run, run_status, thresholds
from src.gate_evidence import Evidence, evidence
from src.gate_plan import lever_names, load_plans
from src.records import items_path, read_items, read_json, require
from src.report.rows import Row, fmt, metric, slashed
from src.routed import paired_gain, quality

FEWSHOT = Path(__file__).resolve().parents[2] / "conf/workload/fewshot.yaml"
FEWSHOT_SHOTS = dict(OmegaConf.load(FEWSHOT).shots)  # a run with more shows its count


def _ci(row: Row, name: str) -> str:
    """'value [low, high]' of a metric logged with its `_low` / `_high` paired bootstrap CI."""
    return f"{fmt(metric(row, name))} [{fmt(metric(row, name + '_low'), 0)}, {fmt(metric(row, name + '_high'), 0)}]"


def _loss(row: Row, prefix: str) -> str:
    """Loss in points of `<prefix>.loss_points` with its CI."""
    return _ci(row, f"{prefix}.loss_points")


def routed_label(row: Row) -> str:
    levers = lever_names({key[len("params.") :]: str(value) for key, value in row.items() if key.startswith("params.")})
    if row.get("params.policy.mode", "map") != "map":  # the session chose per handoff (src/runtime/session.py)
        levers.insert(0, f"policy {row['params.policy.mode']}")
    arrow = str(row.get("tags.direction", "?")).replace("qwen25coder_", "").replace("_to_", " → ")
    notes = ["validation items"] if row.get("tags.split") == "valid" else []
    if row.get("tags.workload") == "fewshot":  # (fewshot_long cycles lists of counts)
        longer = [n for task, k in FEWSHOT_SHOTS.items() if (n := int(row.get(f"params.workload.shots.{task}", k))) > k]
        notes += [f"{max(longer)} shots"] if longer else []
    notes += ["bf16"] if row.get("params.pair.dtype") == "bfloat16" else []  # the models' weights and compute
    notes += ["CPU"] if row.get("params.pair.device") == "cpu" else []  # measured without a GPU
    items = f" ({', '.join(notes)})" if notes else ""
    return f"{row.get('tags.workload')}{items} | {arrow} | {', '.join(levers) or 'pure transfer'}"


def run_of(row: Row) -> Evidence:
    """A record row as the gate reads a run: its record and its items artifact (artifacts/routed/items.json beside
    it, or none)."""
    return _evidence(str(row["record"]), row.get("start_time") or 0)


@cache
def _evidence(record: str, start_time: int) -> Evidence:
    from src.records import metric_values, read_record

    path = Path(record)
    found = read_record(path)
    items = items_path(path.parent)
    document = read_json(items) if items.is_file() else None
    return evidence(
        found["name"], str(path.parent.name), start_time, metric_values(found, path), found["params"], found["tags"],
        document, str(items),
    )  # fmt: skip


@cache
def _verdicts(record: str, start_time: int) -> tuple[Verdict, ...]:
    return tuple(judge_run(_evidence(record, start_time)))


def verdicts(row: Row) -> list[Verdict]:
    """The gate's criteria on this run alone (src/gate_criteria.py judge_run), computed once per record."""
    return list(_verdicts(str(row["record"]), row.get("start_time") or 0))


def decided(rows: list[Row]) -> list[Decision]:
    """The decision as the gate takes it, from every routed record set: per workload × direction × operating point,
    the registered run (results/gate_plans.yaml), else the latest on test items, UNREGISTERED (src/gate.py decide)."""
    runs = [run_of(row) for row in rows if row.get("tags.job") == "routed"]
    return decide(runs, load_plans(ROOT / DEFAULTS.plans), thresholds())


def decision(rows: list[Row]) -> str:
    """The decision as the gate takes it (`python -m src.gate --summary`), from every routed record set."""
    return summary_table(decided(rows))


def _gate(row: Row) -> str:
    """The gate's criteria on this run alone, with those that did not pass (registration aside)."""
    failing = [v for v in verdicts(row) if not v.passed]
    names = {
        "latency: end-to-end TTFT speedup": "latency",
        "latency harness: same work alike": "latency harness",
        "quality: loss vs all-re-prefill": "quality",
        "prefill fraction spent": "prefill",
        "record: logged = items": "record",
    }
    reasons = ", ".join(f"{names.get(v.criterion, v.criterion)} {v.status}" for v in failing)
    return f"{run_status([v.status for v in failing])} ({reasons})" if failing else "PASS"


def _floor(row: Row) -> str:
    """Source alone minus the routed session on the mean, points [95 % CI] (> 0: escalating made answers worse);
    recomputed from the run's per-item scores (src/routed.py `quality`) where the record predates the metric."""
    name = "task.mean.below_source_points"
    if f"metrics.{name}" not in row:
        path = row["record"]
        n_boot, seed = (int(require(row, f"params.{key}", path)) for key in ("eval.tasks.n_boot", "seed"))
        found = quality(_items(row), n_boot, seed)
        row = row | {f"metrics.{key}": value for key, value in found.items()}
    return _ci(row, name)


def routed(rows: list[Row]) -> str:
    """One row per routed-workload run (src/routed.py): accuracy vs the all-re-prefill session, TTFT per path,
    prefill spent, handoffs, rollback, and the gate's verdict on that run alone."""
    lines = [
        "| workload | direction | levers | scored turns | acc routed / all-native / source (%) "
        "| mean loss pt [95 % CI] | below the source pt [95 % CI] | TTFT p50 routed / re-prefill / hit (ms) "
        "| p95 routed / re-prefill (ms) "
        "| TTFT speedup (median paired) | prefill spent | handoffs per turn | rollback | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        turns = sum(
            v for k, v in row.items() if k.startswith("metrics.task.") and k.endswith(".items") and ".mean." not in k
        )
        if row.get("shared_gpu"):  # timed beside other jobs: latency, speedup and the gate (which reads them) withheld
            p50 = p95 = speedup = gate = "shared GPU"
        else:
            p50 = slashed(row, ("ttft.routed_ms_p50", "ttft.reprefill_ms_p50", "ttft.hit_ms_p50"))
            p95 = slashed(row, ("ttft.routed_ms_p95", "ttft.reprefill_ms_p95"))
            speedup, gate = f"{fmt(metric(row, 'ttft_speedup'), 2)}×", _gate(row)
        lines.append(
            f"| {routed_label(row)} | {turns:.0f} "
            f"| {' / '.join(fmt(metric(row, f'task.mean.{n}'), 1, 100) for n in ('acc', 'acc_target', 'acc_source'))} "
            f"| {_loss(row, 'task.mean')} | {_floor(row)} | {p50} | {p95} | {speedup} "
            f"| {fmt(metric(row, 'prefill_fraction'), 0, 100)} % | {fmt(metric(row, 'handoff_frequency'), 2)} "
            f"| {'verified' if metric(row, 'rollback_verified') == 1.0 else 'NOT verified'} | {gate} |"
        )
    return "\n".join(lines)


def routed_tasks(rows: list[Row]) -> str:
    """Per task of each routed run: routed accuracy (%) and loss in points vs the all-native session [95 % CI]."""
    lines = [
        "| workload | direction | levers | task: acc routed / all-native (loss pt [95 % CI]) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        tasks = sorted(
            {k.split(".")[2] for k in row if k.startswith("metrics.task.") and k.endswith(".acc")} - {"mean"}
        )
        cells = [
            f"{task} {fmt(metric(row, f'task.{task}.acc'), 0, 100)} / {fmt(metric(row, f'task.{task}.acc_target'), 0, 100)}"
            f" ({_loss(row, f'task.{task}')})"
            for task in tasks
        ]
        lines.append(f"| {routed_label(row)} | {'; '.join(cells)} |")
    return "\n".join(lines)


def routed_switches(rows: list[Row]) -> str:
    """Final-turn quality after s model switches (the switches workload): per s, the mean and each task."""
    (row,) = [row for row in rows if row.get("tags.workload") == "switches"]
    keys = [k.split(".") for k in row if k.startswith("metrics.switches.s")]  # metrics.switches.s<N>.<task>.<name>
    counts, tasks = sorted({int(k[2][1:]) for k in keys}), sorted({k[3] for k in keys} - {"mean"})
    lines = [
        "| switches | mean acc routed / all-native / source (%) | mean loss pt [95 % CI] | "
        + " | ".join(f"{task} loss pt [95 % CI]" for task in tasks)
        + " | NLL routed / all-native (reference answers) |",
        "|---|---|---|" + "---|" * len(tasks) + "---|",
    ]
    for s in counts:
        prefix = f"switches.s{s}"
        acc = (f"{prefix}.mean.acc", f"{prefix}.mean.acc_target", f"{prefix}.mean.acc_source")
        lines.append(
            f"| {s} | {' / '.join(fmt(metric(row, name), 1, 100) for name in acc)} | {_loss(row, f'{prefix}.mean')} | "
            + " | ".join(_loss(row, f"{prefix}.{task}") for task in tasks)
            + f" | {slashed(row, (f'{prefix}.mean.nll_routed', f'{prefix}.mean.nll_native_target'), 3)} |"
        )
    return "\n".join(lines)


def _items(row: Row) -> list[dict]:
    """The per-item rows of a routed record (artifacts/routed/items.json beside it); a damaged file names itself."""
    return read_items(Path(str(row["record"])).parent)


def routed_paired(rows: list[Row], run_set: str | None = None) -> str:
    """Levers compared on the same items (src/routed.py `paired_gain`): within one direction and workload (its shots,
    dtype and item split), every two recompute runs whose prefill spent differs by ≤ 5 points (equal compute), and every lever run
    against pure transfer (with `run_set`: only pairs with a run of that results/ folder), when they share at least
    half the items of the smaller run. Accuracy of the first minus the second, points [95 % CI]."""
    group = lambda r: routed_label(r).split(" | ")[:2]  # workload (its shots, dtype, item split) and direction
    recompute = lambda r: float(r.get("params.policy.levers.recompute") or 0) > 0
    pure = lambda r: routed_label(r).endswith("pure transfer")
    pairs = []
    for i, first in enumerate(rows):
        for second in rows[i + 1 :]:
            if group(first) != group(second) or (
                run_set
                and run_set not in Path(str(first["record"])).parts
                and run_set not in Path(str(second["record"])).parts
            ):
                continue
            spent = abs(metric(first, "prefill_fraction") - metric(second, "prefill_fraction"))
            if recompute(first) and recompute(second) and spent <= 0.05:
                pairs.append((first, second))
            elif pure(first) != pure(second):
                pairs.append((second, first) if pure(first) else (first, second))
    lines = [
        "| workload | direction | run A | run B | prefill A / B | items paired | acc A − B, pt [95 % CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    key = lambda item: (item["task"], item["index"])
    for first, second in pairs:
        mine, theirs = _items(first), _items(second)
        shared = len({key(item) for item in mine} & {key(item) for item in theirs})
        if 2 * shared < min(len(mine), len(theirs)):  # other item limits: a few items in common say nothing
            continue
        workload, arrow, levers = routed_label(first).split(" | ")
        lines.append(
            f"| {workload} | {arrow} | {levers} | {routed_label(second).split(' | ')[2]} "
            f"| {fmt(metric(first, 'prefill_fraction'), 0, 100)} / {fmt(metric(second, 'prefill_fraction'), 0, 100)} % "
            f"| {shared} | {gain(first, second, mine, theirs)} |"
        )
    return "\n".join(lines)


def gain(first: Row, second: Row, mine: list[dict] | None = None, theirs: list[dict] | None = None) -> str:
    """Routed accuracy of run `first` minus run `second` on the items both scored, points [95 % CI] (src/routed.py
    `paired_gain`, resampled as `first`'s own run: its `eval.tasks.n_boot`, `seed`)."""
    mine = _items(first) if mine is None else mine
    theirs = _items(second) if theirs is None else theirs
    n_boot, seed = (int(require(first, f"params.{key}", first["record"])) for key in ("eval.tasks.n_boot", "seed"))
    found = paired_gain(mine, theirs, n_boot, seed)
    return f"{100 * found.estimate:+.1f} [{100 * found.low:+.0f}, {100 * found.high:+.0f}]"
