"""The routed job: `python -m src.run +experiment=routed workload=fewshot|passage|multiturn|switches pair=…`.

Top to bottom: the pair → the mapper of each direction the workload needs (the reverse one through the swapped pair,
pipeline.calibration / build_mapper), bound once (session.bind) → the workload's items (src/workloads.py) → for each,
the routed session (cfg.policy) beside the all-re-prefill session (the native target) and the source alone, on
the same token ids → per task accuracy and loss in points with paired bootstrap CIs (and on the task mean), NLL of the
reference answers, TTFT p50/p95 per path (map + new turn + first token; re-prefill of what the receiver has not seen;
same-model prefix hit), the median paired speedup with its seeded bootstrap CI, the same-work harness check (a sample
of handoffs re-prefilled inside the routed session), prefill fraction spent, handoff frequency, refusals by context
length and direction, GPU memory, throughput, rollback replayed on the workload's own items, and with
`eval.diagnose.read_error` each item's receiver read error, spliced vs native (src/eval/read_error.py) → tracking
(metrics, per-item JSON, plots).
Random weights: timing and plumbing only (tagged), never quality. The runners live in src/routed_runs.py (the
conversations in src/routed_multiturn.py, the rollback replay in src/routed_rollback.py); which workload plays how:
src/routed_workloads.py `WORKLOADS`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import matplotlib
import numpy as np
import torch
from omegaconf import DictConfig

from src import tracking
from src.eval.accuracy import compare, summarize
from src.eval.diagnose import cache_fidelity
from src.eval.latency import percentiles
from src.eval.metrics import Interval
from src.eval.read_error import read_error_metrics
from src.models import Pair
from src.pipeline import build_mapper, calibration, load, tags, vocab_size
from src.routed_rollback import rollback
from src.routed_runs import LENGTH_EDGES, Run, bucket, task_scores
from src.routed_workloads import WORKLOADS, Workload, check_shard
from src.runtime.engine import Engine
from src.runtime.routing import Route, bind, policy_from
from src.tasks import METRICS
from src.workloads import Bytes

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def routes(cfg: DictConfig, pair: Pair, reverse: bool) -> tuple[dict[tuple[str, str], Route], dict]:
    """Source → target (and target → source) mappers of the configured fit, bound to the pair once."""
    directions = {("source", "target"): pair}
    if reverse:
        directions[("target", "source")] = replace(pair, source=pair.target, target=pair.source)
    bound, mappers = {}, {}
    for key, oriented in directions.items():
        traces, traces_key = calibration(cfg, oriented)
        mappers[key] = build_mapper(cfg, oriented, traces, traces_key, cfg.support)
        compute = getattr(torch, cfg.pair.compute_dtype)
        bound[key] = bind(
            oriented.source, oriented.target, mappers[key], pair.tokenizer_hash, compute, cfg.pair.apply_backend
        )
    return bound, mappers


def quality(items: list[dict], n_boot: int, seed: int, prefix: str = "task") -> dict[str, float]:
    """Per task (`<prefix>.<task>.*`) and task mean: accuracy of the routed session vs the native target (the
    all-re-prefill session) and the source alone, loss in points with a paired bootstrap CI, NLL of the reference
    answers; the mean's CI resamples items within each task (stratified). `below_source_points` [CI]: the source
    alone minus the routed session — positive when escalating made the answers worse (the floor a router needs)."""
    metrics, per_task, pairs, floors = {}, {}, {}, {}
    for task in sorted({item["task"] for item in items}):
        rows = [item for item in items if item["task"] == task]
        scores = {mode: task_scores(rows, mode) for mode in ("routed", "native_target", "native_source")}
        per_task[task] = compare(task, scores["native_source"], scores["native_target"], scores["routed"], n_boot)
        correct = {mode: s.correct(METRICS[task][0]) for mode, s in scores.items()}
        pairs[task] = (correct["native_target"], correct["routed"])
        floors[task] = (correct["native_source"], correct["routed"])
        metrics |= _points(
            f"{prefix}.{task}.below_source_points", mean_difference_ci({task: floors[task]}, n_boot, seed)
        )
        for mode in scores:
            per_task[task][f"nll_{mode}"] = float(np.mean([row["nll"][mode] for row in rows]))
        metrics |= {f"{prefix}.{task}.{key}": value for key, value in per_task[task].items()}
    mean = summarize(per_task)
    interval = mean_difference_ci(pairs, n_boot, seed)
    mean |= {"loss_points_low": 100 * interval.low, "loss_points_high": 100 * interval.high}
    metrics |= _points(f"{prefix}.mean.below_source_points", mean_difference_ci(floors, n_boot, seed))
    for mode in ("routed", "native_target", "native_source"):
        mean[f"nll_{mode}"] = float(np.mean([row[f"nll_{mode}"] for row in per_task.values()]))
    return metrics | loss_spread(items, prefix) | {f"{prefix}.mean.{key}": value for key, value in mean.items()}


def loss_spread(items: list[dict], prefix: str = "task") -> dict[str, float]:
    """`<prefix>.<task>.loss_points_sd`: the standard deviation over items of native − routed correctness (1 lost, −1
    gained, 0 same), in points — what a paired CI's width scales with, so the items a CI needs (src/gate.py)."""
    spread = {}
    for task in sorted({item["task"] for item in items}):
        rows = [item for item in items if item["task"] == task]
        native, routed = (task_scores(rows, mode).correct(METRICS[task][0]) for mode in ("native_target", "routed"))
        differences = native.astype(np.float64) - routed.astype(np.float64)  # [N]
        spread[f"{prefix}.{task}.loss_points_sd"] = 100 * float(differences.std(ddof=1)) if len(rows) > 1 else math.nan
    return spread


def _points(name: str, interval: Interval) -> dict[str, float]:
    return {name: 100 * interval.estimate, f"{name}_low": 100 * interval.low, f"{name}_high": 100 * interval.high}


def mean_difference_ci(pairs: dict[str, tuple[np.ndarray, np.ndarray]], n_boot: int, seed: int) -> Interval:
    """Mean over tasks of acc(first) − acc(second) (target − routed: the loss; source − routed: below the source),
    percentile CI from resampling items within each task."""
    rng = np.random.default_rng(seed)
    differences = [t.astype(np.float64) - r.astype(np.float64) for t, r in pairs.values()]  # per task [N_t]
    boot = np.mean([d[rng.integers(0, d.size, (n_boot, d.size))].mean(1) for d in differences], axis=0)  # [n_boot]
    low, high = np.quantile(boot, [0.025, 0.975])
    return Interval(float(np.mean([d.mean() for d in differences])), float(low), float(high))


def paired_gain(first: list[dict], second: list[dict], n_boot: int, seed: int) -> Interval:
    """Accuracy of the routed session of run `first` minus that of run `second` on the items both scored (matched by
    task and index), mean over tasks with the stratified paired bootstrap CI: levers compared on the same items."""
    key = lambda item: (item["task"], item["index"])
    theirs = {key(item): item for item in second}
    shared = [item for item in first if key(item) in theirs]
    if not shared:
        raise ValueError("the two runs share no scored item: a paired comparison needs the same items")
    pairs = {}
    for task in sorted({item["task"] for item in shared}):
        rows = [item for item in shared if item["task"] == task]
        mine = task_scores(rows, "routed").correct(METRICS[task][0])
        other = task_scores([theirs[key(item)] for item in rows], "routed").correct(METRICS[task][0])
        pairs[task] = (mine, other)
    return mean_difference_ci(pairs, n_boot, seed)


def timing(items: list[dict], n_boot: int, seed: int) -> dict[str, float]:
    """TTFT p50/p95 per path, overall and by prefix length, and the end-to-end speedup of the run's own handoffs:
    the median over handoffs of re-prefill TTFT / routed TTFT (paired) with its bootstrap CI, and the ratio of the
    p50s."""
    metrics: dict[str, float] = {}
    timed = [item for item in items if item["ttft"]]
    for path in ("routed", "reprefill", "hit"):
        values = [item["ttft"][path] for item in timed if path in item["ttft"]]
        if values:
            metrics |= percentiles(values, f"ttft.{path}")
        for label in sorted({bucket(item["history_tokens"], LENGTH_EDGES) for item in timed}):
            chosen = [
                i["ttft"][path]
                for i in timed
                if path in i["ttft"] and bucket(i["history_tokens"], LENGTH_EDGES) == label
            ]
            if chosen:
                metrics |= percentiles(chosen, f"ttft.{path}.{label}")
    for path in ("routed", "reprefill", "hit"):
        peaks = [item["gpu_peak_mb"][path] for item in timed if path in item.get("gpu_peak_mb", {})]
        if peaks and max(peaks) > 0:
            metrics[f"gpu_peak_mb.{path}"] = float(max(peaks))
    metrics |= speedup_ci(timed, n_boot, seed)
    if "ttft_speedup" in metrics:
        metrics["ttft_speedup_of_p50"] = metrics["ttft.reprefill_ms_p50"] / metrics["ttft.routed_ms_p50"]
    return metrics | same_work(timed)


def median_ci(
    values: list[float], n_boot: int, seed: int, level: float = 0.95, clusters: list | None = None
) -> Interval:
    """The median of `values` with a seeded percentile-bootstrap CI (resamples of the values with replacement; with
    `clusters`, one label per value, of whole clusters: turns of one conversation travel together). No values, a
    non-finite one, or n_boot < 1 is a ValueError, never a NaN or silently wide interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"a median's CI needs values, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"a median's CI needs finite values: {int((~np.isfinite(x)).sum())} of {x.size} are not")
    if n_boot < 1:
        raise ValueError(f"a median's CI needs n_boot ≥ 1 resamples, got {n_boot}")
    rng = np.random.default_rng(seed)
    if clusters is None:
        chunk = max(1, (1 << 22) // x.size)  # resamples per draw: memory bounded at [chunk, N]
        boot = np.concatenate(
            [
                np.median(x[rng.integers(0, x.size, (min(chunk, n_boot - at), x.size))], 1)
                for at in range(0, n_boot, chunk)
            ]
        )
    else:
        _, label = np.unique(np.asarray(clusters), return_inverse=True)
        members = [x[label == k] for k in range(int(label.max()) + 1)]  # per cluster [m_k]
        picks = rng.integers(0, len(members), (n_boot, len(members)))  # [n_boot, K]
        boot = np.array([np.median(np.concatenate([members[k] for k in pick])) for pick in picks])
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(np.median(x)), float(low), float(high))


def speedup_ci(items: list[dict], n_boot: int, seed: int) -> dict[str, float]:
    """`ttft_speedup` [`_low`, `_high`]: the median over handoffs of re-prefill / routed TTFT (paired, the same
    handoff), with its seeded bootstrap 95 % CI over handoffs (what src/gate.py judges); {} without a paired handoff.
    A ratio that is not finite (a TTFT of 0 or NaN) is logged as NaN, which the gate reads as MISSING."""
    paired = [ratio for _, ratio in speedup_ratios(items)]
    if not paired:
        return {}
    if not all(math.isfinite(ratio) for ratio in paired):
        return dict.fromkeys(("ttft_speedup", "ttft_speedup_low", "ttft_speedup_high"), math.nan)
    found = median_ci(paired, n_boot, seed)
    return {"ttft_speedup": found.estimate, "ttft_speedup_low": found.low, "ttft_speedup_high": found.high}


def speedup_ratios(items: list[dict]) -> list[tuple[dict, float]]:
    """(item, re-prefill TTFT / routed TTFT) for every item that timed both paths on its handoff (inf where the routed
    TTFT is 0)."""
    return [
        (i, i["ttft"]["reprefill"] / i["ttft"]["routed"] if i["ttft"]["routed"] > 0 else math.inf)
        for i in items
        if {"routed", "reprefill"} <= set(i["ttft"] or {})
    ]


def same_work_ratios(items: list[dict]) -> list[tuple[dict, float]]:
    """(item, baseline re-prefill / the same re-prefill timed in the routed session) over the sampled items
    (`ttft.same_work`, src/routed_runs.py `same_work`) and the turns the routed session re-prefilled by policy."""
    same = []
    for i in items:
        ttft, path = i["ttft"] or {}, (i.get("handoff") or {}).get("path")
        inside = ttft.get("same_work", ttft.get("routed") if path == "reprefill" else None)
        if inside is not None and "reprefill" in ttft:
            same.append((i, ttft["reprefill"] / inside))
    return same


def same_work(items: list[dict]) -> dict[str, float]:
    """The median of `same_work_ratios` and their count — ≈ 1 when the harness times the same work alike (src/gate.py
    checks it); {} when none."""
    same = [ratio for _, ratio in same_work_ratios(items)]
    return {"ttft.same_work_ratio": float(np.median(same)), "ttft.same_work_items": float(len(same))} if same else {}


def handoffs(records: list[dict], turns: int) -> dict[str, float]:
    """Handoff statuses and paths, frequency per turn, prefill fraction spent (token-weighted), bytes, and
    refusals (fallback or unsupported) by direction and context-length bucket."""
    moves = [r for r in records if r["sender"] is not None and r["sender"] != r["receiver"]]
    metrics = {f"handoffs.{status}": float(n) for status, n in Counter(r["status"] for r in moves).items()}
    metrics |= {f"handoffs.path.{path}": float(n) for path, n in Counter(r["path"] for r in moves).items()}
    metrics["handoff_frequency"] = len(moves) / max(turns, 1)
    unseen = sum(r["context"] - r["hit"] for r in moves)
    if unseen:
        metrics["prefill_fraction"] = sum(r["prefill_fraction"] * (r["context"] - r["hit"]) for r in moves) / unseen
    metrics["mapped_bytes_per_handoff"] = float(np.mean([r["bytes"] for r in moves])) if moves else 0.0
    for r in moves:
        key = f"{r['sender']}_to_{r['receiver']}.{bucket(r['context'], LENGTH_EDGES)}"
        metrics[f"handoffs.{key}"] = metrics.get(f"handoffs.{key}", 0.0) + 1
        if r["status"] != "applied":
            metrics[f"refusals.{key}"] = metrics.get(f"refusals.{key}", 0.0) + 1
    return metrics


def _plots(items: list[dict], curve: dict[int, dict[str, float]]) -> dict[str, plt.Figure]:
    figures = {}
    figure, axis = plt.subplots(figsize=(6, 4))
    for path, marker in (("reprefill", "s"), ("routed", "o"), ("hit", "^")):
        points = [(i["history_tokens"], i["ttft"][path]) for i in items if path in i["ttft"]]
        if points:
            axis.scatter(*zip(*points, strict=True), marker=marker, s=12, label=path)
    axis.set(xlabel="prefix tokens", ylabel="TTFT (ms)", xscale="log", yscale="log", title="TTFT vs prefix length")
    axis.legend()
    figures["plots/ttft_vs_prefix.png"] = figure
    figure, axis = plt.subplots(figsize=(6, 4))
    for task in sorted({i["task"] for i in items}):
        rows = [i for i in items if i["task"] == task]
        correct = task_scores(rows, "routed").correct(METRICS[task][0])
        fraction = [i["handoff"]["prefill_fraction"] if i["handoff"] else 1.0 for i in rows]
        axis.scatter(np.mean(fraction), correct.mean(), label=task)
    axis.set(xlabel="prefill fraction spent", ylabel="accuracy (routed)", title="accuracy vs prefill fraction")
    axis.legend(fontsize=7)
    figures["plots/accuracy_vs_prefill_fraction.png"] = figure
    if curve:
        figure, axis = plt.subplots(figsize=(6, 4))
        counts = sorted(curve)
        loss = [curve[s]["loss_points"] for s in counts]
        error = [[curve[s]["loss_points"] - curve[s]["loss_points_low"] for s in counts],
                 [curve[s]["loss_points_high"] - curve[s]["loss_points"] for s in counts]]  # fmt: skip
        axis.errorbar(counts, loss, yerr=error, fmt="o-", capsize=3)
        axis.set(
            xlabel="model switches", ylabel="loss vs all-native (points)", xscale="log", title="quality vs switches"
        )
        figures["plots/quality_vs_switches.png"] = figure
    return figures


ENGINE_KINDS = ("routed", "reprefill", "twin")  # a session kind each; twins are the same-work forks


def check_workload(cfg: DictConfig) -> Workload:
    """The configured workload, once what it is asked to do is what it supports (the engine, item shards, the read
    error); a ValueError naming the key otherwise. Needs no model: src/config_check.py calls it before any job."""
    w = cfg.workload
    if w.name not in WORKLOADS:
        raise ValueError(f"unknown workload {w.name!r}: one of {sorted(WORKLOADS)} (src/routed_workloads.py WORKLOADS)")
    workload = WORKLOADS[w.name]
    having = lambda feature: sorted(name for name, known in WORKLOADS.items() if getattr(known, feature))
    if w.engine_capacity is not None and not workload.engine:
        raise ValueError(f"workload.engine_capacity: the {w.name} workload does not run on the engine yet "
                         f"(only {having('engine')}); set it to null")  # fmt: skip
    check_shard(w.shard, w.shards)
    if w.shards != 1 and not workload.shards:
        raise ValueError(f"workload.shards: the {w.name} workload's items are not sharded (only {having('shards')}); "
                         "set it to 1")  # fmt: skip
    if cfg.eval.diagnose.read_error and not workload.read_error:
        raise ValueError(f"eval.diagnose.read_error: the {w.name} workload's routed and native conversations may "
                         f"differ (each reads its own answers), so no shared history to compare; only "
                         f"{having('read_error')}")  # fmt: skip
    return workload


def routed(cfg: DictConfig) -> float:
    """Run the configured workload through the router session; returns the routed task-mean accuracy."""
    torch.manual_seed(cfg.seed)
    w = cfg.workload
    workload = check_workload(cfg)
    policy = policy_from(cfg.policy)  # a policy that cannot hold is refused before any model loads
    pair = load(cfg)
    bound, mappers = routes(cfg, pair, workload.reverse)
    tokenizer = pair.tokenizer if pair.tokenizer is not None else Bytes(vocab_size(pair))
    models = {"source": pair.source, "target": pair.target}
    engines = {}
    if w.engine_capacity is not None:  # every kind of session on engines of its own, kept across items
        engines = {kind: {n: Engine(m, w.engine_capacity) for n, m in models.items()} for kind in ENGINE_KINDS}
    read = cfg.eval.diagnose.read_error
    run = Run(models, bound, policy, tokenizer, w.warmup, w.same_work_every, engines=engines, read_error=read)
    method = mappers[("source", "target")].manifest.get("method", "mapper")
    run_name = f"{cfg.pair.name}:routed:{w.name}:{method}:{policy.mode}" + (":valid" if w.split == "valid" else "")
    run_tags = tags(cfg, pair, "routed") | {
        "workload": w.name,
        "method": method,
        "policy": policy.mode,
        "split": w.split,
    }
    if w.shards > 1:  # a part of a run: joined by src/routed_merge.py, never judged alone (src/gate.py)
        run_name += f":shard{w.shard}of{w.shards}"
        run_tags["shard"] = f"{w.shard}/{w.shards}"
    # the coefficients it ran (the id src/length_evidence.py matches a mapper's evidence to; a manifest amended with
    # evidence keeps them); a synthetic mapper is never saved
    run_tags["mapper_tensor_sha256"] = mappers[("source", "target")].manifest.get("tensor_sha256", "unsaved")
    graphs = any(e.graphs_enabled for kind in engines.values() for e in kind.values())
    run_tags["engine"] = (
        ("graph" if graphs else "static") if engines else "hf"
    )  # the receiver runtime every path ran on
    with tracking.job_run(cfg, run_name, run_tags) as tracked:
        played = workload.play(run, cfg)
        curve: dict[int, dict[str, float]] = {}
        for count, rows in played.per_switches.items():
            scores = quality(rows, cfg.eval.tasks.n_boot, cfg.seed, f"switches.s{count}")
            tracked.metrics(scores)
            curve[count] = {k.rsplit(".", 1)[-1]: v for k, v in scores.items() if ".mean." in k}
        items = played.items
        metrics = quality(items, cfg.eval.tasks.n_boot, cfg.seed) | timing(items, cfg.eval.tasks.n_boot, cfg.seed)
        metrics |= handoffs(played.records, played.turns) | {"scored_turns": float(played.turns)}
        metrics |= read_error_metrics(items, cfg.eval.tasks.n_boot, cfg.seed)  # {} unless eval.diagnose.read_error
        transfer = bound[("source", "target")].transfer
        if cfg.eval.diagnose.fidelity and played.examples and transfer is not None:  # the histories mapped
            shown = played.examples[: cfg.eval.diagnose.prompts_per_task * len(w.tasks)]
            histories = [run.encode(ex.history) for ex in shown]
            metrics |= {f"fidelity.{k}": v for k, v in cache_fidelity(transfer, histories).items()}
        bind_args = (pair.tokenizer_hash, getattr(torch, cfg.pair.compute_dtype), cfg.pair.apply_backend)
        mapper = mappers[("source", "target")]
        metrics |= rollback(run, mapper, played.replays[: w.rollback_items], w.rollback_tokens, bind_args)
        metrics |= run.throughput()
        peaks = [value for key, value in metrics.items() if key.startswith("gpu_peak_mb.")]
        if peaks:  # per-path peaks (each timed switch resets the counter)
            metrics["gpu_peak_memory_mb"] = max(peaks)
        tracked.metrics(metrics)
        tracked.dict({"items": items, "handoffs": played.records, "policy": repr(policy)}, "routed/items.json")
        for path, figure in _plots(items, curve).items():
            tracked.figure(figure, path)
            plt.close(figure)  # pyplot keeps every open figure: a sweep of runs would pile them up
    print(f"\n{run_name}  (weights={pair.weights}, {len(items)} scored turns, {len(played.records)} switches)")
    for name, value in sorted(metrics.items()):
        print(f"  {name:<48} {value:12.4f}")
    return float(metrics["task.mean.acc"])
