"""Fused-Fit construction benchmark (CacheBridge §4.5; Eqs. 20–23): generic (materialized X, Y) vs streaming (Eq. 22
chunks, float64) vs fused (kernels/fused_fit.py) statistics for a full L_t × {K, V} construction, each followed by the
float64 ridge solve, on random traces at the paper's shapes (Qwen3-14B → 32B: L_s = 40, L_t = 64, 8 KV heads,
d = 128, Head-Local, k = 8, 500 sequences × 256 rows = 128,000 rows). Timing only — random traces, random weights.

    python scripts/bench_fused_fit.py --out fused_fit.json            # one H200: ~1 min
    python scripts/bench_fused_fit.py --quick --out /tmp/ff.json      # CPU smoke run: seconds

Paths: generic / streaming / fused (statistics backends timed here, each + the float64 solve), emulate (the fused
arithmetic in torch), fit (src.fit.fit_mapper(statistics="fused") end to end: Attn-Repair weights from the raw
sensitivities, solve, float32 coefficients). --variant NAME:key=value;... times fused variants (levels, gram
BM,BN,BK,warps,stages, stats rows,warps, panel rows,warps, hint 0 | 1: the gathers' offset hint) on --variant-layers
layers; the JSON is rewritten after every path, so a run cut short keeps what it measured.

Needs only torch (+ triton for the fused kernels) and this repository's src/ and kernels/: no hydra, no mlflow.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from statistics import median_high

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from kernels.fused_fit import (  # noqa: E402
    GRAM_CONFIGS,
    GramConfig,
    PassConfig,
    fused_moments,
    gram_config_in_use,
    make_plan,
    scratch_bytes,
    triton_available,
)
from src.fit import fit_mapper  # noqa: E402
from src.select import depth_layers  # noqa: E402
from src.stats import Moments, reference_moments, ridge_solve, streaming_moments  # noqa: E402
from src.support import gather_features, head_assignment  # noqa: E402
from src.traces import Traces  # noqa: E402
from src.weighting import attn_repair_weights  # noqa: E402

PATHS = ("generic", "streaming", "fused", "emulate", "fit")
COMPONENTS = ("k", "v")


def random_traces(args, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Source / target content rows [L, H, n, d] drawn layer by layer (float32 draws, stored in `dtype`)."""
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rows = args.sequences * args.rows_per_sequence

    def draw(layers: int) -> torch.Tensor:
        out = torch.empty(layers, args.heads, rows, args.dim, dtype=dtype, device=device)  # [L, H, n, d]
        for layer in range(layers):
            out[layer] = torch.randn(args.heads, rows, args.dim, generator=generator, device=device).to(dtype)
        return out

    return {
        "source_k": draw(args.source_layers),
        "source_v": draw(args.source_layers),
        "target_k": draw(args.target_layers),
        "target_v": draw(args.target_layers),
    }


def repair_weights(args, width: int, device: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Raw sensitivities (log-normal, heavy-tailed) and their Attn-Repair weights (Eqs. 17–19), [L_t, H, n] each."""
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    rows = args.sequences * args.rows_per_sequence
    raw, weights = {}, {}
    for component in COMPONENTS:
        noise = torch.randn(
            args.target_layers, args.heads, rows, generator=generator, device=device, dtype=torch.float64
        )
        raw[component] = torch.exp(args.weight_sigma * noise)  # [L_t, H, n]
        weights[component] = torch.stack([attn_repair_weights(r, width)[0] for r in raw[component]])  # [L_t, H, n]
    return raw, weights


def moments(path: str, rows_x, rows_y, w, layers, head_index, args):
    if path == "generic":  # what src.fit does with reference=True: materialize X, Y
        return reference_moments(gather_features(rows_x, layers, head_index), rows_y, w)
    if path == "streaming":  # src.fit's default: float64 chunks of b rows, two passes
        chunk = lambda span: (gather_features(rows_x[:, :, span], layers, head_index), rows_y[:, span], w[:, span])
        return streaming_moments(chunk, rows_x.shape[2], args.chunk_rows)
    backend = "emulate" if path == "emulate" else args.fused_backend
    return fused_moments(
        rows_x, rows_y, w, layers, head_index, args.chunk_rows, backend, args.config, args.levels, args.passes
    )


class Clock:
    """CUDA events on a GPU (no syncs inside the timed loop), perf_counter on CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, stop) -> float:
        if not self.cuda:
            return stop - start
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3


def solve(pending: list, coefficients: dict, lam: float) -> None:
    """Float64 ridge solve (Eq. 23) of the pending problems, stacked along the head axis (one call per group)."""
    if not pending:
        return
    stacked = Moments(
        *(torch.cat([getattr(stats, name) for _, stats in pending]) for name in ("mean_x", "mean_y", "xx", "xy", "yy")),
        rows=pending[0][1].rows,
    )
    weight, bias = ridge_solve(stacked, lam, False)  # [G·H, p, d], [G·H, d]
    heads = pending[0][1].xx.shape[0]
    for index, (key, _) in enumerate(pending):
        coefficients[key] = (weight[index * heads : (index + 1) * heads], bias[index * heads : (index + 1) * heads])
    pending.clear()


def construct(path: str, traces, weights, source_layers, head_index, args, clock: Clock, layers: int):
    """Statistics + ridge solve for target layers [0, layers) × {K, V}; returns W, b per (layer, component)."""
    coefficients, marks, pending = {}, [], []
    start = clock.mark()
    for layer in range(layers):
        for component in COMPONENTS:
            rows_x, rows_y = traces[f"source_{component}"], traces[f"target_{component}"][layer]
            before = clock.mark()
            stats = moments(path, rows_x, rows_y, weights[component][layer], source_layers[layer], head_index, args)
            marks.append((before, clock.mark()))
            pending.append(((layer, component), stats))
            if len(pending) == args.solve_group:
                solve(pending, coefficients, args.lam)
    solve(pending, coefficients, args.lam)
    stop = clock.mark()
    total = clock.seconds(start, stop)
    statistics = sum(clock.seconds(a, b) for a, b in marks)
    return coefficients, {"seconds": total, "stats_seconds": statistics, "solve_seconds": total - statistics}


def fit_path(traces: Traces, source_layers, head_index, args, clock: Clock, layers: int):
    """src.fit.fit_mapper(statistics="fused") on the first `layers` target layers: the fit's own code path."""
    part = Traces(
        source_k=traces.source_k, source_v=traces.source_v, target_k=traces.target_k[:layers],
        target_v=traces.target_v[:layers], sequence_index=traces.sequence_index, position=traces.position,
        attn_k=traces.attn_k[:layers], attn_v=traces.attn_v[:layers], meta={},
    )  # fmt: skip
    start = clock.mark()
    mapper = fit_mapper(part, source_layers[:layers], head_index, "local", "attn_repair", args.lam, False,
                        args.chunk_rows, "fused")  # fmt: skip
    seconds = clock.seconds(start, clock.mark())
    coefficients = {
        (layer, component): (getattr(mapper, f"weight_{component}")[layer], getattr(mapper, f"bias_{component}")[layer])
        for layer in range(layers)
        for component in COMPONENTS
    }
    return coefficients, {"seconds": seconds, "stats_seconds": None, "solve_seconds": None}


def variant(spec: str, args) -> tuple[str, argparse.Namespace]:
    """ "NAME:levels=4;gram=128,64,64,8,3;stats=16,4;panel=32,8;solve=16;hint=0" → (NAME, args with those)."""
    name, _, settings = spec.partition(":")
    changed = argparse.Namespace(**vars(args))
    changed.config = args.config or GRAM_CONFIGS[0]  # explicit: a variant's tiles must not carry over to the next
    for item in filter(None, settings.split(";")):
        key, _, value = item.partition("=")
        numbers = [int(v) for v in value.split(",")]
        if key == "levels":
            changed.levels = numbers[0]
        elif key == "gram":
            changed.config = GramConfig(*numbers)
        elif key == "solve":
            changed.solve_group = numbers[0]
        elif key == "hint":  # hint=0: the gathers without the schedule's offset multiple (the loads before 2026-12-07)
            changed.passes = PassConfig(**{**vars(changed.passes), "offset_hint": bool(numbers[0])})
        elif key in ("stats", "panel"):
            changed.passes = PassConfig(
                **{**vars(changed.passes), f"{key}_rows": numbers[0], f"{key}_warps": numbers[1]}
            )
        else:
            raise ValueError(f"unknown variant setting {key!r}")
    return name, changed


def kernel_profile(traces, weights, source_layers, head_index, args, clock: Clock) -> list[dict]:
    """CUDA time per kernel of one fused target layer (K and V): where the fused seconds go."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            construct("fused", traces, weights, source_layers, head_index, args, clock, layers=1)
            torch.cuda.synchronize()
        events = profiler.key_averages()
    except Exception as error:  # profiling is a diagnostic: never lose the measurement to it
        return [{"error": repr(error)[:200]}]
    rows = [
        {"kernel": event.key[:80], "calls": event.count, "ms": event.self_device_time_total / 1e3}
        for event in events
        if event.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda row: -row["ms"])[:12]


def max_relative(coefficients, reference) -> dict[str, float]:
    """max |ΔW| / max |W| per artifact tensor (weight_k, bias_k, weight_v, bias_v, stacked over layers)."""
    out = {}
    for component in COMPONENTS:
        for index, name in ((0, "weight"), (1, "bias")):
            keys = [key for key in reference if key[1] == component]
            difference = max(float((coefficients[key][index] - reference[key][index]).abs().max()) for key in keys)
            scale = max(float(reference[key][index].abs().max()) for key in keys)
            out[f"{name}_{component}"] = difference / scale
    return out


def bitwise_equal(a, b) -> bool:
    return all(torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1]) for key in a)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (a smoke run)")
    parser.add_argument("--sequences", type=int, default=500)
    parser.add_argument("--rows-per-sequence", type=int, default=256, help="1,024 tokens at stride 4")
    parser.add_argument("--source-layers", type=int, default=40)
    parser.add_argument("--target-layers", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8, help="KV heads of both models")
    parser.add_argument("--dim", type=int, default=128, help="head dim of both models")
    parser.add_argument("--k", type=int, default=8, help="selected source layers per target layer")
    parser.add_argument("--chunk-rows", type=int, default=16384, help="b in Eq. 22")
    parser.add_argument("--lam", type=float, default=0.01, help="ridge λ (absolute), as conf/fit/default.yaml")
    parser.add_argument("--storage", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--weight-sigma", type=float, default=1.5, help="log-normal σ of the raw sensitivities")
    parser.add_argument("--paths", default=None, help=f"comma list of {PATHS} (default generic,streaming,fused)")
    parser.add_argument("--repeats", type=int, default=None, help="timed fused runs, default 3 (others run once)")
    parser.add_argument("--levels", type=int, default=5, choices=(4, 5, 6), help="fused digit-pair orders kept")
    parser.add_argument("--solve-group", type=int, default=1, help="problems per ridge_solve call (1 = as src.fit)")
    parser.add_argument("--fused-backend", default="auto", choices=("auto", "triton", "emulate", "reference"))
    parser.add_argument("--gram-config", default=None, help="BM,BN,BK,warps,stages for the fused Gram kernel")
    parser.add_argument("--stats", default=None, help="fused pass-1 rows,warps")
    parser.add_argument("--panel", default=None, help="fused panel-writer rows,warps")
    parser.add_argument("--variant", action="append", default=[], help="NAME:key=value;... fused variant to time")
    parser.add_argument("--variant-layers", type=int, default=8, help="target layers timed per variant")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.rows_per_sequence, args.source_layers, args.target_layers = 4, 100, 5, 3
        args.heads, args.dim, args.k, args.chunk_rows = 2, 16, 3, 150
        args.storage, args.device = "float32", args.device or "cpu"
        args.paths, args.repeats = args.paths or "generic,streaming,fused,emulate,fit", args.repeats or 2
    args.paths, args.repeats = args.paths or "generic,streaming,fused", args.repeats or 3
    if args.variant and not 1 <= args.variant_layers <= args.target_layers:
        parser.error(f"--variant-layers {args.variant_layers}: 1 to the {args.target_layers} target layers")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.config = GramConfig(*map(int, args.gram_config.split(","))) if args.gram_config else None
    passes = {}
    for key in ("stats", "panel"):
        if getattr(args, key):
            rows, warps = map(int, getattr(args, key).split(","))
            passes |= {f"{key}_rows": rows, f"{key}_warps": warps}
    args.passes = PassConfig(**passes)
    return args


def measure(path: str, traces, weights, fit_traces, source_layers, head_index, args, clock, layers: int):
    """Timed runs of one path over `layers` target layers → (coefficients of the last run, entry)."""
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    runs, first = [], None
    for _ in range(args.repeats if path in ("fused", "emulate") else 1):
        if path == "fit":
            coefficients, timing = fit_path(fit_traces, source_layers, head_index, args, clock, layers)
        else:
            coefficients, timing = construct(path, traces, weights, source_layers, head_index, args, clock, layers)
        first = first or coefficients
        timing["bitwise_equal_to_first_run"] = bitwise_equal(coefficients, first)
        runs.append(timing)
    seconds = median_high(run["seconds"] for run in runs)
    entry = {
        "runs": runs,
        "layers": layers,
        "median_seconds": seconds,
        "ms_per_layer": 1e3 * seconds / layers,
        "peak_bytes_above_traces": (torch.cuda.max_memory_allocated() - baseline) if cuda else None,
        "coefficient_bytes": sum(w.numel() * w.element_size() + b.numel() * b.element_size() for w, b in
                                 coefficients.values()),
        "bitwise_repeatable": all(run["bitwise_equal_to_first_run"] for run in runs),
    }  # fmt: skip
    return coefficients, entry


def main() -> None:
    args = parse()
    device, dtype = args.device, getattr(torch, args.storage)
    cuda = device.startswith("cuda")
    rows = args.sequences * args.rows_per_sequence
    paths = [path for path in args.paths.split(",") if path]
    head_index = head_assignment("local", args.heads, args.heads)  # Head-Local, f = 1
    source_layers = depth_layers(args.source_layers, args.target_layers, args.k)  # [L_t, k]
    width, clock = args.k * head_index.shape[1] * args.dim, Clock(device)
    began = time.perf_counter()
    traces = random_traces(args, device, dtype)
    raw, weights = repair_weights(args, width, device)
    fit_traces = Traces(
        **traces, sequence_index=torch.arange(rows) // args.rows_per_sequence,
        position=torch.arange(rows) % args.rows_per_sequence, attn_k=raw["k"], attn_v=raw["v"], meta={},
    )  # fmt: skip
    trace_bytes = sum(t.numel() * t.element_size() for t in traces.values())
    print(f"traces {trace_bytes / 1e9:.1f} GB ({args.storage}) + weights in {time.perf_counter() - began:.1f} s")
    plan = make_plan(traces["source_k"], traces["target_k"][0], source_layers[0], head_index, args.chunk_rows)
    flops = 2 * args.target_layers * 2 * args.heads * rows * (width * width + width * args.dim)  # A (full) + B
    backend = args.fused_backend if args.fused_backend != "auto" else ("triton" if cuda and triton_available() else
                                                                        "emulate")  # fmt: skip
    if "fused" in paths and backend != "triton":
        print(f"fused: no CUDA or no triton → backend {backend} (labelled in the JSON)")
    results: dict = {}
    summary = {
        "what": "Fused-Fit construction: statistics + float64 ridge solve, L_t × {K, V}, random traces (timing only)",
        "shape": {
            "sequences": args.sequences, "rows_per_sequence": args.rows_per_sequence, "rows": rows,
            "source_layers": args.source_layers, "target_layers": args.target_layers, "heads": args.heads,
            "dim": args.dim, "k": args.k, "support": "local", "p": width, "chunk_rows": args.chunk_rows,
            "fused_chunk_rows": plan.chunk, "solve_group": args.solve_group, "lam": args.lam, "levels": args.levels,
            "passes": vars(args.passes),
        },
        "storage_dtype": args.storage,
        "storage_note": f"traces held in {args.storage}: {trace_bytes / 1e9:.1f} GB (float32: "
        f"{trace_bytes / dtype.itemsize * 4 / 1e9:.1f} GB, too much beside the generic path's float64 design at the "
        "paper shape on one 139 GiB H200); every path reads the same tensors, the kernels upcast on load",
        "weights": f"log-normal(σ={args.weight_sigma}) raw sensitivities → src.weighting.attn_repair_weights",
        "flops_definition": "2·n·(p² + p·d_t) per target head, layer and component (the generic path's Gram work)",
        "peak_note": "peak_bytes_above_traces counts the run's W, b (coefficient_bytes; repeated paths also keep "
        "their first run's for the bitwise check) beside the path's own scratch",
        "paths": results,
        "environment": {
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": __import__("triton").__version__ if triton_available() else None,
            "cuda": torch.version.cuda,
        },
    }  # fmt: skip

    def write() -> None:
        fused = results.get("fused", {})
        summary["goal"] = {
            "seconds": 3.0,
            "max_relative_difference": 1e-6,
            "seconds_met": fused.get("median_seconds", float("inf")) <= 3.0,
            "precision_met": max(fused.get("max_relative_difference_vs_generic", {"-": float("inf")}).values()) <= 1e-6,
        }
        config = gram_config_in_use(device) if cuda else None
        summary["environment"]["gram_config"] = None if config is None else vars(config)
        summary["wall_seconds"] = time.perf_counter() - began
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2, default=str))

    for path in sorted(paths, key=lambda path: path != "fused"):  # warm-up / compile, the kernels first: fail fast
        if path != "fit":
            construct(path, traces, weights, source_layers, head_index, args, clock, layers=1)
    print(f"warm-up done at {time.perf_counter() - began:.0f} s")
    coefficients_of, reference = {}, None
    for path in paths:
        coefficients, entry = measure(path, traces, weights, fit_traces, source_layers, head_index, args, clock,
                                      args.target_layers)  # fmt: skip
        entry["tflops_fp64_equivalent"] = flops / entry["median_seconds"] / 1e12
        if path == "generic":
            reference = coefficients
            entry["scratch_bytes"] = 8 * args.heads * rows * (3 * width + 2 * args.dim)  # X, centered, weighted; Y
        elif path == "streaming":
            entry["scratch_bytes"] = 8 * args.heads * min(args.chunk_rows, rows) * (2 * width + args.dim)  # Eq. 22
        else:
            entry["scratch_bytes"] = scratch_bytes(plan)
            entry["backend"] = "emulate" if path == "emulate" else backend
        if path != "generic":
            coefficients_of[path] = coefficients
        results[path] = entry
        for other, kept in coefficients_of.items() if reference is not None else ():
            if "max_relative_difference_vs_generic" not in results[other]:
                results[other]["max_relative_difference_vs_generic"] = max_relative(kept, reference)
        difference = max(entry.get("max_relative_difference_vs_generic", {"-": float("nan")}).values())
        print(
            f"{path:>9}: {entry['median_seconds']:.3f} s ({entry['tflops_fp64_equivalent']:.1f} TFLOP/s "
            f"fp64-equivalent, {entry['ms_per_layer']:.1f} ms/layer), "
            + ("the reference" if path == "generic" else f"max rel diff vs generic {difference:.1e}"),
            flush=True,
        )
        write()
    coefficients_of.clear()
    if cuda and "fused" in results:
        results["fused"]["kernels_one_layer"] = kernel_profile(traces, weights, source_layers, head_index, args, clock)
        for row in results["fused"]["kernels_one_layer"][:6]:
            print(f"  one layer: {row.get('ms', float('nan')):7.2f} ms  {row.get('kernel', row.get('error'))[:60]}")
    write()
    for spec in args.variant:  # fused variants on the first --variant-layers layers
        name, changed = variant(spec, args)
        try:
            construct("fused", traces, weights, source_layers, head_index, changed, clock, layers=1)  # compile
            coefficients, entry = measure("fused", traces, weights, fit_traces, source_layers, head_index, changed,
                                          clock, args.variant_layers)  # fmt: skip
        except (RuntimeError, ValueError) as error:  # a tile that does not fit this device: record, go on
            results[f"variant:{name}"] = {"error": repr(error)[:300]}
            print(f"variant {name}: {error!r}"[:300], flush=True)
            continue
        entry["scratch_bytes"] = scratch_bytes(plan)
        entry["settings"] = {"levels": changed.levels, "gram": changed.config and vars(changed.config),
                             "passes": vars(changed.passes), "solve_group": changed.solve_group}  # fmt: skip
        if reference is not None:
            entry["max_relative_difference_vs_generic"] = max_relative(coefficients, {
                key: value for key, value in reference.items() if key[0] < args.variant_layers})  # fmt: skip
        results[f"variant:{name}"] = entry
        difference = max(entry.get("max_relative_difference_vs_generic", {"-": float("nan")}).values())
        print(f"variant {name}: {entry['ms_per_layer']:.1f} ms/layer, max rel diff {difference:.1e}", flush=True)
        write()
    write()
    print(f"wrote {args.out} ({summary['wall_seconds']:.0f} s wall)")


if __name__ == "__main__":
    main()
