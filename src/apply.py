"""Apply a mapper: the source's cache → a decode-ready target `DynamicCache`.

`KVTransfer` is built once per (mapper, source model, target model) — it verifies the artifact
against both models and puts the coefficients on the target's device — and is then called per
handoff. Per target layer: gather the selected source blocks, one head-batched matmul, re-apply the
target's RoPE at the same positions. A mapper with token features (src/support.py) also needs the prefix's
token ids: a layer-0 target prefill gives its features and, exactly, target layer 0. `handoff` wraps it with
deterministic rollback to plain prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache, PreTrainedModel

from src.artifact import Mapper
from src.models import KVInterface, describe_kv, fingerprint
from src.rope import apply_rope, remove_rope, rope_cos_sin
from src.support import gather_features, token_width, with_tokens


class TransferError(ValueError):
    """This source cache cannot be mapped safely; the message names why. Callers roll back to prefill."""


def shares_heads(mapper: Mapper) -> bool:
    """True when every target head reads the same source heads (full / pca support)."""
    return bool((mapper.head_index == mapper.head_index[:1]).all())


BACKENDS = ("torch", "auto", "triton")  # apply paths: torch grouped GEMMs, or kernels/apply_map.py
GROUP_BYTES = 1 << 30  # target layers are mapped in groups whose gathered features fit in about 1 GiB


def map_layers(
    mapper: Mapper,
    group: slice,
    source_k: torch.Tensor,
    source_v: torch.Tensor,
    shared: bool,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content rows [L_s, H_s, n, d_s] (K and V) → mapped rows of target layers `group`: [g, H_t, n, d_t].
    `tokens` [n, 2·H_t·d_t]: the target's token features, for a mapper fitted with them.

    One gather and one batched GEMM per component for the whole group. When every target head reads
    the same source heads (full / pca support, `shared`) the features are gathered once per layer and
    all heads are one GEMM against W reshaped to [p, H_t·d_t]."""
    heads = mapper.head_index[:1] if shared else mapper.head_index  # [H_t or 1, f]
    layers = mapper.source_layers[group]  # [g, k]
    mapped = []
    for component, rows in (("k", source_k), ("v", source_v)):
        x = with_tokens(gather_features(rows, layers, heads), tokens).to(mapper.weight_k.dtype)  # [g, H_t or 1, n, p]
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
    mapper: Mapper, source_k: torch.Tensor, source_v: torch.Tensor, tokens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Content rows [L_s, H_s, n, d_s] (K and V) (+ token features [n, 2·H_t·d_t]) → mapped target content
    rows [L_t, H_t, n, d_t]."""
    shared = shares_heads(mapper)
    if mapper.token_features and tokens is None:
        raise TransferError("this mapper reads the target's token features: pass them")
    groups = [
        map_layers(mapper, g, source_k, source_v, shared, tokens)
        for g in layer_groups(mapper, source_k.shape[2], shared)
    ]
    return torch.cat([k for k, _ in groups]), torch.cat([v for _, v in groups])


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a DynamicCache or legacy tuple cache, each [batch, kv_heads, seq, head_dim]."""
    if isinstance(cache, DynamicCache):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [tuple(pair) for pair in cache]


@dataclass
class Handoff:
    cache: DynamicCache
    mode: str  # "transfer" or "prefill"
    reason: str | None  # why the transfer was refused (mode == "prefill")


class KVTransfer:
    """A verified mapper bound to its source and target models, reusable for every handoff."""

    def __init__(
        self,
        mapper: Mapper,
        source: PreTrainedModel,
        target: PreTrainedModel,
        tokenizer_hash: str,
        compute_dtype: torch.dtype = torch.float32,
        backend: str = "torch",
    ):
        manifest = mapper.manifest
        for what, recorded, actual in (
            ("source fingerprint", manifest.get("source_fingerprint"), fingerprint(source)),
            ("target fingerprint", manifest.get("target_fingerprint"), fingerprint(target)),
            ("tokenizer hash", manifest.get("tokenizer_hash"), tokenizer_hash),
        ):
            if recorded != actual:
                raise TransferError(f"mapper does not belong to this pair: {what} {str(recorded)[:12]} ≠ {actual[:12]}")
        self.source, self.target = source, target
        self.source_kv: KVInterface = describe_kv(source)
        self.target_kv: KVInterface = describe_kv(target)
        expected = (self.target_kv.num_layers, self.target_kv.num_kv_heads)
        if tuple(mapper.weight_k.shape[:2]) != expected or mapper.weight_k.shape[-1] != self.target_kv.head_dim:
            raise TransferError(f"mapper shape {tuple(mapper.weight_k.shape)} does not fit the target's KV interface")
        self.token_features = mapper.token_features
        width = mapper.source_layers.shape[1] * mapper.head_index.shape[1] * self.source_kv.head_dim
        width += token_width(self.target_kv.num_kv_heads, self.target_kv.head_dim) if self.token_features else 0
        for name in ("weight_k", "weight_v"):
            if getattr(mapper, name).shape[2] != width:
                raise TransferError(
                    f"mapper {name} reads {getattr(mapper, name).shape[2]} features, its layers, heads and token "
                    f"features make {width}"
                )
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        if backend not in BACKENDS:
            raise ValueError(f"apply backend must be one of {BACKENDS}, not {backend!r}")
        if backend == "triton" and self.token_features:
            raise ValueError("the Triton apply does not read token features; use apply_backend torch or auto")
        self.backend = backend
        self.mapper = mapper.to(self.device, compute_dtype)
        self.shared_heads = shares_heads(mapper)

    def _check(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
        kv = self.source_kv
        if len(layers) != kv.num_layers:
            raise TransferError(f"source cache has {len(layers)} layers, the source model {kv.num_layers}")
        source_device = next(self.source.parameters()).device
        source_dtype = next(self.source.parameters()).dtype
        shape = None
        for index, (key, value) in enumerate(layers):
            for name, t in (("keys", key), ("values", value)):
                if t.dim() != 4 or t.shape[1] != kv.num_kv_heads or t.shape[3] != kv.head_dim:
                    raise TransferError(
                        f"source cache layer {index} {name} has shape {tuple(t.shape)}, "
                        f"expected [batch, {kv.num_kv_heads}, seq, {kv.head_dim}]"
                    )
                if shape is not None and t.shape != shape:
                    raise TransferError(f"source cache layer {index} {name} shape {tuple(t.shape)} ≠ {tuple(shape)}")
                if t.dtype != source_dtype:
                    raise TransferError(
                        f"source cache layer {index} {name} is {t.dtype}, the source model {source_dtype}"
                    )
                if t.device != source_device:
                    raise TransferError(
                        f"source cache layer {index} {name} is on {t.device}, the source on {source_device}"
                    )
                shape = t.shape
        finite = torch.stack([torch.isfinite(k).all() & torch.isfinite(v).all() for k, v in layers])
        if not bool(finite.all()):  # one device sync; the slow path names the layer
            index = int((~finite).nonzero()[0])
            name = "keys" if not bool(torch.isfinite(layers[index][0]).all()) else "values"
            raise TransferError(f"source cache layer {index} {name} contains NaN or Inf")
        return shape[0], shape[2]

    def spent(self, levers: Levers) -> Levers:
        """The target work of a handoff with these levers: a token-feature mapper also prefills layer 0."""
        return replace(levers, native_layers=max(levers.native_layers, 1)) if self.token_features else levers

    def _layer0(self, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer 0's content K and V [B, H_t, T, d_t] for the prefix ids [B, T] (a stopped prefill)."""
        if input_ids is None:
            raise TransferError("this mapper reads the target's token features: pass the prefix's input_ids")
        layer = prefill_layers(self.target, input_ids, 1).layers[0]
        positions = torch.arange(input_ids.shape[1], device=self.device)
        cos, sin = rope_cos_sin(self.target.model.rotary_emb, positions)
        return remove_rope(layer.keys, cos, sin, self.target_kv.rope_layout), layer.values

    @torch.no_grad()
    def __call__(
        self, source_cache, positions: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
    ) -> DynamicCache:
        """source_cache: DynamicCache or [(keys, values)] with [B, H_s, T, d_s]; positions [T] (default 0..T−1);
        input_ids [B, T] of those tokens (needed by a token-feature mapper, checked against the cache otherwise)."""
        layers = cache_layers(source_cache)
        batch, seq = self._check(layers)
        positions = torch.arange(seq) if positions is None else positions
        if positions.shape[-1] != seq:
            raise TransferError(f"{positions.shape[-1]} positions given for a {seq}-token cache")
        if input_ids is not None and tuple(input_ids.shape) != (batch, seq):
            raise TransferError(f"input_ids shape {tuple(input_ids.shape)} ≠ the source cache's ({batch}, {seq})")
        if self.backend != "torch" and not self.token_features:
            return self._fused(layers, positions)
        tokens = layer0 = None
        if self.token_features:
            layer0 = self._layer0(input_ids)  # content K, V [B, H_t, T, d_t]
            tokens = torch.cat(layer0, 1).transpose(1, 2).flatten(2).flatten(0, 1)  # [B·T, 2·H_t·d_t]
        cos, sin = rope_cos_sin(self.source.model.rotary_emb, positions.to(layers[0][0].device))
        to_rows = lambda t: t.to(self.device).transpose(1, 2).flatten(2, 3)  # [L_s, H_s, B·T, d_s]
        source_k = to_rows(torch.stack([remove_rope(k, cos, sin, self.source_kv.rope_layout) for k, _ in layers]))
        source_v = to_rows(torch.stack([v for _, v in layers]))  # [L_s, H_s, B·T, d_s]
        cos, sin = rope_cos_sin(self.target.model.rotary_emb, positions.to(self.device))
        to_cache = lambda t: t.unflatten(2, (batch, seq)).transpose(1, 2)  # [g, B, H_t, T, d_t]
        cache = DynamicCache(config=self.target.config)
        finite = []
        for group in layer_groups(self.mapper, batch * seq, self.shared_heads):
            target_k, target_v = map_layers(self.mapper, group, source_k, source_v, self.shared_heads, tokens)
            keys = apply_rope(to_cache(target_k), cos, sin, self.target_kv.rope_layout).to(self.dtype)
            values = to_cache(target_v).to(self.dtype)
            finite.append(torch.isfinite(keys).flatten(1).all(1) & torch.isfinite(values).flatten(1).all(1))
            for offset, layer in enumerate(range(group.start, group.stop)):
                cache.update(keys[offset], values[offset], layer)
        finite = torch.cat(finite)  # [L_t]
        if not bool(finite.all()):  # one device sync per handoff
            layer = int((~finite).nonzero()[0])
            raise TransferError(f"mapped target layer {layer} is not finite (corrupt coefficients?)")
        if layer0 is not None:  # computed anyway for the features: target layer 0 is exact
            keys = apply_rope(layer0[0], cos, sin, self.target_kv.rope_layout).to(self.dtype)
            cache.layers[0].keys, cache.layers[0].values = keys, layer0[1].to(self.dtype)
        return cache

    def _fused(self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> DynamicCache:
        """The same map through `kernels.apply_map.map_cache` (Triton on CUDA where supported, else its torch
        reference; `backend="triton"` refuses to fall back): one launch per component, finiteness flags."""
        from kernels.apply_map import map_cache  # the kernel module builds on this one

        positions = positions.to(self.device)
        source_cos, source_sin = rope_cos_sin(self.source.model.rotary_emb, positions)
        target_cos, target_sin = rope_cos_sin(self.target.model.rotary_emb, positions)
        flags = torch.zeros(self.target_kv.num_layers, dtype=torch.int32, device=self.device)  # [L_t]
        keys, values = map_cache(
            [k.to(self.device) for k, _ in layers],
            [v.to(self.device) for _, v in layers],
            self.mapper,
            source_cos,
            source_sin,
            target_cos,
            target_sin,
            self.source_kv.rope_layout,
            self.target_kv.rope_layout,
            self.dtype,
            nonfinite=flags,
            backend=self.backend,
        )  # [L_t, B, H_t, T, d_t] each
        if bool(flags.any()):  # one device sync per handoff
            raise TransferError(f"mapped target layer {int(flags.nonzero()[0])} is not finite (corrupt coefficients?)")
        cache = DynamicCache(config=self.target.config)
        for layer in range(keys.shape[0]):
            cache.update(keys[layer], values[layer], layer)
        return cache


@torch.no_grad()
def prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> DynamicCache:
    """The ordinary path: the model's own cache for input_ids [B, T] (logits of the last token only)."""
    device = next(model.parameters()).device
    return model(input_ids.to(device), use_cache=True, logits_to_keep=1).past_key_values


def handoff(transfer: KVTransfer, source_cache, input_ids: torch.Tensor) -> Handoff:
    """Mapped cache when the transfer is safe, else — deterministically — the target's own prefill."""
    try:
        return Handoff(cache=transfer(source_cache, input_ids=input_ids), mode="transfer", reason=None)
    except TransferError as refusal:
        return Handoff(cache=prefill(transfer.target, input_ids), mode="prefill", reason=str(refusal))


@dataclass(frozen=True)
class Levers:
    """Target work kept native around a mapped prefix: the first `native_sink` tokens (exact — their K/V
    depend on those tokens alone, the attention sink), the last `hold_back` tokens (re-prefilled on top of
    the spliced prefix), and the first `native_layers` target layers over the whole prefix (a target
    prefill stopped after that layer)."""

    native_sink: int = 0
    hold_back: int = 0
    native_layers: int = 0

    def __post_init__(self) -> None:
        if min(self.native_sink, self.hold_back, self.native_layers) < 0:
            raise ValueError(f"levers must be ≥ 0, got {self}")

    def clipped(self, prefix_len: int) -> Levers:
        """The levers a prefix of `prefix_len` tokens can take: the sink first, then the hold-back."""
        sink = min(self.native_sink, prefix_len)
        return Levers(sink, min(self.hold_back, prefix_len - sink), self.native_layers)

    def prefill_fraction(self, prefix_len: int, num_layers: int) -> float:
        """Share of the target's prefill compute (layer × token work) still spent on a prefix of
        `prefix_len` tokens: sink and hold-back tokens in full, the mapped span in its native layers."""
        c = self.clipped(prefix_len)
        mapped = prefix_len - c.native_sink - c.hold_back
        layers = min(c.native_layers, num_layers) / num_layers
        return (c.native_sink + c.hold_back + mapped * layers) / prefix_len if prefix_len else 1.0

    def __bool__(self) -> bool:
        return bool(self.native_sink or self.hold_back or self.native_layers)


NO_LEVERS = Levers()  # pure transfer: every prefix token mapped


class _StopForward(Exception):
    pass


def _raise_stop(*_) -> None:
    raise _StopForward


@torch.no_grad()
def prefill_layers(model: PreTrainedModel, input_ids: torch.Tensor, layers: int) -> DynamicCache:
    """The model's own cache of input_ids [B, T] in its first `layers` decoder layers only: the forward
    stops after layer `layers` − 1 (later cache layers stay empty)."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    handle = model.model.layers[layers - 1].register_forward_hook(_raise_stop)
    try:
        model(input_ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return cache


@torch.no_grad()
def spliced_cache(transfer: KVTransfer, source_cache, input_ids: torch.Tensor, levers: Levers) -> DynamicCache:
    """Target cache for input_ids [B, T] that spends only the levers' target prefill (`Levers`).

    Tokens 0..s−1 are prefilled natively on the target; tokens s..T−w−1 are mapped from the source cache at
    their own positions, except in the first `native_layers` layers, which a stopped target prefill of
    0..T−w−1 fills; the last w tokens are re-prefilled natively on top of the spliced prefix."""
    total, sink, hold = input_ids.shape[1], levers.native_sink, levers.hold_back
    if sink + hold > total:
        raise ValueError(f"native_sink={sink} + hold_back={hold} must fit in {total} tokens")
    end = total - hold
    target = transfer.target
    native_layers = min(levers.native_layers, len(target.model.layers))
    if end == 0:
        return prefill(target, input_ids)
    cache = prefill(target, input_ids[:, :sink]) if sink else None
    if end > sink:
        middle = [(k[:, :, sink:end], v[:, :, sink:end]) for k, v in cache_layers(source_cache)]
        mapped = transfer(middle, positions=torch.arange(sink, end), input_ids=input_ids[:, sink:end])
        if cache is None:
            cache = mapped
        else:
            for layer, (own, new) in enumerate(zip(cache.layers, mapped.layers, strict=True)):
                cache.layers[layer].keys = torch.cat([own.keys, new.keys], dim=2)
                cache.layers[layer].values = torch.cat([own.values, new.values], dim=2)
        if native_layers:
            early = prefill_layers(target, input_ids[:, :end], native_layers)
            for layer in range(native_layers):
                cache.layers[layer].keys, cache.layers[layer].values = (
                    early.layers[layer].keys,
                    early.layers[layer].values,
                )
    if hold:
        target(input_ids[:, end:].to(transfer.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache
