"""Apply a mapper: the source's cache → a decode-ready target `DynamicCache`.

`KVTransfer` is built once per (mapper, source model, target model) — it verifies the artifact
against both models and checks everything the mapper carries (src/pair_check.py `check_pair`) and puts the
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
from kernels.apply_map_gemm import packed_weights
from src.artifact import Mapper
from src.forward import ids_problem, prefill_layers
from src.maps import (
    MapFlags,
    TransferError,
    cache_layers,
    dropped_tokens,
    layer_flags,
    layer_groups,
    map_layers,
    map_refusal,
    shares_heads,
    stacked_flags,
    store_slots,
)
from src.models import KVInterface
from src.pair_check import ModelView, bound_mapper, check_pair
from src.rope import apply_rope, remove_rope, rope_cos_sin

BACKENDS = ("torch", "auto", "triton", "gemm")  # torch grouped GEMMs, or kernels/apply_map.py (gemm: one GEMM per head)
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
        self.source, self.target = source, target
        source_view, target_view = ModelView.of(source), ModelView.of(target)
        check_pair(mapper, source_view, target_view, tokenizer_hash)
        self.source_kv: KVInterface = source_view.kv
        self.target_kv: KVInterface = target_view.kv
        self.token_features = mapper.token_features
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.vocab_size = target.get_input_embeddings().num_embeddings
        if backend in ("triton", "gemm") and self.token_features:
            raise ValueError(f"the {backend} apply does not read token features; use apply_backend torch or auto")
        self.backend = backend
        self.mapper = bound_mapper(mapper, self.device, compute_dtype)
        gemm = backend == "gemm"  # its coefficients packed once (kernels/apply_map_gemm.py), not per map
        self.packed = packed_weights(self.mapper, self.source_kv.num_layers) if gemm else None
        self.shared_heads = shares_heads(mapper)

    def check_cache(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
        """(batch, seq) of a source cache whose every layer is a dense [B, H_s, T, d_s] tensor pair of the source
        model's dtype and device; else TransferError. Host metadata only: the values are the flags' (`MapFlags`)."""
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
        token-feature mapper, checked against the cache otherwise). Raises TransferError and nothing else, at once:
        the synchronous path (its flags read once, before it returns)."""
        cache, flags = self._run(source_cache, positions, input_ids)
        if refusal := map_refusal([flags]):
            raise TransferError(refusal)
        return cache

    @torch.no_grad()
    def into(
        self,
        out: tuple[torch.Tensor, torch.Tensor],
        source_cache,
        positions: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        bound: float | None = None,
    ) -> MapFlags:
        """As the call for one conversation (B = 1), without waiting for the device: the mapped K/V written into
        `out` — two [L_t, N_blocks, H_t, block_size, d_t] destinations (`Engine.blocks`) — at `slots` [T] (slot s:
        block s // block_size, row s % block_size; default: slot = position, a static cache's), and the `MapFlags`
        (non-finite values; a finite |value| above `bound`, the magnitude guard) returned, to decide afterwards
        (`map_refusal`) before anything read from the slots is used. Raises TransferError for what the host sees
        (types, shapes, positions, ids): a refusal leaves at most slots written that the receiver does not hold yet."""
        return self._run(source_cache, positions, input_ids, out, slots, bound)[1]

    @torch.no_grad()
    def map_into(
        self,
        source_keys: torch.Tensor,
        source_values: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bound: float | None = None,
    ) -> MapFlags:
        """The map of one span with no host sync (the connector's and the engine's fast path): source K/V
        [L_s, H_s, T, d_s] each (RoPE'd, as cached; the source model's dtype, on the target's device), positions [T]
        and slots [T] (long, on the target's device; distinct; slot s = block · block_size + row) → the
        mapped target K/V stored into keys / values [L_t, N_blocks, H_t, block_size, d_t] (the target's dtype,
        channels contiguous) at those slots; returns the `MapFlags` — a source or mapped layer with NaN / Inf, a
        mapped |value| above `bound` (the magnitude guard; None: none) — still on the device. Shapes, dtypes and
        devices are checked (TransferError); the values of positions and slots are the caller's (reading them would
        sync). A token-feature mapper needs the prefix ids: `into`."""
        try:
            if self.token_features:
                raise TransferError("a token-feature mapper reads the prefix ids (target layer 0): use into()")
            self._check_span(source_keys, source_values, positions, slots, keys, values)
            stacked = (source_keys[:, None], source_values[:, None])  # [L_s, 1, H_s, T, d_s]: no copy into a stack
            layers = list(zip(*stacked, strict=True))  # [1, H_s, T, d_s] views
            return self._mapped(layers, positions, None, (keys, values), slots, bound, stacked)[1]
        except TransferError:
            raise
        except Exception as error:  # no check foresaw it: still a refusal, so a handoff rolls back
            raise TransferError(f"{UNEXPECTED}: {type(error).__name__}: {error}") from error

    def _check_span(self, source_keys, source_values, positions, slots, keys, values) -> None:
        """TransferError unless `map_into`'s arguments have its shapes, dtypes and devices (metadata: no sync)."""
        kv, target = self.source_kv, self.target_kv
        source_dtype = next(self.source.parameters()).dtype
        count = source_keys.shape[2] if isinstance(source_keys, torch.Tensor) and source_keys.dim() == 4 else -1
        source = (kv.num_layers, kv.num_kv_heads, count, kv.head_dim)
        for name, t, shape, dtype in (
            ("source keys", source_keys, source, source_dtype),
            ("source values", source_values, source, source_dtype),
            ("positions", positions, (count,), torch.long),
            ("slots", slots, (count,), torch.long),
        ):
            if (
                not isinstance(t, torch.Tensor)
                or tuple(t.shape) != shape
                or t.dtype != dtype
                or t.device != self.device
            ):
                raise TransferError(f"map_into {name}: expected a {dtype} tensor {shape} on {self.device}, got "
                                    f"{_described(t)}")  # fmt: skip
        for name, t in (("keys", keys), ("values", values)):
            layout = (target.num_layers, target.num_kv_heads, target.head_dim)
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or (t.shape[0], t.shape[2], t.shape[4]) != layout:
                raise TransferError(f"map_into {name}: expected [{layout[0]}, blocks, {layout[1]}, block_size, "
                                    f"{layout[2]}], got {_described(t)}")  # fmt: skip
            if t.dtype != self.dtype or t.device != self.device or t.stride(-1) != 1:
                raise TransferError(f"map_into {name}: {_described(t)}, expected {self.dtype} on {self.device}, "
                                    "channels contiguous")  # fmt: skip

    def _run(
        self, source_cache, positions, input_ids, out=None, slots=None, bound=None
    ) -> tuple[DynamicCache | None, MapFlags]:
        try:
            layers = cache_layers(source_cache)
            batch, seq = self.check_cache(layers)
            positions = self._positions(positions, seq, dropped_tokens(source_cache))
            self._check_ids(input_ids, batch, seq)
            if out is not None and batch != 1:
                raise TransferError(f"a map into slots reads one conversation: the source cache holds {batch}")
            positions = positions.to(self.device, non_blocking=True)  # host-side positions: no stream sync
            slots = positions if out is not None and slots is None else slots
            return self._mapped(layers, positions, input_ids, out, slots, bound)
        except TransferError:
            raise
        except Exception as error:  # no check foresaw it: still a refusal, so a handoff rolls back
            raise TransferError(f"{UNEXPECTED}: {type(error).__name__}: {error}") from error

    def _mapped(
        self, layers, positions, input_ids, out, slots, bound, stacked=None
    ) -> tuple[DynamicCache | None, MapFlags]:
        """The map by the backend (`_fused`, or `_map` then stored at the slots), and its device flags. stacked: the
        layers as (K, V) [L_s, B, H_s, T, d_s] on the target's device where the caller holds them so (`map_into`)."""
        source, _ = stacked_flags(*stacked) if stacked else layer_flags(layers)  # [L_s, 2]
        if self.backend != "torch" and not self.token_features:
            cache, target, beyond = self._fused(layers, positions, out, slots, bound, stacked)
        else:
            batch, seq = layers[0][0].shape[0], layers[0][0].shape[2]
            cache, target, peak = self._map(layers, positions, input_ids, batch, seq)
            beyond = peak > (float("inf") if bound is None else bound)  # [L_t]
            if out is not None:
                mapped = cache_layers(cache)
                for component, destination in enumerate(out):
                    store_slots(destination, torch.stack([pair[component][0] for pair in mapped]), slots)
                cache = None
        return cache, MapFlags(source, target, beyond, bound)

    def _map(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, input_ids, batch: int, seq: int
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The torch map: the target's DynamicCache, its non-finite flags [L_t] and the largest finite |K|, |V| of each
        layer [L_t] (on the device)."""
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
        for group in layer_groups(self.mapper, batch * seq, self.shared_heads):
            target_k, target_v = map_layers(self.mapper, group, source_k, source_v, self.shared_heads, token_rows)
            keys = apply_rope(to_cache(target_k), cos, sin, self.target_kv.rope_layout).to(self.dtype)
            values = to_cache(target_v).to(self.dtype)
            for offset, layer in enumerate(range(group.start, group.stop)):
                cache.update(keys[offset], values[offset], layer)
        if layer0 is not None:  # computed anyway for the features: target layer 0 is exact
            keys = apply_rope(layer0[0], cos, sin, self.target_kv.rope_layout).to(self.dtype)
            cache.layers[0].keys, cache.layers[0].values = keys, layer0[1].to(self.dtype)
        nonfinite, peak = layer_flags(cache_layers(cache))  # [L_t, 2], [L_t]
        return cache, nonfinite.any(1), peak

    def _fused(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, out, slots, bound, stacked=None
    ) -> tuple[DynamicCache | None, torch.Tensor, torch.Tensor]:
        """The same map through `kernels.apply_map.map_cache` (Triton on CUDA where supported, else its torch
        reference; `backend="triton"` refuses to fall back): one launch per component, its flags in the epilogue —
        a new DynamicCache, or None with `out` written at `slots`; the non-finite flags [L_t] and the flags [L_t] of
        a |value| above `bound`. stacked: (K, V) [L_s, B, H_s, T, d_s] on the device, read in place (a list of
        layers costs map_cache one stacking copy of each)."""
        source_cos, source_sin = rope_cos_sin(self.source.model.rotary_emb, positions)
        target_cos, target_sin = rope_cos_sin(self.target.model.rotary_emb, positions)
        layers_t = self.target_kv.num_layers
        nonfinite = torch.zeros(layers_t, dtype=torch.int32, device=self.device)  # [L_t]
        beyond = torch.zeros(layers_t, dtype=torch.int32, device=self.device)  # [L_t]
        try:
            source_keys, source_values = stacked or ([k.to(self.device) for k, _ in layers],
                                                     [v.to(self.device) for _, v in layers])  # fmt: skip
            keys, values = map_cache(
                source_keys,
                source_values,
                self.mapper,
                source_cos,
                source_sin,
                target_cos,
                target_sin,
                self.source_kv.rope_layout,
                self.target_kv.rope_layout,
                self.dtype,
                nonfinite=nonfinite,
                beyond=beyond,
                bound=bound,
                backend=self.backend,
                out=out,
                slots=slots,
                packed=self.packed,
            )  # [L_t, B, H_t, T, d_t] each, or `out`
        except ValueError as refusal:  # map_cache refuses inputs its backend cannot run (e.g. Triton on CPU)
            raise TransferError(str(refusal)) from refusal
        if out is not None:
            return None, nonfinite.bool(), beyond.bool()
        cache = DynamicCache(config=self.target.config)
        for layer in range(keys.shape[0]):
            cache.update(keys[layer], values[layer], layer)
        return cache, nonfinite.bool(), beyond.bool()


def _described(t: object) -> str:
    """A tensor's shape, dtype and device (or the type of what is not one), for a refusal."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"
