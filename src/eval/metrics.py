"""Scores of an evaluation run: accuracy, retention, gap recovered, paired uncertainty, cache fidelity.

Accuracy follows lm-eval (argmax over choice loglikelihoods, first maximum wins; acc_norm divides by
each choice's length). Comparisons between methods are paired: both methods scored the same items,
so the bootstrap resamples items jointly and McNemar's exact test reads only the discordant items.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from src.artifact import Mapper
from src.maps import map_rows
from src.support import token_kv
from src.traces import Traces


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile-bootstrap confidence interval."""

    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Bucket:
    """Items with low ≤ context length < high."""

    low: float
    high: float
    count: int
    accuracy: float  # nan for an empty bucket


def choice_correct(
    loglikelihoods: Sequence[Sequence[float]], labels: Sequence[int], lengths: Sequence[Sequence[int]] | None = None
) -> np.ndarray:
    """Per-item correctness [N] of the argmax choice; with `lengths`, of the argmax of loglikelihood / length."""
    if len(loglikelihoods) != len(labels) or (lengths is not None and len(lengths) != len(labels)):
        raise ValueError("loglikelihoods, labels and lengths need one entry per item")
    correct = np.empty(len(labels), dtype=bool)
    for i, (scores, label) in enumerate(zip(loglikelihoods, labels, strict=True)):
        scores = np.asarray(scores, dtype=np.float64)
        if lengths is not None:
            scores = scores / np.asarray(lengths[i], dtype=np.float64)
        correct[i] = int(np.argmax(scores)) == label
    return correct


def accuracy(
    loglikelihoods: Sequence[Sequence[float]], labels: Sequence[int], lengths: Sequence[Sequence[int]] | None = None
) -> float:
    """acc (or acc_norm with `lengths`) from per-item choice loglikelihoods."""
    return float(choice_correct(loglikelihoods, labels, lengths).mean())


def perplexity(loglikelihoods: Sequence[float]) -> float:
    """lm-eval's lambada perplexity: exp of the negative mean per-item continuation loglikelihood."""
    return math.exp(-float(np.mean(loglikelihoods)))


def retention(transfer: float | np.ndarray, target: float | np.ndarray) -> float | np.ndarray:
    """transfer / target (floats or arrays); nan where target == 0."""
    transfer, target = np.asarray(transfer, dtype=np.float64), np.asarray(target, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(target == 0, np.nan, transfer / target)
    return out if out.ndim else float(out)


def gap_recovered(
    transfer: float | np.ndarray, source: float | np.ndarray, target: float | np.ndarray
) -> float | np.ndarray:
    """(transfer − source) / (target − source) (floats or arrays); nan where target == source."""
    transfer, source, target = (np.asarray(x, dtype=np.float64) for x in (transfer, source, target))
    gap = target - source
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(gap == 0, np.nan, (transfer - source) / gap)
    return out if out.ndim else float(out)


def paired_bootstrap(
    scores: Sequence[Sequence[float]],
    statistic: Callable[..., np.ndarray],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Percentile CI of statistic(mean_1, …, mean_M) where mean_m is method m's mean per-item score
    over one shared resample of the items (paired). Resamples where the statistic is undefined (nan,
    e.g. gap recovered with target == source) are left out of the quantiles."""
    x = np.stack([np.asarray(s, dtype=np.float64) for s in scores])  # [M, N]
    n = x.shape[1]
    if n == 0 or n_boot < 1:
        raise ValueError(f"need items and resamples, got {n} items and n_boot={n_boot}")
    rng = np.random.default_rng(seed)
    chunk = max(1, (1 << 22) // n)  # resample rows per draw, bounds memory at [M, chunk, N]
    means = np.concatenate(
        [
            np.take(x, rng.integers(0, n, size=(min(chunk, n_boot - start), n)), axis=1).mean(-1)
            for start in range(0, n_boot, chunk)
        ],
        axis=1,
    )  # [M, n_boot]
    boot = np.asarray(statistic(*means), dtype=np.float64)
    boot = boot[np.isfinite(boot)]
    estimate = float(statistic(*x.mean(-1)))
    if boot.size == 0:
        return Interval(estimate, math.nan, math.nan)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return Interval(estimate, float(low), float(high))


def accuracy_difference_ci(
    correct_a: Sequence[bool], correct_b: Sequence[bool], n_boot: int = 10_000, seed: int = 0, level: float = 0.95
) -> Interval:
    """acc(a) − acc(b) over the same items, with a paired bootstrap CI."""
    return paired_bootstrap([correct_a, correct_b], lambda a, b: a - b, n_boot, seed, level)


def retention_ci(
    correct_transfer: Sequence[bool],
    correct_target: Sequence[bool],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """acc(transfer) / acc(target) over the same items, with a paired bootstrap CI."""
    return paired_bootstrap([correct_transfer, correct_target], retention, n_boot, seed, level)


def gap_recovered_ci(
    correct_transfer: Sequence[bool],
    correct_source: Sequence[bool],
    correct_target: Sequence[bool],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """(acc(transfer) − acc(source)) / (acc(target) − acc(source)), with a paired bootstrap CI."""
    return paired_bootstrap([correct_transfer, correct_source, correct_target], gap_recovered, n_boot, seed, level)


def mcnemar_p(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> float:
    """Exact McNemar p-value: two-sided binomial(n = discordant, ½) test on the items only a got right."""
    a, b = np.asarray(correct_a, dtype=bool), np.asarray(correct_b, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"paired correctness needs equal shapes, got {a.shape} and {b.shape}")
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    n = only_a + only_b
    term = tail = 1  # C(n, 0); exact integers, C(n, i+1) = C(n, i)·(n − i)/(i + 1)
    for i in range(min(only_a, only_b)):
        term = term * (n - i) // (i + 1)
        tail += term
    return min(1.0, 2 * tail / 2**n)


def rank_correlation(x: Sequence[float], y: Sequence[float], n_boot: int = 10_000, seed: int = 0) -> Interval:
    """Spearman's ρ of paired values (runs), with a percentile CI from resampling the pairs (average ranks for ties;
    resamples with a constant side are skipped). Needs ≥ 3 pairs."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size < 3:
        raise ValueError(f"rank correlation needs ≥ 3 paired values, got {x.shape} and {y.shape}")

    def ranks(v: np.ndarray) -> np.ndarray:  # ties share their average rank
        order = np.empty(v.size)
        order[np.argsort(v, kind="stable")] = np.arange(v.size)
        _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
        return (np.bincount(inverse, weights=order) / counts)[inverse]

    def rho(a: np.ndarray, b: np.ndarray) -> float:
        ra, rb = ranks(a), ranks(b)
        return math.nan if ra.std() == 0 or rb.std() == 0 else float(np.corrcoef(ra, rb)[0, 1])

    rng = np.random.default_rng(seed)
    boot = np.array([rho(x[i], y[i]) for i in rng.integers(0, x.size, (n_boot, x.size))])
    boot = boot[np.isfinite(boot)]
    low, high = np.quantile(boot, [0.025, 0.975]) if boot.size else (math.nan, math.nan)
    return Interval(rho(x, y), float(low), float(high))


def position_relative_error(mapped: torch.Tensor, native: torch.Tensor) -> torch.Tensor:
    """‖mapped − native‖ / ‖native‖ per position, norms over layers, heads and head dim: [L, H, T, d] → [T]."""
    if mapped.shape != native.shape or mapped.dim() != 4:
        raise ValueError(
            f"need two [L, H, T, d] tensors of one shape, got {tuple(mapped.shape)}, {tuple(native.shape)}"
        )
    mapped, native = mapped.double(), native.double()
    return (mapped - native).square().sum((0, 1, 3)).sqrt() / native.square().sum((0, 1, 3)).sqrt()


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√d, causal) v with KV head j serving query heads j·g … (j+1)·g−1: [B, Hq, T, dv]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, T, ·]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_output_cosine(
    q: torch.Tensor, k_native: torch.Tensor, v_native: torch.Tensor, k_mapped: torch.Tensor, v_mapped: torch.Tensor
) -> float:
    """Mean over (batch, query head, position) of the cosine between causal attention outputs with the
    native and with the mapped K/V. q [B, Hq, T, d]; k, v [B, Hkv, T, d] with Hkv dividing Hq."""
    if q.shape[1] % k_native.shape[1]:
        raise ValueError(f"{k_native.shape[1]} KV heads do not divide {q.shape[1]} query heads")
    if k_native.shape != k_mapped.shape or v_native.shape != v_mapped.shape:
        raise ValueError("native and mapped K/V must have equal shapes")
    q = q.float()
    native = _causal_attention(q, k_native.float(), v_native.float())
    mapped = _causal_attention(q, k_mapped.float(), v_mapped.float())
    return float(F.cosine_similarity(native, mapped, dim=-1).mean())


def accuracy_by_length(correct: Sequence[bool], lengths: Sequence[int], edges: Sequence[float]) -> list[Bucket]:
    """Accuracy per context-length bucket [edges[i], edges[i+1]); every item must fall in one."""
    correct, lengths = np.asarray(correct, dtype=bool), np.asarray(lengths, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    if edges.size < 2 or bool((np.diff(edges) <= 0).any()):
        raise ValueError(f"need ≥ 2 increasing edges, got {edges.tolist()}")
    outside = (lengths < edges[0]) | (lengths >= edges[-1])
    if outside.any():
        raise ValueError(f"{int(outside.sum())} lengths outside [{edges[0]}, {edges[-1]})")
    which = np.searchsorted(edges, lengths, side="right") - 1  # bucket index per item
    buckets = []
    for i in range(edges.size - 1):
        hits = correct[which == i]
        buckets.append(
            Bucket(float(edges[i]), float(edges[i + 1]), int(hits.size), float(hits.mean()) if hits.size else math.nan)
        )
    return buckets


def mapper_r2(mapper: Mapper, traces: Traces) -> dict[str, float | list[float]]:
    """R² of the mapped K and V on these rows (content space): pooled, and per target layer (`*_layers`)."""
    token_rows = token_kv(traces.target_k[0], traces.target_v[0]).float() if mapper.token_features else None
    predicted_k, predicted_v = map_rows(mapper, traces.source_k.float(), traces.source_v.float(), token_rows)
    scores: dict[str, float | list[float]] = {}
    for name, predicted, actual in (("k", predicted_k, traces.target_k), ("v", predicted_v, traces.target_v)):
        actual = actual.double()
        residual = ((actual - predicted.double()) ** 2).sum((1, 2, 3))  # [L_t]
        spread = ((actual - actual.mean(dim=2, keepdim=True)) ** 2).sum((1, 2, 3))  # [L_t]
        scores[f"r2_{name}"] = float(1 - residual.sum() / spread.sum())
        scores[f"r2_{name}_layers"] = (1 - residual / spread).tolist()
    return scores
