"""Teacher-forced NLL of a horizon after a prefix whose cache is native or transferred.

The prefix cache covers tokens 0..P−2; the target then reads tokens P−1..P+H−2 on top of it and is
scored on P..P+H−1, so the native path equals one full forward and the transferred path differs only
by the cache. Token P−1 is the new turn the attention recompute rule reads (the scored horizon is not:
choosing by it would peek at the answer). Run it on the reported corpus and on the validation corpus
(`eval.nll.valid_corpus`, logged as `valid.<metric>`, what sweeps tune on).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from src.apply import KVTransfer
from src.forward import prefill
from src.runtime.plan import NO_LEVERS, Levers, spent
from src.runtime.splice import spliced_cache


@torch.no_grad()
def continuation_nll(model: PreTrainedModel, cache: DynamicCache, ids: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Per-stream mean NLL [B] of ids[:, prefix_len:] given a cache of ids[:, :prefix_len−1]."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    logits = model(ids[:, prefix_len - 1 : -1], past_key_values=cache).logits.float()  # [B, H, V]
    targets = ids[:, prefix_len:]  # [B, H]
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(-1)


def horizon_nll(
    transfer: KVTransfer, streams: torch.Tensor, prefix_len: int, levers: Levers = NO_LEVERS
) -> dict[str, float]:
    """Mean horizon NLL of native source, native target and the transferred cache on streams [N, P+H];
    the transferred prefix may keep the levers' tokens and layers native."""
    source, target = transfer.source, transfer.target
    prefix, query = streams[:, : prefix_len - 1], streams[:, prefix_len - 1 : prefix_len]  # [N, P−1], [N, 1]
    modes: dict[str, Callable[[], tuple[PreTrainedModel, DynamicCache]]] = {
        "native_source": lambda: (source, prefill(source, prefix)),
        "native_target": lambda: (target, prefill(target, prefix)),
        "transfer": lambda: (target, spliced_cache(transfer, prefill(source, prefix), prefix, levers, query)),
    }
    scores = {}
    for mode, build in modes.items():
        model, cache = build()
        scores[f"nll_{mode}"] = float(continuation_nll(model, cache, streams, prefix_len).mean())
    gap = scores["nll_native_source"] - scores["nll_native_target"]
    layers = target.config.get_text_config().num_hidden_layers
    used = spent(transfer, levers)  # the levers' target prefill and the mapper's own (token features)
    scores["prefill_fraction"] = used.prefill_fraction(prefix.shape[1], layers, query_len=query.shape[1])
    scores["nll_gap_recovered"] = (scores["nll_native_source"] - scores["nll_transfer"]) / gap if gap else float("nan")
    return scores
