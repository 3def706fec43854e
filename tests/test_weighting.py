"""Attn-Repair calibration weights (paper §3.3, Eqs. 15–19) and their collection from real models.

Exactness against the closed forms (Kish α*, Eq. 18 identity), a brute-force per-query-head reference of
the attention sensitivities, and end-to-end invariants of `collect_traces(attention_boundaries>0)`.
"""

import math

import pytest
import torch

from src.traces import attention_sensitivity, collect_traces, log_boundaries
from src.weighting import attn_repair_weights, kish_alpha, kish_ess
from tests.conftest import calibration_ids, tiny

# --------------------------------------------------------------------------- Kish floor (Eqs. 17–19)


def _eq19(cv2: float, n: int, p: int) -> float:
    tau = min(n, 2 * p)
    return 1.0 if cv2 == 0 else min(1.0, math.sqrt((n / tau - 1) / cv2))


def _concentrated_raw(n: int, heads: int = 3, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed nonnegative sensitivities (large CV²), like attention mass on a few tokens."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(heads, n, generator=generator, dtype=torch.float64) ** 12


def test_kish_alpha_matches_eq19_on_a_grid():
    cv2 = torch.tensor([0.0, 1e-6, 0.01, 0.5, 1.0, 3.0, 47.0, 1e4], dtype=torch.float64)
    for n, p in ((1000, 10), (500, 64), (64, 8), (100, 50), (30, 40)):
        alpha = kish_alpha(cv2, n, p)
        expected = torch.tensor([_eq19(float(c), n, p) for c in cv2], dtype=torch.float64)
        torch.testing.assert_close(alpha, expected, rtol=1e-12, atol=0)
        assert bool(((alpha >= 0) & (alpha <= 1)).all())


def test_kish_alpha_cv2_zero_is_one():
    alpha = kish_alpha(torch.zeros(4, dtype=torch.float64), rows=1000, width=10)
    assert torch.equal(alpha, torch.ones(4, dtype=torch.float64))
    # even when the floor would leave no room at all (τ = n)
    assert torch.equal(kish_alpha(torch.zeros(2, dtype=torch.float64), rows=10, width=10), torch.ones(2).double())


def test_kish_alpha_cap_lowers_alpha():
    cv2 = torch.tensor([0.0, 1e-4, 100.0], dtype=torch.float64)
    capped = kish_alpha(cv2, 1000, 10, cap=0.3)
    torch.testing.assert_close(capped, torch.minimum(kish_alpha(cv2, 1000, 10), torch.tensor(0.3).double()))


def test_attn_repair_weights_binding_floor_hits_tau_exactly():
    n, p = 1000, 100  # τ = min(n, 2p) = 200; CV²(u¹²) ≈ 5.8 > n/τ − 1 = 4
    raw = _concentrated_raw(n)
    w, stats = attn_repair_weights(raw, width=p)
    alpha = torch.tensor(stats["alpha"], dtype=torch.float64)
    assert bool((alpha < 1).all()), "this raw set must make the Kish floor bind"
    ess = kish_ess(w)
    torch.testing.assert_close(ess, torch.full_like(ess, 200.0), rtol=0, atol=1e-9)
    torch.testing.assert_close(torch.tensor(stats["n_eff"], dtype=torch.float64), ess, rtol=1e-12, atol=0)
    # the largest admissible α: a slightly larger one violates n_eff ≥ τ (Eq. 19 is "largest α")
    r = raw / raw.mean(-1, keepdim=True)
    assert bool((kish_ess(1 + (alpha * 1.01)[:, None] * (r - 1)) < 200).all())


def test_attn_repair_weights_non_binding_keeps_alpha_one():
    n, p = 1000, 10
    generator = torch.Generator().manual_seed(1)
    raw = 1 + 0.3 * torch.rand(2, n, generator=generator, dtype=torch.float64)  # CV² ≈ 0.006
    w, stats = attn_repair_weights(raw, width=p)
    assert stats["alpha"] == [1.0, 1.0]
    assert bool((kish_ess(w) >= 2 * p).all())
    torch.testing.assert_close(w, raw / raw.mean(-1, keepdim=True), rtol=1e-14, atol=0)  # α = 1 → w = r


def test_attn_repair_weights_form_eq17_and_mean_one():
    n, p = 777, 16
    raw = _concentrated_raw(n, heads=4, seed=3)
    raw[1] = 1 + 0.01 * raw[1]  # one non-binding head beside binding ones
    w, stats = attn_repair_weights(raw, width=p)
    assert w.shape == raw.shape
    torch.testing.assert_close(w.mean(-1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((w >= 0).all())
    r = raw / raw.mean(-1, keepdim=True)
    cv2 = ((r - 1) ** 2).mean(-1)
    torch.testing.assert_close(torch.tensor(stats["cv2"], dtype=torch.float64), cv2, rtol=1e-12, atol=0)
    alpha = torch.tensor([_eq19(float(c), n, p) for c in cv2], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(stats["alpha"], dtype=torch.float64), alpha, rtol=1e-12, atol=0)
    torch.testing.assert_close(w, 1 + alpha[:, None] * (r - 1), rtol=1e-12, atol=1e-14)


def test_attn_repair_weights_degenerate_rows():
    n = 50
    raw = torch.zeros(3, n, dtype=torch.float64)
    raw[1] = 0.37  # constant, not a power of two: r = 1 up to rounding
    raw[2, 7] = 5.0  # all mass on one row, but τ = min(n, 2p) = n → α = 0 → uniform
    w, stats = attn_repair_weights(raw, width=n)
    torch.testing.assert_close(w, torch.ones_like(w), rtol=0, atol=1e-12)
    assert stats["alpha"][0] == 1.0  # all-zero sensitivities: CV² = 0
    assert stats["alpha"][2] == 0.0


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_kish_ess_eq18_identity(alpha):
    n = 640
    raw = _concentrated_raw(n, heads=2, seed=7)
    r = raw / raw.mean(-1, keepdim=True)
    cv2 = ((r - 1) ** 2).mean(-1)
    w = 1 + alpha * (r - 1)
    torch.testing.assert_close(kish_ess(w), n / (1 + alpha**2 * cv2), rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- sensitivities (Eqs. 15–16)


def _brute_sensitivity(query, key, value, boundaries, eligible, d):
    """Eqs. 15–16 with explicit loops over batch, KV head, boundary and query head, in float64.

    Query head u belongs to KV head u // group (HF GQA order). At boundary c the query at position c
    attends to keys 0..c; sensitivities live on eligible positions i < c, normalized to unit mass per
    (head, component, boundary); boundaries add with equal mass.
    """
    batch, q_heads, seq, _ = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    r_k = torch.zeros(batch, kv_heads, seq, dtype=torch.float64)
    r_v = torch.zeros(batch, kv_heads, seq, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            for c in boundaries:
                prefix = [i for i in range(c) if eligible[i]]
                if not prefix:
                    continue
                rk_c = torch.zeros(seq, dtype=torch.float64)
                rv_c = torch.zeros(seq, dtype=torch.float64)
                for u in range(h * group, (h + 1) * group):
                    q = query[b, u, c].double()
                    keys, values = key[b, h, : c + 1].double(), value[b, h, : c + 1].double()
                    a = torch.softmax(keys @ q / math.sqrt(d), dim=0)
                    o = a @ values
                    for i in range(c + 1):
                        rv_c[i] += a[i] ** 2
                        rk_c[i] += a[i] ** 2 * ((values[i] - o) ** 2).sum() * (q @ q) / d
                for r_c, out in ((rk_c, r_k), (rv_c, r_v)):
                    masked = torch.zeros(seq, dtype=torch.float64)
                    masked[prefix] = r_c[prefix]
                    out[b, h] += masked / masked.sum()
    return r_k, r_v


def _random_qkv(seed=0, batch=2, q_heads=4, kv_heads=2, seq=24, d=8):
    generator = torch.Generator().manual_seed(seed)
    query = 1.5 * torch.randn(batch, q_heads, seq, d, generator=generator)
    key = torch.randn(batch, kv_heads, seq, d, generator=generator)
    value = torch.randn(batch, kv_heads, seq, d, generator=generator)
    return query, key, value


SEQ, DIM = 24, 8
ELIGIBLE = torch.arange(SEQ) % 3 == 1  # sampled positions 1, 4, 7, …
BOUNDARIES = [0, 1, 5, 12, 23]  # 0 and 1 have no eligible prefix position (i < c)


def test_attention_sensitivity_matches_brute_force_gqa():
    query, key, value = _random_qkv(seq=SEQ, d=DIM)  # 2 query heads per KV head
    r_k, r_v = attention_sensitivity(query[:, :, BOUNDARIES], key, value, BOUNDARIES, ELIGIBLE, DIM**-0.5)
    ref_k, ref_v = _brute_sensitivity(query, key, value, BOUNDARIES, ELIGIBLE, DIM)
    assert r_k.shape == r_v.shape == (2, 2, SEQ)
    torch.testing.assert_close(r_v.double(), ref_v, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(r_k.double(), ref_k, rtol=1e-4, atol=1e-7)


def test_attention_sensitivity_unit_mass_per_boundary():
    query, key, value = _random_qkv(seed=1, seq=SEQ, d=DIM)
    positions = torch.arange(SEQ)
    for c in BOUNDARIES:
        r_k, r_v = attention_sensitivity(query[:, :, [c]], key, value, [c], ELIGIBLE, DIM**-0.5)
        inside = ELIGIBLE & (positions < c)
        for r in (r_k, r_v):
            assert bool((r >= 0).all()) and bool(torch.isfinite(r).all())
            assert bool((r[..., ~inside] == 0).all()), "mass outside the eligible prefix"
            mass = r[..., inside].sum(-1)
            expected = torch.ones_like(mass) if bool(inside.any()) else torch.zeros_like(mass)
            torch.testing.assert_close(mass, expected, rtol=0, atol=1e-5)


def test_attention_sensitivity_equal_mass_sum():
    query, key, value = _random_qkv(seed=2, seq=SEQ, d=DIM)
    r_k, r_v = attention_sensitivity(query[:, :, BOUNDARIES], key, value, BOUNDARIES, ELIGIBLE, DIM**-0.5)
    with_mass = sum(bool((ELIGIBLE & (torch.arange(SEQ) < c)).any()) for c in BOUNDARIES)
    assert with_mass == 3
    for r in (r_k, r_v):
        torch.testing.assert_close(r.sum(-1), torch.full((2, 2), float(with_mass)), rtol=0, atol=1e-5)
    # the sum equals the per-boundary results added up
    parts = [attention_sensitivity(query[:, :, [c]], key, value, [c], ELIGIBLE, DIM**-0.5) for c in BOUNDARIES]
    torch.testing.assert_close(r_k, sum(p[0] for p in parts), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r_v, sum(p[1] for p in parts), rtol=1e-6, atol=1e-7)


def test_log_boundaries_paper_setting():
    b = log_boundaries(1024, 32, 12)
    assert len(b) == 32
    assert b[0] == 12 and b[-1] == 1023
    assert b == sorted(set(b))
    steps = torch.tensor(b, dtype=torch.float64).log().diff()
    ideal = math.log(1023 / 12) / 31
    # log-spaced: equal ratios up to integer rounding
    assert float((steps - ideal).abs().max()) < 0.5 / 12 + 1e-9


def test_log_boundaries_short_sequence():
    assert log_boundaries(10, 32, 12) == [9]
    b = log_boundaries(40, 4, 12)
    assert b[0] == 12 and b[-1] == 39 and len(b) == 4


# --------------------------------------------------------------------------- collect_traces


@pytest.mark.parametrize("source_family,target_family", [("llama", "qwen3"), ("qwen2", "llama")])
def test_collect_traces_attention_weights(source_family, target_family):
    source, target = tiny(source_family), tiny(target_family, seed=1)
    ids = calibration_ids(3, 40)
    stride = 2
    traces = collect_traces(source, target, ids, stride=stride, batch_size=2, attention_boundaries=4)
    boundaries = traces.meta["attention_boundaries"]
    assert boundaries == log_boundaries(40, 4, 12)
    rows = 3 * 20
    assert traces.rows == rows
    for r in (traces.attn_k, traces.attn_v):
        assert r.shape == (3, 2, rows)  # [L_t, H_t, n]
        assert bool(torch.isfinite(r).all()) and bool((r >= 0).all())
        # each boundary spreads unit mass over the sampled prefix of its sequence (position 0 is sampled)
        per_sequence = r.unflatten(-1, (3, 20)).sum(-1)
        torch.testing.assert_close(per_sequence, torch.full_like(per_sequence, len(boundaries)), rtol=0, atol=1e-5)

    # r^V end to end: the target's own eager attention probabilities at each boundary query (Eq. 15)
    with torch.no_grad():
        attentions = target(ids, output_attentions=True).attentions  # L_t × [B, H_q, T, T]
    eligible = torch.arange(40) % stride == 0
    for layer, a in enumerate(attentions):
        expected = torch.zeros(3, 2, 40, dtype=torch.float64)
        for c in boundaries:
            r = (a[:, :, c].double() ** 2).unflatten(1, (2, 2)).sum(2) * (eligible & (torch.arange(40) < c))
            expected += r / r.sum(-1, keepdim=True)
        got = traces.attn_v[layer].unflatten(-1, (3, 20)).transpose(0, 1)  # [B, H_t, t]
        torch.testing.assert_close(got, expected[:, :, ::stride], rtol=1e-4, atol=1e-6)


def test_collect_traces_attention_weights_self_transfer():
    model = tiny("llama")
    traces = collect_traces(model, model, calibration_ids(2, 32), stride=2, batch_size=2, attention_boundaries=3)
    assert traces.attn_k.shape == traces.attn_v.shape == (3, 2, traces.rows)
