"""Shape-only stand-ins for systems measurements at the paper's scale: random traces and random-coefficient
mappers with the exact shapes of a pair. Timing, memory and storage only — every manifest says synthetic.

Weight values do not change timings, so these replace trace collection (excluded from the paper's
construction time anyway) and fitting (irrelevant to apply / handoff latency) when a pair is too large
to calibrate within a lease.
"""

from __future__ import annotations

import torch

from src.artifact import Mapper
from src.models import KVInterface
from src.select import depth_layers
from src.support import coefficient_count, head_assignment
from src.traces import Traces


def synthetic_traces(
    source: KVInterface,
    target: KVInterface,
    sequences: int,
    rows_per_sequence: int,
    device: str,
    dtype: torch.dtype,
    seed: int,
) -> Traces:
    """Random content rows [L, H, n, d] for both models plus positive raw Attn-Repair sensitivities."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = sequences * rows_per_sequence
    draw = lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
    sensitivity = lambda: torch.rand(
        target.num_layers, target.num_kv_heads, rows, generator=generator, device=device, dtype=torch.float64
    )
    return Traces(
        source_k=draw(source.num_layers, source.num_kv_heads, rows, source.head_dim),
        source_v=draw(source.num_layers, source.num_kv_heads, rows, source.head_dim),
        target_k=draw(target.num_layers, target.num_kv_heads, rows, target.head_dim),
        target_v=draw(target.num_layers, target.num_kv_heads, rows, target.head_dim),
        sequence_index=torch.arange(sequences).repeat_interleave(rows_per_sequence),
        position=torch.arange(rows_per_sequence).repeat(sequences),
        attn_k=sensitivity(),
        attn_v=sensitivity(),
        meta={"sequences": sequences, "rows": rows, "synthetic": True, "corpus_hash": f"synthetic-seed{seed}"},
    )


def synthetic_mapper(
    source: KVInterface, target: KVInterface, support: str, k: int, manifest: dict, seed: int
) -> Mapper:
    """A mapper of the fitted shape (depth-proportional layers, the support's head map), random coefficients; k past
    the source's layers is a ValueError (`depth_layers` would give fewer columns than the weights' width)."""
    if not 1 <= k <= source.num_layers:
        raise ValueError(f"k={k}: the mapper reads 1 to the source's {source.num_layers} layers per target layer")
    head_index = head_assignment(support, source.num_kv_heads, target.num_kv_heads)
    width = k * head_index.shape[1] * source.head_dim
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator) / width**0.5
    fan_in = source.num_kv_heads if support in ("full", "pca") else head_index.shape[1]
    return Mapper(
        source_layers=depth_layers(source.num_layers, target.num_layers, k),
        head_index=head_index,
        weight_k=draw(target.num_layers, target.num_kv_heads, width, target.head_dim),
        bias_k=draw(target.num_layers, target.num_kv_heads, target.head_dim),
        weight_v=draw(target.num_layers, target.num_kv_heads, width, target.head_dim),
        bias_v=draw(target.num_layers, target.num_kv_heads, target.head_dim),
        manifest=dict(
            manifest,
            synthetic=True,
            support=support,
            method=f"{support}+synthetic",
            k=k,
            coefficient_count=coefficient_count(
                target.num_layers, target.num_kv_heads, k, fan_in, source.head_dim, target.head_dim
            ),
        ),
    )
