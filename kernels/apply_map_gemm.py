"""The map as one large GEMM per target head — `map_cache(backend="gemm")`'s computation on de-RoPE'd content.

The gathered form (kernels/apply_map.py) multiplies, per target layer ℓ and head h, x_ℓh [T, k·f·d_s] by W_ℓh. When
every target layer reads (nearly) all L_s source layers, those L_t small GEMMs are one per head (Eqs. 7, 11):

    A_h = [content(source layer l, source head a_h[g]) for l < L_s, g < f]     # [T, L_s·f·d_s], layer-major, g, channel
    W_h = the W_ℓh scattered into the rows of the source layers S_ℓ selects     # [L_s·f·d_s, L_t·d_t], 0 elsewhere
    [k̂_0 … k̂_{L_t−1}] = RoPE_target(A_h · W_h + b_h)                          # [T, L_t·d_t]; values without RoPE

which cuBLAS runs at its full rate. The FLOPs grow by L_s / k over the gathered form (none when every target layer
reads every source layer): `gemm_worthwhile` says when that pays. `packed_weights` builds W_h, b_h once per mapper —
a bound route holds the result and passes it on every call (`map_cache(..., packed=...)`); without it each call
packs again (an extra copy of the coefficients per call).

A non-finite source entry reaches every target layer at its token here (0 · NaN = NaN through the zero rows), where
the gathered form reaches only the layers that read it: the flags then name every target layer — a superset, and the
same refusal (a map with any flag is refused whole; `src.maps.MapFlags` names the source layer first).

The epilogue here is torch (bias, RoPE, cast, finiteness flags: `src.maps.set_flags`): the reference and the CPU
path, whose result `map_cache` stores wherever `out` says. Where Triton runs, `map_cache` takes `head_products` and
finishes them with `kernels.apply_map_epilogue.store_mapped`, which writes straight into `out`. This module does not
de-RoPE: `map_cache` hands it the content keys (its Triton `derope_keys` on CUDA, `src.rope.remove_rope` elsewhere).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from src.artifact import Mapper
from src.maps import set_flags
from src.rope import apply_rope

WORTHWHILE = 0.75  # `gemm_worthwhile`: k / L_s at or above which the extra FLOPs (L_s / k ≤ 4/3) are worth one GEMM


class PackedMapper(NamedTuple):
    """A mapper's coefficients as one GEMM per target head (`packed_weights`)."""

    weight_k: torch.Tensor  # [H_t, L_s·f·d_s, L_t·d_t]
    bias_k: torch.Tensor  # [H_t, L_t, d_t]
    weight_v: torch.Tensor  # [H_t, L_s·f·d_s, L_t·d_t]
    bias_v: torch.Tensor  # [H_t, L_t, d_t]
    head_index: torch.Tensor  # [H_t, f] long: the source heads of each target head (A_h's)


def gemm_worthwhile(mapper: Mapper, source_layer_count: int) -> bool:
    """True when the one-GEMM form costs at most 4/3 of the gathered form's FLOPs: k ≥ 0.75 · L_s."""
    return mapper.source_layers.shape[1] >= WORTHWHILE * source_layer_count


def gemm_unsupported(mapper: Mapper) -> str | None:
    """Why this mapper cannot run as one GEMM per head (None: it can). Reads nothing on the device: a call under CUDA
    graph capture asks too."""
    if mapper.token_features:
        return "the mapper reads the target's token features (its designs are not source rows alone)"
    return None


@torch.no_grad()
def packed_weights(mapper: Mapper, source_layer_count: int) -> PackedMapper:
    """W_h [H_t, L_s·f·d_s, L_t·d_t]: target layer ℓ's W_ℓh rows of selected block j (source layer S_ℓ[j]) land in
    the rows of source layer S_ℓ[j], columns ℓ·d_t..(ℓ+1)·d_t (a layer selected twice adds up: both read the same
    rows); b_h [H_t, L_t, d_t]. Pure; on the mapper's device and dtype; reads S_ℓ's range on the host. Compute once per
    mapper and keep it."""
    layers = mapper.source_layers  # [L_t, k]
    if layers.numel() and not (0 <= int(layers.min()) and int(layers.max()) < source_layer_count):
        raise ValueError(f"the gemm map cannot serve this mapper: source_layers outside 0..{source_layer_count - 1}")
    if reason := gemm_unsupported(mapper):
        raise ValueError(f"the gemm map cannot serve this mapper: {reason}")
    target_layers, target_heads, width, d_t = mapper.weight_k.shape
    selected = mapper.source_layers.shape[1]
    block = width // selected  # f·d_s rows per selected source layer
    packed = []
    for component in ("k", "v"):
        weight = getattr(mapper, f"weight_{component}").unflatten(2, (selected, block))  # [L_t, H_t, k, f·d_s, d_t]
        shape = (target_heads, source_layer_count, block, target_layers, d_t)
        scattered = torch.zeros(shape, dtype=weight.dtype, device=weight.device)  # [H_t, L_s, f·d_s, L_t, d_t]
        for layer in range(target_layers):
            rows = mapper.source_layers[layer].to(weight.device).long()  # [k]: S_ℓ
            scattered[:, :, :, layer].index_add_(1, rows, weight[layer])  # [H_t, L_s, f·d_s, d_t] += [H_t, k, …]
        bias = getattr(mapper, f"bias_{component}").transpose(0, 1).contiguous()  # [H_t, L_t, d_t]
        packed += [scattered.flatten(3).flatten(1, 2), bias]  # [H_t, L_s·f·d_s, L_t·d_t], [H_t, L_t, d_t]
    return PackedMapper(*packed, mapper.head_index.to(mapper.weight_k.device).long())


def head_rows(content: torch.Tensor, head_index: torch.Tensor) -> torch.Tensor:
    """A_h for every target head: content [L_s, B, H_s, T, d_s] → [H_t, B·T, L_s·f·d_s] (layer-major, then the
    admitted head g, then the channel), one gather kernel."""
    source_layers, batch, _, seq, _ = content.shape
    device = content.device
    layer = torch.arange(source_layers, device=device).view(1, 1, 1, -1, 1)  # [1, 1, 1, L_s, 1]
    row = torch.arange(batch, device=device).view(1, -1, 1, 1, 1)  # [1, B, 1, 1, 1]
    head = head_index[:, None, None, None, :]  # [H_t, 1, 1, 1, f]
    token = torch.arange(seq, device=device).view(1, 1, -1, 1, 1)  # [1, 1, T, 1, 1]
    rows = content[layer, row, head, token]  # [H_t, B, T, L_s, f, d_s]
    return rows.view(rows.shape[0], batch * seq, -1)  # [H_t, B·T, L_s·f·d_s]


def _gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[H, n, P] @ [H, P, N] → [H, n, N]: fp32 output from half-precision inputs where cuBLAS offers it (CUDA,
    `aten::bmm.dtype`), else in the inputs' dtype (the reference's rounding)."""
    half = a.dtype in (torch.bfloat16, torch.float16)
    if half and a.is_cuda and "dtype" in torch.ops.aten.bmm.overloads():
        return torch.bmm(a, w, out_dtype=torch.float32)
    return torch.bmm(a, w)


def head_products(
    content_keys: torch.Tensor, source_values: torch.Tensor, packed: PackedMapper
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two GEMMs: content keys and values [L_s, B, H_s, T, d_s] (cast to the coefficients' dtype) → Y_K, Y_V,
    each [H_t, B·T, L_t·d_t] (fp32 from half-precision inputs on CUDA: `_gemm`), before bias and RoPE."""
    return tuple(
        _gemm(head_rows(rows.to(weight.dtype), packed.head_index), weight)  # [H_t, B·T, L_t·d_t]
        for rows, weight in ((content_keys, packed.weight_k), (source_values, packed.weight_v))
    )


def map_cache_gemm(
    content_keys: torch.Tensor,
    source_values: torch.Tensor,
    packed: PackedMapper,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    target_layout: str,
    out_dtype: torch.dtype,
    nonfinite: torch.Tensor | None = None,
    beyond: torch.Tensor | None = None,
    bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content keys and values [L_s, B, H_s, T, d_s] (keys de-RoPE'd, any dtype: cast to the coefficients') →
    the target's (keys, values), each [L_t, B, H_t, T, d_t] contiguous in out_dtype; flags as `map_cache_ref`'s.
    The torch epilogue: the reference of `kernels.apply_map_epilogue.store_mapped`, and the CPU path."""
    _, batch, _, seq, _ = content_keys.shape
    target_heads, target_layers, d_t = packed.bias_k.shape
    mapped = []
    for y, bias, rotary in zip(head_products(content_keys, source_values, packed), (packed.bias_k, packed.bias_v),
                               (True, False), strict=True):  # fmt: skip
        y = y.view(target_heads, batch, seq, target_layers, d_t)  # [H_t, B, T, L_t, d_t]
        y = y.add_(bias[:, None, None].to(y.dtype)).permute(3, 1, 0, 2, 4)  # [L_t, B, H_t, T, d_t], a view
        if rotary:
            y = apply_rope(y, target_cos, target_sin, target_layout)  # [L_t, B, H_t, T, d_t]
        mapped.append(y.to(out_dtype).contiguous())  # [L_t, B, H_t, T, d_t]
    set_flags(mapped[0], mapped[1], nonfinite, beyond, bound)
    return mapped[0], mapped[1]
