"""The map arithmetic every apply path shares (torch here, Triton in kernels/apply_map.py): which target
layers go together, how one group of target layers is computed from the source's content rows; the refusal
type, the cache types a map can read, and the check of everything a mapper carries. Below both `src/apply.py`
and `kernels/`, so neither imports the other's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from src.artifact import COEFFICIENTS, Mapper
from src.models import KVInterface
from src.support import gather_features, token_width, with_token_kv


class TransferError(ValueError):
    """This source cache cannot be mapped safely; the message names why. Callers roll back to prefill."""


class MapFlags(NamedTuple):
    """What one map found in its values, left on the device so that mapping never waits for the host; decided
    afterwards, every map of a handoff at once, by `map_refusal`."""

    source: torch.Tensor  # [L_s, 2] bool: source layer ℓ's keys / values hold NaN or Inf
    target: torch.Tensor  # [L_t] bool: mapped target layer ℓ holds NaN or Inf
    beyond: torch.Tensor  # [L_t] bool: mapped target layer ℓ holds a finite |K| or |V| above `bound`
    bound: float | None = None  # the magnitude guard (`Policy.guard_max_abs`; None: no guard)


def map_refusal(flags: Sequence[MapFlags]) -> str | None:
    """Why these maps must be refused — NaN or Inf in a source layer or a mapped layer, or a mapped value past the
    magnitude guard — or None; one host read of every flag."""
    if not flags:
        return None
    tensors = [t for f in flags for t in (f.source, f.target, f.beyond)]
    host = torch.cat([t.reshape(-1).to(tensors[0].device) for t in tensors]).cpu()  # the one device sync
    if not host.any():
        return None
    pieces = iter(host.split([t.numel() for t in tensors]))  # each map's (source, target, beyond), in order
    for f in flags:
        source, target, beyond = next(pieces), next(pieces), next(pieces)
        if source.any():
            layer, component = divmod(int(source.nonzero()[0]), 2)
            return f"source cache layer {layer} {('keys', 'values')[component]} contains NaN or Inf"
        if target.any():
            return f"mapped target layer {int(target.nonzero()[0])} is not finite (corrupt coefficients?)"
        if beyond.any():
            return f"guard: mapped |K|, |V| of target layer {int(beyond.nonzero()[0])} exceed {f.bound:g}"
    return None


ALIGN = 16  # elements: a layer offset known to be a multiple of it lets a Triton kernel store 16-byte vectors


@dataclass(frozen=True, eq=False)
class LayerViews:
    """Where one component (K or V) of a map lands, layer by layer: L views alike in shape, strides, dtype and device,
    at any addresses — slices of one stacked tensor, or separate allocations (vLLM's GPU runner allocates each layer's
    paged cache on its own). The Triton path addresses layer ℓ as `base` + offsets[ℓ] elements, the torch path writes
    `views[ℓ]`: the same elements."""

    views: Sequence[torch.Tensor]  # L × [N_blocks, H, block_size, d] (or [B, H, T, d]): a stacked tensor or a tuple
    offsets: torch.Tensor  # [L] int64 on their device: view ℓ's first element − view 0's, in elements (may be < 0)
    multiple: int = 1  # a power of two ≤ ALIGN dividing every offset: the kernels' hint (their stores vectorize on it)

    @property
    def base(self) -> torch.Tensor:
        return self.views[0]  # [N_blocks, H, block_size, d]: the kernel's `out`, whose strides every layer shares

    @classmethod
    def stacked(cls, stacked: torch.Tensor) -> LayerViews:
        """The layers of one tensor [L, ...]: a constant step, offsets ℓ · stride(0) (made on its device in one launch,
        no copy: map_cache makes them on every call with a stacked destination)."""
        layers, step = stacked.shape[0], stacked.stride(0)
        if step == 0:  # one layer, or a broadcast one
            return cls(stacked, torch.zeros(layers, dtype=torch.long, device=stacked.device), ALIGN)  # [L]
        return cls(stacked, torch.arange(0, layers * step, step, device=stacked.device), offset_multiple([step]))

    @classmethod
    def of(cls, views: Sequence[torch.Tensor]) -> LayerViews:
        """Separate views (built once: one small host → device copy of the offsets); a ValueError naming the layer and
        what differs where they are not alike (`unlike`), or where a view does not start a whole number of elements
        from view 0's first element."""
        if reason := unlike(views):
            raise ValueError(reason)
        size, offsets = views[0].element_size(), []
        for layer, view in enumerate(views):
            gap = view.data_ptr() - views[0].data_ptr()  # bytes
            if gap % size:
                raise ValueError(f"layer {layer}'s cache starts {gap} bytes from layer 0's: not a whole number of "
                                 f"{size}-byte elements")  # fmt: skip
            offsets.append(gap // size)
        return cls(tuple(views), torch.tensor(offsets, dtype=torch.long, device=views[0].device),  # [L]
                   offset_multiple(offsets))  # fmt: skip


def offset_multiple(offsets: Sequence[int]) -> int:
    """The largest power of two ≤ ALIGN that divides every offset (elements)."""
    multiple = ALIGN
    while multiple > 1 and any(offset % multiple for offset in offsets):
        multiple //= 2
    return multiple


def unlike(views: Sequence[torch.Tensor]) -> str | None:
    """Why these layers' views are not alike in shape, strides, dtype and device (naming the first layer that
    differs from layer 0, and how), or None."""
    first = _described(views[0])
    for layer, view in enumerate(views):
        if differs := [f"{key} {mine} ≠ {first[key]}" for key, mine in _described(view).items() if mine != first[key]]:
            return f"layer {layer}'s cache is not alike layer 0's: {', '.join(differs)}"
    return None


def _described(view: torch.Tensor) -> dict[str, object]:
    return {"shape": tuple(view.shape), "strides": view.stride(), "dtype": view.dtype, "device": view.device}


def store_slots(destination: Sequence[torch.Tensor], mapped: torch.Tensor, slots: torch.Tensor) -> None:
    """mapped [L, H, T, d] into destination's L layers [N_blocks, H, block_size, d] (a stacked tensor or separate
    views: `LayerViews.views`) at slots [T] (slot s: block s // block_size, row s % block_size) — the torch path's
    store; device index ops, no host sync."""
    block, row = slots // destination[0].shape[2], slots % destination[0].shape[2]  # [T]
    for layer, values in zip(destination, mapped, strict=True):
        layer[block, :, row] = values.transpose(0, 1).to(layer.dtype)  # [T, H, d]: indexing puts T first


def layer_flags(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-finite flags [L, 2] (keys, values) and the largest finite |entry| [L] of each layer's (keys, values), on
    the device, in a few multi-tensor launches (one per tensor where the layers are not dense: `stacked_flags`)."""
    tensors = [t for pair in layers for t in pair]
    return _peak_flags(torch.stack(torch._foreach_norm(tensors, float("inf"))).float().view(-1, 2))


def stacked_flags(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer_flags` of stacked keys / values [L, ...] (any strides: one reduction per component)."""
    dims = tuple(range(1, keys.dim()))
    norms = [torch.linalg.vector_norm(t, float("inf"), dim=dims) for t in (keys, values)]  # [L] each
    return _peak_flags(torch.stack(norms, 1).float())


def _peak_flags(peaks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """max |x| per layer and component [L, 2] (NaN where one is NaN) → non-finite flags [L, 2], largest finite [L]."""
    finite = torch.isfinite(peaks)  # [L, 2]
    return ~finite, torch.where(finite, peaks, 0.0).amax(1)  # [L, 2], [L]


def set_flags(
    keys: torch.Tensor,
    values: torch.Tensor,
    nonfinite: torch.Tensor | None,
    beyond: torch.Tensor | None,
    bound: float | None,
) -> None:
    """A torch map's flags, in place on the device: nonfinite [L_t] 1 where layer ℓ of keys / values [L_t, ...] holds
    NaN or Inf, beyond [L_t] 1 where its largest finite |entry| exceeds `bound` (None: no bound); either may be None."""
    if nonfinite is None and beyond is None:
        return
    bad, peak = layer_flags(list(zip(keys, values, strict=True)))  # [L_t, 2], [L_t]
    if nonfinite is not None:
        nonfinite.copy_(bad.any(1).to(nonfinite.dtype))
    if beyond is not None:
        beyond.copy_((peak > (float("inf") if bound is None else bound)).to(beyond.dtype))


MAPPABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # cache layer types whose (keys, values) are the cache


def shares_heads(mapper: Mapper) -> bool:
    """True when every target head reads the same source heads (full / pca support)."""
    return bool((mapper.head_index == mapper.head_index[:1]).all())


GROUP_BYTES = 1 << 30  # target layers are mapped in groups whose gathered features fit in about 1 GiB


def map_layers(
    mapper: Mapper,
    group: slice,
    source_k: torch.Tensor,
    source_v: torch.Tensor,
    shared: bool,
    token_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content rows [L_s, H_s, n, d_s] (K and V) → mapped rows of target layers `group`: [g, H_t, n, d_t].
    `token_rows` [n, 2·H_t·d_t]: the target's token K/V rows, for a mapper fitted with token features.

    One gather and one batched GEMM per component for the whole group. When every target head reads
    the same source heads (full / pca support, `shared`) the features are gathered once per layer and
    all heads are one GEMM against W reshaped to [p, H_t·d_t]."""
    heads = mapper.head_index[:1] if shared else mapper.head_index  # [H_t or 1, f]
    layers = mapper.source_layers[group]  # [g, k]
    mapped = []
    for component, rows in (("k", source_k), ("v", source_v)):
        x = with_token_kv(gather_features(rows, layers, heads), token_rows)  # [g, H_t or 1, n, p]
        x = x.to(mapper.weight_k.dtype)
        weight = getattr(mapper, f"weight_{component}")[group]  # [g, H_t, p, d_t]
        bias = getattr(mapper, f"bias_{component}")[group]  # [g, H_t, d_t]
        if shared:
            w = weight.permute(0, 2, 1, 3).flatten(2)  # [g, p, H_t·d_t]
            y = torch.baddbmm(bias.flatten(1)[:, None, :], x[:, 0], w)  # [g, n, H_t·d_t]
            mapped.append(y.unflatten(2, bias.shape[1:]).transpose(1, 2))  # [g, H_t, n, d_t]
        else:
            g, h = weight.shape[:2]
            y = torch.baddbmm(bias.flatten(0, 1)[:, None, :], x.flatten(0, 1), weight.flatten(0, 1))  # [g·H_t, n, d_t]
            mapped.append(y.unflatten(0, (g, h)))  # [g, H_t, n, d_t]
    return mapped[0], mapped[1]


def layer_groups(mapper: Mapper, rows: int, shared: bool) -> list[slice]:
    """Slices of target layers whose gathered features stay under GROUP_BYTES."""
    target_layers, target_heads, width = mapper.weight_k.shape[:3]
    per_layer = (1 if shared else target_heads) * rows * width * mapper.weight_k.element_size()
    size = max(1, min(target_layers, GROUP_BYTES // max(per_layer, 1)))
    return [slice(start, min(start + size, target_layers)) for start in range(0, target_layers, size)]


def map_rows(
    mapper: Mapper, source_k: torch.Tensor, source_v: torch.Tensor, token_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content rows [L_s, H_s, n, d_s] (K and V) (+ token K/V rows [n, 2·H_t·d_t]) → mapped target content
    rows [L_t, H_t, n, d_t]."""
    shared = shares_heads(mapper)
    if mapper.token_features and token_rows is None:
        raise TransferError("this mapper reads the target's token features: pass them")
    groups = [
        map_layers(mapper, g, source_k, source_v, shared, token_rows)
        for g in layer_groups(mapper, source_k.shape[2], shared)
    ]
    return torch.cat([k for k, _ in groups]), torch.cat([v for _, v in groups])


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a DynamicCache (full or sliding-window layers) or of a list / tuple of (keys, values)
    pairs, each [batch, kv_heads, seq, head_dim]. Any other cache type is refused (TransferError naming it): a
    StaticCache pads to its maximum length, quantized and offloaded layers hold other data."""
    if isinstance(cache, DynamicCache):
        for index, layer in enumerate(cache.layers):
            if type(layer) not in MAPPABLE_LAYERS:
                raise TransferError(
                    f"source cache layer {index} is a {type(layer).__name__}; only "
                    f"{' / '.join(kind.__name__ for kind in MAPPABLE_LAYERS)} layers can be mapped"
                )
        return [(layer.keys, layer.values) for layer in cache.layers]
    if not isinstance(cache, list | tuple):
        raise TransferError(
            f"source cache is a {type(cache).__name__}: pass a DynamicCache or a list of (keys, values) per layer"
        )
    for index, pair in enumerate(cache):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise TransferError(f"source cache layer {index} is a {type(pair).__name__}, not a (keys, values) pair")
    return [tuple(pair) for pair in cache]


def dropped_tokens(cache) -> int:
    """Tokens a sliding-window DynamicCache has already dropped (it holds the last ones only, so its first held
    token sits at this position); 0 for a list of (keys, values), whose positions are the caller's to give."""
    if not isinstance(cache, DynamicCache):
        return 0
    return max(
        (
            layer.cumulative_length - layer.keys.shape[-2]
            for layer in cache.layers
            if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized
        ),
        default=0,
    )


def check_mapper(mapper: Mapper, source: KVInterface, target: KVInterface) -> None:
    """Refuse a mapper whose contents this pair cannot use: index dtypes, shapes and ranges, coefficient dtypes,
    shapes and finiteness. The message names the field."""
    if not isinstance(mapper, Mapper):
        raise TransferError(f"mapper is a {type(mapper).__name__}, not a src.artifact.Mapper")
    if not isinstance(mapper.manifest, dict):
        raise TransferError(f"mapper manifest is a {type(mapper.manifest).__name__}, not a dict")
    for name, t in mapper.tensors().items():
        if not isinstance(t, torch.Tensor):
            raise TransferError(f"mapper {name} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
            raise TransferError(f"mapper {name} is not a dense tensor with data ({t.layout}, {t.device})")
    bounds = {
        "source_layers": (target.num_layers, source.num_layers),
        "head_index": (target.num_kv_heads, source.num_kv_heads),
    }
    for name, (rows, bound) in bounds.items():
        t = getattr(mapper, name)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TransferError(f"mapper {name} is {t.dtype}: indices must be integers")
        if t.dim() != 2 or t.shape[0] != rows or t.shape[1] == 0:
            raise TransferError(f"mapper {name} has shape {tuple(t.shape)}, expected [{rows}, ≥ 1]")
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= bound:
            raise TransferError(f"mapper {name} holds indices {low}..{high}, outside [0, {bound})")
    expected = (target.num_layers, target.num_kv_heads)
    weight_k = mapper.weight_k
    if weight_k.dim() != 4 or tuple(weight_k.shape[:2]) != expected or weight_k.shape[-1] != target.head_dim:
        raise TransferError(f"mapper shape {tuple(mapper.weight_k.shape)} does not fit the target's KV interface")
    width = mapper.source_layers.shape[1] * mapper.head_index.shape[1] * source.head_dim
    width += token_width(target.num_kv_heads, target.head_dim) if mapper.token_features else 0
    for name in COEFFICIENTS:
        t = getattr(mapper, name)
        if not t.dtype.is_floating_point:
            raise TransferError(f"mapper {name} is {t.dtype}: coefficients must be floating point")
        if name.startswith("weight") and t.dim() == 4 and t.shape[2] != width:
            raise TransferError(
                f"mapper {name} reads {t.shape[2]} features, its layers, heads and token features make {width}"
            )
        shape = (*expected, width, target.head_dim) if name.startswith("weight") else (*expected, target.head_dim)
        if tuple(t.shape) != shape:
            raise TransferError(f"mapper {name} has shape {tuple(t.shape)}, expected {shape}")
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            where = tuple(int(i) for i in (~finite).nonzero()[0])
            raise TransferError(f"mapper {name} contains NaN or Inf (first at {where})")
