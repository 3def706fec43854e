"""Handoff latency: mapping a present source cache vs the target re-prefilling the same prefix.

Timing discipline: warm-up, then `repeats` timed calls; CUDA events on GPU (synchronized), wall
clock on CPU; the methods are measured side by side in one process. Work across devices (a cross-GPU handoff):
`wall_ms`, every device synchronized around each call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from src.apply import KVTransfer
from src.forward import prefill
from src.runtime.plan import NO_LEVERS, Levers
from src.runtime.splice import spliced_cache


def time_ms(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def synchronize(*devices: torch.device) -> None:
    """Wait for every CUDA device among `devices` (CPU devices have nothing in flight)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def wall_ms(
    fn: Callable[[], object],
    repeats: int,
    warmup: int,
    devices: tuple[torch.device, ...],
    before: Callable[[], object] = lambda: None,
) -> list[float]:
    """Wall-clock milliseconds of each of `repeats` calls of fn after `warmup` untimed ones, every device of
    `devices` synchronized before and after each call and `before()` (e.g. a barrier) run untimed first: work that
    spans devices or processes, which one device's CUDA events cannot time."""
    times = []
    for index in range(warmup + repeats):
        before()
        synchronize(*devices)
        began = time.perf_counter()
        fn()
        synchronize(*devices)
        if index >= warmup:
            times.append((time.perf_counter() - began) * 1e3)
    return times


def percentiles(times: list[float], name: str) -> dict[str, float]:
    t = torch.tensor(times, dtype=torch.float64)
    return {f"{name}_ms_p50": float(t.quantile(0.5)), f"{name}_ms_p95": float(t.quantile(0.95))}


@torch.inference_mode()
def handoff_latency(
    transfer: KVTransfer, prefix: torch.Tensor, repeats: int, warmup: int, levers: Levers = NO_LEVERS
) -> dict[str, float]:
    """apply and re-prefill latencies for prefix ids [B, T], and their p50 speedup. With levers, apply
    includes the target's own prefill of the native tokens and layers (`spliced_cache`)."""
    source_cache = prefill(transfer.source, prefix)
    device = transfer.device
    if levers:
        apply = lambda: spliced_cache(transfer, source_cache, prefix, levers, query_ids=prefix[:, -1:])  # timing only
    else:
        apply = lambda: transfer(source_cache, input_ids=prefix)
    metrics = percentiles(time_ms(apply, repeats, warmup, device), "apply")
    metrics |= percentiles(time_ms(lambda: prefill(transfer.target, prefix), repeats, warmup, device), "prefill")
    metrics["handoff_speedup"] = metrics["prefill_ms_p50"] / metrics["apply_ms_p50"]
    return metrics
