"""Apply a mapper: the source's cache → a decode-ready target `DynamicCache`.

`KVTransfer` is built once per (mapper, source model, target model) — it verifies the artifact
against both models, checks everything the mapper carries (src/maps.py `check_mapper`) and puts the
coefficients on the target's device — and is then called per handoff. Per target layer: gather the
selected source blocks, one head-batched matmul, re-apply the target's RoPE at the same positions. A
mapper with token features (src/support.py) also needs the prefix's token ids: a layer-0 target prefill
gives its features and, exactly, target layer 0. Every input a call cannot map (cache type, layout,
sparsity, shapes, dtype, device, positions, token ids, non-finite values) is refused with a `TransferError`
naming it — and any other failure inside a call is turned into one too — so `handoff` (src/runtime/splice.py)
always rolls back to plain prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kernels.apply_map import map_cache
from src.artifact import Mapper
from src.forward import ids_problem, prefill_layers
from src.maps import (
    TransferError,
    cache_layers,
    check_mapper,
    dropped_tokens,
    layer_groups,
    map_layers,
    shares_heads,
)
from src.models import IncompatiblePairError, KVInterface, check_model, describe_kv, fingerprint
from src.rope import apply_rope, remove_rope, rope_cos_sin

BACKENDS = ("torch", "auto", "triton")  # apply paths: torch grouped GEMMs, or kernels/apply_map.py
UNEXPECTED = "unexpected failure while mapping (a bug: please report it)"  # prefix of a refusal no check foresaw


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
        if backend not in BACKENDS:
            raise ValueError(f"apply backend must be one of {BACKENDS}, not {backend!r}")
        if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype must be a floating-point torch.dtype, not {compute_dtype!r}")
        if not isinstance(mapper, Mapper) or not isinstance(mapper.manifest, dict):
            raise TransferError(f"mapper is a {type(mapper).__name__} without a manifest dict, not a Mapper")
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
        for role, model, kv in (("source", source, self.source_kv), ("target", target, self.target_kv)):
            try:  # what load_pair checks, minus the sliding-window opt-in (decided there), and the rotary module
                check_model(kv, role, allow_sliding_window=True)
                rope_cos_sin(model.model.rotary_emb, torch.arange(1))
            except (IncompatiblePairError, ValueError) as error:
                raise TransferError(f"{role} model cannot be mapped: {error}") from error
        check_mapper(mapper, self.source_kv, self.target_kv)
        self.token_features = mapper.token_features
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.vocab_size = target.get_input_embeddings().num_embeddings
        if backend == "triton" and self.token_features:
            raise ValueError("the Triton apply does not read token features; use apply_backend torch or auto")
        self.backend = backend
        bound = mapper.to(self.device, compute_dtype)
        bound.source_layers, bound.head_index = bound.source_layers.long(), bound.head_index.long()
        self.mapper = bound
        self.shared_heads = shares_heads(mapper)

    def _check(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
        """(batch, seq) of a source cache whose every layer is a dense [B, H_s, T, d_s] tensor pair of the source
        model's dtype and device, all finite; else TransferError."""
        kv = self.source_kv
        if len(layers) != kv.num_layers:
            raise TransferError(f"source cache has {len(layers)} layers, the source model {kv.num_layers}")
        source_device = next(self.source.parameters()).device
        source_dtype = next(self.source.parameters()).dtype
        shape = None
        for index, (key, value) in enumerate(layers):
            for name, t in (("keys", key), ("values", value)):
                if not isinstance(t, torch.Tensor):
                    raise TransferError(f"source cache layer {index} {name} is a {type(t).__name__}, not a tensor")
                if t.is_nested or t.layout != torch.strided:
                    layout = "nested" if t.is_nested else str(t.layout)
                    raise TransferError(f"source cache layer {index} {name} is {layout}: only dense tensors map")
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
        if shape[0] == 0 or shape[2] == 0:
            raise TransferError(f"source cache is empty: shape {tuple(shape)}")
        peaks = torch._foreach_norm([t for pair in layers for t in pair], float("inf"))  # max |x|: NaN / inf stay so
        finite = torch.isfinite(torch.stack(peaks).view(-1, 2)).all(1)  # [L_s]: one multi-tensor launch, few more
        if not bool(finite.all()):  # one device sync; the slow path names the layer
            index = int((~finite).nonzero()[0])
            name = "keys" if not bool(torch.isfinite(layers[index][0]).all()) else "values"
            raise TransferError(f"source cache layer {index} {name} contains NaN or Inf")
        return shape[0], shape[2]

    @staticmethod
    def _positions(positions, seq: int, dropped: int) -> torch.Tensor:
        """The cached tokens' positions [T]: given (integers ≥ 0, one per token) or 0..T−1 — which a sliding-window
        cache that has dropped tokens cannot assume."""
        if positions is None:
            if dropped:
                raise TransferError(
                    f"source cache is a sliding window holding the last {seq} of {seq + dropped} tokens: pass their "
                    f"positions ({dropped}..{dropped + seq - 1}); the mapped cache then holds only those tokens"
                )
            return torch.arange(seq)
        if not isinstance(positions, torch.Tensor):
            raise TransferError(f"positions is a {type(positions).__name__}, expected an integer tensor [{seq}]")
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise TransferError(f"positions are {positions.dtype}, expected integers")
        if positions.is_nested or positions.layout != torch.strided or positions.device.type == "meta":
            raise TransferError("positions must be a dense tensor with data")
        if positions.dim() != 1:
            raise TransferError(f"positions have shape {tuple(positions.shape)}, expected [{seq}]")
        if positions.shape[-1] != seq:
            raise TransferError(f"{positions.shape[-1]} positions given for a {seq}-token cache")
        if int(positions.min()) < 0:
            raise TransferError(f"positions must be ≥ 0, the smallest is {int(positions.min())}")
        return positions

    def _check_ids(self, input_ids, batch: int, seq: int) -> None:
        """input_ids: None (unless the mapper reads token features) or integer ids [B, T] inside the vocabulary."""
        if input_ids is None:
            if self.token_features:
                raise TransferError("this mapper reads the target's token features: pass the prefix's input_ids")
            return
        if problem := ids_problem(input_ids, self.vocab_size):
            raise TransferError(problem)
        if tuple(input_ids.shape) != (batch, seq):
            raise TransferError(f"input_ids shape {tuple(input_ids.shape)} ≠ the source cache's ({batch}, {seq})")

    def _layer0(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer 0's content K and V [B, H_t, T, d_t] for the prefix ids [B, T] (a stopped prefill)."""
        layer = prefill_layers(self.target, input_ids, 1).layers[0]
        positions = torch.arange(input_ids.shape[1], device=self.device)
        cos, sin = rope_cos_sin(self.target.model.rotary_emb, positions)
        return remove_rope(layer.keys, cos, sin, self.target_kv.rope_layout), layer.values

    @torch.no_grad()
    def __call__(
        self, source_cache, positions: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
    ) -> DynamicCache:
        """source_cache: DynamicCache or [(keys, values)] with [B, H_s, T, d_s]; positions [T] (default 0..T−1;
        required for a sliding-window cache that has dropped tokens); input_ids [B, T] of those tokens (needed by a
        token-feature mapper, checked against the cache otherwise). Raises TransferError and nothing else."""
        return self._run(source_cache, positions, input_ids, None)

    @torch.no_grad()
    def into(
        self,
        out: tuple[torch.Tensor, torch.Tensor],
        source_cache,
        positions: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> None:
        """As the call, the mapped K/V written into `out`: two [L_t, B, H_t, T, d_t] views (the slots of a static
        cache, `Engine.slots`) — the fused kernel stores straight into them, the torch path copies. Raises
        TransferError and nothing else; a refusal may leave the slots written (they are past what the receiver
        holds, so its state is unchanged)."""
        self._run(source_cache, positions, input_ids, out)

    def _run(self, source_cache, positions, input_ids, out) -> DynamicCache | None:
        try:
            layers = cache_layers(source_cache)
            batch, seq = self._check(layers)
            positions = self._positions(positions, seq, dropped_tokens(source_cache))
            self._check_ids(input_ids, batch, seq)
            if self.backend != "torch" and not self.token_features:
                return self._fused(layers, positions, out)
            cache = self._map(layers, positions, input_ids, batch, seq)
            if out is None:
                return cache
            for component, target in enumerate(out):
                target.copy_(torch.stack([pair[component] for pair in cache_layers(cache)]))
            return None
        except TransferError:
            raise
        except Exception as error:  # no check foresaw it: still a refusal, so a handoff rolls back
            raise TransferError(f"{UNEXPECTED}: {type(error).__name__}: {error}") from error

    def _map(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, input_ids, batch: int, seq: int
    ) -> DynamicCache:
        token_rows = layer0 = None
        if self.token_features:
            layer0 = self._layer0(input_ids)  # content K, V [B, H_t, T, d_t]
            token_rows = torch.cat(layer0, 1).transpose(1, 2).flatten(2).flatten(0, 1)  # [B·T, 2·H_t·d_t]
        cos, sin = rope_cos_sin(self.source.model.rotary_emb, positions.to(layers[0][0].device))
        to_rows = lambda t: t.to(self.device).transpose(1, 2).flatten(2, 3)  # [L_s, H_s, B·T, d_s]
        source_k = to_rows(torch.stack([remove_rope(k, cos, sin, self.source_kv.rope_layout) for k, _ in layers]))
        source_v = to_rows(torch.stack([v for _, v in layers]))  # [L_s, H_s, B·T, d_s]
        cos, sin = rope_cos_sin(self.target.model.rotary_emb, positions.to(self.device))
        to_cache = lambda t: t.unflatten(2, (batch, seq)).transpose(1, 2)  # [g, B, H_t, T, d_t]
        cache = DynamicCache(config=self.target.config)
        finite = []
        for group in layer_groups(self.mapper, batch * seq, self.shared_heads):
            target_k, target_v = map_layers(self.mapper, group, source_k, source_v, self.shared_heads, token_rows)
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

    def _fused(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, out=None
    ) -> DynamicCache | None:
        """The same map through `kernels.apply_map.map_cache` (Triton on CUDA where supported, else its torch
        reference; `backend="triton"` refuses to fall back): one launch per component, finiteness flags."""
        positions = positions.to(self.device)
        source_cos, source_sin = rope_cos_sin(self.source.model.rotary_emb, positions)
        target_cos, target_sin = rope_cos_sin(self.target.model.rotary_emb, positions)
        flags = torch.zeros(self.target_kv.num_layers, dtype=torch.int32, device=self.device)  # [L_t]
        try:
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
                out=out,
            )  # [L_t, B, H_t, T, d_t] each
        except ValueError as refusal:  # map_cache refuses inputs its backend cannot run (e.g. Triton on CPU)
            raise TransferError(str(refusal)) from refusal
        if bool(flags.any()):  # one device sync per handoff
            raise TransferError(f"mapped target layer {int(flags.nonzero()[0])} is not finite (corrupt coefficients?)")
        if out is not None:
            return None
        cache = DynamicCache(config=self.target.config)
        for layer in range(keys.shape[0]):
            cache.update(keys[layer], values[layer], layer)
        return cache
