"""Mapper construction sharded over processes with torch.distributed (launched by `torchrun`): the artifact of
`src.fit.fit_mapper` on the pooled rows, within float64 rounding.

Each rank holds the rows of its own block of calibration sequences (`shard_rows`; Attn-Repair sensitivities are
per sequence, so a shard carries its own). Per target layer ℓ × component, in the same order on every rank:

  1. the rank's weighted moments about its own mean — x̄_r, ȳ_r, A_r, B_r (Eqs. 20–21) and W_r = Σ_r w — from the
     one-process statistics path (generic, streaming or fused);
  2. one all-reduce of [W_r, W_r·x̄_r, W_r·ȳ_r] → the pooled weighted means μx, μy;
  3. the parallel-variance merge (Chan, Golub & LeVeque): A = Σ_r A_r + W_r (x̄_r − μx)(x̄_r − μx)ᵀ, likewise B and
     Σw‖y − μy‖²; each rank adds its own correction and the sum is reduced onto the layer's owner (ℓ mod world).

Centering stays before accumulation (no Σwxxᵀ − Wμμᵀ cancellation on large K offsets). Then every owner solves its
layers (Eq. 23, float64) and broadcasts W, b, so every rank returns the whole Mapper. Attn-Repair (Eqs. 17–19) needs
the whole row set of a layer × head × component only through n, Σr and Σ(r/r̄ − 1)²: two all-reduces before the
loop, then each rank weights its own rows exactly as one process would. Collectives: NCCL on CUDA, gloo on CPU.
Block-PCA (a control) needs a basis of all rows first and is one-process only.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

from kernels.fused_fit import fused_moments
from src.artifact import Mapper
from src.fit import STATISTICS, fitted_mapper
from src.stats import Moments, reference_moments, ridge_solve, streaming_moments
from src.support import gather_features, token_kv, token_width, with_token_kv
from src.traces import Traces
from src.weighting import kish_alpha

# NVLink SHARP / multicast off in every process on the lent GPU machines (their fabric setup does not support it)
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_distributed(device_type: str) -> torch.device:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
    NCCL with one GPU per local rank on "cuda" (GPU_ENV set first), gloo on "cpu". Returns this rank's device."""
    if device_type == "cuda":
        os.environ.update(GPU_ENV)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    if device_type != "cpu":
        raise ValueError(f"device_type must be 'cuda' (NCCL) or 'cpu' (gloo), not {device_type!r}")
    dist.init_process_group("gloo")
    return torch.device("cpu")


def shard_rows(traces: Traces, rank: int, world: int) -> Traces:
    """The rows of this rank's contiguous block of calibration sequences (whole sequences, ascending order)."""
    sequences = traces.sequence_index.unique()  # sorted
    if sequences.numel() < world:
        raise ValueError(f"{sequences.numel()} calibration sequences cannot be split over {world} ranks")
    mine = torch.tensor_split(sequences, world)[rank]
    return traces.select_rows(torch.nonzero(torch.isin(traces.sequence_index, mine))[:, 0])


def owner(layer: int, world: int) -> int:
    """The rank that solves target layer `layer` (round robin)."""
    return layer % world


def _all_sum(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(t, op=op)
    return t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree(shard: Traces, signature: tuple, device: torch.device) -> int:
    """Total rows over ranks, after checking that every rank has rows and the same shapes and method."""
    digest = lambda text: int(hashlib.sha256(repr(text).encode()).hexdigest()[:15], 16)
    shapes = (*shard.source_k.shape[:2], shard.source_k.shape[3], *shard.target_k.shape[:2], shard.target_k.shape[3])
    local = torch.tensor([*shapes, shard.attn_k is not None, digest(signature)], dtype=torch.int64, device=device)
    low, high = _all_sum(local.clone(), dist.ReduceOp.MIN), _all_sum(local.clone(), dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise ValueError(
            "ranks disagree on trace shapes [L_s, H_s, d_s, L_t, H_t, d_t], sensitivities or the method "
            f"(layers, heads, support, weighting, λ, statistics): min {low.tolist()} ≠ max {high.tolist()}"
        )
    rows = torch.tensor([shard.rows], dtype=torch.int64, device=device)
    if int(_all_sum(rows.clone(), dist.ReduceOp.MIN)) == 0:
        raise ValueError("a rank holds no calibration rows: launch fewer processes than there are sequences")
    return int(_all_sum(rows))


def repair_weights(shard: Traces, width: int, alpha_cap: float) -> tuple[torch.Tensor, dict]:
    """Attn-Repair weights of this rank's rows [2, L_t, H_t, n_r] (K, V) from the pooled r̄, CV² and n (Eqs. 17–19),
    as `src.weighting.attn_repair_weights` gives on all rows; and α* per component [L_t][H_t] (the manifest's)."""
    raw = torch.stack([shard.attn_k, shard.attn_v])  # [2, L_t, H_t, n_r]
    rows = int(_all_sum(torch.tensor([shard.rows], dtype=torch.int64, device=raw.device)))
    mean = (_all_sum(raw.sum(-1)) / rows)[..., None]  # [2, L_t, H_t, 1]   r̄ over all rows
    r = torch.where(mean > 0, raw / mean.clamp_min(torch.finfo(raw.dtype).tiny), torch.ones_like(raw))
    cv2 = _all_sum(((r - 1) ** 2).sum(-1)) / rows  # [2, L_t, H_t]
    alpha = kish_alpha(cv2, rows, width, alpha_cap)  # Eq. 19
    return 1 + alpha[..., None] * (r - 1), {"k": alpha[0].tolist(), "v": alpha[1].tolist()}  # Eq. 17


def pooled_moments(local: Moments, weight_sum: torch.Tensor, rows: int, dst: int) -> Moments | None:
    """Merge every rank's `local` moments (about its own weighted mean; W_r = weight_sum [H]) into the moments of
    all rows about the pooled mean, reduced onto rank `dst` (None elsewhere). A rank whose rows all carry zero
    weight for a head contributes nothing to it."""
    have = (weight_sum > 0)[:, None]  # [H, 1]
    mean_x = torch.where(have, local.mean_x, 0)  # [H, p]
    mean_y = torch.where(have, local.mean_y, 0)  # [H, d]
    p = mean_x.shape[1]
    sums = _all_sum(torch.cat([weight_sum[:, None], weight_sum[:, None] * mean_x, weight_sum[:, None] * mean_y], 1))
    pooled_x, pooled_y = sums[:, 1 : 1 + p] / sums[:, :1], sums[:, 1 + p :] / sums[:, :1]  # μx [H, p], μy [H, d]
    dx, dy = mean_x - pooled_x, mean_y - pooled_y  # [H, p], [H, d]
    w = weight_sum[:, None, None]  # [H, 1, 1]
    xx = torch.where(have[..., None], local.xx, 0) + w * dx[:, :, None] * dx[:, None, :]  # [H, p, p]   Eq. 20
    xy = torch.where(have[..., None], local.xy, 0) + w * dx[:, :, None] * dy[:, None, :]  # [H, p, d]   Eq. 21
    yy = torch.where(have[:, 0], local.yy, 0) + weight_sum * (dy * dy).sum(-1)  # [H]
    packed = torch.cat([xx.flatten(1), xy.flatten(1), yy[:, None]], 1)  # [H, p·p + p·d + 1]
    dist.reduce(packed, dst)
    if dist.get_rank() != dst:
        return None
    xx, xy = packed[:, : p * p].unflatten(1, (p, p)), packed[:, p * p : -1].unflatten(1, (p, -1))
    return Moments(mean_x=pooled_x, mean_y=pooled_y, xx=xx, xy=xy, yy=packed[:, -1], rows=rows)


def local_moments(
    statistics: str,
    source_rows: torch.Tensor,
    target_rows: torch.Tensor,
    weights: torch.Tensor | None,
    layers: torch.Tensor,
    head_index: torch.Tensor,
    chunk_rows: int,
    token_rows: torch.Tensor | None,
) -> Moments:
    """One rank's moments of the design (gather_features ⊕ token features, as src.fit) → target rows [H_t, n, d_t]."""
    design = lambda span: with_token_kv(
        gather_features(source_rows[:, :, span], layers, head_index), None if token_rows is None else token_rows[span]
    )  # [H_t, b, p]
    chunk = lambda span: (design(span), target_rows[:, span], None if weights is None else weights[:, span])
    rows = source_rows.shape[2]
    if statistics == "generic":
        return reference_moments(*chunk(slice(0, rows)))
    if statistics == "streaming":
        return streaming_moments(chunk, rows, chunk_rows)
    return fused_moments(source_rows, target_rows, weights, layers, head_index, chunk_rows)


def fit_mapper_sharded(
    shard: Traces,
    source_layers: torch.Tensor,
    head_index: torch.Tensor,
    support: str,
    weighting: str,
    lam: float,
    lam_relative: bool,
    chunk_rows: int,
    alpha_cap: float = 1.0,
    token_features: bool = False,
    statistics: str = "streaming",
    timings: dict | None = None,
) -> Mapper:
    """`fit_mapper` over the rows of all ranks, each holding `shard`; call it on every rank with the same arguments.
    Returns the whole Mapper on every rank. `timings`, when given, receives seconds per phase and bytes reduced."""
    if support == "pca":
        raise ValueError("the block-PCA control needs its basis from all rows first: fit it in one process")
    if statistics not in STATISTICS:
        raise ValueError(f"unknown statistics {statistics!r}; choose one of {STATISTICS}")
    if statistics == "fused" and token_features:
        raise ValueError("fused statistics do not read token features; use statistics='streaming'")
    if weighting == "attn_repair" and shard.attn_k is None:
        raise ValueError("attn_repair weighting needs traces collected with attention_boundaries > 0")
    device, world, rank = shard.source_k.device, dist.get_world_size(), dist.get_rank()
    signature = (source_layers.tolist(), head_index.tolist(), support, weighting, lam, lam_relative, alpha_cap)
    clock = {"start": time.perf_counter()}
    rows = _agree(shard, (*signature, token_features, statistics), device)
    target_layers, target_heads, _, target_dim = shard.target_k.shape
    width = source_layers.shape[1] * head_index.shape[1] * shard.source_k.shape[-1]  # p = k·f·d_s
    width += token_width(target_heads, target_dim) if token_features else 0
    token_rows = token_kv(shard.target_k[0], shard.target_v[0]) if token_features else None  # [n_r, 2·H_t·d_t]
    weights, alpha = repair_weights(shard, width, alpha_cap) if weighting == "attn_repair" else (None, None)
    _sync(device)
    clock["weights"] = time.perf_counter()
    owned: dict[tuple[int, int], Moments] = {}
    for layer in range(target_layers):
        for index, (source_rows, target_rows) in enumerate(
            ((shard.source_k, shard.target_k[layer]), (shard.source_v, shard.target_v[layer]))
        ):
            w = None if weights is None else weights[index, layer]  # [H_t, n_r]
            local = local_moments(
                statistics, source_rows, target_rows, w, source_layers[layer], head_index, chunk_rows, token_rows
            )
            weight_sum = torch.full((target_heads,), float(shard.rows), dtype=torch.float64, device=device)
            merged = pooled_moments(local, weight_sum if w is None else w.double().sum(-1), rows, owner(layer, world))
            if merged is not None:
                owned[(layer, index)] = merged
    _sync(device)
    clock["moments"] = time.perf_counter()
    solved, failed = {}, -1
    for (layer, index), moments in owned.items():
        try:
            solved[(layer, index)] = [t.float() for t in ridge_solve(moments, lam, lam_relative)]  # Eq. 23
        except FloatingPointError:
            failed = max(failed, layer)
    failed = int(_all_sum(torch.tensor([failed], device=device), dist.ReduceOp.MAX))
    if failed >= 0:
        raise FloatingPointError(f"ridge solve of target layer {failed} failed on rank {owner(failed, world)}")
    _sync(device)
    clock["solve"] = time.perf_counter()
    coefficients: dict[str, list[torch.Tensor]] = {name: [] for name in ("weight_k", "bias_k", "weight_v", "bias_v")}
    for layer in range(target_layers):
        packed = torch.empty(2, target_heads, width + 1, target_dim, device=device)  # [K/V, H_t, p + 1, d_t]
        if rank == owner(layer, world):
            for index in (0, 1):
                packed[index, :, :width], packed[index, :, width] = solved[(layer, index)]
        dist.broadcast(packed, owner(layer, world))
        for index, component in enumerate("kv"):
            coefficients[f"weight_{component}"].append(packed[index, :, :width])  # [H_t, p, d_t]
            coefficients[f"bias_{component}"].append(packed[index, :, width])  # [H_t, d_t]
    _sync(device)
    clock["gather"] = time.perf_counter()
    if timings is not None:
        marks = list(clock.values())  # start, weights, moments, solve, gather
        timings.update({f"{name}_seconds": marks[i] - marks[i - 1] for i, name in enumerate(clock) if i})
        problem = target_heads * (width * width + width * target_dim + 1) * 8
        timings.update(seconds=marks[-1] - marks[0], reduced_bytes=2 * target_layers * problem, world=world)
    return fitted_mapper(
        coefficients,
        source_layers,
        head_index,
        support=support,
        weighting=weighting,
        lam=lam,
        lam_relative=lam_relative,
        alpha_cap=alpha_cap,
        token_features=token_features,
        statistics=statistics,
        alpha=alpha,
        fitted_width=None,
        calibration=dict(shard.meta, rows=rows),
    )
