"""A cross-model test pair whose true mapper is known in closed form (correctness only, never quality).

    from tests.exact_pair import exact_pair
    source, target, tokenizer_hash, exact, wrong = exact_pair()  # tiny llama, CPU float32

`exact_pair(family="llama" | "mistral" | "qwen2", seed=0, dtype=torch.float32, tokenizer_hash=None, **config)`
→ `ExactPair` (a NamedTuple, unpacks as above); `config` overrides tests/conftest.py's tiny config (e.g.
vocab_size=260 for a byte tokenizer); `tokenizer_hash` replaces the vocab-size stand-in (a real tokenizer's).

The target is the source with, in every layer ℓ and KV head h:
  V  multiplied by an invertible d×d matrix A_ℓh (v' = v·A), o_proj compensated by A⁻¹;
  K  multiplied per RoPE frequency pair (i, i + d/2) by a complex number c_ℓhi (a 2×2 rotation·scale, which
     commutes with RoPE), the q heads of the group compensated by 1/conj(c) so every attention score is kept;
except in the LAST layer, where K is multiplied by a dense invertible 4·B (which does not commute with RoPE, so
a map applied at the wrong positions shows) and q is left alone; and with a different lm_head, final norm and
last-layer MLP. The last layer's attention, MLP and the head feed no cache, so the target's logits differ from
the source's while its cache at layer ℓ is exactly the source's layer-ℓ content cache through (B_ℓh, A_ℓh).

  exact   Mapper (local support, k = 1, target layer ℓ ← source layer ℓ, zero bias): a transferred source cache
          equals the target's own cache (float rounding, ~1e-6), and only through the map — the source's
          native cache differs from the target's (`max_cache_diff` ≈ 2).
  wrong   the same Mapper with every coefficient perturbed (+0.1·N(0, 1)): its transfer differs from the
          target's own cache, so a "transfer" that leaks the target's native state shows as wrong == native.

Both manifests carry fingerprints (src.models.fingerprint), the tokenizer hash, support / k / head_index /
source_layers / token_features=False / coefficient_count, so `KVTransfer(mapper, source, target,
tokenizer_hash, compute_dtype=dtype)` accepts them. `max_cache_diff(a, b)` is the largest |ΔK| or |ΔV| between
two caches (DynamicCache or [(K, V)]).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from src.artifact import Mapper
from src.maps import cache_layers
from src.models import build_random_model, describe_kv, fingerprint, vocabulary_hash
from src.support import coefficient_count
from tests.conftest import FAMILIES

EXACT_FAMILIES = ("llama", "mistral", "qwen2")  # qwen3's k_norm does not commute with a scaled K rotation


class ExactPair(NamedTuple):
    source: PreTrainedModel
    target: PreTrainedModel
    tokenizer_hash: str
    exact: Mapper
    wrong: Mapper


def _value_matrix(d: int, generator: torch.Generator) -> torch.Tensor:
    """A well-conditioned, non-orthogonal invertible A [d, d]: Q₁·diag(s)·Q₂, s ∈ [0.5, 2]."""
    q1 = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))[0]
    q2 = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))[0]
    scales = 0.5 + 1.5 * torch.rand(d, generator=generator, dtype=torch.float64)
    return q1 @ torch.diag(scales) @ q2


def _key_matrix(d: int, generator: torch.Generator) -> torch.Tensor:
    """B [d, d] acting on row vectors as k·B = complex multiply of each RoPE pair (k_i, k_{i+d/2}) by c_i."""
    half = d // 2
    c = torch.polar(
        0.5 + 1.5 * torch.rand(half, generator=generator, dtype=torch.float64),
        2 * torch.pi * torch.rand(half, generator=generator, dtype=torch.float64),
    )
    b = torch.zeros(d, d, dtype=torch.float64)
    i = torch.arange(half)
    b[i, i], b[i + half, i + half] = c.real, c.real  # k'_i = a·k_i − b·k_{i+d/2}
    b[i + half, i], b[i, i + half] = -c.imag, c.imag  # k'_{i+d/2} = b·k_i + a·k_{i+d/2}
    return b


@torch.no_grad()
def _transform(
    layer_attn, keys: list[torch.Tensor], values: list[torch.Tensor], q_per_kv: int, d: int, keep_scores: bool
) -> None:
    """Rewrite one attention module in place: v' = v·A_h, k' = k·B_h, o_proj ← o_proj·A_h⁻ᵀ, and (keep_scores)
    q' = q·B_h⁻ᵀ."""

    def rewrite(linear: torch.nn.Linear, head: int, matrix: torch.Tensor) -> None:  # rows h·d … of W: y' = y·M
        rows = slice(head * d, (head + 1) * d)
        w = linear.weight[rows].double()  # [d, hidden]
        linear.weight[rows] = (matrix.T @ w).to(linear.weight.dtype)
        if linear.bias is not None:
            linear.bias[rows] = (linear.bias[rows].double() @ matrix).to(linear.bias.dtype)

    for h, (b, a) in enumerate(zip(keys, values, strict=True)):
        rewrite(layer_attn.k_proj, h, b)
        rewrite(layer_attn.v_proj, h, a)
        for j in range(h * q_per_kv, (h + 1) * q_per_kv):  # HF repeat_kv: q head j reads kv head j // q_per_kv
            if keep_scores:
                rewrite(layer_attn.q_proj, j, torch.linalg.inv(b).T)
            cols = slice(j * d, (j + 1) * d)
            o = layer_attn.o_proj.weight[:, cols].double()  # [hidden, d]
            layer_attn.o_proj.weight[:, cols] = (o @ torch.linalg.inv(a).T).to(layer_attn.o_proj.weight.dtype)


def _mapper(source, target, tokenizer_hash: str, weight_k: torch.Tensor, weight_v: torch.Tensor, method: str) -> Mapper:
    dtype = next(target.parameters()).dtype  # float64 coefficients for a float64 pair
    source_kv, target_kv = describe_kv(source), describe_kv(target)
    layers, heads, d = target_kv.num_layers, target_kv.num_kv_heads, target_kv.head_dim
    source_layers = torch.arange(layers)[:, None]  # [L_t, 1]  target layer ℓ ← source layer ℓ
    head_index = torch.arange(heads)[:, None]  # [H_t, 1]  Head-Local, H_s = H_t
    manifest = {
        "support": "local",
        "weighting": "uniform",
        "lambda": 0.0,
        "lambda_relative": False,
        "alpha_cap": 1.0,
        "token_features": False,
        "alpha": None,
        "k": 1,
        "fan_in": 1,
        "fitted_width": None,
        "source_layers": source_layers.tolist(),
        "head_index": head_index.tolist(),
        "calibration": {},
        "method": method,
        "selection": "fixed",
        "shift": 0,
        "selection_scores": None,
        "coefficient_count": coefficient_count(layers, heads, 1, 1, source_kv.head_dim, d),
        "source_fingerprint": fingerprint(source),
        "target_fingerprint": fingerprint(target),
        "tokenizer_hash": tokenizer_hash,
        "source_kv": source_kv.to_dict(),
        "target_kv": target_kv.to_dict(),
    }
    return Mapper(
        source_layers=source_layers,
        head_index=head_index,
        weight_k=weight_k.to(dtype),  # [L_t, H_t, d_s, d_t]
        bias_k=torch.zeros(layers, heads, d, dtype=dtype),
        weight_v=weight_v.to(dtype),
        bias_v=torch.zeros(layers, heads, d, dtype=dtype),
        manifest=manifest,
    )


def exact_pair(
    family: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer_hash: str | None = None,
    **config,
) -> ExactPair:
    """Tiny source, a target that differs from it but whose cache is an exact map of the source's, and the
    exact and a wrong mapper (module docstring)."""
    if family not in EXACT_FAMILIES:
        raise ValueError(f"no exact map for family {family!r}; choose one of {EXACT_FAMILIES}")
    source = build_random_model(dict(FAMILIES[family], **config), seed=seed, dtype=dtype)
    target = copy.deepcopy(source)
    kv = describe_kv(source)
    d = kv.head_dim
    generator = torch.Generator().manual_seed(1000 + seed)
    weight_k = torch.empty(kv.num_layers, kv.num_kv_heads, d, d, dtype=torch.float64)  # [L, H, d, d]
    weight_v = torch.empty_like(weight_k)
    for layer in range(kv.num_layers):
        last = layer == kv.num_layers - 1  # its attention scores feed no cache: any invertible K map
        for h in range(kv.num_kv_heads):
            weight_k[layer, h] = 4 * _value_matrix(d, generator) if last else _key_matrix(d, generator)
            weight_v[layer, h] = _value_matrix(d, generator)
        attention = target.model.layers[layer].self_attn
        _transform(attention, list(weight_k[layer]), list(weight_v[layer]), kv.q_per_kv, d, keep_scores=not last)
    with torch.no_grad():  # outputs differ, caches don't: these feed no K/V
        for p in (target.lm_head.weight, *target.model.layers[-1].mlp.parameters()):
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype) * p.std())
        target.model.norm.weight.mul_(0.5 + torch.rand(target.model.norm.weight.shape, generator=generator).to(dtype))
    tokenizer_hash = tokenizer_hash or vocabulary_hash(target)
    exact = _mapper(source, target, tokenizer_hash, weight_k, weight_v, "exact")
    noise = lambda w: w + 0.1 * torch.randn(w.shape, generator=generator, dtype=torch.float64)
    wrong = _mapper(source, target, tokenizer_hash, noise(weight_k), noise(weight_v), "exact+noise")
    return ExactPair(source, target, tokenizer_hash, exact, wrong)


def max_cache_diff(a, b) -> float:
    """Largest |ΔK| or |ΔV| over all layers of two caches of the same shape (DynamicCache or [(K, V)])."""
    return max(
        max((ka.double() - kb.double()).abs().max().item(), (va.double() - vb.double()).abs().max().item())
        for (ka, va), (kb, vb) in zip(cache_layers(a), cache_layers(b), strict=True)
    )
