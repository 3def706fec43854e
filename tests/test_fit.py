"""Mapper fitting (paper §3.1–3.4): planted-map recovery, streaming = materialized statistics, the ridge
closed form (Eq. 10/23), coefficient counts (Eqs. 12–13), head assignment, PCA control, layer selection,
and end-to-end fits between real tiny models with mismatched KV interfaces.
"""

import pytest
import torch

from src.apply import KVTransfer
from src.eval.metrics import mapper_r2
from src.fit import fit_mapper, fit_transfer
from src.forward import prefill
from src.models import vocabulary_hash
from src.select import depth_layers, probe_r2, select_layers
from src.stats import Moments, reference_moments, ridge_solve, streaming_moments
from src.support import coefficient_count, gather_features, head_assignment
from src.traces import Traces, collect_traces
from tests.conftest import calibration_ids, tiny

# --------------------------------------------------------------------------- synthetic traces


def _source(layers, heads, dim, rows, seed, scale=1.0, offset=0.0, dtype=torch.float32):
    """Correlated-across-channels source rows [L_s, H_s, n, d_s] (stored like real traces, float32)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(layers, heads, rows, dim, generator=generator, dtype=torch.float64)
    mix = torch.eye(dim, dtype=torch.float64) + 0.3 * torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    return (base @ mix * scale + offset).to(dtype)


def _plant(source, layers, head_index, dim, seed, noise=0.0):
    """target[ℓ] = gather_features(source, S_ℓ, head_index)·W_ℓ + b_ℓ (+ noise): [L_t, H_t, n, d_t], W, b."""
    generator = torch.Generator().manual_seed(seed)
    features = [gather_features(source, layers[ell], head_index).double() for ell in range(layers.shape[0])]
    heads, rows, width = features[0].shape
    weight = torch.randn(layers.shape[0], heads, width, dim, generator=generator, dtype=torch.float64) / width**0.5
    bias = 3 * torch.randn(layers.shape[0], heads, dim, generator=generator, dtype=torch.float64)
    target = torch.stack([torch.baddbmm(bias[ell][:, None], x, weight[ell]) for ell, x in enumerate(features)])
    if noise:
        spread = target.std(dim=2, keepdim=True)
        target = target + noise * spread * torch.randn(target.shape, generator=generator, dtype=torch.float64)
    return target.to(source.dtype), weight, bias


def _traces(source_k, source_v, target_k, target_v, attn=None, sequences=1):
    rows = source_k.shape[2]
    per_sequence = rows // sequences
    return Traces(
        source_k=source_k,
        source_v=source_v,
        target_k=target_k,
        target_v=target_v,
        sequence_index=torch.arange(rows) // per_sequence,
        position=torch.arange(rows) % per_sequence,
        attn_k=None if attn is None else attn[0],
        attn_v=None if attn is None else attn[1],
        meta={"synthetic": True},
    )


def _planted_traces(support, source_heads=2, target_heads=2, k=2, d_s=8, d_t=6, rows=600, noise=1e-5, **scaling):
    """Both components planted; S_ℓ = a fixed k-subset of 3 source layers for each of 2 target layers."""
    layers = torch.tensor([[0, 2], [1, 2]])[:, :k]
    head_index = head_assignment(support, source_heads, target_heads)
    source_k = _source(3, source_heads, d_s, rows, seed=1, **scaling)
    source_v = _source(3, source_heads, d_s, rows, seed=2, **scaling)
    target_k, weight_k, bias_k = _plant(source_k, layers, head_index, d_t, seed=3, noise=noise)
    target_v, weight_v, bias_v = _plant(source_v, layers, head_index, d_t, seed=4, noise=noise)
    traces = _traces(source_k, source_v, target_k, target_v)
    return traces, layers, head_index, {"k": (weight_k, bias_k), "v": (weight_v, bias_v)}


def _fit(traces, layers, head_index, support, weighting="uniform", lam=1e-8, relative=True, chunk=97, **kw):
    return fit_mapper(traces, layers, head_index, support, weighting, lam, relative, chunk, **kw)


def _relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# --------------------------------------------------------------------------- planted map recovery


@pytest.mark.parametrize(
    "support,source_heads,target_heads",
    [("full", 2, 2), ("local", 2, 2), ("full", 2, 4), ("local", 2, 4), ("local", 4, 2)],
)
def test_planted_affine_map_is_recovered(support, source_heads, target_heads):
    traces, layers, head_index, planted = _planted_traces(support, source_heads, target_heads)
    mapper = _fit(traces, layers, head_index, support)
    scores = mapper_r2(mapper, traces)
    assert scores["r2_k"] > 0.9999 and scores["r2_v"] > 0.9999, scores
    for component, (weight, bias) in planted.items():
        fitted_w, fitted_b = getattr(mapper, f"weight_{component}"), getattr(mapper, f"bias_{component}")
        assert fitted_w.shape == weight.shape and fitted_b.shape == bias.shape
        assert _relative_error(fitted_w, weight) < 1e-3
        assert _relative_error(fitted_b, bias) < 1e-3
    assert torch.equal(mapper.source_layers, layers) and torch.equal(mapper.head_index, head_index)


@pytest.mark.parametrize(
    "scaling",
    [dict(offset=1e3), dict(scale=1e-3), dict(scale=1e4), dict(scale=1e4, offset=1e3)],
    ids=["offset1e3", "scale1e-3", "scale1e4", "scale1e4+offset1e3"],
)
@pytest.mark.parametrize("support", ["full", "local"])
def test_planted_map_numerically_robust(support, scaling):
    """Centering before accumulating + float64 keep large offsets and extreme scales from cancelling."""
    traces, layers, head_index, planted = _planted_traces(support, **scaling)
    mapper = _fit(traces, layers, head_index, support)
    scores = mapper_r2(mapper, traces)
    assert scores["r2_k"] > 0.9999 and scores["r2_v"] > 0.9999, scores
    for component, (weight, bias) in planted.items():
        assert _relative_error(getattr(mapper, f"weight_{component}"), weight) < 1e-3
        # b̂ = ȳ − x̄Ŵ: its error scales with the offset times the weight error; compare on the target scale
        target = getattr(traces, f"target_{component}").double()
        bias_error = (getattr(mapper, f"bias_{component}").double() - bias).abs().max()
        assert float(bias_error) < 1e-3 * float(target.abs().max())


# --------------------------------------------------------------------------- streaming statistics


def _design(heads=3, rows=53, width=5, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(heads, rows, width, generator=generator) * 2 + 40).float()
    y = (x.double() @ torch.randn(heads, width, dim, generator=generator, dtype=torch.float64)).float() - 7
    y = y + torch.randn(y.shape, generator=generator)
    w = torch.rand(heads, rows, generator=generator, dtype=torch.float64) ** 3
    return x, y, (w / w.mean(-1, keepdim=True)).float()


def _assert_moments_equal(a: Moments, b: Moments, rtol=1e-10):
    for name in ("mean_x", "mean_y", "xx", "xy", "yy"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=rtol, atol=rtol * 1e-2, msg=name)
    assert a.rows == b.rows


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, 53, 64])  # 7 does not divide n = 53; 64 > n
def test_streaming_moments_equal_reference(chunk_rows, weighted):
    x, y, w = _design()
    w = w if weighted else None
    seen = []

    def chunk(span):
        seen.append(span.stop - span.start)
        return x[:, span], y[:, span], None if w is None else w[:, span]

    streamed = streaming_moments(chunk, x.shape[1], chunk_rows)
    assert max(seen) <= chunk_rows and sum(seen) == 2 * x.shape[1]  # two passes of bounded chunks
    reference = reference_moments(x, y, w)
    _assert_moments_equal(streamed, reference)
    for lam, relative in ((0.1, False), (1e-4, True)):
        w_s, b_s = ridge_solve(streamed, lam, relative)
        w_r, b_r = ridge_solve(reference, lam, relative)
        torch.testing.assert_close(w_s, w_r, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(b_s, b_r, rtol=1e-9, atol=1e-10)


def test_reference_moments_match_definitions():
    x, y, w = _design(seed=4)
    m = reference_moments(x, y, w)
    xd, yd, wd = x.double(), y.double(), w.double()
    mean_x = (wd[..., None] * xd).sum(1) / wd.sum(1, keepdim=True)
    xc = xd - mean_x[:, None]
    torch.testing.assert_close(m.mean_x, mean_x, rtol=1e-12, atol=0)
    mean_y = (wd[..., None] * yd).sum(1) / wd.sum(1, keepdim=True)
    yc = yd - mean_y[:, None]
    torch.testing.assert_close(m.mean_y, mean_y, rtol=1e-12, atol=0)
    torch.testing.assert_close(m.xx, torch.einsum("hn,hnp,hnq->hpq", wd, xc, xc), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m.xy, torch.einsum("hn,hnp,hnq->hpq", wd, xc, yc), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m.yy, torch.einsum("hn,hnd,hnd->h", wd, yc, yc), rtol=1e-10, atol=1e-10)
    assert m.xx.dtype == torch.float64 and m.rows == x.shape[1]


def _weighted_synthetic_traces():
    traces, layers, head_index, _ = _planted_traces("local", rows=301, noise=0.05)
    generator = torch.Generator().manual_seed(9)
    attn = [torch.rand(2, 2, 301, generator=generator, dtype=torch.float64) ** 4 for _ in range(2)]
    traces.attn_k, traces.attn_v = attn
    return traces, layers, head_index


@pytest.mark.parametrize(("statistics", "tolerance"), [("streaming", 1e-8), ("fused", 1e-6)])
@pytest.mark.parametrize("weighting", ["uniform", "attn_repair"])
@pytest.mark.parametrize("support", ["full", "local"])
def test_fit_statistics_agree_with_generic(support, weighting, statistics, tolerance):
    """fit.statistics = streaming | fused give the generic (materialized float64) artifact within the 1e-6 contract;
    fused runs the kernels' integer-digit arithmetic on CPU. Offsets of 1e3 exercise its centring correction."""
    traces, layers, _ = _weighted_synthetic_traces()
    traces.source_k, traces.source_v = traces.source_k + 1e3, traces.source_v - 1e3
    head_index = head_assignment(support, 2, 2)
    kwargs = dict(lam=0.01, relative=False, chunk=37)  # 37 ∤ 301
    generic = _fit(traces, layers, head_index, support, weighting, statistics="generic", **kwargs)
    other = _fit(traces, layers, head_index, support, weighting, statistics=statistics, **kwargs)
    for name in ("weight_k", "bias_k", "weight_v", "bias_v"):
        assert _relative_error(getattr(other, name), getattr(generic, name)) < tolerance, name
    assert other.manifest["alpha"] == generic.manifest["alpha"]
    assert (generic.manifest["statistics"], other.manifest["statistics"]) == ("generic", statistics)


def test_statistics_option_aliases_and_refusals():
    traces, layers, head_index = _weighted_synthetic_traces()
    legacy = fit_mapper(traces, layers, head_index, "local", "uniform", 0.01, False, 64, True)  # old `reference`
    generic = fit_mapper(traces, layers, head_index, "local", "uniform", 0.01, False, 64, "generic")
    assert torch.equal(legacy.weight_k, generic.weight_k) and legacy.manifest["statistics"] == "generic"
    with pytest.raises(ValueError, match="unknown statistics"):
        _fit(traces, layers, head_index, "local", statistics="float16")
    with pytest.raises(ValueError, match="statistics=fused gathers head blocks only"):
        _fit(traces, layers, head_index, "local", statistics="fused", token_features=True)
    with pytest.raises(ValueError, match="statistics=fused gathers head blocks only"):
        _fit(traces, layers, head_assignment("pca", 2, 2), "pca", statistics="fused")


def test_uniform_attn_repair_weights_equal_plain_ridge():
    traces, layers, head_index = _weighted_synthetic_traces()
    plain = _fit(traces, layers, head_index, "local", "uniform", lam=0.01, relative=False)
    for value, exact in ((0.25, True), (0.37, False)):
        traces.attn_k = torch.full_like(traces.attn_k, value)
        traces.attn_v = torch.full_like(traces.attn_v, value)
        repaired = _fit(traces, layers, head_index, "local", "attn_repair", lam=0.01, relative=False)
        assert repaired.manifest["alpha"] == {"k": [[1.0, 1.0]] * 2, "v": [[1.0, 1.0]] * 2}
        for name in ("weight_k", "bias_k", "weight_v", "bias_v"):
            if exact:  # raw/mean = 1 exactly → w ≡ 1 → bit-identical statistics
                assert torch.equal(getattr(repaired, name), getattr(plain, name)), name
            else:  # raw/mean = 1 ± ulp
                assert _relative_error(getattr(repaired, name), getattr(plain, name)) < 1e-10, name


def test_attn_repair_needs_sensitivities():
    traces, layers, head_index, _ = _planted_traces("local")
    with pytest.raises(ValueError, match="attention_boundaries"):
        _fit(traces, layers, head_index, "local", "attn_repair")


# --------------------------------------------------------------------------- ridge closed form (Eq. 10)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("lam,relative", [(0.0, False), (0.5, False), (30.0, False), (1e-3, True), (0.2, True)])
def test_ridge_solve_equals_closed_form(lam, relative, weighted):
    x, y, w = _design(heads=2, rows=40, width=6, dim=3, seed=11)
    w = w.double() / w.double().mean(-1, keepdim=True) if weighted else torch.ones(2, 40, dtype=torch.float64)
    weight, bias = ridge_solve(reference_moments(x, y, w if weighted else None), lam, relative)

    xd, yd, n = x.double(), y.double(), x.shape[1]
    mean_x = (w[..., None] * xd).sum(1) / n  # x̄_w = n⁻¹ Σ wᵢ xᵢ (mean-one weights)
    mean_y = (w[..., None] * yd).sum(1) / n
    xc, yc = xd - mean_x[:, None], yd - mean_y[:, None]
    d = torch.diag_embed(w)
    gram = xc.transpose(1, 2) @ d @ xc
    lam_h = lam * gram.diagonal(dim1=-2, dim2=-1).mean(-1) if relative else torch.full((2,), lam).double()
    eye = torch.eye(6, dtype=torch.float64)
    expected_w = torch.linalg.solve(gram + lam_h[:, None, None] * eye, xc.transpose(1, 2) @ d @ yc)
    expected_b = mean_y - (mean_x[:, None] @ expected_w)[:, 0]
    torch.testing.assert_close(weight, expected_w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(bias, expected_b, rtol=1e-9, atol=1e-10)


def test_ridge_solve_relative_lambda_is_scale_invariant():
    x, y, _ = _design(seed=12)
    w1, _ = ridge_solve(reference_moments(x, y, None), 0.3, relative=True)
    w2, _ = ridge_solve(reference_moments(x * 1e3, y * 1e3, None), 0.3, relative=True)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-9)  # float32 inputs: x·1e3 rounds differently


def test_ridge_solve_nan_gram_raises():
    x, y, _ = _design()
    moments = reference_moments(x, y, None)
    moments.xx[1, 2, 2] = float("nan")
    with pytest.raises(FloatingPointError):
        ridge_solve(moments, 0.01, relative=False)
    with pytest.raises(FloatingPointError):
        ridge_solve(moments, 0.01, relative=True)
    x[0, 3, 1] = float("nan")  # a NaN trace row poisons the whole Gram of head 0
    with pytest.raises(FloatingPointError):
        ridge_solve(reference_moments(x, y, None), 0.01, relative=False)


def test_ridge_solve_nan_cross_moment_raises():
    x, y, _ = _design()
    moments = reference_moments(x, y, None)
    moments.xy[0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        ridge_solve(moments, 0.01, relative=False)


# --------------------------------------------------------------------------- coefficient counts (Eqs. 12–13)


@pytest.mark.parametrize(
    "target_layers,target_heads,k,d_s,d_t,source_heads",
    [(40, 8, 8, 128, 128, 8), (3, 2, 1, 16, 16, 2), (5, 4, 3, 64, 128, 2), (7, 1, 2, 32, 8, 4), (2, 6, 2, 8, 16, 3)],
)
def test_coefficient_count_eq12_eq13(target_layers, target_heads, k, d_s, d_t, source_heads):
    full = coefficient_count(target_layers, target_heads, k, source_heads, d_s, d_t)
    local = coefficient_count(target_layers, target_heads, k, 1, d_s, d_t)
    assert full == 2 * target_layers * target_heads * (k * source_heads * d_s) * d_t  # Eq. 12
    assert local == 2 * target_layers * target_heads * (k * d_s) * d_t  # Eq. 13
    assert full // local == source_heads and full % local == 0  # C_full / C_local = H_s


@pytest.mark.parametrize("support,expected_fan_in", [("full", 2), ("local", 1)])
@pytest.mark.parametrize("k", [1, 2])
def test_coefficient_count_equals_mapper_numel(support, expected_fan_in, k):
    traces, layers, head_index, _ = _planted_traces(support, k=k, rows=120)
    mapper = _fit(traces, layers, head_index, support)
    assert mapper.manifest["fan_in"] == expected_fan_in and mapper.manifest["k"] == k
    count = coefficient_count(2, 2, k, expected_fan_in, 8, 6)
    assert mapper.weight_k.numel() + mapper.weight_v.numel() == count


# --------------------------------------------------------------------------- head assignment


def test_token_features_widen_every_design_and_are_refused_with_pca():
    traces, layers, head_index, _ = _planted_traces("local")
    mapper = _fit(traces, layers, head_index, "local", token_features=True)
    heads, dim = traces.target_k.shape[1], traces.target_k.shape[-1]
    width = layers.shape[1] * 8 + 2 * heads * dim
    assert mapper.weight_k.shape[2] == mapper.weight_v.shape[2] == width and mapper.token_features
    assert mapper.weight_k.numel() + mapper.weight_v.numel() == coefficient_count(
        traces.target_k.shape[0], heads, layers.shape[1], 1, 8, dim, 2 * heads * dim
    )
    with pytest.raises(ValueError, match="token features are not offered with the block-PCA control"):
        _fit(traces, layers, head_assignment("pca", 2, 2), "pca", token_features=True)


def test_head_assignment_equal_counts_is_identity():
    for heads in (1, 2, 8):
        assert torch.equal(head_assignment("local", heads, heads), torch.arange(heads)[:, None])
        assert torch.equal(head_assignment("full", heads, heads), torch.arange(heads).expand(heads, heads))


def test_head_assignment_more_target_heads():
    # H_t = 2·H_s: a(h) = ⌊h/2⌋
    assert head_assignment("local", 2, 4).tolist() == [[0], [0], [1], [1]]
    assert head_assignment("local", 4, 8)[:, 0].tolist() == [h // 2 for h in range(8)]
    assert head_assignment("local", 2, 6)[:, 0].tolist() == [0, 0, 0, 1, 1, 1]


def test_head_assignment_more_source_heads():
    # H_s = 2·H_t: target head h reads source heads [2h, 2h+1]
    assert head_assignment("local", 4, 2).tolist() == [[0, 1], [2, 3]]
    assert head_assignment("local", 8, 4).tolist() == [[2 * h, 2 * h + 1] for h in range(4)]
    assert head_assignment("full", 4, 2).tolist() == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("source_heads,target_heads", [(2, 3), (3, 2), (4, 6), (6, 4)])
def test_head_assignment_non_dividing_raises(source_heads, target_heads):
    for support in ("local", "cyclic"):
        with pytest.raises(ValueError, match="divide"):
            head_assignment(support, source_heads, target_heads)
    assert head_assignment("full", source_heads, target_heads).shape == (target_heads, source_heads)


def test_head_assignment_unknown_support():
    with pytest.raises(ValueError, match="unknown support"):
        head_assignment("diagonal", 2, 2)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_cyclic_shift_is_a_permutation(heads):
    local = head_assignment("local", heads, heads)
    assert torch.equal(head_assignment("cyclic", heads, heads, shift=0), local)
    assert torch.equal(head_assignment("cyclic", heads, heads, shift=heads), local)
    for shift in range(1, heads):
        cyclic = head_assignment("cyclic", heads, heads, shift=shift)
        assert sorted(cyclic[:, 0].tolist()) == list(range(heads))
        assert cyclic[:, 0].tolist() == [(h + shift) % heads for h in range(heads)]
        assert bool((cyclic != local).all())


# --------------------------------------------------------------------------- PCA support (control)


def test_pca_support_equals_map_on_pca_coordinates():
    source_heads, d_s, d_t, rows, k = 2, 4, 3, 400, 2
    generator = torch.Generator().manual_seed(21)

    def low_rank_source():  # per layer: a 4-dim signal inside the 8-dim all-head block, plus small noise
        latent = torch.randn(3, rows, d_s, generator=generator, dtype=torch.float64)
        lift = 3 * torch.randn(3, d_s, source_heads * d_s, generator=generator, dtype=torch.float64)
        blocks = latent @ lift + 0.05 * torch.randn(3, rows, source_heads * d_s, generator=generator).double()
        return (blocks + 2).unflatten(-1, (source_heads, d_s)).permute(0, 2, 1, 3).float()  # [L_s, H_s, n, d_s]

    source_k, source_v = low_rank_source(), low_rank_source()
    target_k = torch.randn(2, 2, rows, d_t, generator=generator)
    target_v = torch.randn(2, 2, rows, d_t, generator=generator)
    target_k = target_k + gather_features(source_k, torch.tensor([0, 1]), head_assignment("full", 2, 2))[..., :d_t]
    traces = _traces(source_k, source_v, target_k, target_v)
    layers = torch.tensor([[0, 1], [1, 2]])
    head_index = head_assignment("pca", source_heads, 2)
    lam = 0.5
    mapper = _fit(traces, layers, head_index, "pca", lam=lam, relative=False)

    assert mapper.weight_k.shape == (2, 2, k * source_heads * d_s, d_t)  # full width …
    assert mapper.manifest["fitted_width"] == k * d_s  # … but fitted on k·d_s coordinates
    assert mapper.manifest["support"] == "pca"

    for component, source, target in (("k", source_k, target_k), ("v", source_v, target_v)):
        blocks = source.permute(0, 2, 1, 3).flatten(2).double()  # [L_s, n, H_s·d_s]
        means = blocks.mean(1)
        # top-d_s principal directions by SVD (independent of src's eigh; the map is basis-invariant)
        bases = torch.stack(
            [torch.linalg.svd(b - m, full_matrices=False)[2][:d_s].T for b, m in zip(blocks, means, strict=True)]
        )
        for ell in range(2):
            chosen = layers[ell]
            coords = torch.cat([(blocks[j] - means[j]) @ bases[j] for j in chosen], dim=-1)  # [n, k·d_s]
            x = coords.expand(2, rows, k * d_s)
            w_pca, b_pca = ridge_solve(reference_moments(x, target[ell], None), lam, relative=False)
            fold = torch.block_diag(*[bases[j] for j in chosen])  # [k·H_s·d_s, k·d_s]
            expected_w = fold @ w_pca  # [H_t, k·H_s·d_s, d_t]
            expected_b = b_pca - torch.cat([means[j] for j in chosen]) @ expected_w
            fitted_w = getattr(mapper, f"weight_{component}")[ell].double()
            fitted_b = getattr(mapper, f"bias_{component}")[ell].double()
            assert _relative_error(fitted_w, expected_w) < 1e-4
            assert _relative_error(fitted_b, expected_b) < 1e-4
            # rank-constrained: W lies in the span of the retained directions
            residual = fitted_w - fold @ (fold.T @ fitted_w)
            assert float(residual.norm()) < 1e-4 * float(fitted_w.norm())
            # and predicting through the folded map equals predicting from PCA coordinates
            features = gather_features(source, chosen, head_index).double()
            torch.testing.assert_close(
                features @ fitted_w + fitted_b[:, None],
                torch.baddbmm(b_pca[:, None], x, w_pca),
                rtol=1e-4,
                atol=1e-4,
            )


# --------------------------------------------------------------------------- layer selection


@pytest.mark.parametrize("source_layers,target_layers,k", [(3, 3, 1), (28, 40, 1), (40, 28, 4), (5, 2, 5), (1, 4, 1)])
def test_depth_layers_monotone_and_in_range(source_layers, target_layers, k):
    chosen = depth_layers(source_layers, target_layers, k)
    assert chosen.shape == (target_layers, k)
    assert int(chosen.min()) >= 0 and int(chosen.max()) < source_layers
    assert bool((chosen.diff(dim=1) > 0).all())  # k distinct layers, ascending
    assert bool((chosen.diff(dim=0) >= 0).all())  # deeper target layers never pick shallower sources
    assert int(chosen[0, 0]) == 0 and int(chosen[-1, -1]) == source_layers - 1


def test_depth_layers_equal_counts_is_identity():
    assert torch.equal(depth_layers(6, 6, 1), torch.arange(6)[:, None])


def test_identity_selection():
    traces, _, _, _ = _planted_traces("local", rows=50)
    traces.target_k, traces.target_v = traces.source_k.clone(), traces.source_v.clone()  # L_t = L_s = 3
    chosen, scores = select_layers(traces, head_assignment("local", 2, 2), 1, "identity", 16)
    assert torch.equal(chosen, torch.arange(3)[:, None]) and scores is None
    with pytest.raises(ValueError, match="identity"):
        select_layers(traces, head_assignment("local", 2, 2), 2, "identity", 16)
    traces.target_k = traces.target_k[:2]
    with pytest.raises(ValueError, match="identity"):
        select_layers(traces, head_assignment("local", 2, 2), 1, "identity", 16)
    with pytest.raises(ValueError, match="k=4"):
        select_layers(traces, head_assignment("local", 2, 2), 4, "depth", 16)
    with pytest.raises(ValueError, match="unknown selection"):
        select_layers(traces, head_assignment("local", 2, 2), 1, "random", 16)


def test_r2_selection_picks_the_planted_layer():
    planted = [2, 0, 3]  # target layer ℓ is a linear function of source layer planted[ℓ] only
    source_k = _source(4, 2, 8, 500, seed=31)
    source_v = _source(4, 2, 8, 500, seed=32)
    local = head_assignment("local", 2, 2)
    layers = torch.tensor(planted)[:, None]
    target_k, _, _ = _plant(source_k, layers, local, 6, seed=33, noise=0.01)
    target_v, _, _ = _plant(source_v, layers, local, 6, seed=34, noise=0.01)
    traces = _traces(source_k, source_v, target_k, target_v)
    chosen, scores = select_layers(traces, local, 1, "r2", chunk_rows=77)
    assert chosen[:, 0].tolist() == planted
    assert scores.shape == (3, 4)
    for ell, j in enumerate(planted):
        assert float(scores[ell, j]) > 0.999
        others = [i for i in range(4) if i != j]
        assert float(scores[ell, others].max()) < 0.2  # unrelated layers explain ≈ p/n of the variance
    torch.testing.assert_close(scores, probe_r2(traces, local, chunk_rows=500), rtol=1e-8, atol=1e-10)
    # k = 2 keeps the planted layer and returns ascending indices
    chosen2, _ = select_layers(traces, local, 2, "r2", chunk_rows=77)
    assert all(planted[ell] in chosen2[ell].tolist() for ell in range(3))
    assert bool((chosen2.diff(dim=1) > 0).all())


# --------------------------------------------------------------------------- end to end, mismatched KV interfaces


def _ridge_r2_from_scratch(traces, source_layers, head_index, lam: float) -> dict[str, list[float]]:
    """Per target layer R² of the ridge map W = (XcᵀXc + λI)⁻¹ XcᵀYc on the traces' own rows, through the SVD of the
    materialized float64 design (Xc = U S Vᵀ → W = V S/(S² + λ) Uᵀ Yc): another route than src.stats' Cholesky."""
    out = {}
    for name in ("k", "v"):
        source, target = getattr(traces, f"source_{name}").double(), getattr(traces, f"target_{name}").double()
        out[name] = []
        for ell in range(target.shape[0]):
            x = gather_features(source, source_layers[ell], head_index)  # [H_t, n, p]
            xc, yc = x - x.mean(1, keepdim=True), target[ell] - target[ell].mean(1, keepdim=True)
            u, singular, vh = torch.linalg.svd(xc, full_matrices=False)  # [H_t, n, r], [H_t, r], [H_t, r, p]
            weight = vh.mT @ ((singular / (singular**2 + lam))[..., None] * (u.mT @ yc))  # [H_t, p, d_t]
            out[name].append(float(1 - ((yc - xc @ weight) ** 2).sum() / (yc**2).sum()))
    return out


PAIRS = {
    "kv_heads_2to4": (dict(family="qwen3"), dict(family="qwen3", num_key_value_heads=4, num_attention_heads=8)),
    "kv_heads_4to2": (dict(family="qwen3", num_key_value_heads=4, num_attention_heads=8), dict(family="qwen3")),
    "head_dim_64to128": (
        dict(family="llama", head_dim=64),
        dict(family="llama", head_dim=128, hidden_size=128, num_attention_heads=4),
    ),
}


@pytest.mark.parametrize("support", ["local", "full"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_mismatched_kv_interfaces_fit_and_apply(pair, support):
    source_spec, target_spec = (dict(spec) for spec in PAIRS[pair])
    source = tiny(source_spec.pop("family"), seed=0, **source_spec)
    target = tiny(target_spec.pop("family"), seed=1, **target_spec)
    token_hash = vocabulary_hash(target)
    assert vocabulary_hash(source) == token_hash
    traces = collect_traces(source, target, calibration_ids(4, 32), stride=2, batch_size=4)
    mapper = fit_transfer(source, target, traces, token_hash, support=support, k=2, selection="r2", lam=0.01)
    assert mapper.manifest["coefficient_count"] == mapper.weight_k.numel() + mapper.weight_v.numel()
    scores = mapper_r2(mapper, traces)  # fit rows: the fitted map is the ridge optimum there, solved from scratch
    optimum = _ridge_r2_from_scratch(traces, mapper.source_layers, mapper.head_index, lam=0.01)
    for name in ("k", "v"):
        assert scores[f"r2_{name}_layers"] == pytest.approx(optimum[name], abs=1e-5), (name, scores, optimum)

    transfer = KVTransfer(mapper, source, target, token_hash)
    prompt = calibration_ids(2, 12, seed=7)
    mapped = transfer(prefill(source, prompt[:, :-1]))
    own = prefill(target, prompt[:, :-1])
    assert len(mapped.layers) == len(own.layers)
    for ours, theirs in zip(mapped.layers, own.layers, strict=True):
        assert ours.keys.shape == theirs.keys.shape and ours.values.shape == theirs.values.shape
        assert ours.keys.dtype == theirs.keys.dtype
    assert mapped.get_seq_length() == own.get_seq_length() == 11
    with torch.no_grad():
        logits = target(prompt[:, -1:], past_key_values=mapped).logits
    assert logits.shape == (2, 1, 96) and bool(torch.isfinite(logits).all())
    assert mapped.get_seq_length() == 12  # the decode step appended to the mapped cache
