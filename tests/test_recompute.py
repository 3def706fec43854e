"""Selective recompute in place (src/runtime/recompute.py through src.runtime.splice.spliced_cache): the mechanics on a pair whose
exact cross-model map is known (source ≠ target), each selection rule, and prefill-fraction accounting of the work."""

from functools import cache

import pytest
import torch

import src.runtime.receivers
from src.apply import KVTransfer
from src.eval.nll import horizon_nll
from src.forward import prefill, prefill_layers
from src.maps import cache_layers
from src.runtime.plan import Levers
from src.runtime.recompute import RULES, deviation_scores, recompute_in_place, select_tokens
from src.runtime.splice import spliced_cache
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair, max_cache_diff

BOTH = pytest.mark.parametrize("pair", ["llama", "qwen2"], indirect=True)
CACHE_RULES = tuple(rule for rule in RULES if rule != "turn")  # the turn rule: the static engine (test_selection.py)


@cache
def _exact_pair(family: str):
    return exact_pair(family)


@pytest.fixture
def pair(request):
    """The exact pair in the real pair's family (qwen2); the mechanics tests also run llama (`BOTH`)."""
    return _exact_pair(getattr(request, "param", "qwen2"))


@pytest.fixture(params=["eager", "sdpa"])
def attention(pair, request):
    """The target under each attention implementation that reads the recompute mask (restored afterwards)."""
    pair.target.set_attn_implementation(request.param)
    yield request.param
    pair.target.set_attn_implementation("eager")


def transfers(pair) -> tuple[KVTransfer, KVTransfer]:
    return (KVTransfer(m, pair.source, pair.target, pair.tokenizer_hash) for m in (pair.exact, pair.wrong))


@pytest.fixture
def chosen(monkeypatch):
    """The positions every recompute in spliced_cache was asked for."""
    calls = []

    def spy(model, cache, input_ids, positions):
        calls.append(positions.clone())
        return recompute_in_place(model, cache, input_ids, positions)

    monkeypatch.setattr(src.runtime.receivers, "recompute_in_place", spy)
    return calls


@BOTH
@pytest.mark.parametrize("rule", CACHE_RULES)
def test_recompute_of_every_mapped_token_is_a_native_prefill(pair, attention, rule):
    ids = calibration_ids(2, 30, seed=3)
    native = prefill(pair.target, ids)
    assert max_cache_diff(prefill(pair.source, ids), native) > 0.1  # source ≠ target: only a map gets there
    for transfer in transfers(pair):  # exact map, and a wrong one whose every mapped value must be replaced
        levers = Levers(native_sink=3, hold_back=2, recompute=1.0, recompute_rule=rule)
        cache = spliced_cache(transfer, prefill(pair.source, ids), ids, levers, query_ids=ids[:, :3])
        assert cache.get_seq_length() == 30
        assert max_cache_diff(cache, native) < 1e-5
    assert pair.target.config._attn_implementation == attention  # the attention rule restores the implementation


@pytest.mark.parametrize("rule", CACHE_RULES)
def test_recompute_of_none_is_pure_transfer(pair, rule):
    _, wrong = transfers(pair)
    ids = calibration_ids(2, 30, seed=4)
    pure = wrong(prefill(pair.source, ids), input_ids=ids)
    for share in (0.0, 0.01):  # 1 % of 30 tokens rounds to none
        levers = Levers(recompute=share, recompute_rule=rule)
        cache = spliced_cache(wrong, prefill(pair.source, ids), ids, levers, query_ids=ids[:, :2])
        assert max_cache_diff(cache, pure) == 0.0


def test_recomputed_tokens_equal_native_when_every_earlier_token_is_native(pair, attention):
    _, wrong = transfers(pair)
    ids = calibration_ids(2, 24, seed=5)
    native = prefill(pair.target, ids)
    cache = spliced_cache(wrong, prefill(pair.source, ids), ids, Levers(native_sink=6))  # 0..5 native, 6.. wrong
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    recompute_in_place(pair.target, cache, ids, torch.tensor([[8, 6, 7], [6, 7, 8]]))  # any order, per row
    assert cache.get_seq_length() == 24
    for layer, own, (keys, values) in zip(cache.layers, native.layers, before, strict=True):
        assert torch.allclose(layer.keys[:, :, :9], own.keys[:, :, :9], atol=1e-5)  # 0..5 kept, 6..8 now native
        assert torch.allclose(layer.values[:, :, :9], own.values[:, :, :9], atol=1e-5)
        assert torch.equal(layer.keys[:, :, 9:], keys[:, :, 9:]) and torch.equal(
            layer.values[:, :, 9:], values[:, :, 9:]
        )
        assert not torch.allclose(keys[:, :, 6:9], own.keys[:, :, 6:9], atol=1e-3)  # they were wrong before


def test_recompute_reads_the_spliced_cache(pair, attention):
    """Recomputing the last 5 mapped tokens in place is the hold-back of 5 on the same (wrong) mapped prefix, not
    a native prefill: each recomputed token reads the spliced cache before it."""
    _, wrong = transfers(pair)
    ids = calibration_ids(2, 30, seed=6)
    recomputed = spliced_cache(
        wrong, prefill(pair.source, ids), ids, Levers(recompute=5 / 30, recompute_rule="recency")
    )
    held_back = spliced_cache(wrong, prefill(pair.source, ids), ids, Levers(hold_back=5))
    assert max_cache_diff(recomputed, held_back) < 1e-5
    assert max_cache_diff(recomputed, prefill(pair.target, ids)) > 1e-2


def test_deviation_scores_find_the_perturbed_tokens(pair):
    ids = calibration_ids(2, 20, seed=7)
    native = prefill_layers(pair.target, ids, 1)
    spliced = prefill(pair.target, ids)
    spliced.layers[0].values[0, :, 11] += 0.5  # row 0: token 11's V; row 1: token 4's K
    spliced.layers[0].keys[1, :, 4] -= 0.5
    spliced.layers[1].keys[:, :, 15] += 9.0  # outside the compared layers: ignored
    scores = deviation_scores(cache_layers(native)[:1], cache_layers(spliced), 1, 2, 20)  # [B, 18] over tokens 2..19
    assert select_tokens(scores, 1, 2).tolist() == [[11], [4]]


def test_deviation_rule_recomputes_the_most_deviating_tokens(pair, chosen):
    _, wrong = transfers(pair)
    ids = calibration_ids(2, 30, seed=8)
    levers = Levers(native_sink=2, recompute=0.2, recompute_layers=2)
    spliced_cache(wrong, prefill(pair.source, ids), ids, levers)
    pure = spliced_cache(wrong, prefill(pair.source, ids), ids, Levers(native_sink=2))
    native = cache_layers(prefill_layers(pair.target, ids, 2))[:2]
    expected = select_tokens(deviation_scores(native, cache_layers(pure), 2, 2, 30), 6, 2)
    assert len(chosen) == 1 and torch.equal(chosen[0], expected)


def test_attention_rule_recomputes_what_the_new_turn_reads(pair, attention, chosen):
    exact, _ = transfers(pair)
    ids, query = calibration_ids(2, 26, seed=9), calibration_ids(2, 4, seed=10)
    levers = Levers(native_sink=1, hold_back=2, recompute=0.25, recompute_rule="attention")
    cache = spliced_cache(exact, prefill(pair.source, ids), ids, levers, query_ids=query)
    # the exact map: the spliced prefix is native, so the new turn (hold-back + query) reads it as in one forward
    pair.target.set_attn_implementation("eager")
    full = pair.target(torch.cat([ids, query], 1), output_attentions=True).attentions  # [B, Hq, 30, 30] each
    pair.target.set_attn_implementation(attention)
    mass = sum(a[:, :, 24:, 1:24].sum((1, 2)) for a in full)  # queries 24..29 onto the mapped span 1..23
    assert levers.recomputed(26) == 7  # round(0.25 · 26), half up
    assert len(chosen) == 1 and torch.equal(chosen[0], select_tokens(mass, 7, 1))
    assert cache.get_seq_length() == 26 and pair.target.config._attn_implementation == attention


def test_recency_rule_recomputes_the_last_mapped_tokens(pair, chosen):
    exact, _ = transfers(pair)
    ids = calibration_ids(1, 20, seed=11)
    spliced_cache(exact, prefill(pair.source, ids), ids, Levers(hold_back=3, recompute=0.2, recompute_rule="recency"))
    assert chosen[0].tolist() == [[13, 14, 15, 16]]  # 20 % of 20 tokens, the last of the mapped 0..16


def test_the_attention_rule_needs_the_new_turn_and_recompute_needs_a_mask(pair):
    exact, _ = transfers(pair)
    ids = calibration_ids(1, 12, seed=12)
    with pytest.raises(ValueError, match="new turn"):
        spliced_cache(exact, prefill(pair.source, ids), ids, Levers(recompute=0.5, recompute_rule="attention"))
    pair.target.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="4-D mask"):
            recompute_in_place(pair.target, prefill(pair.source, ids), ids, torch.tensor([[3]]))
    finally:
        pair.target.config._attn_implementation = "eager"


@pytest.mark.parametrize(
    "levers",
    [
        Levers(recompute=0.2, recompute_rule="recency"),
        Levers(recompute=0.2),
        Levers(recompute=0.1, recompute_layers=2, native_layers=1),
        Levers(hold_back=3, recompute=0.15, recompute_rule="attention"),
    ],
)
def test_prefill_fraction_is_the_target_work_done(pair, levers):
    """Tokens × layers the target's decoder layers actually ran, over T × L, is what `prefill_fraction` charges."""
    exact, _ = transfers(pair)
    ids, query = calibration_ids(1, 40, seed=13), calibration_ids(1, 2, seed=14)
    layers = pair.target.model.layers
    work = []
    hooks = [layer.register_forward_hook(lambda _, args, __: work.append(args[0].shape[1])) for layer in layers]
    try:
        spliced_cache(exact, prefill(pair.source, ids), ids, levers, query_ids=query)
    finally:
        for hook in hooks:
            hook.remove()
    charged = levers.prefill_fraction(40, len(layers), query_len=query.shape[1])
    assert sum(work) / (40 * len(layers)) == pytest.approx(charged)
    assert charged > 0


def test_horizon_nll_with_every_token_recomputed_is_the_targets(pair):
    """The NLL eval passes the token read on top of the prefix as the attention rule's new turn, and charges it."""
    _, wrong = transfers(pair)
    streams = calibration_ids(2, 28, seed=15)
    scores = horizon_nll(wrong, streams, 20, Levers(recompute=1.0, recompute_rule="attention"))
    assert scores["nll_transfer"] == pytest.approx(scores["nll_native_target"], abs=1e-5)
    assert scores["nll_native_source"] != pytest.approx(scores["nll_native_target"], abs=1e-3)
    assert scores["prefill_fraction"] == pytest.approx((19 + 1) / 19)  # 19 prefix tokens + the 1-token query pass
