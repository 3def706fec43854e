"""Multi-GPU benchmarks (issue 14), random weights and random traces — timing and exactness only, never quality.

construction  sharded mapper construction (src/distributed.py) at the Qwen3-14B → 32B shapes: L_s = 40, L_t = 64,
              8 KV heads, d = 128, Head-Local, k = 8, Attn-Repair, 500 sequences × 256 rows (1,024 tokens, s = 4) =
              128,000 rows split by sequence over the ranks; every rank draws the same traces and keeps its block.
              --check: rank 0 also fits the whole row set in one process (src.fit.fit_mapper) and compares.
handoff       cross-GPU handoff: S (14B) on GPU 0 holds the prefix cache, T (32B) on GPU 1 maps it (Triton apply)
              and answers the new turn. Transport of S's cache: --transport peer (one process, copy_ into GPU 1
              buffers) or nccl (two processes, batched NCCL send/recv). TTFT = transport + map + turn + first token.
summarize     markdown tables (scaling efficiency; cross-GPU TTFT) from the JSON files of the runs above.

Every process sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 before torch loads
(export them in the shell as well, so torchrun's agent has them too):

    torchrun --standalone --nproc-per-node 4 scripts/bench_distributed.py construction --out $OUT/construction_4.json
    python scripts/bench_distributed.py handoff --transport peer --out $OUT/handoff_peer.json
    torchrun --standalone --nproc-per-node 2 scripts/bench_distributed.py handoff --transport nccl --out $OUT/h.json
    python scripts/bench_distributed.py summarize $OUT/*.json
    torchrun --standalone --nproc-per-node 2 scripts/bench_distributed.py construction --quick --device cpu --out x.json

Needs torch (+ triton for the fused statistics and the Triton apply), transformers and this repository: no hydra.
"""

from __future__ import annotations

import os

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")  # = GPU_ENV

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from statistics import median_high  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from src.apply import KVTransfer  # noqa: E402
from src.artifact import save_mapper  # noqa: E402
from src.distributed import GPU_ENV, fit_mapper_sharded, init_distributed  # noqa: E402
from src.eval.latency import percentiles, synchronize, wall_ms  # noqa: E402
from src.fit import STATISTICS, fit_mapper  # noqa: E402
from src.forward import prefill  # noqa: E402
from src.maps import cache_layers  # noqa: E402
from src.models import build_random_model, describe_kv, fingerprint, vocabulary_hash  # noqa: E402
from src.select import depth_layers  # noqa: E402
from src.support import head_assignment  # noqa: E402
from src.synthetic import synthetic_mapper  # noqa: E402
from src.traces import Traces  # noqa: E402

COEFFICIENTS = ("weight_k", "bias_k", "weight_v", "bias_v")
SHAPE = ("sequences", "rows_per_sequence", "source_layers", "target_layers", "heads", "dim", "k", "chunk_rows", "lam")


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    count = torch.cuda.device_count() if cuda else 0
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "gpus_visible": count,
        "peer_access": {
            f"{a}->{b}": torch.cuda.can_device_access_peer(a, b) for a in range(count) for b in range(count) if a != b
        }
        if cuda
        else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "env": {name: os.environ.get(name) for name in GPU_ENV},
    }


# --------------------------------------------------------------------------- construction


def random_shard(args, rank: int, world: int, device: torch.device) -> Traces:
    """This rank's block of sequences of one random trace set (the same draws on every rank, whatever the world)."""
    sequence_index = torch.arange(args.sequences).repeat_interleave(args.rows_per_sequence)  # [n]
    mine = torch.tensor_split(torch.arange(args.sequences), world)[rank]  # = src.distributed.shard_rows
    keep = torch.nonzero(torch.isin(sequence_index, mine))[:, 0]
    rows, kept = sequence_index.numel(), keep.to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    dtype = getattr(torch, args.storage)

    def draw(layers: int) -> torch.Tensor:
        out = torch.empty(layers, args.heads, keep.numel(), args.dim, dtype=dtype, device=device)  # [L, H, n_r, d]
        for layer in range(layers):
            out[layer] = torch.randn(args.heads, rows, args.dim, generator=generator, device=device)[:, kept].to(dtype)
        return out

    def sensitivities() -> torch.Tensor:  # log-normal raw r (heavy-tailed, as bench_fused_fit): [L_t, H, n_r]
        noise = [
            torch.randn(args.heads, rows, generator=generator, device=device, dtype=torch.float64)
            for _ in range(args.target_layers)
        ]
        return torch.exp(args.weight_sigma * torch.stack(noise)[:, :, kept])

    return Traces(
        source_k=draw(args.source_layers),
        source_v=draw(args.source_layers),
        target_k=draw(args.target_layers),
        target_v=draw(args.target_layers),
        sequence_index=sequence_index[keep],
        position=torch.arange(args.rows_per_sequence).repeat(args.sequences)[keep],
        attn_k=sensitivities(),
        attn_v=sensitivities(),
        meta={"sequences": args.sequences, "rows": rows, "synthetic": True, "corpus_hash": f"synthetic-{args.seed}"},
    )


def construction(args) -> None:
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    began = time.perf_counter()
    shard = random_shard(args, rank, world, device)
    source_layers = depth_layers(args.source_layers, args.target_layers, args.k)  # [L_t, k]
    head_index = head_assignment("local", args.heads, args.heads)
    fit = dict(support="local", weighting="attn_repair", lam=args.lam, lam_relative=False, chunk_rows=args.chunk_rows)
    if rank == 0:
        print(f"world {world}: {shard.rows} rows per rank drawn in {time.perf_counter() - began:.1f} s")
    runs = []
    for repeat in range(1 + args.repeats):  # the first run warms up (Triton compiles, NCCL connects): not counted
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        synchronize(device)
        start, timings = time.perf_counter(), {}
        mapper = fit_mapper_sharded(
            shard, source_layers, head_index, **fit, statistics=args.statistics, timings=timings
        )
        synchronize(device)
        dist.barrier()
        timings["wall_seconds"] = time.perf_counter() - start
        keys = sorted(key for key in timings if key.endswith("seconds"))
        slowest = torch.tensor([timings[key] for key in keys], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank's phases
        timings |= {f"max_{key}": value for key, value in zip(keys, slowest.tolist(), strict=True)}
        if rank == 0:
            with tempfile.TemporaryDirectory() as directory:
                saved = time.perf_counter()
                save_mapper(mapper, directory)
                timings["save_seconds"] = time.perf_counter() - saved
            print(
                f"run {repeat}: {timings['wall_seconds']:.3f} s + save {timings['save_seconds']:.3f} s "
                + ", ".join(f"{k} {v:.3f}" for k, v in timings.items() if k.startswith("max_"))
            )
        if device.type == "cuda":
            peak = torch.tensor([torch.cuda.max_memory_allocated(device)], device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            timings["max_peak_bytes"] = int(peak)
        if repeat:
            runs.append(timings)
    result = {
        "what": "sharded construction: Attn-Repair weights + statistics + merge + float64 solve + gather, L_t × {K, V}",
        "world": world,
        "shape": {key: getattr(args, key) for key in SHAPE},
        "statistics": args.statistics,
        "storage_dtype": args.storage,
        "runs": runs,
        "median_seconds": median_high([run["wall_seconds"] for run in runs]),
        "median_seconds_without_weights": median_high(
            [run["wall_seconds"] - run["max_weights_seconds"] for run in runs]
        ),
        "environment": environment(device),
    }
    if args.check:
        whole = shard if world == 1 else None
        result["check"] = check(args, whole, mapper, source_layers, head_index, fit, device) if rank == 0 else None
        dist.barrier()
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        print(f"median {result['median_seconds']:.3f} s over {len(runs)} runs; wrote {args.out}")
    dist.destroy_process_group()


def check(args, whole: Traces | None, mapper, source_layers, head_index, fit: dict, device: torch.device) -> dict:
    """One process, all rows, the same statistics path: max |Δ| / max |W| per tensor (goal ≤ 1e-6)."""
    whole = random_shard(args, 0, 1, device) if whole is None else whole
    synchronize(device)
    began = time.perf_counter()
    reference = fit_mapper(whole, source_layers, head_index, statistics=args.statistics, **fit)
    synchronize(device)
    seconds = time.perf_counter() - began
    largest = lambda a, b: float((a - b).abs().max() / b.abs().max())
    relative = {name: largest(getattr(mapper, name), getattr(reference, name)) for name in COEFFICIENTS}
    alpha = [torch.tensor(m.manifest["alpha"][c]) for m in (mapper, reference) for c in "kv"]  # [L_t, H_t] each
    print(f"one-process fit_mapper {seconds:.3f} s; max relative difference {max(relative.values()):.1e}")
    return {
        "one_process_seconds": seconds,
        "max_relative_difference": relative,
        "alpha_max_abs_difference": max(float((alpha[i] - alpha[i + 2]).abs().max()) for i in (0, 1)),
    }


# --------------------------------------------------------------------------- cross-GPU handoff


def pair_spec(name: str) -> dict:
    """conf/pair/NAME.yaml over run.yaml's `pair:` defaults (what Hydra composes for `pair=NAME`)."""
    defaults = yaml.safe_load((ROOT / "conf/run.yaml").read_text())["pair"]
    return defaults | yaml.safe_load((ROOT / f"conf/pair/{name}.yaml").read_text())


def build(spec: dict, role: str, device: torch.device):
    model = spec[role]
    return build_random_model(
        model["config"], model["seed"], getattr(torch, spec["dtype"]), str(device), spec["attn_implementation"]
    )


def receiver(spec: dict, device: torch.device, args) -> KVTransfer:
    """T and the mapper on `device`, bound by KVTransfer. KVTransfer verifies the mapper against S's fingerprint and
    takes S's cache on S's device, so S's weights are built here too (same seed): identity only, never run."""
    source, target = build(spec, "source", device), build(spec, "target", device)
    identity = {
        "source_fingerprint": fingerprint(source),
        "target_fingerprint": fingerprint(target),
        "tokenizer_hash": vocabulary_hash(target),
        "weights": "random",
    }
    mapper = synthetic_mapper(describe_kv(source), describe_kv(target), "local", args.k, identity, args.seed)
    compute = getattr(torch, spec["compute_dtype"])
    return KVTransfer(mapper, source, target, identity["tokenizer_hash"], compute, spec["apply_backend"])


def cache_shapes(spec: dict, length: int) -> list[tuple[int, ...]]:
    """S's cache at a prefix of `length` tokens: K, V per source layer, each [1, H_s, length, d_s]."""
    config = spec["source"]["config"]
    return [(1, config["num_key_value_heads"], length, config["head_dim"])] * (2 * config["num_hidden_layers"])


def peer_arrival(buffers: list[torch.Tensor], tensors: list[torch.Tensor]):
    """S's cache tensors copied into T's buffers (device to device: NVLink / PCIe peer access when enabled)."""
    return lambda: [b.copy_(t, non_blocking=True) for b, t in zip(buffers, tensors, strict=True)]


def nccl_arrival(buffers: list[torch.Tensor]):
    """S's cache tensors received from rank 0 into T's buffers: one batched group of NCCL recvs."""
    return lambda: [r.wait() for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0) for b in buffers])]


def receive_side(transfer: KVTransfer, buffers: list, arrive, before, devices: tuple, prefix, turn, args) -> dict:
    """On T's device: transport alone, transport + map + new turn + first token, the same with the cache already there,
    the map alone, and T's re-prefill of prefix + turn."""
    device = transfer.device
    pairs = list(zip(buffers[0::2], buffers[1::2], strict=True))  # (K, V) per source layer on T's device
    prefix, turn = prefix.to(device), turn.to(device)
    mapped = lambda: transfer(pairs, input_ids=prefix)
    first_token = lambda: transfer.target(turn, past_key_values=mapped(), logits_to_keep=1).logits[:, -1].argmax(-1)
    cache_bytes = sum(b.numel() * b.element_size() for b in buffers)
    run = lambda fn, name, hook=(lambda: None): percentiles(wall_ms(fn, args.repeats, args.warmup, devices, hook), name)
    metrics = {"cache_bytes": cache_bytes}
    metrics |= run(arrive, "transport", before)
    metrics |= run(lambda: (arrive(), first_token()), "ttft_cross", before)
    metrics |= run(first_token, "ttft_local")
    metrics |= run(mapped, "map")
    if args.prefill_repeats:
        whole = torch.cat([prefix, turn], 1)
        reprefill = lambda: transfer.target(whole, logits_to_keep=1).logits[:, -1].argmax(-1)
        metrics |= percentiles(wall_ms(reprefill, args.prefill_repeats, 1, devices), "prefill")
        metrics["speedup_cross_vs_prefill"] = metrics["prefill_ms_p50"] / metrics["ttft_cross_ms_p50"]
    metrics["transport_gbps"] = cache_bytes / metrics["transport_ms_p50"] / 1e6
    if device.type == "cuda":
        metrics["gpu_peak_bytes_target"] = torch.cuda.max_memory_allocated(device)
    return metrics


@torch.no_grad()
def handoff(args) -> None:
    """Peer: one process, S on device 0, T on device 1. NCCL: rank 0 holds S, rank 1 T; both walk the same schedule
    (per prefix: 2 × (warm-up + repeats) barrier → send / receive rounds), so no send waits for a missing receive."""
    spec = pair_spec(args.pair) | {"apply_backend": args.apply_backend}
    rank = None
    if args.transport == "nccl":
        init_distributed(args.device)  # NCCL on cuda; gloo on cpu (a smoke run of the schedule)
        if dist.get_world_size() != 2:
            raise SystemExit("--transport nccl runs as 2 processes: torchrun --nproc-per-node 2")
        rank = dist.get_rank()
    elif args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--transport peer needs 2 visible GPUs")
    cuda = args.device == "cuda"
    sender, target_device = (torch.device("cuda", i) if cuda else torch.device("cpu") for i in (0, 1))
    source = build(spec, "source", sender) if rank in (None, 0) else None
    transfer = receiver(spec, target_device, args) if rank in (None, 1) else None
    if cuda and rank is None:
        torch.cuda.set_device(target_device)  # Triton launches on the current device: T's, for the map
    vocab = spec["target"]["config"]["vocab_size"]
    ids = torch.randint(
        0, vocab, (1, max(args.prefix_lens) + args.new_turn), generator=torch.Generator().manual_seed(0)
    )
    results = {}
    for length in args.prefix_lens:
        prefix, turn = ids[:, :length], ids[:, length : length + args.new_turn]
        tensors = None  # S's cache exists before the switch (packed contiguous): not timed
        if source is not None:
            tensors = [t.contiguous() for pair in cache_layers(prefill(source, prefix)) for t in pair]
        if rank == 0:
            for _ in range(2 * (args.warmup + args.repeats)):  # transport alone, then the whole handoff
                dist.barrier()
                for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1) for t in tensors]):
                    request.wait()
            synchronize(sender)
            continue
        shapes = cache_shapes(spec, length)
        buffers = [torch.empty(shape, dtype=transfer.dtype, device=target_device) for shape in shapes]
        if rank is None:
            arrive, before, devices = peer_arrival(buffers, tensors), (lambda: None), (sender, target_device)
        else:
            arrive, before, devices = nccl_arrival(buffers), dist.barrier, (target_device,)
        results[length] = receive_side(transfer, buffers, arrive, before, devices, prefix, turn, args)
        print(f"prefix {length:>6}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[length].items()), flush=True)
    if rank in (None, 1):
        result = {
            "what": "cross-GPU handoff TTFT: transport of S's cache device 0 → device 1 + map + new turn + first token",
            "transport": args.transport,
            "backend": dist.get_backend() if rank is not None else "copy_",
            "pair": spec["name"],
            "apply_backend": spec["apply_backend"],
            "new_turn": args.new_turn,
            "repeats": args.repeats,
            "timing": "wall clock, every involved device synchronized before and after each call",
            "results": results,
            "environment": environment(target_device),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.out}")
    if rank is not None:
        dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------- tables


def summarize(args) -> None:
    runs = [json.loads(Path(path).read_text()) for path in args.files]
    built = sorted((run for run in runs if "world" in run), key=lambda run: run["world"])
    if built:
        one = next((run["median_seconds"] for run in built if run["world"] == 1), None)
        print(
            "| GPUs | construction s (median) | without Attn-Repair weights | speedup | scaling efficiency | "
            "max rel. diff vs one process |\n|---|---|---|---|---|---|"
        )
        for run in built:
            speedup = one / run["median_seconds"] if one else float("nan")
            check = run.get("check") or {}
            difference = max(check.get("max_relative_difference", {"-": float("nan")}).values())
            print(
                f"| {run['world']} | {run['median_seconds']:.3f} | {run['median_seconds_without_weights']:.3f} | "
                f"{speedup:.2f}× | {speedup / run['world']:.0%} | {difference:.1e} |"
            )
    for run in (run for run in runs if "transport" in run):
        print(
            f"\n{run['transport']} ({run['backend']}, {run['environment']['device']}), ms p50 / p95:\n\n"
            "| prefix | cache bytes | transport | GB/s | TTFT incl. transport | TTFT, cache already on T's GPU | map | T re-prefill | "
            "speedup |\n|---|---|---|---|---|---|---|---|---|"
        )
        for length, m in run["results"].items():
            prefill_ms = f"{m['prefill_ms_p50']:.1f}" if "prefill_ms_p50" in m else "—"
            speedup = f"{m['speedup_cross_vs_prefill']:.2f}×" if "speedup_cross_vs_prefill" in m else "—"
            print(
                f"| {int(length):,} | {m['cache_bytes'] / 1e6:,.0f} MB | {m['transport_ms_p50']:.2f} / "
                f"{m['transport_ms_p95']:.2f} | {m['transport_gbps']:.0f} | {m['ttft_cross_ms_p50']:.1f} / "
                f"{m['ttft_cross_ms_p95']:.1f} | {m['ttft_local_ms_p50']:.1f} | {m['map_ms_p50']:.1f} | "
                f"{prefill_ms} | {speedup} |"
            )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    construct = commands.add_parser("construction", help="sharded construction (run under torchrun)")
    construct.add_argument("--out", required=True)
    construct.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run; with --device cpu: gloo)")
    construct.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    construct.add_argument("--statistics", default="fused", choices=STATISTICS)
    construct.add_argument("--check", action="store_true", help="rank 0 also fits all rows in one process and compares")
    construct.add_argument("--sequences", type=int, default=500)
    construct.add_argument("--rows-per-sequence", type=int, default=256, help="1,024 tokens at stride 4")
    construct.add_argument("--source-layers", type=int, default=40)
    construct.add_argument("--target-layers", type=int, default=64)
    construct.add_argument("--heads", type=int, default=8)
    construct.add_argument("--dim", type=int, default=128)
    construct.add_argument("--k", type=int, default=8)
    construct.add_argument("--chunk-rows", type=int, default=16384, help="b in Eq. 22")
    construct.add_argument("--lam", type=float, default=0.01, help="ridge λ (absolute), as conf/fit/default.yaml")
    construct.add_argument("--storage", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    construct.add_argument("--weight-sigma", type=float, default=1.5, help="log-normal σ of the raw sensitivities")
    construct.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up run")
    construct.add_argument("--seed", type=int, default=0)
    cross = commands.add_parser("handoff", help="cross-GPU handoff TTFT (peer: python; nccl: torchrun, 2 processes)")
    cross.add_argument("--out", required=True)
    cross.add_argument("--transport", required=True, choices=("peer", "nccl"))
    cross.add_argument("--pair", default="qwen3_14b_to_32b", help="a random-weight pair of conf/pair/")
    cross.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (gloo)")
    lengths = lambda text: [int(x) for x in text.split(",")]
    cross.add_argument("--prefix-lens", type=lengths, default=[1024, 4096, 16384, 32768])
    cross.add_argument("--new-turn", type=int, default=64)
    cross.add_argument("--repeats", type=int, default=30)
    cross.add_argument("--prefill-repeats", type=int, default=3, help="0 skips T's re-prefill (slow at 32K)")
    cross.add_argument("--warmup", type=int, default=3)
    cross.add_argument("--k", type=int, default=8, help="selected source layers (Head-Local, random coefficients)")
    cross.add_argument(
        "--apply-backend", default="auto", choices=("torch", "auto", "triton"), help="pair.apply_backend"
    )
    cross.add_argument("--seed", type=int, default=0)
    table = commands.add_parser("summarize", help="markdown tables from the JSON results")
    table.add_argument("files", nargs="+")
    args = parser.parse_args()
    if args.command == "construction" and args.quick:
        args.sequences, args.rows_per_sequence, args.source_layers, args.target_layers = 6, 50, 5, 4
        args.heads, args.dim, args.k, args.chunk_rows, args.storage = 2, 16, 3, 64, "float32"
    return args


if __name__ == "__main__":
    arguments = parse()
    {"construction": construction, "handoff": handoff, "summarize": summarize}[arguments.command](arguments)
