"""Fit what the receiver reads (issue 13, lever 3; `fit.v_space=attention`): the target's attention between the
sampled rows (`attention_mixing`) is the model's own attention pooled onto them, the V fit on mixed rows equals the
ordinary fit when the attention is the identity, recovers a known exact map, and streams like the reference; traces
with mixing split only into whole sequences."""

from dataclasses import replace

import pytest
import torch

from src.apply import KVTransfer
from src.fit import _mixed, fit_mapper, fit_transfer
from src.forward import prefill
from src.select import layers_for_support
from src.support import head_assignment
from src.traces import attention_mixing, collect_traces
from tests.conftest import calibration_ids, tiny
from tests.exact_pair import exact_pair, max_cache_diff

SEQUENCES, LENGTH = 6, 24


@pytest.fixture(scope="module")
def pair():
    return tiny("llama", seed=0), tiny("llama", seed=1, num_hidden_layers=3)


@pytest.fixture(scope="module")
def traces(pair):
    return collect_traces(*pair, calibration_ids(SEQUENCES, LENGTH), stride=2, batch_size=4, mixing=True)


def test_mixing_at_stride_one_is_the_models_own_attention_averaged_over_each_kv_group(pair):
    _, target = pair
    ids = calibration_ids(2, LENGTH)
    traces = collect_traces(target, target, ids, stride=1, batch_size=2, mixing=True)
    own = target(ids, output_attentions=True).attentions  # per layer [B, H_q, T, T] (eager attention)
    group = target.config.num_attention_heads // target.config.num_key_value_heads
    for layer, probs in enumerate(own):
        expected = probs.unflatten(1, (-1, group)).mean(2)  # [B, H_kv, T, T]
        torch.testing.assert_close(traces.mix[layer].transpose(0, 1), expected, rtol=1e-4, atol=1e-5)


def test_mixing_rows_sum_to_one_causally_over_the_sampled_rows(traces):
    t = -(-LENGTH // 2)
    assert traces.mix.shape == (3, 2, SEQUENCES, t, t)  # [L_t, H_t, S, t, t]
    torch.testing.assert_close(traces.mix.sum(-1), torch.ones(3, 2, SEQUENCES, t))
    assert torch.all(traces.mix.triu(1) == 0) and torch.all(traces.mix >= 0)
    query, key = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8)
    pooled = attention_mixing(query[:, :, ::3], key, stride=3, softmax_scale=8**-0.5)  # the sampled rows' queries
    assert pooled.shape == (1, 2, 3, 3) and torch.allclose(pooled.sum(-1), torch.ones(1, 2, 3))


def _fit(traces, v_space, statistics="generic", chunk_rows=4096):
    layers, _ = layers_for_support(traces, "local", 2, "depth", chunk_rows)
    head_index = head_assignment("local", traces.source_k.shape[1], traces.target_k.shape[1], 0)
    return fit_mapper(
        traces, layers, head_index, "local", "uniform", 1e-6, True, chunk_rows, statistics, v_space=v_space
    )


def test_identity_attention_fits_like_the_ordinary_fit(traces):
    eye = torch.eye(traces.mix.shape[-1]).expand_as(traces.mix).clone()
    plain, mixed = _fit(traces, "token"), _fit(replace(traces, mix=eye), "attention")
    for name in ("weight_k", "bias_k", "weight_v", "bias_v"):
        torch.testing.assert_close(getattr(mixed, name), getattr(plain, name), rtol=1e-5, atol=1e-6)
    real = _fit(traces, "attention")
    assert torch.equal(real.weight_k, plain.weight_k)  # K is never mixed
    assert (real.weight_v - plain.weight_v).abs().max() > 1e-3  # the real attention changes the V fit
    assert real.manifest["v_space"] == "attention" and plain.manifest["v_space"] == "token"


@pytest.mark.parametrize("chunk_rows", [12, 25, 1000])
def test_streaming_panels_of_whole_sequences_equal_the_reference(traces, chunk_rows):
    reference, streamed = _fit(traces, "attention"), _fit(traces, "attention", "streaming", chunk_rows)
    torch.testing.assert_close(streamed.weight_v, reference.weight_v, rtol=1e-6, atol=1e-7)


def test_an_exact_map_is_recovered_from_mixed_rows():
    source, target, tokenizer_hash, exact, _ = exact_pair()
    traces = collect_traces(source, target, calibration_ids(12, 32), stride=2, batch_size=4, mixing=True)
    mapper = fit_transfer(source, target, traces, tokenizer_hash, k=1, selection="depth", lam=1e-8, v_space="attention")
    transfer = KVTransfer(mapper, source, target, tokenizer_hash)
    prompt = calibration_ids(1, 20, seed=5)
    assert max_cache_diff(transfer(prefill(source, prompt)), prefill(target, prompt)) < 1e-3
    assert mapper.manifest["method"].endswith("+vattn")


def test_mixing_traces_split_into_whole_sequences_only(traces):
    t = traces.mix.shape[-1]
    fit, heldout = traces.split_heldout(0.34)
    assert fit.mix.shape[2] + heldout.mix.shape[2] == SEQUENCES
    torch.testing.assert_close(heldout.mix, traces.mix[:, :, fit.mix.shape[2] :])
    with pytest.raises(ValueError, match="whole sequences"):
        traces.select_rows(torch.arange(t + 1))
    with pytest.raises(ValueError, match="needs traces collected with the target's attention mixing"):
        _fit(replace(traces, mix=None), "attention")
    with pytest.raises(ValueError, match="unknown v_space"):
        _fit(traces, "query")


def test_mixed_rows_are_each_rows_attention_weighted_sum_within_its_sequence():
    generator = torch.Generator().manual_seed(0)
    mix = torch.rand(2, 4, 3, 3, generator=generator).tril()  # [H_t, S, t, t]
    rows = torch.randn(2, 12, 5, generator=generator)  # [H_t, S·t, p]
    span = slice(3, 9)  # sequences 1 and 2
    out = _mixed(rows[:, span], mix, span)
    for h in range(2):
        for s in (1, 2):
            for t in range(3):
                expected = sum(mix[h, s, t, u] * rows[h, s * 3 + u] for u in range(3))
                torch.testing.assert_close(out[h, (s - 1) * 3 + t], expected)
