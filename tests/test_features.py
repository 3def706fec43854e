"""Feature probes (src/probe.py): the baseline equals the mapper, each widening does what it says."""

from __future__ import annotations

import pytest
import torch

from src.eval.metrics import mapper_r2
from src.fit import fit_mapper
from src.probe import VARIANTS, base_design, probe_features, random_features
from src.support import gather_features, head_assignment
from tests.test_fit import _source, _traces

LAYERS = torch.tensor([[0, 2], [1, 2], [0, 1]])  # S_ℓ for 3 target layers from 3 source layers


def _noisy_traces(rows=480, d_s=6, d_t=5, seed=0):
    """Targets: K from source K, V from source K and V (so V's own features miss part of it), plus noise;
    target layer 0 is the 'token layer' that the `token` variant reads."""
    head_index = head_assignment("local", 2, 2)
    source_k, source_v = _source(3, 2, d_s, rows, seed=1), _source(3, 2, d_s, rows, seed=2)
    generator = torch.Generator().manual_seed(seed)
    targets = {"k": [], "v": []}
    for layer in range(LAYERS.shape[0]):
        own_k = gather_features(source_k, LAYERS[layer], head_index).double()  # [H_t, n, 2·d_s]
        own_v = gather_features(source_v, LAYERS[layer], head_index).double()
        w = lambda: torch.randn(2, 2 * d_s, d_t, generator=generator, dtype=torch.float64) / d_s
        noise = lambda: 0.1 * torch.randn(2, rows, d_t, generator=generator, dtype=torch.float64)
        targets["k"].append(own_k @ w() + noise())
        targets["v"].append(own_v @ w() + own_k @ w() + noise())
    target_k, target_v = (torch.stack(targets[c]).float() for c in "kv")
    return _traces(source_k, source_v, target_k, target_v, sequences=8), head_index


def _probe(traces, head_index, variants, lam=1e-3, relu_width=16, seed=0):
    fit, heldout = traces.split_heldout(0.25)
    return probe_features(fit, heldout, LAYERS, head_index, list(variants), lam, True, 97, relu_width, seed)


def test_own_variant_equals_the_head_local_mapper():
    traces, head_index = _noisy_traces()
    fit, heldout = traces.split_heldout(0.25)
    scores = _probe(traces, head_index, ["own"])
    mapper = fit_mapper(fit, LAYERS, head_index, "local", "uniform", 1e-3, True, 97)
    reference = mapper_r2(mapper, heldout)
    for component in "kv":
        assert scores[f"own.r2_{component}_heldout"] == pytest.approx(reference[f"r2_{component}"], abs=1e-5)
        assert scores[f"own.r2_{component}_heldout_layers"] == pytest.approx(
            reference[f"r2_{component}_layers"], abs=1e-5
        )
        assert scores[f"own.width_{component}"] == LAYERS.shape[1] * 6


def test_token_variant_equals_the_token_feature_mapper():
    traces, head_index = _noisy_traces()
    fit, heldout = traces.split_heldout(0.25)
    scores = _probe(traces, head_index, ["token"])
    mapper = fit_mapper(fit, LAYERS, head_index, "local", "uniform", 1e-3, True, 97, token_features=True)
    reference = mapper_r2(mapper, heldout)
    for component in "kv":
        assert scores[f"token.r2_{component}_heldout"] == pytest.approx(reference[f"r2_{component}"], abs=1e-5)


def test_kv_variant_recovers_what_v_reads_from_k():
    traces, head_index = _noisy_traces()
    scores = _probe(traces, head_index, ["own", "kv"])
    assert scores["kv.r2_v_heldout"] > 0.95 > scores["own.r2_v_heldout"] + 0.1
    assert scores["kv.width_v"] == 2 * scores["own.width_v"]
    assert scores["kv.r2_k_heldout"] == pytest.approx(scores["own.r2_k_heldout"], abs=0.02)  # V adds nothing to K


def test_token_variant_makes_target_layer_zero_exact():
    traces, head_index = _noisy_traces()
    scores = _probe(traces, head_index, ["token"], lam=1e-9)
    for component in "kv":
        assert scores[f"token.r2_{component}_heldout_layers"][0] == pytest.approx(1.0, abs=1e-6)
        assert scores[f"token.width_{component}"] == 2 * 6 + 2 * 2 * 5  # own + [K, V] of both target heads


def test_relu_features_are_seeded_and_widen_the_design():
    traces, head_index = _noisy_traces()
    design = base_design("v", "own", LAYERS[0], head_index)
    first, second, other = (random_features(design, traces, 16, 97, seed) for seed in (3, 3, 4))
    span = slice(0, 50)
    assert first(traces, span).shape == (2, 50, 12 + 16)
    assert torch.equal(first(traces, span), second(traces, span))
    assert not torch.equal(first(traces, span), other(traces, span))
    assert torch.equal(first(traces, span)[..., :12], design(traces, span))
    scores = _probe(traces, head_index, ["relu"])
    assert scores["relu.r2_v_fit"] >= scores["relu.r2_v_heldout"]


def test_unknown_variant_is_refused():
    traces, head_index = _noisy_traces()
    with pytest.raises(ValueError, match="unknown probe variant 'mlp'"):
        _probe(traces, head_index, ["mlp"])
    assert "mlp" not in VARIANTS
