"""End-to-end handoff TTFT: from "switch to T" to T's first generated token, given S's cache.

transfer   map S's prefix cache → prefill the new turn on top of it → first token
prefill    T re-prefills prefix + new turn → first token            (what a router does today)
cache_hit  T already holds its own prefix cache → new turn → first token (same-model prefix hit)

Beside TTFT: GPU peak memory per path, and the source cache's transport cost when S and T live apart —
bytes, host staging (device → pinned host → device) and device-to-device copies (to a second GPU when
there is one, else within the one GPU, labelled by `d2d_peer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from src.apply import KVTransfer
from src.eval.latency import percentiles, time_ms
from src.forward import prefill
from src.maps import cache_layers


def _peak_mb(fn, device: torch.device) -> float:
    """GPU peak memory (MB) of one call of fn (0 on CPU)."""
    if device.type != "cuda":
        fn()
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def transport(source_cache, repeats: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Bytes of S's cache and the ms / GB/s to move it: device → pinned host, host → device, device → device."""
    tensors = [t for pair in cache_layers(source_cache) for t in pair]  # K, V per layer: [B, H_s, P, d_s]
    total = sum(t.numel() * t.element_size() for t in tensors)
    metrics: dict[str, float] = {"cache_bytes": float(total)}
    if device.type != "cuda":
        return metrics
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    others = [i for i in range(torch.cuda.device_count()) if i != (device.index or 0)]
    peer = torch.device("cuda", others[0]) if others else device
    to_peer = (lambda t: t.to(peer, non_blocking=True)) if others else torch.clone
    moves = {
        "d2h": lambda: [h.copy_(t, non_blocking=True) for h, t in zip(host, tensors, strict=True)],
        "h2d": lambda: [h.to(device, non_blocking=True) for h in host],
        "d2d": lambda: [to_peer(t) for t in tensors],
    }
    for name, move in moves.items():
        metrics |= percentiles(time_ms(move, repeats, warmup, device), name)
        metrics[f"{name}_gbps"] = total / metrics[f"{name}_ms_p50"] / 1e6
    metrics["host_staging_ms_p50"] = metrics["d2h_ms_p50"] + metrics["h2d_ms_p50"]
    metrics["d2d_peer"] = float(bool(others))  # 1: a second GPU; 0: a copy within the one GPU
    return metrics


def handoff_paths(
    transfer: KVTransfer, source_cache, prefix: torch.Tensor, turn: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """The three paths for prefix ids [1, P] (S's cache of them given) and new-turn ids [1, N], each a call that
    returns T's next-token logits [1, V]; T's own prefix cache (cache_hit) is built here, untimed."""
    target = transfer.target
    own_cache = prefill(target, prefix)
    last_logits = lambda cache, ids: target(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]

    def via_cache_hit() -> torch.Tensor:
        logits = last_logits(own_cache, turn)
        own_cache.crop(-turn.shape[1])  # back to the prefix for the next repetition
        return logits

    return {
        "transfer": lambda: last_logits(transfer(source_cache, input_ids=prefix), turn),  # the map is timed
        "prefill": lambda: target(torch.cat([prefix, turn], dim=1), logits_to_keep=1).logits[:, -1],
        "cache_hit": via_cache_hit,
    }


@torch.no_grad()
def handoff_ttft(
    transfer: KVTransfer, prefix: torch.Tensor, turn: torch.Tensor, repeats: int, prefill_repeats: int, warmup: int
) -> dict[str, float]:
    """TTFT p50/p95 (ms) of the three paths for prefix ids [1, P] and new-turn ids [1, N], and the speedups."""
    device = transfer.device
    prefix, turn = prefix.to(device), turn.to(device)
    source_cache = prefill(transfer.source, prefix)  # S's cache exists before the switch: not timed
    paths = handoff_paths(transfer, source_cache, prefix, turn)
    first_token = {name: (lambda path=path: path().argmax(-1)) for name, path in paths.items()}  # [1] each
    metrics = percentiles(time_ms(first_token["transfer"], repeats, warmup, device), "ttft_transfer")
    metrics |= percentiles(time_ms(first_token["prefill"], prefill_repeats, min(warmup, 1), device), "ttft_prefill")
    metrics |= percentiles(time_ms(first_token["cache_hit"], repeats, warmup, device), "ttft_cache_hit")
    metrics |= percentiles(time_ms(lambda: transfer(source_cache, input_ids=prefix), repeats, warmup, device), "map")
    metrics["ttft_speedup_vs_prefill"] = metrics["ttft_prefill_ms_p50"] / metrics["ttft_transfer_ms_p50"]
    for name, path in first_token.items():
        metrics[f"gpu_peak_mb_{name}"] = _peak_mb(path, device)
    return metrics | transport(source_cache, repeats, warmup, device)
