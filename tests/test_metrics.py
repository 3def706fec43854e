"""Evaluation metrics against values worked out by hand (in the comments) and brute-force references."""

import math

import numpy as np
import pytest
import torch

from src.eval.metrics import (
    accuracy,
    accuracy_by_length,
    accuracy_difference_ci,
    attention_output_cosine,
    choice_correct,
    gap_recovered,
    gap_recovered_ci,
    mcnemar_p,
    paired_bootstrap,
    perplexity,
    position_relative_error,
    rank_correlation,
    retention,
    retention_ci,
)

# --------------------------------------------------------------------------- accuracy


def test_accuracy_argmax_first_maximum_wins():
    # argmax per item: 0 (label 0 ✓), 1 (label 0 ✗), tie → 0 (label 1 ✗)  ⇒  acc = 1/3
    lls = [[-1.0, -2.0], [-3.0, -1.0], [-2.0, -2.0]]
    assert choice_correct(lls, [0, 0, 1]).tolist() == [True, False, False]
    assert accuracy(lls, [0, 0, 1]) == pytest.approx(1 / 3)


def test_acc_norm_divides_by_length():
    # raw: −4 > −6 → choice 0; per length: −4/2 = −2 < −6/6 = −1 → choice 1 (ragged: the second item has 3 choices)
    lls, lengths = [[-4.0, -6.0], [-1.0, -5.0, -9.0]], [[2, 6], [1, 10, 30]]
    assert accuracy(lls, [1, 2]) == 0.0
    # second item: −1, −0.5, −0.3 → choice 2
    assert accuracy(lls, [1, 2], lengths) == 1.0
    with pytest.raises(ValueError):
        accuracy(lls, [1])


def test_perplexity():
    assert perplexity([-1.0, -3.0]) == pytest.approx(math.e**2)  # exp(−mean(−1, −3))


# --------------------------------------------------------------------------- retention, gap recovered


def test_retention_and_gap_recovered():
    assert retention(0.45, 0.5) == pytest.approx(0.9)
    assert math.isnan(retention(0.3, 0.0))
    assert gap_recovered(0.45, 0.40, 0.50) == pytest.approx(0.5)  # (0.45 − 0.40) / (0.50 − 0.40)
    assert gap_recovered(0.35, 0.40, 0.50) == pytest.approx(-0.5)  # worse than the source
    assert math.isnan(gap_recovered(0.45, 0.5, 0.5))
    out = gap_recovered(np.array([0.45, 0.6]), np.array([0.4, 0.5]), np.array([0.5, 0.5]))
    assert out[0] == pytest.approx(0.5) and math.isnan(out[1])


# --------------------------------------------------------------------------- McNemar


def _pair(only_a: int, only_b: int, both: int = 3, neither: int = 2) -> tuple[list[bool], list[bool]]:
    a = [True] * only_a + [False] * only_b + [True] * both + [False] * neither
    b = [False] * only_a + [True] * only_b + [True] * both + [False] * neither
    return a, b


def test_mcnemar_exact_binomial_values():
    # 1 vs 9 discordant: 2·(C(10,0) + C(10,1)) / 2¹⁰ = 22/1024 (= scipy binomtest(1, 10).pvalue)
    assert mcnemar_p(*_pair(1, 9)) == pytest.approx(22 / 1024, rel=1e-12)
    assert mcnemar_p(*_pair(9, 1)) == mcnemar_p(*_pair(1, 9))  # two-sided, symmetric
    assert mcnemar_p(*_pair(0, 5)) == pytest.approx(2 / 32)  # 2·C(5,0)/2⁵
    # 2 vs 8: 2·(1 + 10 + 45)/1024 = 112/1024
    assert mcnemar_p(*_pair(2, 8)) == pytest.approx(112 / 1024, rel=1e-12)


def test_mcnemar_edges():
    assert mcnemar_p(*_pair(0, 0)) == 1.0  # no discordant pairs
    assert mcnemar_p(*_pair(3, 3)) == 1.0  # 2·42/64 > 1 is capped
    assert mcnemar_p([], []) == 1.0
    # many discordant items stay exact and fast: 7000 vs 7042 ⇒ z ≈ 42/√14042 ≈ 0.35, p ≈ 0.73
    assert mcnemar_p(*_pair(7000, 7042)) == pytest.approx(0.73, abs=0.01)
    with pytest.raises(ValueError):
        mcnemar_p([True], [True, False])


# --------------------------------------------------------------------------- paired bootstrap


def _correct(n: int, p: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(n) < p


def test_bootstrap_difference_contains_estimate_and_is_deterministic():
    a, b = _correct(400, 0.6, 1), _correct(400, 0.5, 2)
    ci = accuracy_difference_ci(a, b, n_boot=2_000, seed=7)
    assert ci.estimate == pytest.approx(a.mean() - b.mean())
    assert ci.low < ci.estimate < ci.high
    assert accuracy_difference_ci(a, b, n_boot=2_000, seed=7) == ci
    assert accuracy_difference_ci(a, b, n_boot=2_000, seed=8) != ci


def test_bootstrap_width_matches_normal_approximation():
    # a always right, b right on every other item: diff 0.5, sd of a paired mean = √(0.25/400) = 0.025 ⇒ ±0.049
    a, b = np.ones(400, dtype=bool), np.arange(400) % 2 == 0
    ci = accuracy_difference_ci(a, b, n_boot=4_000, seed=0)
    assert ci.estimate == 0.5
    assert ci.low == pytest.approx(0.5 - 0.049, abs=0.008) and ci.high == pytest.approx(0.5 + 0.049, abs=0.008)


def test_bootstrap_pairing_cancels_shared_items():
    # identical methods: every paired resample has difference 0 (an unpaired bootstrap would not)
    a = _correct(300, 0.5, 3)
    assert accuracy_difference_ci(a, a, n_boot=500) == accuracy_difference_ci(a, a.copy(), n_boot=500)
    ci = accuracy_difference_ci(a, a, n_boot=500)
    assert (ci.estimate, ci.low, ci.high) == (0.0, 0.0, 0.0)


def test_retention_and_gap_recovered_ci():
    source, target = _correct(500, 0.4, 4), _correct(500, 0.7, 5)
    transfer = np.where(np.arange(500) % 2 == 0, target, source)  # half the items from each
    ci = retention_ci(transfer, target, n_boot=1_000)
    assert ci.estimate == pytest.approx(transfer.mean() / target.mean())
    assert ci.low < ci.estimate < ci.high
    ci = gap_recovered_ci(transfer, source, target, n_boot=1_000)
    assert ci.estimate == pytest.approx((transfer.mean() - source.mean()) / (target.mean() - source.mean()))
    assert ci.low < ci.estimate < ci.high
    # target == source on every resample: undefined everywhere
    same = gap_recovered_ci(transfer, source, source, n_boot=200)
    assert all(math.isnan(v) for v in (same.estimate, same.low, same.high))


def test_paired_bootstrap_chunking_and_errors():
    # more resamples than one chunk (2²² / N rows) still gives n_boot replicates of a generic statistic
    x = _correct(20_000, 0.5, 6)
    ci = paired_bootstrap([x], lambda m: m, n_boot=500, seed=1)
    assert ci.low < x.mean() < ci.high
    with pytest.raises(ValueError):
        paired_bootstrap([[]], lambda m: m)
    with pytest.raises(ValueError):
        paired_bootstrap([[1.0]], lambda m: m, n_boot=0)


# --------------------------------------------------------------------------- cache fidelity


def test_position_relative_error():
    native = torch.ones(2, 3, 4, 5)  # [L, H, T, d]
    mapped = native.clone()
    mapped[:, :, 1] *= 1.1  # ‖0.1·x‖/‖x‖ = 0.1 at position 1
    mapped[0, 0, 3, 0] += 2.0  # position 3: ‖2‖ / √(2·3·5) = 2/√30
    error = position_relative_error(mapped, native)
    assert error.shape == (4,)
    torch.testing.assert_close(error, torch.tensor([0.0, 0.1, 0.0, 2 / math.sqrt(30)], dtype=torch.float64))
    with pytest.raises(ValueError):
        position_relative_error(mapped[0], native[0])


def _reference_attention(q, k, v):
    """Per query head h, KV head h // group, explicit causal softmax."""
    batch, heads, length, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        scores = q[:, h].double() @ k[:, h // group].double().transpose(-1, -2) / math.sqrt(dim)  # [B, T, T]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)
        out[:, h] = scores.softmax(-1) @ v[:, h // group].double()
    return out


def test_attention_output_cosine_by_hand():
    # q = 0 ⇒ uniform causal attention: t=0 reads v0, t=1 reads (v0 + v1)/2.
    # native v0 = (1,0), v1 = (0,1) → outputs (1,0), (½,½); mapped v0 = v1 = (1,0) → (1,0), (1,0)
    # cosines 1 and ½/(√½·1) = 1/√2; mean (1 + 1/√2)/2; both query heads share the single KV head
    q, k = torch.zeros(1, 2, 2, 2), torch.randn(1, 1, 2, 2)
    v_native, v_mapped = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]]), torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])
    assert attention_output_cosine(q, k, v_native, k, v_mapped) == pytest.approx((1 + 1 / math.sqrt(2)) / 2, abs=1e-6)
    assert attention_output_cosine(q, k, v_native, k, v_native) == pytest.approx(1.0, abs=1e-6)


def test_attention_output_cosine_matches_gqa_reference():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=generator)  # [B, Hq, T, d]
    k, v = torch.randn(2, 2, 6, 8, generator=generator), torch.randn(2, 2, 6, 8, generator=generator)
    k_mapped = k + 0.3 * torch.randn(k.shape, generator=generator)
    v_mapped = v.clone()
    v_mapped[:, 1] = -v_mapped[:, 1]  # KV head 1 serves query heads 2, 3 (not 1, 3)
    native, mapped = _reference_attention(q, k, v), _reference_attention(q, k_mapped, v_mapped)
    expected = float(torch.nn.functional.cosine_similarity(native, mapped, dim=-1).mean())
    assert attention_output_cosine(q, k, v, k_mapped, v_mapped) == pytest.approx(expected, abs=1e-5)
    # bf16 caches are upcast
    assert attention_output_cosine(q.bfloat16(), k.bfloat16(), v.bfloat16(), k.bfloat16(), v.bfloat16()) == (
        pytest.approx(1.0, abs=1e-5)
    )
    with pytest.raises(ValueError):
        attention_output_cosine(torch.randn(1, 3, 6, 8), k[:1], v[:1], k[:1], v[:1])  # 2 ∤ 3


# --------------------------------------------------------------------------- length buckets


def test_accuracy_by_length():
    # [0,128): lengths 10 ✓, 20 ✗ → ½; [128,256): 150 ✓ → 1; [256,512): 256 ✓, 511 ✗ → ½; [512,1024): empty
    buckets = accuracy_by_length([True, False, True, True, False], [10, 20, 150, 256, 511], [0, 128, 256, 512, 1024])
    assert [(b.low, b.high, b.count) for b in buckets] == [(0, 128, 2), (128, 256, 1), (256, 512, 2), (512, 1024, 0)]
    assert [b.accuracy for b in buckets[:3]] == [0.5, 1.0, 0.5] and math.isnan(buckets[3].accuracy)
    with pytest.raises(ValueError, match="outside"):
        accuracy_by_length([True], [512], [0, 512])  # the last edge is exclusive
    with pytest.raises(ValueError):
        accuracy_by_length([True], [5], [10, 0])


def test_rank_correlation_is_spearmans_rho_with_average_ranks_for_ties():
    x, y = [1, 2, 2, 3, 5, 4, 7.0], [2, 1, 4, 3, 6, 6, 9.0]  # ties on both sides; scipy.stats.spearmanr: 0.8727…
    found = rank_correlation(x, y, 2000)
    assert found.estimate == pytest.approx(0.872727, abs=1e-6) and found.low < found.estimate <= found.high <= 1
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40.0], 200).estimate == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1.0], 200).estimate == pytest.approx(-1.0)
    assert math.isnan(rank_correlation([1, 2, 3], [5, 5, 5.0], 200).estimate)  # a constant side has no ranking
    with pytest.raises(ValueError, match="≥ 3 paired values"):
        rank_correlation([1, 2], [2, 1])
