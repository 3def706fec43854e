"""Evidence that unsafe transfers roll back, deterministically, to the target's own prefill."""

from __future__ import annotations

import torch

from src.apply import KVTransfer
from src.forward import prefill
from src.runtime.splice import handoff


def _same_cache(a, b) -> bool:
    return all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers, strict=True)
    )


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
        checks[f"rollback_{name}"] = float(result.mode == "prefill" and _same_cache(result.cache, native))
    checks["rollback_clean_transfers"] = float(handoff(transfer, clean, prefix).mode == "transfer")
    checks["rollback_verified"] = float(all(value == 1.0 for value in checks.values()))
    return checks
