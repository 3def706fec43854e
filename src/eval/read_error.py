"""Where the error is, for the receiver: its attention output on the new turn's queries, spliced vs native (issue 25).

For a routed item, each receiver layer ℓ reads the history through attention. With the native queries of the turn
(the receiver's own forward of the turn on its native history: one extra forward of T tokens, the native prefill
reused), the layer's attention output is computed twice — over the native history K/V and over the spliced one (the
routed session's cache: mapped, with every lever applied) — the turn's own K/V native in both:

    o_t    = W_o · concat_h Σ_j a_htj v_hj + b_o          (softmax(q Kᵀ · scale), query t sees keys ≤ its position)
    e_ℓ    = Σ_t ‖o'_t − o_t‖² / Σ_t ‖o_t‖²                (the relative error of what layer ℓ reads)
    s_ℓj   = Σ_t ⟨c_tj, Δo_t⟩ / Σ_t ‖Δo_t‖²,  c_tj = W_o · concat_h (a'_htj v'_hj − a_htj v_hj)   (Σ_j s_ℓj = 1)

o is taken after o_proj, in the residual stream's space (a model's V basis is arbitrary, W_o·V is not). The queries
are teacher-forced, so e_ℓ is the error the spliced cache puts into layer ℓ's read, not error carried up from the
layers below: where the error is. s_ℓj is history token j's share of it (the turn's tokens hold a share too: their
K/V are native, their weights renormalize). An item's summary: the per-layer vector, its mean and max (and the max's
layer), and the shares of its mean error (each layer's shares weighted by e_ℓ) held by the attention sink (position
0), ten deciles of the rest of the history, and the turn. `read_error` collects it on DynamicCaches (an engine
session hands its slots out as one: `Session.cache`); `read_error_metrics` gives a run's means.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from kernels.turn_attention import turn_attention_weights
from src.eval.metrics import paired_bootstrap
from src.models import describe_kv
from src.rope import apply_rope, rope_cos_sin
from src.traces import QueryCapture

DECILES = 10  # history bins (after the sink) of an item's share profile


def layer_read_error(
    q: torch.Tensor,
    native: tuple[torch.Tensor, torch.Tensor],
    mapped: tuple[torch.Tensor, torch.Tensor],
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    scale: float,
) -> tuple[float, torch.Tensor]:
    """One layer's (e_ℓ, s_ℓ [S]) of the module docstring, in float64: q [H_q, T, d] (RoPE applied) of the last T of
    S positions; native, mapped: (K [H_kv, S, d] with RoPE, V [H_kv, S, d]); o_proj's weight [hidden, H_q·d] and
    bias. Shares are 0 where the outputs are equal (e_ℓ = 0)."""
    q, w = q.double(), o_weight.double()
    heads, count, _ = q.shape
    length = native[0].shape[1]
    positions = torch.arange(length - count, length, device=q.device)  # [T]: the last T of the S positions
    outputs, reads = [], []
    for keys, values in (native, mapped):
        a = turn_attention_weights(q, keys, positions, scale, torch.float64)  # [H_q, T, S]
        v = values.double().repeat_interleave(heads // values.shape[0], 0)  # [H_q, S, d]
        outputs.append((a @ v).transpose(0, 1).reshape(count, -1) @ w.T)  # [T, hidden] (bias: cancels in Δo)
        reads.append((a, v))
    delta = outputs[1] - outputs[0]  # [T, hidden]
    own = outputs[0] if o_bias is None else outputs[0] + o_bias.double()  # [T, hidden]
    back = (delta @ w).reshape(count, heads, -1).transpose(0, 1)  # [H_q, T, d]: W_o,hᵀ Δo_t
    read = lambda a, v: a * (back @ v.transpose(-1, -2))  # [H_q, T, S]: a_htj ⟨W_o,h v_hj, Δo_t⟩
    contribution = (read(*reads[1]) - read(*reads[0])).sum((0, 1))  # [S]
    total = delta.square().sum()
    shares = contribution / total if total > 0 else torch.zeros_like(contribution)  # [S]
    return float(total / own.square().sum()), shares


def item_summary(errors: torch.Tensor, shares: torch.Tensor, history: int) -> dict:
    """An item's summary (module docstring) from its per-layer errors [L] and shares [L, S] over history + turn."""
    weights = errors / errors.sum() if errors.sum() > 0 else torch.zeros_like(errors)  # [L]
    share = weights.to(shares.dtype) @ shares  # [S]
    return {
        "layers": errors.tolist(),
        "mean": float(errors.mean()),
        "max": float(errors.max()),
        "max_layer": int(errors.argmax()),
        "share_sink": float(share[0]),
        "share_deciles": [float(part.sum()) for part in share[1:history].tensor_split(DECILES)],
        "share_turn": float(share[history:].sum()),
    }


@torch.no_grad()
def read_error(
    target: PreTrainedModel, native: DynamicCache, mapped: DynamicCache, history: int, turn: torch.Tensor
) -> dict:
    """The item's read error (module docstring): `native` and `mapped` are the receiver's caches of the same
    conversation (its native prefill, and the routed session's spliced cache), each holding at least the `history`
    tokens the turn (ids [T]) follows; neither is changed. Full-attention models only (a ValueError otherwise)."""
    kv = describe_kv(target)
    if kv.sliding_window is not None or kv.kv_lora_rank is not None:
        raise ValueError("the read error recomputes full attention: sliding-window and latent (MLA) receivers are out")
    device = next(target.parameters()).device
    cache = copy.deepcopy(native)
    if cache.get_seq_length() > history:  # a negative crop drops the tokens past the history (0 would drop all)
        cache.crop(history - cache.get_seq_length())
    capture = QueryCapture(target, kv)
    try:
        target(turn[None].to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        queries = dict(capture.queries)  # layer → [1, H_q, T, d] before RoPE
    finally:
        capture.close()
    cos, sin = rope_cos_sin(target.model.rotary_emb, torch.arange(history, history + turn.numel()))  # [1, 1, T, r]
    errors, shares = [], []
    for index, (own, spliced) in enumerate(zip(cache.layers, mapped.layers, strict=True)):
        q = apply_rope(queries[index], cos, sin, kv.rope_layout)[0]  # [H_q, T, d]
        keys = torch.cat([spliced.keys[0, :, :history], own.keys[0, :, history:]], 1)  # [H_kv, P + T, d]
        values = torch.cat([spliced.values[0, :, :history], own.values[0, :, history:]], 1)  # [H_kv, P + T, d]
        o_proj = target.model.layers[index].self_attn.o_proj
        error, share = layer_read_error(
            q, (own.keys[0], own.values[0]), (keys, values), o_proj.weight, o_proj.bias, kv.attention_softmax_scale
        )
        errors.append(error)
        shares.append(share.cpu())
    return item_summary(torch.tensor(errors, dtype=torch.float64), torch.stack(shares), history)


def read_error_metrics(items: list[dict], n_boot: int, seed: int) -> dict[str, float]:
    """A run's `read_error.*` from its items' summaries: the mean over items of the item mean [with its bootstrap
    CI over items], of the item max, of each layer's error, and of each share; {} when no item has one."""
    found = [item["read_error"] for item in items if item.get("read_error")]
    if not found:
        return {}
    mean = paired_bootstrap([[r["mean"] for r in found]], lambda m: m, n_boot, seed)
    layers = np.mean([r["layers"] for r in found], 0)  # [L]
    deciles = np.mean([r["share_deciles"] for r in found], 0)  # [DECILES]
    return (
        {"read_error.mean": mean.estimate, "read_error.mean_low": mean.low, "read_error.mean_high": mean.high}
        | {"read_error.max": float(np.mean([r["max"] for r in found])), "read_error.items": float(len(found))}
        | {f"read_error.layer_{index}": float(value) for index, value in enumerate(layers)}
        | {f"read_error.share_{part}": float(np.mean([r[f"share_{part}"] for r in found])) for part in ("sink", "turn")}
        | {f"read_error.share_decile_{index}": float(value) for index, value in enumerate(deciles)}
    )
