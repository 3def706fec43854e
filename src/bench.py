"""Systems jobs (`+experiment=latency|construction|handoff`): storage, mapper application, construction and
end-to-end handoff TTFT, methods side by side in one process. With `budget=synthetic_paper` they run
at the paper's shapes on random traces / random-coefficient mappers (timing only, labelled so).
"""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib
import torch
from omegaconf import DictConfig, OmegaConf

from kernels.fused_fit import make_plan, triton_available
from kernels.fused_fit import scratch_bytes as fused_scratch_bytes
from src import tracking
from src.apply import KVTransfer
from src.artifact import Mapper, save_mapper
from src.eval.latency import handoff_latency
from src.eval.ttft import handoff_ttft
from src.fit import fit_mapper
from src.models import Pair, build_random_model, describe_kv
from src.pipeline import build_mapper, calibration, load, make_transfer, spec, tags, text_ids
from src.select import layers_for_support
from src.support import head_assignment
from src.synthetic import synthetic_traces

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SUPPORTS_COMPARED = ("full", "local")


def _prefix_ids(cfg: DictConfig, pair: Pair, length: int) -> torch.Tensor:
    return text_ids(cfg, pair, cfg.eval.nll.corpus, 1, length)  # [1, length]


def _transfers(cfg: DictConfig, pair: Pair, kinds: tuple[str, ...]) -> tuple[dict[str, KVTransfer], dict[str, dict]]:
    """A KVTransfer per support kind, and each artifact's storage (bytes, coefficients)."""
    traces, traces_key = (None, None) if cfg.budget.synthetic else calibration(cfg, pair)  # synthetic: no traces
    transfers, storage = {}, {}
    for kind in kinds:
        support = OmegaConf.merge(cfg.support, {"kind": kind, "shift": 0})
        mapper = build_mapper(cfg, pair, traces, traces_key, support)
        if "tensor_bytes" not in mapper.manifest:  # synthetic: serialize once to measure the artifact
            began = time.perf_counter()
            save_mapper(mapper, Path(cfg.paths.home) / "mappers" / f"synthetic-{cfg.pair.name}-{kind}")
            mapper.manifest["save_seconds"] = time.perf_counter() - began
        storage[kind] = {
            "artifact_bytes": mapper.manifest["tensor_bytes"],
            "coefficient_count": mapper.manifest["coefficient_count"],
        }
        transfers[kind] = make_transfer(cfg, pair, mapper)
    return transfers, storage


def latency(cfg: DictConfig) -> None:
    """Artifact storage and apply latency per support vs target re-prefill, over prefix lengths."""
    pair = load(cfg)
    with tracking.job_run(cfg, f"{cfg.pair.name}:latency", tags(cfg, pair, "latency")) as run:  # spans the job
        transfers, storage = _transfers(cfg, pair, SUPPORTS_COMPARED)
        lengths = list(cfg.eval.latency.prefix_lens)
        ids = _prefix_ids(cfg, pair, max(lengths))
        results = {
            kind: {
                n: handoff_latency(t, ids[:, :n], cfg.eval.latency.repeats, cfg.eval.latency.warmup) for n in lengths
            }
            for kind, t in transfers.items()
        }
        figure, axis = plt.subplots(figsize=(6, 4))
        for kind, by_length in results.items():
            axis.plot(lengths, [by_length[n]["apply_ms_p50"] for n in lengths], "o-", label=f"apply {kind}")
        axis.plot(lengths, [results["local"][n]["prefill_ms_p50"] for n in lengths], "k--", label="target re-prefill")
        axis.set(xlabel="prefix tokens", ylabel="ms (p50)", xscale="log", yscale="log", title=cfg.pair.name)
        axis.legend()
        for kind, by_length in results.items():
            run.metrics({f"{name}.{kind}": value for name, value in storage[kind].items()})
            for n, metrics in by_length.items():
                run.metrics({f"{name}.{kind}": value for name, value in metrics.items()}, step=n)
        run.dict(
            {"storage": storage, "latency": {k: {str(n): m for n, m in v.items()} for k, v in results.items()}},
            "latency.json",
        )
        run.figure(figure, "plots/latency_vs_prefix.png")
    for kind in SUPPORTS_COMPARED:
        print(
            f"{kind:>6}: artifact {storage[kind]['artifact_bytes'] / 1e9:.3f} GB, "
            f"{storage[kind]['coefficient_count']:,} coefficients"
        )
    for n in lengths:
        print(
            f"prefix {n:>6}: apply full {results['full'][n]['apply_ms_p50']:.2f} ms, local "
            f"{results['local'][n]['apply_ms_p50']:.2f} ms, re-prefill {results['local'][n]['prefill_ms_p50']:.2f} ms"
        )


def handoff(cfg: DictConfig) -> None:
    """End-to-end TTFT of a handoff (map + new turn + first token) vs re-prefill vs same-model cache hit."""
    pair = load(cfg)
    with tracking.job_run(cfg, f"{cfg.pair.name}:handoff", tags(cfg, pair, "handoff")) as run:  # spans the job
        transfer = _transfers(cfg, pair, (cfg.support.kind,))[0][cfg.support.kind]
        h = cfg.eval.handoff
        ids = _prefix_ids(cfg, pair, max(h.prefix_lens) + h.new_turn)
        results, out_of_memory, profiles, samples = {}, [], {}, {}
        for n in h.prefix_lens:
            prefix, turn = ids[:, :n], ids[:, n : n + h.new_turn]
            try:
                results[n] = handoff_ttft(
                    transfer, prefix, turn, h.repeats, h.prefill_repeats, h.warmup, tuple(h.engines),
                    tuple(h.recompute_shares), profiles.setdefault(n, {}) if h.profile else None,
                    tuple(h.recompute_rules), h.progressive, samples.setdefault(n, {}),
                )  # fmt: skip
            except torch.OutOfMemoryError:
                out_of_memory.append(n)
                print(f"prefix {n:>6}: out of GPU memory")
                continue
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(f"prefix {n:>6}: " + ", ".join(f"{k} {v:.3g}" for k, v in results[n].items() if "_p95" not in k))
            run.metrics(results[n], step=n)  # logged as measured: a run cut short keeps every finished length
        figure, axis = plt.subplots(figsize=(6, 4))
        for name in h.engines:
            for path, style in (("map", "o-"), ("reprefill", "s--"), ("hit", "^:")):
                key = f"ttft.{name}.{path}_ms_p50"
                axis.plot(list(results), [m[key] for m in results.values()], style, label=f"{name} {path}")
        axis.set(xlabel="prefix tokens", ylabel="TTFT ms (p50)", xscale="log", yscale="log", title=cfg.pair.name)
        axis.legend()
        kept = {str(n): samples[n] for n in results}  # every timed call's ms: each ratio's interval recomputes
        summary = {str(n): m for n, m in results.items()}
        run.dict({"ttft": summary, "samples": kept, "out_of_memory": out_of_memory}, "handoff.json")
        for n, tables in profiles.items():  # where each path's time goes (eval.handoff.profile)
            run.dict(tables, f"profiles/prefix_{n}.json")
        run.figure(figure, "plots/ttft_vs_prefix.png")


def construction(cfg: DictConfig) -> None:
    """Fit time vs calibration budget (nested prefixes): generic (materialized, the reference), streaming and
    `fit.statistics` (fused under +experiment=construction) statistics, each the artifact's max relative difference
    to generic and its scratch memory (Eq. 22; the fused kernels' int8 panel + float64 Gram).

    Times statistics + solve + serialization from traces (excl. trace collection, selection, attention
    weights, as the paper). Synthetic budgets need no models: shapes come from meta-device builds. On CPU the
    fused path is the kernels' arithmetic emulated in torch (tagged): its time says nothing about the kernels."""
    if cfg.budget.synthetic:
        meta = [
            build_random_model(spec(s)["config"], 0, torch.bfloat16, "meta") for s in (cfg.pair.source, cfg.pair.target)
        ]
        kvs = [describe_kv(m) for m in meta]
        b = cfg.budget
        traces = synthetic_traces(
            *kvs, b.sequences, b.seq_len // b.stride, cfg.pair.device, getattr(torch, b.storage_dtype), cfg.seed
        )
        run_tags = {
            "job": "construction",
            "weights": "random",
            "pair": cfg.pair.name,
            "direction": cfg.pair.direction,
            "note": "synthetic traces: timing only",
        }
        layers = layers_for_support(traces, cfg.support.kind, cfg.fit.k, "depth", cfg.fit.chunk_rows)[0]
    else:
        pair = load(cfg)
        traces, _ = calibration(cfg, pair)
        run_tags = tags(cfg, pair, "construction")
        layers = layers_for_support(traces, cfg.support.kind, cfg.fit.k, cfg.support.selection, cfg.fit.chunk_rows)[0]
    heads = head_assignment(cfg.support.kind, traces.source_k.shape[1], traces.target_k.shape[1], cfg.support.shift)
    paths = list(dict.fromkeys(("generic", "streaming", cfg.fit.statistics)))  # generic first: the reference
    cuda = traces.source_k.is_cuda
    run_tags["fused_backend"] = "triton" if cuda and triton_available() else "emulate (torch, CPU: not a kernel time)"
    with tracking.job_run(cfg, f"{cfg.pair.name}:construction", run_tags) as run:  # spans the measurement
        budgets = [b for b in cfg.eval.construction.budgets if b <= cfg.budget.sequences] or [cfg.budget.sequences]
        out = Path(cfg.paths.home) / "mappers" / f"construction-{cfg.pair.name}"
        rows: dict[int, dict[str, float]] = {}
        for budget in budgets:
            subset = traces.select_rows(torch.nonzero(traces.sequence_index < budget)[:, 0])
            timing: dict[str, list[float]] = {path: [] for path in paths}
            mappers, peaks = {}, {}
            for path in paths:
                for _ in range(cfg.eval.construction.repeats):
                    _synchronize()
                    baseline = _reset_peak() if cuda else 0
                    began = time.perf_counter()
                    mappers[path] = fit_mapper(
                        subset,
                        layers,
                        heads,
                        cfg.support.kind,
                        cfg.weighting.kind,
                        cfg.fit.lam,
                        cfg.fit.lam_relative,
                        cfg.fit.chunk_rows,
                        path,
                        alpha_cap=cfg.weighting.alpha_cap,
                    )
                    save_mapper(mappers[path], out / path, cfg.fit.coefficient_dtype)
                    _synchronize()
                    timing[path].append(time.perf_counter() - began)
                    if cuda:
                        peaks[path] = torch.cuda.max_memory_allocated() - baseline
            rows[budget] = {f"{p}_seconds": float(torch.tensor(t).median()) for p, t in timing.items()}
            for path in paths[1:]:
                rows[budget][f"{path}_max_relative_difference"] = _max_relative(mappers["generic"], mappers[path])
            rows[budget] |= {
                "max_relative_difference": max(rows[budget][f"{p}_max_relative_difference"] for p in paths[1:]),
                "rows": subset.rows,
                **{f"{p}_scratch_bytes": _scratch_bytes(p, heads, layers, subset, cfg.fit.chunk_rows) for p in paths},
                **{f"{p}_peak_bytes": value for p, value in peaks.items()},  # CUDA: allocated above the traces
            }
            print(
                f"{budget:>5} sequences ({subset.rows} rows): "
                + ", ".join(
                    f"{p} {rows[budget][f'{p}_seconds']:.3f} s"
                    + (f" (max rel diff {rows[budget][f'{p}_max_relative_difference']:.2e})" if p != "generic" else "")
                    for p in paths
                )
            )
            del subset, mappers
        figure, axis = plt.subplots(figsize=(6, 4))
        for path in paths:
            axis.plot(budgets, [rows[b][f"{path}_seconds"] for b in budgets], "o-", label=path)
        axis.set(xlabel="calibration sequences", ylabel="construction s (median)", yscale="log", title=cfg.pair.name)
        axis.legend()
        for budget, metrics in rows.items():
            run.metrics(metrics, step=budget)
        run.figure(figure, "plots/construction_vs_budget.png")


def _max_relative(reference: Mapper, other: Mapper) -> float:
    """max over the artifact's float tensors of max |Δ| / max |reference| (the ≤ 1e-6 construction contract)."""
    return max(
        float((want - got).abs().max() / want.abs().max().clamp_min(1e-30))
        for want, got in zip(reference.tensors().values(), other.tensors().values(), strict=True)
        if want.is_floating_point()
    )


def _scratch_bytes(path: str, heads: torch.Tensor, layers: torch.Tensor, traces, chunk_rows: int) -> int:
    """Working memory of one (layer, component) statistics call beside the traces (formula, not a reading):
    generic: float64 X, its centred and weighted copies and Y, centred [H_t, n, ·]; streaming: Eq. 22's float64
    panels of one chunk, O(H_t·b·(2p + d_t)); fused: the int8 digit panel + float64 Gram (kernels/fused_fit.py)."""
    width = layers.shape[1] * heads.shape[1] * traces.source_k.shape[-1]  # p
    dim = traces.target_k.shape[-1]
    if path == "generic":
        return 8 * heads.shape[0] * traces.rows * (3 * width + 2 * dim)
    if path == "streaming":
        return 8 * heads.shape[0] * min(chunk_rows, traces.rows) * (2 * width + dim)
    plan = make_plan(traces.source_k, traces.target_k[0], layers[0], heads, chunk_rows)
    return fused_scratch_bytes(plan)["total"]


def _reset_peak() -> int:
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
