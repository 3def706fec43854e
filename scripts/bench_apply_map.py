"""Mapper application at a pair's KV shapes (Qwen3-14B → 32B; --shapes coder: Qwen2.5-Coder 0.5B → 1.5B): the
reference (the `src.apply.map_layers` path of KVTransfer) vs the fused Triton path (`kernels.apply_map.map_cache`)
and the same under a CUDA graph, per support and prefix; with `--backends gemm`, also the map as one GEMM per target
head (`map_cache(backend="gemm")`, its coefficients packed once per mapper, kernels/apply_map_gemm.py), its graph, and
its gather and two GEMMs alone (`gemm_products_only`: `head_products`, no de-RoPE and no epilogue — what the epilogue
adds is the difference; no output compared). Two paths call the map as the serving paths do: `triton_stacked` with
the source already stacked [L_s, B, H_s, T, d_s] (the connector's export and the engine's map graph hand it so; every
other path stacks the per-layer list inside the timed call), and `triton_paged` as the vLLM connector's direct writer
does — stacked source, each target layer's flash cache (NHD, 16-token blocks) its own allocation, the request's
blocks shuffled (`slots`), the finiteness flags (`triton_paged_guard`: and the magnitude guard, bound GUARD) — its
output read back from the blocks for the error columns. These time the device work back to back (the queue kept
full); the connector's own device span also holds the host's launch gaps of one isolated handoff.

Random source caches and random coefficients of the exact shapes — timing, memory and numerics only. Rotary
tables come from `transformers.Qwen3Config` (the real 14B / 32B sizes) through its rotary embedding class; no
model is built. Times are CUDA-event p50 / p95 over --reps calls after --warmup; every path also computes
the per-layer finiteness KVTransfer checks. Standalone: torch, triton, transformers and `src` only.

    python scripts/bench_apply_map.py --out apply_map.json          # one H200: ≈ 1 min
    python scripts/bench_apply_map.py --shapes coder --k 24 --supports local --prefix 2048 8192 16384 --out coder.json
    python scripts/bench_apply_map.py --shapes coder --k 24 --supports local --prefix 8192 16384 --backends triton gemm \
        --out coder_gemm.json
    python scripts/bench_apply_map.py --quick --out /tmp/apply.json  # CPU smoke: tiny shapes, reference and gemm
                                                                     # (checked against the reference)
"""

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.apply_map import (  # noqa: E402
    HAVE_TRITON,
    CapturedMapCache,
    KernelConfig,
    default_config,
    map_cache,
    map_cache_ref,
    triton_unsupported,
)
from kernels.apply_map_gemm import PackedMapper, gemm_worthwhile, head_products, packed_weights  # noqa: E402
from kernels.paged_read import read_layers_ref  # noqa: E402
from src.artifact import Mapper  # noqa: E402
from src.rope import remove_rope, rope_cos_sin  # noqa: E402
from src.select import depth_layers  # noqa: E402
from src.serving.paged import flash_halves, slots_for  # noqa: E402
from src.support import head_assignment  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}
BLOCK = 16  # vLLM's GPU block size (the bench's and the connector's)
GUARD = 1e4  # triton_paged_guard's magnitude bound: the flags are computed, random data never reaches it


def sizes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)  # fmt: skip


SHAPES = {  # the KV-relevant sizes of each pair (--shapes; tiny: --quick), as (source, target)
    "qwen3": (sizes(5120, 17408, 40, 40, 8, 128), sizes(5120, 25600, 64, 64, 8, 128)),  # Qwen3-14B → 32B
    "coder": (sizes(896, 4864, 24, 14, 2, 64), sizes(1536, 8960, 28, 12, 2, 128)),  # Qwen2.5-Coder 0.5B → 1.5B
    "tiny": (sizes(64, 128, 4, 4, 2, 16), sizes(96, 192, 6, 6, 2, 16)),
}  # RoPE of both pairs: default, θ = 1e6 (Qwen2.5-Coder's too)
PEAKS = {  # dense, by the device name's model
    "H200": {"bf16_dense_tflops": 790.0, "tf32_dense_tflops": 395.0, "hbm_gbps": 4800.0},
    "H100": {"bf16_dense_tflops": 989.0, "tf32_dense_tflops": 494.0, "hbm_gbps": 3350.0},  # SXM datasheet
}
PEAK = PEAKS["H100" if torch.cuda.is_available() and "H100" in torch.cuda.get_device_name() else "H200"]
SWEEP = {  # candidate `_map_kernel` tiles (block_m, block_k, num_warps, num_stages), each in both launch orders and
    # both dot forms (one tl.dot per RoPE half, or KernelConfig.single_dot)
    torch.bfloat16: [
        (128, 64, 4, 4),  # around the default (128, 64, 4, 3), the 2026-12-07 sweep's best
        (256, 64, 4, 3),
        (128, 128, 4, 3),
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 32, 8, 4),
        (64, 64, 4, 3),
        (64, 64, 4, 4),
        (128, 64, 4, 3),
        (128, 64, 8, 2),
        (64, 64, 4, 2),
        (256, 64, 8, 3),
    ],
    torch.float32: [(128, 32, 8, 3), (128, 32, 8, 2), (64, 32, 4, 3)],
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2**-6}  # --quick: max |Δ| / max |reference| of every path


def qwen3_config(kv_sizes: dict) -> Qwen3Config:
    return Qwen3Config(**kv_sizes, vocab_size=151936, max_position_embeddings=40960, rope_parameters=ROPE)


def random_mapper(source: Qwen3Config, target: Qwen3Config, support: str, k: int, dtype, device) -> Mapper:
    """A mapper of the fitted shape (depth-proportional layers, the support's head map), drawn on the device."""
    heads = head_assignment(support, source.num_key_value_heads, target.num_key_value_heads)  # [H_t, f]
    width = k * heads.shape[1] * source.head_dim
    shape = (target.num_hidden_layers, target.num_key_value_heads)
    draw = lambda *s, scale: (torch.randn(*s, device=device) * scale).to(dtype)
    return Mapper(
        source_layers=depth_layers(source.num_hidden_layers, target.num_hidden_layers, k).to(device),  # [L_t, k]
        head_index=heads.to(device),
        weight_k=draw(*shape, width, target.head_dim, scale=width**-0.5),  # [L_t, H_t, p, d_t]
        bias_k=draw(*shape, target.head_dim, scale=0.1),  # [L_t, H_t, d_t]
        weight_v=draw(*shape, width, target.head_dim, scale=width**-0.5),
        bias_v=draw(*shape, target.head_dim, scale=0.1),
        manifest={"synthetic": True},
    )


def timed(fn: Callable[[], object], reps: int, warmup: int, cuda: bool) -> dict[str, float]:
    """Per-call ms (CUDA events on GPU, perf_counter on CPU) after warm-up: p50, p95, mean."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    ordered = sorted(times)
    return {
        "ms_p50": statistics.median(ordered),
        "ms_p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
        "ms_mean": statistics.fmean(ordered),
    }


def peak_extra_bytes(fn: Callable[[], object], cuda: bool) -> int | None:
    """GPU memory a call allocates beyond what is live before it (outputs included)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before


def work(mapper: Mapper, source: Qwen3Config, batch: int, seq: int, cache_bytes: int) -> dict[str, float]:
    """Arithmetic (2 FLOP per MAC, K and V) and the minimum HBM traffic: source K/V + coefficients + target K/V;
    `gemm_flop`: what the one-GEMM form multiplies (every source layer per target layer: L_s / k times `flop`)."""
    target_layers, target_heads, width, d_t = mapper.weight_k.shape
    flops = 2 * 2 * target_layers * target_heads * batch * seq * width * d_t
    gemm_flops = flops * source.num_hidden_layers // mapper.source_layers.shape[1]
    source_bytes = 2 * source.num_hidden_layers * batch * source.num_key_value_heads * seq * source.head_dim
    coefficients = 2 * (mapper.weight_k.numel() + mapper.bias_k.numel()) * mapper.weight_k.element_size()
    target_bytes = 2 * target_layers * batch * target_heads * seq * d_t
    return {"flop": flops, "gemm_flop": gemm_flops, "bytes": (source_bytes + target_bytes) * cache_bytes + coefficients}


def errors(ours, reference) -> dict[str, float]:
    out = {}
    for name, a, b in zip(("k", "v"), ours, reference, strict=True):
        difference = (a.double() - b.double()).abs().max()
        out[f"max_abs_err_{name}"] = float(difference)
        out[f"max_rel_err_{name}"] = float(difference / b.double().abs().max())  # relative to the largest entry
    return out


def paged_destinations(target: Qwen3Config, seq: int, dtype: torch.dtype, device) -> tuple[tuple, torch.Tensor]:
    """The connector's direct-writer destinations: each target layer's flash cache, logically [N_blocks, H_t, BLOCK,
    2·d_t] and stored NHD [N_blocks, BLOCK, H_t, 2·d_t] (FlashAttention's order), its own allocation (vLLM's GPU
    runner allocates them apart), 8 blocks more than the request needs, the request's blocks in shuffled order —
    (K, V) halves as `LayerViews` and the request's slots [T]."""
    blocks = -(-seq // BLOCK)
    shape = (blocks + 8, BLOCK, target.num_key_value_heads, 2 * target.head_dim)  # NHD
    caches = [torch.zeros(shape, dtype=dtype, device=device).transpose(1, 2) for _ in range(target.num_hidden_layers)]
    order = torch.randperm(blocks + 8, generator=torch.Generator().manual_seed(0))[:blocks].tolist()
    return flash_halves(caches), slots_for(order, BLOCK, 0, seq, device)


def paged_output(destinations: tuple, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a map stored into `paged_destinations` at slots [T], read back as the other paths return it:
    keys, values [L_t, 1, H_t, T, d_t]."""
    keys, values = read_layers_ref(*destinations, slots)  # [L_t, H_t, T, d_t] each
    return keys[:, None], values[:, None]


def exact_errors(keys, values, mapper: Mapper, tables, outputs: dict, layers: int = 2) -> dict[str, float]:
    """Error of each path vs fp64 on the first `layers` target layers, same rounded inputs (content keys)."""
    compute = mapper.weight_k.dtype
    content = remove_rope(torch.stack(keys), tables[0], tables[1]).to(compute).double()  # [L_s, B, H_s, T, d_s]
    head = slice(0, layers)
    weights = (mapper.weight_k, mapper.bias_k, mapper.weight_v, mapper.bias_v)
    wide = Mapper(mapper.source_layers[head], mapper.head_index, *(t[head].double() for t in weights), manifest={})
    identity = (torch.ones_like(tables[0]), torch.zeros_like(tables[1]))
    values64 = torch.stack(values).to(compute).double()
    exact = map_cache_ref(content, values64, wide, *identity, *tables[2:], out_dtype=torch.float64)
    return {
        f"{path}_rel_err_vs_fp64_{name}": float((a[head].double() - e).abs().max() / e.abs().max())
        for path, pair in outputs.items()
        for name, a, e in zip(("k", "v"), pair, exact, strict=True)
    }


def sweep_tiles(
    call: tuple, options: dict, tiles: list[tuple[int, ...]], cuda: bool
) -> tuple[KernelConfig | None, dict]:
    """p50 of every candidate tile (20 calls each) in both launch orders and dot forms; the fastest, and the per-tile
    results."""
    timings, sweep = {}, {}
    for tile in [(*tile, inner, single) for tile in tiles for inner in (True, False) for single in (False, True)]:
        config = KernelConfig(*tile)
        try:
            stats = timed(lambda c=config: map_cache(*call, **options, config=c), 20, 3, cuda)
            timings[config] = stats["ms_p50"]
        except Exception as error:  # a tile this GPU cannot hold (shared memory, registers)
            stats = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        sweep[str(tile)] = stats
    return (min(timings, key=timings.get) if timings else None), sweep


def tile_arg(text: str) -> tuple[int, int, int, int]:
    """--tiles: "block_m,block_k,num_warps,num_stages" → a tile tuple (argparse reports a bad one as a usage error)."""
    parts = text.split(",")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"a tile is BM,BK,WARPS,STAGES (positive integers), not {text!r}")
    return tuple(int(part) for part in parts)


def measure(
    paths: dict[str, Callable], amount: dict, peak_tflops: float, args, cuda: bool, readers: dict | None = None
) -> tuple[dict, dict]:
    """Timing, throughput vs peaks and peak memory of every path, and one output of each (cloned; through
    `readers[name]` where a path's output must be read back, untimed)."""
    rows, outputs = {}, {}
    for name, fn in paths.items():
        stats = timed(fn, args.reps, args.warmup, cuda)
        tflops = amount["flop"] / (stats["ms_p50"] / 1e3) / 1e12
        gbps = amount["bytes"] / (stats["ms_p50"] / 1e3) / 1e9
        rows[name] = dict(
            stats,
            tflops=tflops,
            gbps=gbps,
            tflops_fraction_of_peak=tflops / peak_tflops,
            gbps_fraction_of_peak=gbps / PEAK["hbm_gbps"],
            peak_extra_bytes=peak_extra_bytes(fn, cuda),
        )
        outputs[name] = tuple(t.clone() for t in (readers or {}).get(name, lambda given: given)(fn()))
    return rows, outputs


def bench_prefix(
    args,
    source,
    target,
    mapper: Mapper,
    packed: PackedMapper | None,
    rotary: dict,
    seq: int,
    tuned: KernelConfig | None,
) -> dict:
    """All paths at one prefix (the gemm ones with `packed`); sweeps the tiles first when `tuned` is None and the
    sweep is on."""
    device = mapper.weight_k.device
    cuda, compute, cache = device.type == "cuda", mapper.weight_k.dtype, getattr(torch, args.cache_dtype)
    positions = torch.arange(seq, device=device)
    tables = [*rope_cos_sin(rotary["s"], positions), *rope_cos_sin(rotary["t"], positions)]  # [1, 1, T, d]
    shape = (args.batch, source.num_key_value_heads, seq, source.head_dim)
    keys = [torch.randn(shape, device=device).to(cache) for _ in range(source.num_hidden_layers)]  # [B, H_s, T, d_s]
    values = [torch.randn(shape, device=device).to(cache) for _ in range(source.num_hidden_layers)]
    flags = torch.zeros(target.num_hidden_layers, dtype=torch.int32, device=device)  # [L_t]
    call = (keys, values, mapper, *tables, "half", "half", cache)
    options = {"nonfinite": flags, "precision": args.precision}  # Triton paths
    paths = {"reference": lambda: map_cache_ref(*call, nonfinite=flags)}
    reason = triton_unsupported(keys[0], mapper, tables[0], tables[2], ("half", "half"))
    sweep, path_errors, readers = {}, {}, {}
    if "triton" in args.backends and reason is None:
        default = default_config(seq, compute, target.head_dim)
        if tuned is None and not args.no_sweep:
            tuned, sweep = sweep_tiles(call, options, args.tiles or SWEEP[compute], cuda)
        paths["triton"] = lambda: map_cache(*call, **options, config=default)
        other = replace(default, single_dot=not default.single_dot)  # the other dot form, the default tile
        name = "triton_single_dot" if other.single_dot else "triton_two_dots"
        try:  # a form this GPU's compiler refuses is a result too (the default is still timed)
            map_cache(*call, **options, config=other)
            paths[name] = lambda: map_cache(*call, **options, config=other)
        except Exception as error:
            path_errors[name] = f"{type(error).__name__}: {str(error)[:200]}"
        if tuned is not None and tuned != default:
            paths["triton_tuned"] = lambda: map_cache(*call, **options, config=tuned)
        stacked = (torch.stack(keys), torch.stack(values), *call[2:])  # [L_s, B, H_s, T, d_s] each, stacked once
        paths["triton_stacked"] = lambda: map_cache(*stacked, **options, config=default)
        if args.batch == 1:  # one request's blocks
            halves, slots = paged_destinations(target, seq, cache, device)
            paged = options | {"out": halves, "slots": slots}  # the measured runs' policy: no magnitude guard
            paths["triton_paged"] = lambda: map_cache(*stacked, **paged, config=default)
            guarded = paged | {"beyond": torch.zeros_like(flags), "bound": GUARD}  # [L_t] flags, a guard set
            paths["triton_paged_guard"] = lambda: map_cache(*stacked, **guarded, config=default)
            readers["triton_paged"] = readers["triton_paged_guard"] = lambda out: paged_output(out, slots)
        if cuda and not args.no_graph:
            graph = CapturedMapCache(*call, **options, config=tuned or default)
            paths["triton_graph"] = lambda: graph(keys, values)
    if packed is not None:
        gemm = {"nonfinite": flags, "backend": "gemm", "packed": packed}
        paths["gemm"] = lambda: map_cache(*call, **gemm)
        if cuda and not args.no_graph:
            try:  # a capture this torch cannot make is a result too (the eager path is still timed)
                gemm_graph = CapturedMapCache(*call, **gemm)
                paths["gemm_graph"] = lambda: gemm_graph(keys, values)
            except Exception as error:
                path_errors["gemm_graph"] = f"{type(error).__name__}: {str(error)[:200]}"
    amount = work(mapper, source, args.batch, seq, cache.itemsize)
    peak = PEAK["tf32_dense_tflops" if compute == torch.float32 else "bf16_dense_tflops"]
    rows, outputs = measure(paths, amount, peak, args, cuda, readers)
    for name in rows:
        rows[name] |= errors(outputs[name], outputs["reference"])
    if not args.no_exact:
        exact = exact_errors(keys, values, mapper, tables, {n: o for n, o in outputs.items() if "graph" not in n})
        for key, value in exact.items():
            path, metric = key.split("_rel_err_vs_fp64_")
            rows[path][f"rel_err_vs_fp64_{metric}"] = value
    nonfinite = int(flags.sum())  # set by the last path measured; random finite data → 0
    if args.quick and (
        failed := [n for n, r in rows.items() if max(r["max_rel_err_k"], r["max_rel_err_v"]) > TOLERANCE[compute]]
    ):
        raise SystemExit(f"--quick: {failed} differ from the reference by more than {TOLERANCE[compute]:.1e}")
    if packed is not None:  # the gather and the two GEMMs alone (no de-RoPE, no epilogue): what the epilogue adds to
        stacked = torch.stack(keys), torch.stack(values)  # [L_s, B, H_s, T, d_s] each
        stats = timed(lambda: head_products(*stacked, packed), args.reps, args.warmup, cuda)
        rows["gemm_products_only"] = dict(stats, tflops=amount["gemm_flop"] / (stats["ms_p50"] / 1e3) / 1e12)
    return {"work": amount, "paths": rows, "nonfinite_layers": nonfinite, "triton_unsupported": reason} | {
        "path_errors": path_errors,
        "sweep": sweep,
        "tuned": tuned,
    }


def bench_support(args, source, target, support: str, device: str) -> dict:
    compute = getattr(torch, args.compute_dtype)
    mapper = random_mapper(source, target, support, args.k, compute, device)
    packed = packed_weights(mapper, source.num_hidden_layers) if "gemm" in args.backends else None  # once per mapper
    rotary = {role: Qwen3RotaryEmbedding(config).to(device) for role, config in (("s", source), ("t", target))}
    results, tuned, sweep = {}, None, {}
    for seq in sorted(args.prefix, reverse=True):  # the longest first: it runs the tile sweep
        result = bench_prefix(args, source, target, mapper, packed, rotary, seq, tuned)
        tuned, swept = result.pop("tuned"), result.pop("sweep")
        sweep = sweep or swept
        results[str(seq)] = result
        rows = result["paths"]
        line = ", ".join(
            f"{n} {r['ms_p50']:.3f}/{r['ms_p95']:.3f} ms ({r['tflops']:.0f} TFLOP/s)" for n, r in rows.items()
        )
        print(f"{support:>5} T={seq:>5}: {line}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return {
        "prefixes": results,
        "gemm_worthwhile": gemm_worthwhile(mapper, source.num_hidden_layers),
        "sweep_at": max(args.prefix),
        "sweep": sweep,
        "tuned_config": asdict(tuned) if tuned else None,
        "default_config": asdict(default_config(max(args.prefix), compute, target.head_dim)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--supports", nargs="+", default=["local", "full"], choices=["local", "full"])
    parser.add_argument("--shapes", default="qwen3", choices=["qwen3", "coder"], help="the pair's KV shapes")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--precision", choices=["ieee", "tf32", "tf32x3"], help="tl.dot precision, fp32 coefficients")
    parser.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backends", nargs="+", default=["triton"], choices=["triton", "gemm"],
                        help="map_cache paths timed beside the reference (gemm: one GEMM per target head)")  # fmt: skip
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep at the longest prefix")
    parser.add_argument("--tiles", nargs="+", type=tile_arg, metavar="BM,BK,WARPS,STAGES",
                        help="sweep these tiles instead of SWEEP's (both launch orders and dot forms)")  # fmt: skip
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph path")
    parser.add_argument("--no-exact", action="store_true", help="skip the fp64 error check")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, CPU allowed, 3 reps")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.quick:
        args.prefix, args.reps, args.warmup, args.k, args.no_sweep = [16, 40], 3, 1, 2, True
        args.backends = sorted({*args.backends, "gemm"})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        parser.error("the full benchmark needs CUDA; use --quick for a CPU smoke run")
    source, target = (qwen3_config(role) for role in SHAPES["tiny" if args.quick else args.shapes])
    torch.manual_seed(0)
    report = {
        "what": "mapper application: reference (src.apply.map_layers path) vs fused Triton and gemm; random data, timing "
        "only",
        "shapes": {
            role: {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim}
            for role, c in (("source", source), ("target", target))
        }
        | {
            "k": args.k,
            "batch": args.batch,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "peaks": PEAK,
        "environment": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": __import__("triton").__version__ if HAVE_TRITON else None,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "supports": {},
    }
    began = time.perf_counter()
    for support in args.supports:
        report["supports"][support] = bench_support(args, source, target, support, device)
    report["seconds"] = time.perf_counter() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
