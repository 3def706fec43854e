"""Native sink, hold-back, native layers and recompute around a mapped prefix (src.runtime.splice.spliced_cache, Levers);
the recompute mechanics and rules on a cross-model exact pair are in test_recompute.py."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from src.apply import KVTransfer
from src.fit import fit_transfer
from src.forward import prefill, prefill_layers
from src.models import vocabulary_hash
from src.runtime.plan import Levers
from src.runtime.splice import spliced_cache
from src.traces import collect_traces
from tests.conftest import calibration_ids, tiny


@pytest.fixture(scope="module")
def identity():
    model = tiny("qwen3")
    hashed = vocabulary_hash(model)
    traces = collect_traces(model, model, calibration_ids(8, 64), 1, 8)
    mapper = fit_transfer(model, model, traces, hashed, support="local", k=1, selection="identity", lam=1e-6)
    return model, KVTransfer(mapper, model, model, hashed), mapper


def _max_difference(a, b) -> float:
    return max(
        float((x.keys - y.keys).abs().max().max((x.values - y.values).abs().max()))
        for x, y in zip(a.layers, b.layers, strict=True)
    )


@pytest.mark.parametrize(
    ("sink", "hold", "layers"), [(0, 0, 0), (4, 0, 0), (0, 5, 0), (4, 5, 0), (30, 0, 0), (0, 30, 0), (29, 1, 0),
                                 (0, 0, 1), (4, 5, 2), (0, 0, 3), (0, 0, 9)]
)  # fmt: skip
def test_identity_map_with_levers_equals_native(identity, sink, hold, layers):
    model, transfer, _ = identity
    ids = calibration_ids(2, 30, seed=3)
    cache = spliced_cache(transfer, prefill(model, ids), ids, Levers(sink, hold, layers))
    assert cache.get_seq_length() == 30
    assert _max_difference(cache, prefill(model, ids)) < 1e-4  # identity map reproduces the native cache


@pytest.mark.parametrize("rule", ["deviation", "attention", "recency"])
@pytest.mark.parametrize("share", [0.3, 1.0])
def test_identity_map_with_recompute_equals_native(identity, rule, share):
    model, transfer, _ = identity
    ids = calibration_ids(2, 30, seed=3)
    levers = Levers(native_sink=2, hold_back=3, recompute=share, recompute_rule=rule)
    cache = spliced_cache(transfer, prefill(model, ids), ids, levers)
    assert _max_difference(cache, prefill(model, ids)) < 1e-4


def test_native_sink_is_exact_and_hold_back_sees_the_mapped_prefix(identity):
    model, _, mapper = identity
    broken = type(mapper)(**{**mapper.tensors(), "manifest": mapper.manifest})
    broken.weight_k, broken.weight_v = mapper.weight_k * 0.5, mapper.weight_v * 0.5  # a wrong (but finite) map
    transfer = KVTransfer(broken, model, model, vocabulary_hash(model))
    ids = calibration_ids(1, 30, seed=4)
    native, sink_only = prefill(model, ids), prefill(model, ids[:, :6])
    cache = spliced_cache(transfer, prefill(model, ids), ids, Levers(6, 4))
    for own, sink, spliced in zip(native.layers, sink_only.layers, cache.layers, strict=True):
        assert torch.equal(sink.keys, spliced.keys[:, :, :6])  # sink: the target's own 6-token prefill
        assert torch.allclose(own.keys[:, :, :6], spliced.keys[:, :, :6], atol=1e-5)  # = native (causality)
        assert not torch.allclose(own.keys[:, :, 6:26], spliced.keys[:, :, 6:26])  # the mapped middle
    # hold-back tokens are the target's own computation on top of the spliced prefix
    expected = spliced_cache(transfer, prefill(model, ids), ids[:, :26], Levers(6, 0))
    model(ids[:, 26:], past_key_values=expected, use_cache=True)
    assert _max_difference(cache, expected) == 0.0


def test_levers_must_fit(identity):
    model, transfer, _ = identity
    ids = calibration_ids(1, 10)
    with pytest.raises(ValueError, match="must fit"):
        spliced_cache(transfer, prefill(model, ids), ids, Levers(6, 5))


def test_levers_refuse_bad_values_and_clip_to_the_prefix():
    for bad, match in [
        (dict(native_sink=-1), "≥ 0"),
        (dict(recompute=1.5), r"\[0, 1\]"),
        (dict(recompute=-0.1), r"\[0, 1\]"),
        (dict(recompute_rule="random"), "recompute_rule"),
        (dict(recompute_layers=0), "recompute_layers"),
    ]:
        with pytest.raises(ValueError, match=match):
            Levers(**bad)
    assert Levers(4, 8, 2).clipped(10) == Levers(4, 6, 2) and Levers(12, 8).clipped(10) == Levers(10, 0)
    recompute = Levers(4, 8, recompute=0.5, recompute_rule="recency", recompute_layers=3)
    assert recompute.clipped(10) == Levers(4, 6, recompute=0.5, recompute_rule="recency", recompute_layers=3)
    assert not Levers() and Levers(native_layers=1) and Levers(recompute=0.1)


@pytest.mark.parametrize(
    ("field", "value"),
    [("native_sink", 2.5), ("native_sink", None), ("hold_back", True), ("native_layers", "1"), ("recompute", float("nan")),
     ("recompute", float("inf")), ("recompute", None), ("recompute", False), ("recompute_layers", 1.0),
     ("recompute_rule", ["deviation"]), ("progressive", 0), ("progressive", 0.0), ("progressive", 1.5),
     ("progressive", -0.5), ("progressive", float("nan")), ("progressive", True), ("progressive", None)],
)  # fmt: skip
def test_levers_refuse_what_is_not_a_count_or_a_share(field, value):
    with pytest.raises(ValueError, match=field):
        Levers(**{field: value})


def test_levers_keep_plain_numbers():
    levers = Levers(native_sink=np.int64(2), recompute=np.float32(0.5), recompute_layers=np.int32(2))
    assert levers == Levers(2, recompute=0.5, recompute_layers=2)
    assert type(levers.native_sink) is int and type(levers.recompute) is float and type(levers.recompute_layers) is int
    assert Levers(recompute=1).recompute == 1.0 and type(Levers(recompute=1).recompute) is float


def test_prefill_fraction_counts_tokens_and_layers():
    assert Levers().prefill_fraction(100, 28) == 0.0
    assert Levers(4, 16).prefill_fraction(100, 28) == pytest.approx(0.2)
    assert Levers(native_layers=7).prefill_fraction(100, 28) == pytest.approx(0.25)
    assert Levers(4, 16, 7).prefill_fraction(100, 28) == pytest.approx(0.2 + 0.8 * 0.25)
    assert Levers(200).prefill_fraction(100, 28) == 1.0


def test_prefill_fraction_charges_each_recompute_rule():
    assert Levers(recompute=0.25, recompute_rule="recency").prefill_fraction(100, 28) == pytest.approx(0.25)
    assert Levers(recompute=0.25).prefill_fraction(100, 28) == pytest.approx(0.25 + 1 / 28)  # + its layer-0 prefill
    deviation = Levers(native_layers=2, recompute=0.25, recompute_layers=4)
    assert deviation.native_depth(100) == 4 and deviation.prefill_fraction(100, 28) == pytest.approx(0.25 + 4 / 28)
    attention = Levers(hold_back=10, recompute=0.25, recompute_rule="attention")
    assert attention.prefill_fraction(100, 28, query_len=5) == pytest.approx((10 + 25 + 10 + 5) / 100)  # + queries
    assert Levers(recompute=0.004).prefill_fraction(100, 28) == 0.0  # rounds to no token: no rule runs
    assert Levers(4, 16, recompute=1.0, recompute_rule="recency").recomputed(100) == 80  # at most the mapped span
    assert Levers(4, 16, recompute=1.0, recompute_rule="recency").prefill_fraction(100, 28) == 1.0


def test_progressive_is_a_share_in_the_open_closed_unit_interval():
    with pytest.raises(ValueError, match=r"progressive is a share of a layer's recomputed set .* in \(0, 1\], not 0"):
        Levers(progressive=0)
    assert Levers().progressive == 1.0 and type(Levers(progressive=np.float32(0.5)).progressive) is float


def test_layer_sizes_shrink_past_the_native_layers_and_are_charged():
    """|S_ℓ| per layer: below the native depth the whole set (deviation, recency: their forward starts at the
    embeddings) or none (turn: it starts there); then ⌊p · |S| + ½⌋ per layer; prefill_fraction charges Σ |S_ℓ| / L."""
    deviation = Levers(recompute=0.25, recompute_layers=2, progressive=0.5)
    assert deviation.layer_sizes(100, 6) == (25, 25, 25, 13, 7, 4)
    assert deviation.prefill_fraction(100, 6) == pytest.approx((100 * 2 + 99) / 600)
    turn = replace(deviation, recompute_rule="turn")
    assert turn.native_depth(100) == 2 and turn.layer_sizes(100, 6) == (0, 0, 25, 13, 7, 4)
    assert turn.prefill_fraction(100, 6) == pytest.approx((100 * 2 + 49) / 600)
    assert Levers(recompute=0.05, recompute_rule="recency", progressive=0.3).layer_sizes(100, 4) == (5, 2, 1, 0)
    every = Levers(recompute=1.0, recompute_rule="turn", recompute_layers=3)
    assert every.prefill_fraction(100, 6) == 1.0  # native layers + the rest recomputed: one prefill, no layer twice
    assert Levers(recompute=0.004, recompute_rule="turn").layer_sizes(100, 3) == (0, 0, 0)  # no set: no native layer
    full = Levers(native_sink=4, hold_back=6, recompute=0.3, recompute_layers=2)
    assert full.prefill_fraction(100, 28) == pytest.approx((4 + 6 + 90 * 2 / 28 + 30) / 100)  # progressive 1: as before


@pytest.mark.parametrize("layers", [1, 2])
def test_prefill_layers_is_the_native_cache_of_the_first_layers(identity, layers):
    model, _, _ = identity
    ids = calibration_ids(2, 20, seed=6)
    native, early = prefill(model, ids), prefill_layers(model, ids, layers)
    for index in range(layers):
        assert torch.equal(early.layers[index].keys, native.layers[index].keys)
        assert torch.equal(early.layers[index].values, native.layers[index].values)
    assert early.layers[layers].keys is None or early.layers[layers].keys.numel() == 0


def test_native_layers_replace_the_mapped_layers_only(identity):
    model, _, mapper = identity
    broken = type(mapper)(**{**mapper.tensors(), "manifest": mapper.manifest})
    broken.weight_k, broken.weight_v = mapper.weight_k * 0.5, mapper.weight_v * 0.5
    transfer = KVTransfer(broken, model, model, vocabulary_hash(model))
    ids = calibration_ids(1, 24, seed=7)
    native = prefill(model, ids)
    cache = spliced_cache(transfer, prefill(model, ids), ids, Levers(native_layers=1))
    assert torch.allclose(cache.layers[0].keys, native.layers[0].keys, atol=1e-6)
    assert not torch.allclose(cache.layers[1].keys, native.layers[1].keys)
