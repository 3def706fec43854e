"""What a device export's `Transport.load` costs the receiver's host, and how much of it is CUDA IPC: a sender process
publishes device exports of one pair's K/V size in turn (its newest `--keep` kept, older removed, as a sender engine
does), and the receiver loads each — its opened allocations dropped at release (mode "drop": the connector without
a pool), or the newest few kept alive (mode "keep": torch then reuses an allocation's mapping instead of opening its
handle again, when a new export lies in an allocation already opened), or the sender's exports placed in its export
pool (mode "pool": room for `--keep` + 2 exports, opened once by the receiver and kept mapped: src/serving/
export_pool.py). GPU only; both processes on one device; the modes alternate. "keep" measures what the opens cost, not
a mode to serve with: CUDA leaves it undefined when an exporter frees memory an importer still maps, and a sender's
allocator frees its segments on `empty_cache` — "pool" is the safe form, memory the sender never frees while it lives.

    python scripts/bench_ipc_open.py --tokens 8192 --out /tmp/ipc_open.json

Per mode: p50 / p90 host ms of `Transport.load` (the file's header and lock, the opens, the views) over the loads
after the first few, how many distinct allocation handles the exports used (a pool: one) and how many of them lay in
a pool.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import safetensors
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sender(directory: str, shape: list[int], count: int, keep: int, pool_bytes: int, commands, replies) -> None:
    """Publishes export i when told, keeping its newest `keep` (an engine's keep_exports), removing older ones; its
    exports in an export pool of `pool_bytes` where > 0."""
    from src.serving.transport import Transport

    transport, published = Transport(directory, "device", pool_bytes), []
    for i in range(count):
        commands.get()
        keys = torch.randn(*shape, dtype=torch.bfloat16, device="cuda")  # [L, H, T, d]
        values = torch.randn(*shape, dtype=torch.bfloat16, device="cuda")
        export_id = f"{i:032x}"
        transport.put(export_id, keys, values, list(range(shape[2])), "fp", "tok", (0, shape[1], shape[1]), None,
                      fingerprint_dtype="bfloat16")  # fmt: skip
        del keys, values
        published.append(export_id)
        while len(published) > keep and transport.remove(published[0]):
            published.pop(0)
        replies.put(export_id)
    commands.get()


def run(mode: str, args) -> dict:
    """One sender, `args.loads` exports loaded in turn; `mode` "drop" (release everything), "keep" (the newest
    `args.kept` opened allocations stay referenced) or "pool" (the sender's export pool)."""
    from src.serving.export_pool import aligned
    from src.serving.transport import Transport

    directory = tempfile.mkdtemp(prefix="kvrelay-ipc-", dir="/dev/shm")
    shape = [args.layers, args.heads, args.tokens, args.head_dim]
    pool_bytes = (args.keep + 2) * 2 * aligned(2 * math.prod(shape)) if mode == "pool" else 0  # bf16 keys, values
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    sender = context.Process(target=_sender, args=(directory, shape, args.loads, args.keep, pool_bytes, commands,
                                                   replies))  # fmt: skip
    sender.start()
    receiver, kept, handles, pooled, times = Transport(directory), {}, set(), 0, []
    try:
        for _ in range(args.loads):
            commands.put("publish")
            export_id = replies.get(timeout=120)
            torch.cuda.synchronize()
            began = time.perf_counter()
            keys, values, lease = receiver.load(export_id, 0, args.tokens, "cuda")
            times.append((time.perf_counter() - began) * 1e3)
            keys.sum().item()  # read it, as a map would
            (path,) = Path(directory).glob(f"{export_id}.*")
            with safetensors.safe_open(path, "pt") as handle:
                metadata = handle.metadata()
            if "pool" in metadata:  # nothing opened per load: the pool stays mapped
                handles.add(json.loads(metadata["pool_memory"])["handle"])
                pooled += 1
            shared = [json.loads(metadata[key])["handle"] for key in ("keys", "values") if key in metadata]
            for opened, allocation in zip(lease.opened, shared, strict=True):  # the allocation each lies in
                handles.add(allocation)
                if mode == "keep":  # the newest `args.kept` allocations, least recently loaded evicted first
                    kept.pop(allocation, None)
                    kept[allocation] = opened.untyped_storage()
                    while len(kept) > args.kept:
                        kept.pop(next(iter(kept)))
            del keys, values
            lease.release()
    finally:
        commands.put("stop")
        sender.join(timeout=60)
    measured = times[args.warmup :]
    return {"mode": mode, "p50_ms": statistics.median(measured), "p90_ms": sorted(measured)[int(0.9 * len(measured))],
            "loads": len(measured), "allocations": len(handles), "pooled": pooled, "pool_bytes": pool_bytes,
            "all_ms": times}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=24)  # Qwen2.5-Coder 0.5B, the sender of the bench's pair
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--loads", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--keep", type=int, default=4, help="the sender's keep_exports")
    parser.add_argument("--kept", type=int, default=8, help="opened allocations the receiver keeps in mode keep")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("CUDA IPC needs a GPU")
    rows = [run(mode, args) for mode in ("drop", "keep", "pool") * 2]  # alternating
    result = {"bench": "ipc_open", "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(row["mode"], "p50", round(row["p50_ms"], 3), "p90", round(row["p90_ms"], 3), "ms; allocations",
              row["allocations"], "; pooled", row["pooled"], "of", len(row["all_ms"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
