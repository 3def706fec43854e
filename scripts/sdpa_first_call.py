"""Does an attention backend pay a cost per new sequence length? The engine's long-prefill call (src/runtime/engine.py
`_attend`: causal sdpa over a view of the static K/V buffer, GQA) timed on each length twice — the first call on a
length its process had not run, then again — per backend set: torch's own choice, cuDNN alone, FlashAttention alone,
and the routed runs' timed set (src/routed_runs.py `TIMED_ATTENTION`). A backend that builds a plan per shape (cuDNN's
SDPA graph) shows first ≫ again; the gate's baseline paid ≈ 40 ms that way on an H100 (scripts/ttft_drift.py).

    python scripts/sdpa_first_call.py [--lengths 6263 6430 6148 6789] [--heads 12 2 128] [--device cuda]

Prints per set the median first-call and repeat ms (or why it cannot run), then torch's backend
priority after the calls (on CUDA torch sets it on its first sdpa call: cuDNN first on sm90 with cuDNN > 9.15).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.eval.latency import time_ms  # noqa: E402
from src.routed_runs import TIMED_ATTENTION  # noqa: E402

SETS = {
    "torch's choice": None,
    "cuDNN alone": [SDPBackend.CUDNN_ATTENTION],
    "flash alone": [SDPBackend.FLASH_ATTENTION],
    "timed set": TIMED_ATTENTION,
}


def _call_ms(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int) -> float:
    """One causal sdpa over slots 0..length − 1 (the engine's flash path), timed once, no warm-up: ms (a plan built
    on the host before the launch lies between the clock's events)."""
    attend = lambda: F.scaled_dot_product_attention(q[:, :, :length], keys[None, :, :length],
                                                    values[None, :, :length], is_causal=True, enable_gqa=True)  # fmt: skip
    return time_ms(attend, repeats=1, warmup=0, device=q.device)[0]


def probe(lengths: list[int], q_heads: int, kv_heads: int, dim: int, device: torch.device, offset: int) -> list[str]:
    """Per backend set: median ms of each length's first call and of its second. Each set runs its lengths + offset
    (distinct per set) so that no set reads a plan another built."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    capacity = max(lengths) + offset * len(SETS) + 1
    q = torch.randn(1, q_heads, capacity, dim, dtype=dtype, device=device)  # [1, H_q, N, d]
    keys = torch.randn(kv_heads, capacity + 1, dim, dtype=dtype, device=device)  # [H_kv, N + 1, d]: the engine's slots
    values = torch.randn_like(keys)
    lines = []
    for n, (name, backends) in enumerate(SETS.items()):
        first, again = [], []
        try:
            with torch.inference_mode(), sdpa_kernel(backends) if backends else nullcontext():
                for length in (length + n * offset for length in lengths):
                    first.append(_call_ms(q, keys, values, length))
                    again.append(_call_ms(q, keys, values, length))
        except RuntimeError as refusal:
            lines.append(f"  {name}: cannot run ({str(refusal).splitlines()[0][:100]})")
            continue
        lines.append(
            f"  {name}: first call on a new length {statistics.median(first):.2f} ms, again "
            f"{statistics.median(again):.2f} ms (median of {len(lengths)} lengths)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[6263, 6430, 6148, 6789, 6238, 6608])
    parser.add_argument("--heads", type=int, nargs=3, default=[12, 2, 128], metavar=("Q", "KV", "DIM"))
    parser.add_argument("--offset", type=int, default=7, help="added to every length per set (a length unseen)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if min(args.lengths) < 2 or args.offset < 1 or min(args.heads) < 1 or args.heads[0] % args.heads[1]:
        sys.exit("sdpa_first_call: lengths ≥ 2, offset ≥ 1, and query heads a multiple of the KV heads")
    device = torch.device(args.device)
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), torch "
          f"{torch.__version__}, cuDNN {cudnn}")  # fmt: skip
    print("\n".join(probe(args.lengths, *args.heads, device, args.offset)))
    print(f"  sdpa priority after the calls: {[SDPBackend(b).name for b in torch._C._get_sdp_priority_order()]}")


if __name__ == "__main__":
    main()
