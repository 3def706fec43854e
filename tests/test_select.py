"""Layer selection (`src.select`, §3.1) beyond tests/test_fit.py (which checks that r2 picks a planted layer, the
depth map, identity and the refusals): the probe R² equals, value by value, an independent least-squares R² per
(target layer, source layer) averaged over target heads and over K and V; `layers_for_support` probes with the
support's own heads (all heads for `full`), so a target head fed by another source head is found by `full` only.
"""

import torch

from src.select import layers_for_support, probe_r2
from src.support import gather_features, head_assignment
from src.traces import Traces


def _traces(source_k, source_v, target_k, target_v) -> Traces:
    rows = source_k.shape[2]
    return Traces(source_k, source_v, target_k, target_v, torch.zeros(rows, dtype=torch.long), torch.arange(rows))


def _lstsq_r2(source: torch.Tensor, target: torch.Tensor, head_index: torch.Tensor) -> torch.Tensor:
    """[L_t, L_s]: pooled-over-channels R² of a centered OLS of target head h on the source heads it reads, mean
    over target heads (float64, torch.linalg.lstsq)."""
    scores = torch.zeros(target.shape[0], source.shape[0], dtype=torch.float64)
    for ell in range(target.shape[0]):
        for j in range(source.shape[0]):
            x = gather_features(source.double(), torch.tensor([j]), head_index)  # [H_t, n, p]
            x = x - x.mean(1, keepdim=True)
            y = target[ell].double() - target[ell].double().mean(1, keepdim=True)  # [H_t, n, d_t]
            residual = y - x @ torch.linalg.lstsq(x, y).solution
            scores[ell, j] = (1 - residual.square().sum((1, 2)) / y.square().sum((1, 2))).mean()
    return scores


def test_probe_r2_equals_an_independent_least_squares_r2():
    generator = torch.Generator().manual_seed(5)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)
    source_k, source_v = randn(3, 2, 80, 4) + 2, randn(3, 2, 80, 4) - 1  # [L_s, H_s, n, d_s]
    local = head_assignment("local", 2, 2)
    mix = lambda source, j: gather_features(source, torch.tensor([j]), local) @ randn(2, 4, 3)  # [H_t, n, 3]
    target_k = torch.stack([mix(source_k, 0) + randn(2, 80, 3), mix(source_k, 2) + 0.3 * randn(2, 80, 3)])
    target_v = torch.stack([mix(source_v, 1) + 2 * randn(2, 80, 3), mix(source_v, 1) + randn(2, 80, 3)])
    traces = _traces(source_k.float(), source_v.float(), target_k.float(), target_v.float())
    scores = probe_r2(traces, local, chunk_rows=13)
    expected = (_lstsq_r2(source_k, target_k, local) + _lstsq_r2(source_v, target_v, local)) / 2
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert 0.3 < float(scores.max()) < 0.95  # intermediate values, not only 0 / 1


def test_full_support_probes_every_source_head():
    """Target head h reads source head 1 − h of layer 1: the local probe (head h only) cannot see it."""
    generator = torch.Generator().manual_seed(6)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    source_k, source_v = randn(3, 2, 200, 4), randn(3, 2, 200, 4)
    crossed = torch.tensor([[1], [0]])  # [H_t, 1]
    plant = lambda source: gather_features(source, torch.tensor([1]), crossed) @ randn(2, 4, 4)  # [H_t, n, 4]
    target_k, target_v = plant(source_k)[None], plant(source_v)[None]  # one target layer
    traces = _traces(source_k, source_v, target_k, target_v)
    chosen_full, scores_full = layers_for_support(traces, "full", 1, "r2", 64)
    _, scores_local = layers_for_support(traces, "local", 1, "r2", 64)
    assert chosen_full.tolist() == [[1]] and float(scores_full[0, 1]) > 0.999
    assert float(scores_local.max()) < 0.2
    for support in ("cyclic", "pca"):  # every non-full support probes with the local assignment
        torch.testing.assert_close(layers_for_support(traces, support, 1, "r2", 64)[1], scores_local)
