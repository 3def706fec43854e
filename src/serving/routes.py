"""The routes an engine serves, loaded and verified when it starts — before any request — and what a route does on
the worker: map an export's span for the worker's own heads.

Scheduler side (`scheduled_routes`): each mapper artifact is read and verified (src/artifact.py: bytes against the
version id and the manifest), its tokenizer hash must be the receiver's, and its id (`routing.mapper_id`), length
evidence and calibration length go into a `Route` — whose transfer stays on the worker. Worker side
(`bound_routes`): who the receiver and each source model are (`viewed`: the fingerprint in the dtype the mapper's pair
was fingerprinted in, streamed from the safetensors files one tensor at a time, src/model_identity.py; the KV interface
and rotary module from the config — no weights loaded; the model is loaded on the host only where the files cannot be
matched to it with certainty), and `routing.view_refusal` checks the artifact against both (fingerprints, tokenizer
hash, shapes, a sliding-window receiver) with the checks a Session's `bind` runs (src/pair_check.py); a refusal stops
the engine with its reason. Only the mapper (on the worker's device), the two rotary modules and the KV interfaces are
kept.

Tensor parallelism: the worker of rank r of R holds target KV heads [r·H_t/R, (r+1)·H_t/R) (vLLM splits KV heads
contiguously); it reads every source head the export holds and maps its own heads only — Head-Local reads one
source head per target head, so with a sender of the same TP degree a rank could read one sender rank's file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from kernels.apply_map import map_cache
from kernels.apply_map_gemm import PackedMapper, gemm_worthwhile, packed_weights
from src.artifact import Mapper, length_evidence, load_mapper
from src.maps import LayerViews
from src.model_identity import NotStreamable, skeleton, streamed_identity
from src.models import (
    KVInterface,
    describe_kv,
    fingerprint,
    load_model,
    load_tokenizer,
    tokenizer_hash,
    vocabulary_hash,
)
from src.pair_check import ModelView, bound_mapper
from src.rope import RopeTable
from src.runtime.routing import Route, mapper_id, view_refusal
from src.serving.config import RouteSpec, fitted_dtypes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    """Who a model directory is: the project's fingerprint (in a dtype) and its tokenizer's hash."""

    fingerprint: str
    tokenizer_hash: str


def model_tokenizer_hash(path: Path, model: PreTrainedModel | None = None) -> str:
    """The tokenizer hash of a model directory (a random-weight model without one: its vocabulary-size stand-in)."""
    if any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return tokenizer_hash(load_tokenizer(path))
    if model is None:
        raise ValueError(f"{path} has no tokenizer: its identity needs the model (vocabulary_hash)")
    return vocabulary_hash(model)


def viewed(path: Path, dtype: torch.dtype) -> tuple[ModelView, Identity]:
    """What a route is checked against on the worker, for the model directory at `path` in `dtype`: its fingerprint
    streamed from the safetensors files (src/model_identity.py), its KV interface from the config's skeleton on the
    meta device and its rotary module built on the CPU — no weights loaded. Where the files cannot be matched to the
    model with certainty, the model is loaded on the host instead (one log line says why) and dropped after."""
    model = skeleton(path, dtype)
    try:
        identity = streamed_identity(path, dtype, model)
    except NotStreamable as reason:
        logger.warning("kvrelay: %s: identity not streamed (%s): loading the model on the host", path, reason)
        model = load_model(path, dtype=dtype)
        identity = fingerprint(model)
    view = ModelView(identity, describe_kv(model), model.model.rotary_emb)
    return view, Identity(identity, model_tokenizer_hash(path, model))


@dataclass(frozen=True)
class ScheduledRoute:
    route: Route  # mapper id, calibration length, length evidence (the transfer is bound on the worker)
    source_fingerprint: str  # the model the mapper maps from
    fingerprint_dtype: str  # the dtype that fingerprint is in: its fit's pair.dtype (config.fitted_dtypes)


def scheduled_routes(specs: tuple[RouteSpec, ...], receiver_tokenizer: str) -> dict[str, ScheduledRoute]:
    """Mapper id → the scheduler's view of each route; a ValueError names an artifact that cannot serve here."""
    routes = {}
    for spec in specs:
        mapper = load_mapper(spec.mapper)
        manifest = mapper.manifest
        if manifest.get("tokenizer_hash") != receiver_tokenizer:
            raise ValueError(f"kvrelay: mapper {spec.mapper} was fitted for tokenizer "
                             f"{str(manifest.get('tokenizer_hash'))[:12]}, this engine's is {receiver_tokenizer[:12]}")  # fmt: skip
        identity = mapper_id(mapper)
        if identity in routes:
            raise ValueError(f"kvrelay: two routes carry the same mapper {identity}")
        verified, shown = length_evidence(manifest) or (None, None)
        calibrated = manifest.get("calibration", {}).get("seq_len")
        route = Route(None, identity, None, calibrated, verified, shown)
        dtype = fitted_dtypes(manifest)["fingerprint_dtype"]
        routes[identity] = ScheduledRoute(route, manifest["source_fingerprint"], dtype)
    return routes


@dataclass(frozen=True)
class Bound:
    """A verified route on a worker: the mapper on its device and what positions need."""

    mapper: Mapper  # KVTransfer.mapper: compute dtype, on the worker's device
    source_kv: KVInterface
    target_kv: KVInterface
    source_rope: RopeTable  # the sender's rotary module, its cos / sin tabled once (src/rope.py)
    target_rope: RopeTable
    backend: str
    packed: dict[tuple[int, int], PackedMapper] = field(default_factory=dict, compare=False)  # "gemm": per heads

    def map(
        self, keys: torch.Tensor, values: torch.Tensor, start: int, heads: slice, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Source keys / values [L_s, H_s, n, d_s] of positions start..start+n−1 → the target's keys and values
        [L_t, n, H, d_t] of target heads `heads` (this worker's), and int32 flags [L_t]: 1 where a mapped value is
        not finite. No host sync (kernels/apply_map.py `map_cache`)."""
        (mapped_k, mapped_v), flags, _ = self._map(keys, values, start, heads, out_dtype)  # [L_t, 1, H, n, d_t] each
        return mapped_k[:, 0].transpose(1, 2), mapped_v[:, 0].transpose(1, 2), flags  # [L_t, n, H, d_t]

    def map_into(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        heads: slice,
        destinations: tuple[LayerViews, LayerViews],
        slots: torch.Tensor,
        guard: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `map`, the mapped keys / values stored straight into destinations (K, V): L_t layers
        [N_blocks, H, block_size, d_t] each, alike, at any addresses (channels contiguous, any other strides: each
        layer's paged blocks, `paged.Writer`) at slots [n] (long, on the mapper's device) — no scratch. Returns int32
        flags [L_t] each: non-finite, and beyond (a finite |value| above `guard`; None: no guard). No host sync."""
        dtype = destinations[0].base.dtype
        _, nonfinite, beyond = self._map(keys, values, start, heads, dtype, destinations, slots, guard)
        return nonfinite, beyond

    def _map(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        heads: slice,
        out_dtype: torch.dtype,
        out: tuple[LayerViews, LayerViews] | None = None,
        slots: torch.Tensor | None = None,
        guard: float | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """`map_cache` of this worker's heads: (keys, values) [L_t, 1, H, n, d_t] (or into `out`'s L_t layers
        [N_blocks, H, block_size, d_t] at `slots` [n]), the non-finite flags [L_t] and the beyond flags [L_t] (all 0
        without a guard)."""
        m = self.mapper
        own = Mapper(m.source_layers, m.head_index[heads], m.weight_k[:, heads], m.bias_k[:, heads],
                     m.weight_v[:, heads], m.bias_v[:, heads], m.manifest)  # fmt: skip
        device = m.weight_k.device
        count = keys.shape[2]  # positions start..start+count−1: [1, 1, count, rope_dim] each, views of a table
        source_cos, source_sin = self.source_rope.at(start, count, device)
        target_cos, target_sin = self.target_rope.at(start, count, device)
        nonfinite, beyond = (torch.zeros(m.weight_k.shape[0], dtype=torch.int32, device=device) for _ in range(2))
        span = (heads.start, heads.stop)
        if self.backend == "gemm" and span not in self.packed:  # the worker's heads packed once, not per handoff
            self.packed[span] = packed_weights(own, keys.shape[0])  # kernels/apply_map_gemm.py
        mapped = map_cache(
            keys[:, None].to(device), values[:, None].to(device), own,  # [L_s, 1, H_s, n, d_s]
            source_cos, source_sin, target_cos, target_sin,
            self.source_kv.rope_layout, self.target_kv.rope_layout, out_dtype,
            nonfinite=nonfinite, backend=self.backend, out=out, slots=slots,
            beyond=None if guard is None else beyond, bound=guard, packed=self.packed.get(span),
        )  # fmt: skip
        return mapped, nonfinite, beyond


def load_refusal(
    nonfinite: torch.Tensor, beyond: torch.Tensor | None, peak: torch.Tensor | None, guard: float | None
) -> str | None:
    """Why a worker's mapped span must be recomputed — a mapped target layer not finite (flags [L_t]), or past the
    magnitude guard `guard`: `beyond` flags [L_t] (`Bound.map_into`) or the `peak` max(|K|, |V|) of a mapped
    scratch — or None. Host tensors: `LoadFlags` brings a device map's flags over."""
    if bool(nonfinite.any()):
        return f"mapped target layer {int(nonfinite.nonzero()[0])} is not finite"
    if beyond is not None and bool(beyond.any()):
        return f"guard: mapped |K|, |V| of target layer {int(beyond.nonzero()[0])} exceed {guard:g}"
    if peak is not None and float(peak) > guard:
        return f"guard: mapped |K|, |V| reach {float(peak):.3g} > {guard:g}"
    return None


@dataclass(frozen=True)
class LoadFlags:
    """A load's flags on their way to the host: the non-finite and beyond flags [L_t] (int32) and a scratch's peak,
    copied into pinned memory right behind the map on its stream, an event recorded after the copies — so `refusal`
    waits for the map alone, not for what the stream queued since (vLLM's forward, whose wait held the worker's host
    before its sampling could be queued)."""

    nonfinite: torch.Tensor
    beyond: torch.Tensor | None
    peak: torch.Tensor | None
    ready: torch.cuda.Event | None  # None: the flags were computed on the host

    @classmethod
    def after_map(cls, nonfinite: torch.Tensor, beyond: torch.Tensor | None, peak: torch.Tensor | None) -> LoadFlags:
        """The flags of a map just queued (no host wait)."""
        if not nonfinite.is_cuda:
            return cls(nonfinite, beyond, peak, None)
        host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (nonfinite, beyond, peak)]  # fmt: skip
        ready = torch.cuda.Event()
        ready.record()
        return cls(*host, ready)

    def refusal(self, guard: float | None) -> str | None:
        """`load_refusal` of these flags, once the map and its reads of the export have ended on the device."""
        if self.ready is not None:
            self.ready.synchronize()
        return load_refusal(self.nonfinite, self.beyond, self.peak, guard)


def bound_routes(
    specs: tuple[RouteSpec, ...],
    target: Path,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None,
    backend: str,
    device: torch.device | str,
) -> tuple[Identity, dict[str, Bound]]:
    """The identity of the receiver model at `target` (what its exports name as their source) and, by mapper id, each
    route verified against it and its source (module docstring), its coefficients in `compute_dtype` (None: the dtype
    the mapper was fitted in, `fitted_dtypes` — float32 coefficients run at full precision in vLLM's workers, no
    TF32). The host copies of the models are dropped."""
    receiver, receiver_id = viewed(Path(target), dtype)
    bound = {}
    for spec in specs:
        sender, sender_id = viewed(spec.source, dtype) if spec.source != Path(target) else (receiver, receiver_id)
        if sender_id.tokenizer_hash != receiver_id.tokenizer_hash:
            raise ValueError(f"kvrelay: route {spec.mapper}: the source's tokenizer {sender_id.tokenizer_hash[:12]} "
                             f"≠ the receiver's {receiver_id.tokenizer_hash[:12]}")  # fmt: skip
        mapper = load_mapper(spec.mapper)
        if refusal := view_refusal(mapper, sender, receiver, receiver_id.tokenizer_hash):
            raise ValueError(f"kvrelay: route {spec.mapper} ({spec.source} → {target}) cannot serve: {refusal}")
        if mapper.token_features:
            raise ValueError(f"kvrelay: mapper {spec.mapper} reads the target's token features (a layer-0 receiver "
                             "prefill inside the load): not served by the connector")  # fmt: skip
        if backend == "gemm" and not gemm_worthwhile(mapper, sender.kv.num_layers):  # packs every source layer
            logger.warning("kvrelay: route %s: apply_backend \"gemm\" multiplies all %d source layers for a mapper "
                           "reading %d per target layer — %.1f× the gathered map's work (\"auto\" maps it gathered)",
                           spec.mapper, sender.kv.num_layers, mapper.source_layers.shape[1],
                           sender.kv.num_layers / mapper.source_layers.shape[1])  # fmt: skip
        compute = compute_dtype or getattr(torch, fitted_dtypes(mapper.manifest)["compute_dtype"])
        bound[mapper_id(mapper)] = Bound(bound_mapper(mapper, device, compute), sender.kv, receiver.kv,
                                         RopeTable(sender.rotary.to(device)), RopeTable(receiver.rotary.to(device)),
                                         backend)  # fmt: skip
    return receiver_id, bound
