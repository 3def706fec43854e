"""End-to-end handoff TTFT: from "switch to T" to T's first generated token, given S's cache.

transfer   map S's prefix cache → prefill the new turn on top of it → first token
prefill    T re-prefills prefix + new turn → first token            (what a router does today)
cache_hit  T already holds its own prefix cache → new turn → first token (same-model prefix hit)
"""

from __future__ import annotations

import torch

from src.apply import KVTransfer, prefill
from src.eval.latency import percentiles, time_ms


@torch.no_grad()
def handoff_ttft(
    transfer: KVTransfer, prefix: torch.Tensor, turn: torch.Tensor, repeats: int, prefill_repeats: int, warmup: int
) -> dict[str, float]:
    """TTFT p50/p95 (ms) of the three paths for prefix ids [1, P] and new-turn ids [1, N], and the speedups."""
    target, device = transfer.target, transfer.device
    prefix, turn = prefix.to(device), turn.to(device)
    source_cache = prefill(transfer.source, prefix)  # S's cache exists before the switch: not timed
    own_cache = prefill(target, prefix)
    first_token = lambda cache, ids: target(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1)

    def via_transfer():
        return first_token(transfer(source_cache), turn)

    def via_prefill():
        return target(torch.cat([prefix, turn], dim=1), logits_to_keep=1).logits[:, -1].argmax(-1)

    def via_cache_hit():
        token = first_token(own_cache, turn)
        own_cache.crop(-turn.shape[1])  # back to the prefix for the next repetition
        return token

    metrics = percentiles(time_ms(via_transfer, repeats, warmup, device), "ttft_transfer")
    metrics |= percentiles(time_ms(via_prefill, prefill_repeats, min(warmup, 1), device), "ttft_prefill")
    metrics |= percentiles(time_ms(via_cache_hit, repeats, warmup, device), "ttft_cache_hit")
    metrics |= percentiles(time_ms(lambda: transfer(source_cache), repeats, warmup, device), "map")
    metrics["ttft_speedup_vs_prefill"] = metrics["ttft_prefill_ms_p50"] / metrics["ttft_transfer_ms_p50"]
    if torch.cuda.is_available():
        metrics["gpu_peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return metrics
