"""Where the mapped cache goes wrong: fidelity on real prompts and native-swap attributions.

`cache_fidelity` compares the mapped cache of each prompt with the target's own, in content space
(RoPE removed): pooled K/V R², relative error per position (position 0 — the attention sink — apart),
and the cosine of each layer's causal attention output under the native vs the mapped K/V.
`swap_nll` puts native target K/V back into the mapped cache one piece at a time — all keys, all
values, one layer — and reads the horizon NLL, so the pieces whose error costs most are named.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from src.apply import KVTransfer
from src.eval.metrics import attention_output_cosine, position_relative_error
from src.eval.nll import continuation_nll
from src.forward import prefill
from src.rope import apply_rope, rope_cos_sin
from src.traces import QueryCapture, content_kv


def _r2(sse: torch.Tensor, sst: torch.Tensor) -> float:
    return float(1 - sse / sst)


@torch.no_grad()
def cache_fidelity(transfer: KVTransfer, prompts: list[torch.Tensor]) -> dict[str, float]:
    """Mapped vs native target cache over prompts (each [T_i] token ids, T_i ≥ 2)."""
    target, kv = transfer.target, transfer.target_kv
    device = transfer.device
    stats = {"k": [], "v": []}  # per prompt: content rows [L_t, H_t, T, d_t] mapped and native
    errors = {f"{name}_{part}": [] for name in ("k", "v") for part in ("first", "rest")}
    cosines = []
    capture = QueryCapture(target, kv)
    try:
        for ids in prompts:
            ids = ids[None].to(device)  # [1, T]
            positions = torch.arange(ids.shape[1], device=device)
            native = prefill(target, ids)
            queries = dict(capture.queries)  # layer → [1, H_q, T, d] pre-RoPE
            mapped = transfer(prefill(transfer.source, ids), input_ids=ids)
            cos, sin = rope_cos_sin(target.model.rotary_emb, positions)
            native_rows, mapped_rows = (
                content_kv(target, kv, native, positions),
                content_kv(target, kv, mapped, positions),
            )
            for index, name in ((0, "k"), (1, "v")):
                n = torch.stack([layer[index][0] for layer in native_rows]).double()  # [L_t, H_t, T, d_t]
                m = torch.stack([layer[index][0] for layer in mapped_rows]).double()  # [L_t, H_t, T, d_t]
                stats[name].append((m, n))
                error = position_relative_error(m, n)  # [T]
                errors[f"{name}_first"].append(float(error[0]))
                errors[f"{name}_rest"].append(float(error[1:].mean()))
            for layer, (own, new) in enumerate(zip(native.layers, mapped.layers, strict=True)):
                q = apply_rope(queries[layer], cos, sin, kv.rope_layout)  # [1, H_q, T, d]
                cosines.append(attention_output_cosine(q, own.keys, own.values, new.keys, new.values))
    finally:
        capture.close()
    scores = {}
    for name, pairs in stats.items():
        mapped = torch.cat([m for m, _ in pairs], dim=2)  # [L_t, H_t, ΣT, d_t]
        native = torch.cat([n for _, n in pairs], dim=2)
        sst = (native - native.mean(2, keepdim=True)).square().sum()
        scores[f"prompt_r2_{name}"] = _r2((mapped - native).square().sum(), sst)
    for name in ("k", "v"):  # mean over prompts of ‖mapped − native‖ / ‖native‖ at position 0 and after it
        scores[f"relative_error_position0_{name}"] = sum(errors[f"{name}_first"]) / len(prompts)
        scores[f"relative_error_rest_{name}"] = sum(errors[f"{name}_rest"]) / len(prompts)
    scores["attention_output_cosine"] = sum(cosines) / len(cosines)
    return scores


def _cache(layers: list[tuple[torch.Tensor, torch.Tensor]], config) -> DynamicCache:
    cache = DynamicCache(config=config)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


@torch.no_grad()
def swap_nll(transfer: KVTransfer, streams: torch.Tensor, prefix_len: int) -> dict[str, float]:
    """Horizon NLL on streams [N, P+H] with native target K/V swapped into the mapped cache: all keys
    (`nll_swap_k`), all values (`nll_swap_v`), and each target layer ℓ alone (`nll_swap_layer_ℓ`)."""
    target = transfer.target
    prefix = streams[:, : prefix_len - 1]
    native = [(layer.keys, layer.values) for layer in prefill(target, prefix).layers]
    mapped = [
        (layer.keys, layer.values) for layer in transfer(prefill(transfer.source, prefix), input_ids=prefix).layers
    ]
    nll = lambda layers: float(continuation_nll(target, _cache(layers, target.config), streams, prefix_len).mean())
    scores = {
        "nll_swap_k": nll([(own[0], new[1]) for own, new in zip(native, mapped, strict=True)]),
        "nll_swap_v": nll([(new[0], own[1]) for own, new in zip(native, mapped, strict=True)]),
    }
    for swapped in range(len(native)):
        scores[f"nll_swap_layer_{swapped}"] = nll([*mapped[:swapped], native[swapped], *mapped[swapped + 1 :]])
    return scores
