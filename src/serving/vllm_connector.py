"""kvrelay inside vLLM: an out-of-tree KV connector (no vLLM patch) that exports a sender's K/V and maps them into a
receiver's paged blocks.

    KVTransferConfig(kv_connector="KVRelayConnector", kv_connector_module_path="src.serving.vllm_connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={...})

(settings: src/serving/config.py, refused as the connector starts — which vLLM does once the model has loaded, so
`python -m src.serving.preflight` runs the same checks before; request parameters: src/serving/params.py). One
class, two roles, as vLLM's own connectors: the scheduler side decides, once per step, and writes its decisions into
`KVRelayMetadata` (metadata.py); the worker side only executes them.

Scheduler: a request asking for an export gets an id (returned in its output's `kv_transfer_params`), and when its
prefill completes the step's metadata carries a `Save` of its prompt's blocks. A handoff request is claimed in
`get_num_new_matched_tokens` — after vLLM's own prefix hit, which comes first (the sink) — by `claim.claim`, whose
decision is a `SplicePlan` (src/runtime/plan.py, the runtime's own `plan_splice` on a receiver without a forward),
or refused (0 tokens: an ordinary prefill, the output vLLM gives without the connector). The tokens it matches are
the plan's span, plan.end − plan.start; a claim re-keys the request's prefix-cache keys from its first mapped block
(src/serving/provenance.py; none to re-key when the request carries the conversation's provenance salt) and, once
its blocks are allocated — vLLM counting exactly that span as loaded, else the claim is refused there too — becomes
a `Load` that carries the plan and the span's blocks. Every request with kvrelay parameters gets a record in its
output.

Worker: `start_load_kv` (before the forward) reads each load's span plan.start..plan.end − 1 from the transport,
maps it for this worker's KV heads (`routes.Bound.map`) and writes it into the paged blocks (`paged.write_mapped`;
`paged_writer` "stacked" on FlashAttention's layout: the map stores into them itself, `Bound.map_into`), no host
sync; the finiteness flags and the magnitude guard are read afterwards, in `get_block_ids_with_load_errors`,
where the export's lease is released (its reads have ended: transport.py) and a failed load's blocks are reported —
vLLM then recomputes them (kv_load_failure_policy "recompute"), discarding the step's output for that request. A
load that cannot even start (export missing or malformed), or that the scheduler refused, is reported the same way.
`wait_for_save` (after the forward, once per step) reads each save's slots from every layer (FlashAttention's layout: in
one launch, `paged.read_export`) and publishes the export
(in files, or kept on the GPU: `export_memory`). No per-layer hook: the forward itself is untouched (CUDA graphs
included).
"""

from __future__ import annotations

import collections
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.hashing import get_hash_fn_by_name

from src.models import dtype_name
from src.runtime.plan import SplicePlan
from src.serving.claim import claim
from src.serving.config import connector_config, engine_refusal
from src.serving.metadata import KVRelayMetadata, Load, Save
from src.serving.metrics import KVRelayPromMetrics, KVRelayStats
from src.serving.paged import UNQUANTIZED, Writer, check_layout, flash_halves, read_export, slots_for, write_mapped
from src.serving.params import KEY, Handoff, RelayParams, parse
from src.serving.provenance import rekey, salted
from src.serving.routes import LoadFlags, bound_routes, model_tokenizer_hash, scheduled_routes
from src.serving.timings import Span, Timings
from src.serving.transport import ExportError, Header, Lease, Transport

logger = init_logger(__name__)


@dataclass
class _Tracked:
    """What the scheduler side keeps about one request with kvrelay parameters."""

    params: RelayParams
    prompt: list[int]
    record: dict
    export_id: str | None = None
    blocks: list[int] = field(default_factory=list)  # an exporting request's blocks so far
    exported: bool = False
    header: Header | None = None
    plan: SplicePlan | None = None  # the claim: this request's mapped span
    handoff: Handoff | None = None
    keys: str = ""  # how the claimed request's prefix-cache keys are kept apart: "cache_salt" or "re-keyed"
    load_blocks: set[int] = field(default_factory=set)
    decisions: dict[int, SplicePlan | str] = field(default_factory=dict)  # the claim per native hit: vLLM asks again
    # each step a request waits for blocks, and again when a preempted one resumes


def _refuse(tracked: _Tracked, reason: str, hit: int) -> None:
    """No span mapped for this request this time: an ordinary prefill, and its record says why. A request preempted
    after its load stays "mapped" (what it generated before was read over the mapped span), its record saying how it
    resumed."""
    done = tracked.record.get("handoff", {})
    if done.get("status") == "mapped":
        done["resumed"] = f"read natively from token {hit}: {reason}"
    else:
        tracked.record["handoff"] = {"status": "refused", "reason": reason, "hit": hit}
    tracked.plan = None


class KVRelayConnector(KVConnectorBase_V1):
    """The kvrelay connector (module docstring)."""

    timings = Timings("off")  # src/serving/timings.py: off unless the engine's environment asks (__init__)
    _stats: KVRelayStats | None = None  # the scheduler side's counts since the last step (metrics.py)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = connector_config(transfer.kv_connector_extra_config, transfer.kv_load_failure_policy)
        device = torch.device(vllm_config.device_config.device)
        stages, cache_dtype = vllm_config.parallel_config.pipeline_parallel_size, vllm_config.cache_config.cache_dtype
        if refusal := engine_refusal(self.config, device.type, stages, cache_dtype):
            raise ValueError(refusal)  # before the export directory is made or any route read
        self.block_size = vllm_config.cache_config.block_size
        self.transport = Transport(self.config.transport, self.config.export_memory, self.config.export_pool_mb << 20)
        self.timings = Timings.from_environment("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        model = vllm_config.model_config
        if role == KVConnectorRole.SCHEDULER:
            self.target_layers = model.get_total_num_hidden_layers()
            self.tokenizer_hash = model_tokenizer_hash(Path(model.tokenizer or model.model))
            self.routes = scheduled_routes(self.config.routes, self.tokenizer_hash)
            self.hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)  # vLLM's block keys
            self._tracked: dict[str, _Tracked] = {}
            self._loads: list[Load] = []
            self._stats = KVRelayStats()
            return
        self.device = device
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.rank, self.ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.identity, self.bound = bound_routes(
            self.config.routes, Path(model.model), self.config.fingerprint_dtype, self.config.compute_dtype,
            self.config.apply_backend, self.device,
        )  # fmt: skip
        self.layers: list[torch.nn.Module] = []
        self._started: list[tuple[Load, LoadFlags, Lease, Span]] = []  # the loads mapped this step, checked after
        self._failed: list[tuple[Load, str]] = []
        self._exports: collections.deque[str] = collections.deque()

    # ---------------------------------------------------------------- scheduler side

    def on_new_request(self, request) -> None:
        params = parse(request.kv_transfer_params)
        if isinstance(params, str):
            logger.warning("kvrelay: request %s: %s (served as an ordinary prefill)", request.request_id, params)
            self._tracked[request.request_id] = _Tracked(RelayParams(), [], {"error": params})
            return
        if params == RelayParams():
            return
        tracked = _Tracked(params, list(request.prompt_token_ids or []), {})
        if params.export:
            tracked.export_id = uuid.uuid4().hex
            tracked.record["export"] = tracked.export_id
        if params.mapped is not None and not salted(request, params.mapped.mapper_id):
            span = params.mapped  # re-keyed before vLLM's prefix lookup: the conversation's earlier keys hit again
            try:
                rekey(request, span.start // self.block_size * self.block_size, span.mapper_id, self.block_size,
                      self.hash_fn)  # fmt: skip
            except ValueError as error:
                tracked.record["error"] = f"mapped span not re-keyed: {error}"
        self._tracked[request.request_id] = tracked

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.params.handoff is None:
            return 0, False
        handoff = tracked.params.handoff
        plan = self._decide(request.request_id, tracked, handoff, num_computed_tokens)
        if isinstance(plan, str):
            _refuse(tracked, plan, num_computed_tokens)
            return 0, False
        if salted(request, handoff.mapper_id):  # vLLM keyed it apart as it arrived (provenance.py)
            tracked.keys = "cache_salt"
        else:
            tracked.keys = "re-keyed"
            try:  # never raise inside vLLM's scheduler: an ordinary prefill instead
                with self.timings.phase("rekey", request.request_id, len(tracked.prompt)):
                    rekey(request, plan.start, handoff.mapper_id, self.block_size, self.hash_fn)
            except ValueError as error:
                _refuse(tracked, f"mapped span not re-keyed: {error}", num_computed_tokens)
                return 0, False
        tracked.plan, tracked.handoff = plan, handoff
        return plan.end - plan.start, False  # plan.start is the hit: the tokens past it that the plan maps

    def _decide(self, request_id: str, tracked: _Tracked, handoff: Handoff, hit: int) -> SplicePlan | str:
        route = self.routes.get(handoff.mapper_id)
        if route is None:
            return f"unknown mapper id {handoff.mapper_id!r}: this engine serves {sorted(self.routes)}"
        if tracked.header is None or tracked.header.export_id != handoff.export_id:
            try:
                with self.timings.phase("header", request_id, len(tracked.prompt)):
                    tracked.header = self.transport.header(handoff.export_id)
            except ExportError as error:
                return str(error)
        if hit not in tracked.decisions:
            with self.timings.phase("claim", request_id, len(tracked.prompt)):
                tracked.decisions[hit] = claim(tracked.prompt, hit, tracked.header, route.route,
                                               route.source_fingerprint, route.fingerprint_dtype, self.config.policy,
                                               self.tokenizer_hash, self.block_size, self.target_layers)  # fmt: skip
        return tracked.decisions[hit]

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """The claim's plan becomes a `Load`, once vLLM has allocated its blocks and counted exactly its span,
        plan.end − plan.start tokens, as loaded (what `get_num_new_matched_tokens` returned). None counted (vLLM kept
        a longer local hit, or the request skips prefix reads): the claim is refused, an ordinary prefill. Any other
        count is not what was planned: a refused `Load`, whose blocks the worker reports as failed — vLLM recomputes
        them (kv_load_failure_policy "recompute"), never serves a span the plan did not map."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.plan is None:
            return
        with self.timings.phase("alloc", request.request_id, len(tracked.prompt)):
            self._allocated(request.request_id, tracked, blocks, num_external_tokens)

    def _allocated(self, request_id: str, tracked: _Tracked, blocks, num_external_tokens: int) -> None:
        plan, handoff = tracked.plan, tracked.handoff
        if num_external_tokens == 0:
            _refuse(tracked, "vLLM loads none of the claimed span (its own prefix hit, or the request reads none)",
                    plan.held)  # fmt: skip
            return
        block_ids = list(blocks.get_block_ids()[0])
        counted = block_ids[plan.start // self.block_size : -(-(plan.start + num_external_tokens) // self.block_size)]
        if num_external_tokens != plan.end - plan.start:
            refusal = (f"vLLM counts {num_external_tokens} tokens from {plan.start} as loaded, the plan maps "
                       f"{plan.start}..{plan.end - 1}: its blocks are recomputed")  # fmt: skip
            logger.error("kvrelay: request %s: %s", request_id, refusal)
            tracked.record["handoff"] = {"status": "recomputed", "reason": refusal, "hit": plan.held, "mapped": 0}
            self._loads.append(Load(request_id, handoff.export_id, handoff.mapper_id, plan, counted, refusal))
            return
        load = Load(request_id, handoff.export_id, handoff.mapper_id, plan, counted)
        tracked.load_blocks = set(load.block_ids)
        prompt_blocks = block_ids[: -(-len(tracked.prompt) // self.block_size)]  # the prompt's blocks (tests read them)
        start, end, loads = plan.start, plan.end, 1
        done = tracked.record.get("handoff", {})
        if done.get("status") == "mapped":  # loaded again after a preemption, from the hit it resumed with: the span
            # ever mapped is the union (a shorter hit: its native blocks were evicted; a longer one: its own mapped)
            start, end, loads = min(start, done["start"]), max(end, done["end"]), done["loads"] + 1
        tracked.record["handoff"] = {"status": "mapped", "reason": f"policy: {self.config.policy.mode}",
                                     "hit": start, "start": start, "end": end, "mapped": end - start,
                                     "mapper": load.mapper_id, "keys": tracked.keys, "blocks": prompt_blocks,
                                     "loads": loads}  # fmt: skip
        self._loads.append(load)

    def build_connector_meta(self, scheduler_output) -> KVRelayMetadata:
        meta = KVRelayMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._progress(new.req_id, list(new.block_ids[0]), True, new.num_computed_tokens, scheduled, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            blocks = [] if new_blocks is None else list(new_blocks[0])
            resumed = request_id in cached.resumed_req_ids
            self._progress(request_id, blocks, resumed, cached.num_computed_tokens[i], scheduled, meta)
        return meta

    def _progress(self, request_id: str, blocks: list[int], replace: bool, computed: int, scheduled, meta) -> None:
        """An exporting request's blocks so far; a Save once this step completes its prompt."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.export_id is None or tracked.exported:
            return
        tracked.blocks = blocks if replace else tracked.blocks + blocks
        if computed + scheduled.get(request_id, 0) >= len(tracked.prompt) > 0:
            held, now = tracked.params.mapped, tracked.plan  # an earlier handoff's span, this request's own
            spans = [(s.start, s.end) for s in (held, now) if s is not None]
            mapped = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None  # never mapped again
            with self.timings.phase("export", request_id, len(tracked.prompt)):
                blocks = tracked.blocks[: -(-len(tracked.prompt) // self.block_size)]  # the prompt's
                meta.saves.append(Save(request_id, tracked.export_id, tracked.prompt, blocks, mapped))
            tracked.exported = True
            tracked.record["export_tokens"] = len(tracked.prompt)

    def update_connector_output(self, connector_output) -> None:
        failed = getattr(connector_output, "invalid_block_ids", None) or set()
        for tracked in self._tracked.values():
            if failed & tracked.load_blocks:
                record = tracked.record["handoff"]
                if record["loads"] > 1:  # a resumed request's load: what it generated before read the mapped span
                    record["resumed"] = "late refusal of the resumed load (the worker's log names it): recomputed"
                else:
                    record["status"], record["mapped"] = "recomputed", 0
                    record["reason"] = "late refusal on the worker (its log names it): the span was recomputed natively"
                tracked.load_blocks = set()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        if tracked.export_id is not None and not tracked.exported:
            tracked.record["export"] = None
            tracked.record["export_reason"] = "the request finished before its prefill completed"
        self._stats.count(tracked.record)
        return False, {KEY: tracked.record}

    def get_kv_connector_stats(self) -> KVRelayStats | None:
        """The scheduler side's counts since the last call (vLLM asks once per step), then zero; None where there
        are none, and always on the worker side (it counts nothing: a late refusal reaches the request's record)."""
        stats = self._stats
        if stats is None or stats.is_empty():
            return None
        self._stats = KVRelayStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVRelayStats:
        """The counts as they crossed from the engine core (`KVRelayStats.data`)."""
        return KVRelayStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVRelayPromMetrics:
        return KVRelayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        context = self._vllm_config.compilation_config.static_forward_context
        named = sorted((extract_layer_index(name), context[name]) for name in kv_caches)
        self.layers = [layer for _, layer in named]
        self.layout = check_layout(self.layers[0])
        self.writer = Writer()  # paged_writer: each layer's own writer, one write, or the map's stores (paged.py)
        if self.config.paged_writer == "stacked":
            try:
                self.writer = Writer.over(self.layers, self.layout)
            except ValueError as why:
                logger.warning("kvrelay: paged_writer stacked: %s; each layer's own writer writes", why)
        self.halves = self.writer.direct  # the export's one-launch read over the flash layout's halves (read_export)
        if self.halves is None and self.layout == "flash" and self.layers[0].kv_cache.dtype in UNQUANTIZED:
            try:
                self.halves = flash_halves([layer.kv_cache for layer in self.layers])
            except ValueError as why:
                logger.warning("kvrelay: the export reads each layer apart: %s", why)
        heads, total = self.layers[0].kv_cache.shape[1], self._vllm_config.model_config.get_total_num_kv_heads()
        first = self.rank * heads if total >= self.ranks else self.rank * total // self.ranks  # else: replicated
        self.heads = slice(first, first + heads)  # this worker's KV heads: vLLM splits them contiguously
        self.total_heads = total
        for mapper, bound in self.bound.items():
            kv = bound.target_kv
            if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (len(self.layers), total, self.head_dim):
                raise ValueError(f"kvrelay: mapper {mapper} targets {kv.num_layers} layers × {kv.num_kv_heads} KV "
                                 f"heads × {kv.head_dim}, this engine holds {len(self.layers)} × {total} × "
                                 f"{self.head_dim}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.layers[0].kv_cache.shape[3] // 2

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for load in self._get_connector_metadata().loads:
            if load.refusal is not None:
                self._failed.append((load, load.refusal))
                continue
            try:
                self._load(load)
            except Exception as error:  # noqa: BLE001 — any failure is a late refusal: the blocks are recomputed
                self._failed.append((load, f"{type(error).__name__}: {error}"))

    def _load(self, load: Load) -> None:
        bound = self.bound[load.mapper_id]
        start, end = load.plan.start, load.plan.end
        phase = lambda name: self.timings.phase(name, load.request_id, end - start)  # noqa: E731
        with phase("load"):
            keys, values, lease = self.transport.load(load.export_id, start, end, self.device)  # [L_s, H_s, n, d_s]
        try:
            kv = bound.source_kv
            if tuple(keys.shape) != (kv.num_layers, kv.num_kv_heads, end - start, kv.head_dim):
                raise ExportError(f"export {load.export_id} holds K/V {tuple(keys.shape)}, the mapper's source "
                                  f"{kv.num_layers} × {kv.num_kv_heads} × n × {kv.head_dim}")  # fmt: skip
            with phase("slots"):  # block_ids[0] holds position start: a claim starts on a block (provenance.py)
                slots = slots_for(load.block_ids, self.block_size, 0, end - start, self.device)  # [n]
            guard = self.config.policy.guard_max_abs
            began = self.timings.mark(self.device)  # the map's device time (timings.py), None unless timed on CUDA
            if self.writer.direct is not None:  # into the blocks: no scratch, no write, the guard's flags [L_t]
                with phase("map"):
                    flags, beyond = bound.map_into(keys, values, start, self.heads, self.writer.direct, slots, guard)
                span = (began, self.timings.mark(self.device))
                self._started.append((load, LoadFlags.after_map(flags, beyond, None), lease, span))
                return
            with phase("map"):
                mapped_k, mapped_v, flags = bound.map(keys, values, start, self.heads, self.layers[0].kv_cache.dtype)
            with phase("write"):
                write_mapped(self.layers, mapped_k, mapped_v, slots, self.writer.stacked)
        except BaseException:
            if self.device.type == "cuda":  # reads of the sender's memory may be queued: let them end first
                torch.cuda.current_stream(self.device).synchronize()
            lease.release()
            raise
        with phase("guard"):
            peak = None if guard is None else torch.maximum(mapped_k.abs().amax(), mapped_v.abs().amax()).float()
        span = (began, self.timings.mark(self.device))
        self._started.append((load, LoadFlags.after_map(flags, None, peak), lease, span))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of every load refused on the worker this step (read once the forward is queued)."""
        failed = list(self._failed)
        guard = self.config.policy.guard_max_abs
        for load, flags, lease, span in self._started:
            with self.timings.phase("check", load.request_id, load.plan.end - load.plan.start):
                if reason := flags.refusal(guard):  # the map, and its reads of the export, have ended on the device
                    failed.append((load, reason))
                lease.release()
            self.timings.elapsed(span, load.request_id, load.plan.end - load.plan.start)
        self._started, self._failed = [], []
        for load, reason in failed:
            logger.warning("kvrelay: late refusal of request %s (export %s): %s — its %d blocks are recomputed",
                           load.request_id, load.export_id, reason, len(load.block_ids))  # fmt: skip
        return {block for load, _ in failed for block in load.block_ids}

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        for save in self._get_connector_metadata().saves:
            try:
                with self.timings.phase("export", save.request_id, len(save.ids)):  # its time: KVRELAY_TIMINGS
                    self._export(save)
            except Exception as error:  # noqa: BLE001 — an export that fails is absent: receivers refuse it
                logger.error("kvrelay: export %s of request %s failed: %s", save.export_id, save.request_id, error)

    def _export(self, save: Save) -> None:
        slots = slots_for(save.block_ids, self.block_size, 0, len(save.ids), self.device)  # [T]
        try:
            keys, values = read_export(self.layers, slots, self.layout, self.halves)  # [L, H, T, d] each
        except Exception as error:  # noqa: BLE001 — the one-launch read failing (a compiler's refusal): read apart
            if self.halves is None:
                raise
            logger.warning("kvrelay: the export's one-launch read failed (%s); each layer is read apart from now on",
                           error)  # fmt: skip
            self.halves = None
            keys, values = read_export(self.layers, slots, self.layout)
        heads = (self.heads.start, self.heads.stop - self.heads.start, self.total_heads)
        self.transport.put(save.export_id, keys, values, save.ids, self.identity.fingerprint,
                           self.identity.tokenizer_hash, heads, save.mapped, self.rank, self.ranks,
                           fingerprint_dtype=dtype_name(self.config.fingerprint_dtype))  # fmt: skip
        self._exports.append(save.export_id)  # each rank removes its own part (and frees its device memory)
        while len(self._exports) > self.config.keep_exports and self.transport.remove(
            self._exports[0], self.rank, self.ranks
        ):  # a part a receiver still reads stays until a later save
            self._exports.popleft()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return
