"""What the connector's scheduler side hands its workers each step (vLLM's `build_connector_meta`): built once
there, from the claim and vLLM's block allocation, and consumed on every worker in `start_load_kv` (loads) and
`wait_for_save` (saves) — the worker re-derives nothing the scheduler decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from src.runtime.plan import SplicePlan


@dataclass
class Load:
    """Map the span of a request's plan, positions plan.start..plan.end − 1 of an export, into the blocks it fills
    (the worker derives their slots on its device: block ids travel, not one slot per token) — or, `refusal` set,
    nothing: the worker reports those blocks as failed."""

    request_id: str
    export_id: str
    mapper_id: str
    plan: SplicePlan
    block_ids: list[int]  # the request's blocks from the one holding plan.start (vLLM counts them as loaded)
    refusal: str | None = None  # why the scheduler refused it after vLLM allocated its blocks


@dataclass
class Save:
    """Publish the K/V of a request's prompt (token ids, positions 0..T−1, in blocks `block_ids`) as an export."""

    request_id: str
    export_id: str
    ids: list[int]
    block_ids: list[int]
    mapped: tuple[int, int] | None


@dataclass
class KVRelayMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
