"""Sufficient statistics and the ridge solve (`src.stats`, Eqs. 8–10, 20–23) beyond tests/test_fit.py (which
checks streaming = reference moments for chunk sizes 1 / 7 / 53 / 64, the closed form, NaN refusals): row panels
cover the rows exactly once in bounded, ordered spans; a noise-free planted per-head affine map is recovered
exactly through the streaming path, far from the origin; the weights really select rows; a singular Gram is
solved through the jitter retry instead of failing.
"""

import pytest
import torch

from src.stats import reference_moments, ridge_solve, row_spans, streaming_moments


@pytest.mark.parametrize(("rows", "chunk_rows"), [(0, 4), (1, 1), (10, 3), (10, 10), (10, 64), (4096, 1000)])
def test_row_spans_cover_each_row_once_in_bounded_panels(rows, chunk_rows):
    spans = row_spans(rows, chunk_rows)
    covered = [row for span in spans for row in range(span.start, span.stop)]
    assert covered == list(range(rows))  # in order, no gap, no overlap
    assert all(0 < span.stop - span.start <= chunk_rows for span in spans)
    assert len(spans) == -(-rows // chunk_rows)  # ⌈rows / b⌉ panels


def _planted(heads=3, rows=301, width=5, dim=4, offset=1e3, seed=0):
    """X [H, n, p] around a large offset, and Y = X·W_h + b_h exactly (float64), per-head W [H, p, d], b [H, d]."""
    generator = torch.Generator().manual_seed(seed)
    x = offset + torch.randn(heads, rows, width, generator=generator, dtype=torch.float64)
    weight = torch.randn(heads, width, dim, generator=generator, dtype=torch.float64)
    bias = 10 * torch.randn(heads, dim, generator=generator, dtype=torch.float64)
    return x, x @ weight + bias[:, None], weight, bias


def _stream(x, y, w, chunk_rows):
    return streaming_moments(lambda s: (x[:, s], y[:, s], None if w is None else w[:, s]), x.shape[1], chunk_rows)


@pytest.mark.parametrize("chunk_rows", [1, 19, 301])
def test_streaming_ridge_recovers_a_planted_map_far_from_the_origin(chunk_rows):
    x, y, weight, bias = _planted()
    fitted_w, fitted_b = ridge_solve(_stream(x, y, None, chunk_rows), lam=0.0, relative=False)
    torch.testing.assert_close(fitted_w, weight, rtol=1e-7, atol=1e-7)  # each head its own map
    torch.testing.assert_close(fitted_b, bias, rtol=1e-7, atol=1e-5)  # b = μy − μx·W (Eq. 9) at offset 1e3


def test_weights_select_rows():
    """Rows with zero weight are corrupt: the weighted fit recovers the map, the uniform fit does not."""
    x, y, weight, bias = _planted(rows=200, offset=0.0, seed=1)
    corrupt = torch.arange(200) % 4 == 0
    y = y.clone()
    y[:, corrupt] += 5 * torch.randn(y[:, corrupt].shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype)
    w = (~corrupt).double().expand(3, -1) * 4 / 3  # mean one
    fitted_w, fitted_b = ridge_solve(_stream(x, y, w, 37), lam=0.0, relative=False)
    torch.testing.assert_close(fitted_w, weight, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(fitted_b, bias, rtol=1e-7, atol=1e-7)
    uniform_w, _ = ridge_solve(_stream(x, y, None, 37), lam=0.0, relative=False)
    assert (uniform_w - weight).abs().max() > 1e-2
    streamed, reference = _stream(x, y, w, 37), reference_moments(x, y, w)
    torch.testing.assert_close(streamed.xx, reference.xx, rtol=1e-10, atol=1e-8)


def test_singular_gram_is_solved_through_the_jitter_retry():
    """A duplicated feature column makes A_h singular: λ = 0 Cholesky fails, the jittered retry succeeds and its
    map still reproduces Y (the two columns share the planted coefficient)."""
    x, y, _, _ = _planted(rows=120, width=4, offset=0.0, seed=3)
    x = torch.cat([x, x[..., :1]], -1)  # [H, n, 5], column 4 = column 0
    moments = reference_moments(x, y, None)
    assert int(torch.linalg.cholesky_ex(moments.xx)[1].max()) > 0  # not positive definite as it stands
    weight, bias = ridge_solve(moments, lam=0.0, relative=False)
    assert bool(torch.isfinite(weight).all())
    torch.testing.assert_close(x @ weight + bias[:, None], y, rtol=1e-5, atol=1e-5)
