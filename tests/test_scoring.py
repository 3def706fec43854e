"""Choice scoring on a context cache (`src.eval.scoring`): the native modes equal a plain full forward over
context + continuation (1e-4), batching over continuations of different lengths equals scoring them one at a
time, the exact map of tests/exact_pair.py reproduces the target's native scoring (1e-4) while a wrong map
and the source's own cache do not (a leak of the target's native cache would pass the first but not the
second), and the source prefill + map run once per context whatever the number of continuations.
"""

import functools

import pytest
import torch

from src.apply import KVTransfer
from src.eval.scoring import (
    choice_loglikelihoods,
    context_cache,
    greedy_decode,
    shared_continuation_loglikelihoods,
)
from src.models import Pair, vocabulary_hash
from tests.conftest import CountingTransfer, calibration_ids, tiny
from tests.exact_pair import exact_pair, max_cache_diff

NATIVE_TOL = 1e-4


@functools.cache
def _pair() -> Pair:
    source, target = tiny("qwen2", seed=1), tiny("llama", seed=0)
    return Pair(source=source, target=target, tokenizer=None, tokenizer_hash=vocabulary_hash(target), weights="random")


@functools.cache
def _exact() -> tuple[Pair, KVTransfer, KVTransfer]:
    """The exact-map pair (tests/exact_pair.py) with its exact and its wrong transfer."""
    source, target, token_hash, exact, wrong = exact_pair()
    pair = Pair(source=source, target=target, tokenizer=None, tokenizer_hash=token_hash, weights="random")
    return pair, KVTransfer(exact, source, target, token_hash), KVTransfer(wrong, source, target, token_hash)


@torch.no_grad()
def _full_forward(model, context: torch.Tensor, continuation: torch.Tensor) -> tuple[float, bool]:
    """Stock HF scoring: one forward over context + continuation, read at the continuation's positions."""
    ids = torch.cat([context, continuation])[None]  # [1, T_c + L]
    logprobs = model(ids).logits.float().log_softmax(-1)[0, context.numel() - 1 : -1]  # [L, V]
    total = logprobs.gather(-1, continuation[:, None]).sum()
    return float(total), bool((logprobs.argmax(-1) == continuation).all())


@torch.no_grad()
def _greedy_reference(model, context: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation by full forwards, no cache."""
    ids = context[None]  # [1, T]
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # [1, T + 1]
    return ids[0, context.numel() :]


def _continuations(model, context: torch.Tensor) -> list[torch.Tensor]:
    """Lengths 1–7, one of them the model's own greedy continuation (is_greedy must then be True)."""
    random = [calibration_ids(1, length, seed=10 + length)[0] for length in (1, 3, 7, 2)]
    return [*random, _greedy_reference(model, context, 4)]


def _assert_scores_close(ours, theirs, tol):
    assert len(ours) == len(theirs)
    for (value, greedy), (expected, expected_greedy) in zip(ours, theirs, strict=True):
        assert value == pytest.approx(expected, abs=tol)
        assert greedy == expected_greedy


@pytest.mark.parametrize("mode", ["native_target", "native_source"])
@pytest.mark.parametrize("context_len", [1, 2, 17])
def test_native_equals_full_forward(mode, context_len):
    pair = _pair()
    model = pair.target if mode == "native_target" else pair.source
    context = calibration_ids(1, context_len, seed=3)[0]  # [T_c]
    continuations = _continuations(model, context)
    scores = choice_loglikelihoods(mode, pair, context, continuations)
    _assert_scores_close(scores, [_full_forward(model, context, c) for c in continuations], NATIVE_TOL)
    assert scores[-1][1] and not all(greedy for _, greedy in scores)


def test_batched_equals_one_at_a_time():
    pair = _pair()
    context = calibration_ids(1, 12, seed=4)[0]
    continuations = _continuations(pair.target, context)
    batched = choice_loglikelihoods("native_target", pair, context, continuations)
    alone = [choice_loglikelihoods("native_target", pair, context, [c])[0] for c in continuations]
    _assert_scores_close(batched, alone, 1e-5)


def _largest_gap(ours, theirs) -> float:
    return max(abs(value - expected) for (value, _), (expected, _) in zip(ours, theirs, strict=True))


def test_transfer_equals_native_only_through_the_exact_map():
    pair, exact, wrong = _exact()
    for context_len in (1, 9, 30):
        context = calibration_ids(1, context_len, seed=context_len)[0]
        continuations = _continuations(pair.target, context)
        native = choice_loglikelihoods("native_target", pair, context, continuations)
        mapped = choice_loglikelihoods("transfer", pair, context, continuations, exact)
        _assert_scores_close(mapped, native, NATIVE_TOL)
        if context_len > 1:  # a one-token context has no prefix to map
            assert _largest_gap(choice_loglikelihoods("transfer", pair, context, continuations, wrong), native) > 1e-2
            assert _largest_gap(choice_loglikelihoods("native_source", pair, context, continuations), native) > 1e-1


def test_transfer_cache_equals_the_targets_own_only_through_the_exact_map():
    pair, exact, wrong = _exact()
    context = calibration_ids(1, 20, seed=12)[0]
    own = context_cache("native_target", pair, context)
    assert max_cache_diff(context_cache("transfer", pair, context, exact), own) < 1e-4
    assert max_cache_diff(context_cache("transfer", pair, context, wrong), own) > 1e-2
    assert max_cache_diff(context_cache("native_source", pair, context), own) > 1e-1  # S's cache is not T's


def test_transfer_prefills_and_maps_once_per_context():
    pair, transfer, _ = _exact()
    counting = CountingTransfer(transfer)
    context = calibration_ids(1, 10, seed=6)[0]
    continuations = _continuations(pair.target, context)
    forwards = {"source": 0, "target": 0}
    hooks = [
        model.register_forward_pre_hook(lambda *_, role=role: forwards.__setitem__(role, forwards[role] + 1))
        for role, model in (("source", pair.source), ("target", pair.target))
    ]
    try:
        choice_loglikelihoods("transfer", pair, context, continuations, counting)
    finally:
        for hook in hooks:
            hook.remove()
    assert counting.calls == 1
    assert forwards == {"source": 1, "target": 1}  # one source prefill, one batched read of all five continuations


def test_shared_continuation_loops_contexts():
    pair = _pair()
    contexts = [calibration_ids(1, length, seed=length)[0] for length in (5, 8, 1)]
    continuation = calibration_ids(1, 3, seed=7)[0]
    scores = shared_continuation_loglikelihoods("native_target", pair, contexts, continuation)
    _assert_scores_close(scores, [_full_forward(pair.target, c, continuation) for c in contexts], NATIVE_TOL)


def test_greedy_decode_from_cache():
    pair = _pair()
    context = calibration_ids(1, 11, seed=8)[0]
    cache = context_cache("native_target", pair, context)
    tokens = greedy_decode(pair.target, cache, int(context[-1]), 6, stop=lambda tokens: False)
    assert tokens == _greedy_reference(pair.target, context, 6).tolist()
    cache = context_cache("native_target", pair, context)
    assert greedy_decode(pair.target, cache, int(context[-1]), 6, stop=lambda tokens: len(tokens) == 2) == tokens[:2]


def test_refusals():
    pair, transfer, _ = _exact()
    context, continuation = calibration_ids(1, 4)[0], calibration_ids(1, 2)[0]
    with pytest.raises(ValueError, match="mode must be one of"):
        choice_loglikelihoods("prefill", pair, context, [continuation])
    with pytest.raises(ValueError, match="needs a KVTransfer"):
        choice_loglikelihoods("transfer", pair, context, [continuation])
    with pytest.raises(ValueError, match="needs a KVTransfer built on this pair"):
        choice_loglikelihoods("transfer", _pair(), context, [continuation], transfer)
    with pytest.raises(ValueError, match="at least one token"):
        choice_loglikelihoods("native_target", pair, context[:0], [continuation])
    with pytest.raises(ValueError, match="each of at least one token"):
        choice_loglikelihoods("native_target", pair, context, [continuation, continuation[:0]])
