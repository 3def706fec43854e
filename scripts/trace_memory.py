"""Peak host memory of calibration trace collection (src/traces.py collect_traces) at one sequence length, on the tiny
random pair (conf/pair/tiny_random.yaml, eager attention) on CPU: is it bounded by the statistics or by the sequence?
One configuration per process (ru_maxrss is the process's high-water mark); compare lengths at the same tokens:

    python scripts/trace_memory.py --seq-len 1024 --sequences 16 --batch-size 4
    python scripts/trace_memory.py --seq-len 8192 --sequences 2 --batch-size 1
    python scripts/trace_memory.py --seq-len 8192 --sequences 2 --batch-size 1 --chunk-tokens 8192   # one forward

Prints the peak resident memory above what the process held before collecting (MiB), the statistics' bytes (the rows
kept, and the mixing when --mixing) and the tokens read per forward.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.pipeline import load  # noqa: E402
from src.traces import ATTENTION_TILE, collect_traces  # noqa: E402


def resident_mib() -> float:
    """The process's resident memory now (Linux /proc), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--sequences", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--chunk-tokens", type=int, help="tokens per forward (default: src/traces.py's choice)")
    parser.add_argument("--mixing", action="store_true", help="also the target's attention mixing (fit.v_space)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("run", overrides=["pair=tiny_random", "budget=paper_mix"])
    pair = load(cfg)
    vocab = pair.target.config.vocab_size
    ids = torch.randint(0, vocab, (args.sequences, args.seq_len), generator=torch.Generator().manual_seed(0))
    budget = cfg.budget
    before = resident_mib()
    began = time.perf_counter()
    traces = collect_traces(
        pair.source, pair.target, ids, budget.stride, args.batch_size, getattr(torch, budget.storage_dtype),
        budget.attention_boundaries, budget.first_boundary, mixing=args.mixing, chunk_tokens=args.chunk_tokens,
    )  # fmt: skip
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    fields = ("source_k", "source_v", "target_k", "target_v", "attn_k", "attn_v", "mix")
    kept = sum(t.numel() * t.element_size() for name in fields if (t := getattr(traces, name)) is not None)
    chunk = args.chunk_tokens or max(1, ATTENTION_TILE // args.seq_len)
    print(
        f"T={args.seq_len} N={args.sequences} B={args.batch_size} chunk={min(chunk, args.seq_len)} tokens"
        f"{' mixing' if args.mixing else ''}: peak {peak - before:.0f} MiB above the {before:.0f} MiB held before; "
        f"statistics {kept / 2**20:.1f} MiB ({traces.rows} rows); {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
