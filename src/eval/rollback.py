"""Evidence that unsafe transfers roll back, deterministically, to the target's own prefill."""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from src.apply import KVTransfer
from src.forward import prefill
from src.runtime.splice import handoff


def cache_max_abs_diff(cache: DynamicCache, reference: DynamicCache) -> float:
    """max |a − b| over every layer's keys and values; inf when a layer's shapes differ or a value is NaN."""
    diff = 0.0
    for a, b in zip(cache.layers, reference.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            found = float((x.float() - y.float()).abs().max()) if x.shape == y.shape else math.inf
            diff = max(diff, math.inf if math.isnan(found) else found)
    return diff


@torch.no_grad()
def verify_rollback(transfer: KVTransfer, prefix: torch.Tensor) -> dict[str, float]:
    """Feed unsafe source caches (NaN, missing layer, wrong dtype); each must yield mode 'prefill' with a cache
    bit-identical to the target's own prefill, and a clean cache must transfer. 1.0 = verified."""
    native = prefill(transfer.target, prefix)
    clean = [(layer.keys, layer.values) for layer in prefill(transfer.source, prefix).layers]
    poisoned = [(k.clone(), v) for k, v in clean]
    poisoned[len(poisoned) // 2][0].view(-1)[0] = float("nan")
    unsafe = {"nan": poisoned, "missing_layer": clean[:-1], "dtype": [(k.half(), v.half()) for k, v in clean]}
    checks = {}
    for name, cache in unsafe.items():
        result = handoff(transfer, cache, prefix)
        checks[f"rollback_{name}"] = float(result.mode == "prefill" and cache_max_abs_diff(result.cache, native) == 0.0)
    checks["rollback_clean_transfers"] = float(handoff(transfer, clean, prefix).mode == "transfer")
    checks["rollback_verified"] = float(all(value == 1.0 for value in checks.values()))
    return checks
