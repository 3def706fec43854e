"""Which calls of vLLM's FlashAttention cache writer (`reshape_and_cache_flash`) never finish: one case per process,
each cut at 25 s. On an H100 (vllm 0.26.0, 2026-12-06, results/vllm-h100-2026-12-06f/fa-probe.txt) one KV head of 16
channels in FlashAttention's strided K / V views hung (bf16 and fp32, blocks of 16 or 32); contiguous caches, two
heads, and 64 or 128 channels finished — why tests/test_paged_direct.py compares with it on both heads of its pair.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/probe_flash_writer.py      # GPU, vllm importable
"""

from __future__ import annotations

import subprocess
import sys

import torch

CASES = [  # (channels, heads, FlashAttention's strided views (else contiguous caches), dtype, block size)
    (16, 1, True, "bfloat16", 32), (16, 1, False, "bfloat16", 32), (16, 1, True, "float32", 32),
    (64, 1, True, "bfloat16", 32), (64, 2, True, "bfloat16", 16), (128, 2, True, "bfloat16", 16),
    (16, 1, True, "bfloat16", 16), (16, 2, True, "bfloat16", 32),
]  # fmt: skip


def write(d: int, heads: int, strided: bool, dtype: torch.dtype, block: int, tokens: int = 40) -> None:
    """One call of the writer: `tokens` tokens' K / V [n, H, d] into 4 blocks from slot `block` on, synchronized."""
    from vllm import _custom_ops as ops

    if strided:  # as FlashAttentionImpl views a layer's cache [B, H, N, 2d]: K | V per token, [B, N, H, d] each
        caches = torch.full((4, heads, block, 2 * d), 7.0, dtype=dtype, device="cuda")
        key_cache, value_cache = caches.transpose(1, 2).split(d, dim=-1)
    else:
        key_cache = torch.zeros(4, block, heads, d, dtype=dtype, device="cuda")  # [B, N, H, d]
        value_cache = torch.zeros_like(key_cache)
    keys, values = (torch.randn(tokens, heads, d, dtype=dtype, device="cuda") for _ in range(2))  # [n, H, d]
    slots = torch.arange(block, block + tokens, device="cuda", dtype=torch.long)  # [n]
    one = torch.tensor(1.0, device="cuda")
    ops.reshape_and_cache_flash(keys, values, key_cache, value_cache, slots, "auto", one, one)
    torch.cuda.synchronize()
    print("finished", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("probe_flash_writer: needs a CUDA GPU and vLLM's compiled ops (scripts/device_vllm.sh install)")
    if len(sys.argv) > 1:  # one case, in its own process
        d, heads, strided, dtype, block = sys.argv[1:]
        write(int(d), int(heads), strided == "1", getattr(torch, dtype), int(block))
        return 0
    for d, heads, strided, dtype, block in CASES:
        args = [str(d), str(heads), str(int(strided)), dtype, str(block)]
        try:
            run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=25)
            errors = run.stderr.strip().splitlines()
            outcome = "finished" if "finished" in run.stdout else (errors[-1] if errors else f"rc {run.returncode}")
        except subprocess.TimeoutExpired:
            outcome = "HANG (25 s)"
        print(f"d={d} heads={heads} strided={int(strided)} {dtype} block={block}: {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
