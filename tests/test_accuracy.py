"""The task protocol (`src.eval.accuracy`), the calibration domains and the diagnostics (`src.eval.diagnose`)
on tiny random models with a byte-level tokenizer over real task text: lm-eval's pair encoding, native
scoring equal to a stock full forward, the exact map of tests/exact_pair.py with native sink / hold-back /
layers equal to native target scoring with the prefill fraction it spent (a wrong map and the source's own
scores differ, so native target state leaking into the transfer condition shows), hand-computed comparison
metrics, the task-format calibration text free of evaluated items, and diagnostics that read perfect on the
exact map and not on the wrong one."""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from src.apply import KVTransfer
from src.corpus import dev_text, token_sequences
from src.eval.accuracy import TaskScores, by_length, compare, encode_pair, score_task, summarize
from src.eval.diagnose import cache_fidelity, swap_nll
from src.eval.nll import continuation_nll
from src.forward import prefill
from src.models import Pair, tokenizer_hash
from src.runtime.plan import Levers
from src.tasks import load_task
from tests.conftest import calibration_ids, tiny
from tests.exact_pair import exact_pair

DATA = Path(__file__).resolve().parents[2] / "shared/data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data not found at {DATA}")
VOCAB = 260  # 256 byte symbols + </s>


def _tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: every UTF-8 byte is one token, </s> = 256."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "</s>"})
    return tokenizer


@functools.cache
def _exact() -> tuple[Pair, KVTransfer, KVTransfer]:
    """The exact-map pair (tests/exact_pair.py) at the byte vocabulary, with its exact and its wrong transfer."""
    tokenizer = _tokenizer()
    source, target, hashed, exact, wrong = exact_pair(vocab_size=VOCAB, tokenizer_hash=tokenizer_hash(tokenizer))
    pair = Pair(source=source, target=target, tokenizer=tokenizer, tokenizer_hash=hashed, weights="random")
    return pair, KVTransfer(exact, source, target, hashed), KVTransfer(wrong, source, target, hashed)


@functools.cache
def _native(task: str, items: int, mode: str = "native_target") -> TaskScores:
    return score_task(mode, _exact()[0], _items(task, items))


@functools.cache
def _two_models() -> Pair:
    tokenizer = _tokenizer()
    source, target = tiny("qwen2", seed=1, vocab_size=VOCAB), tiny("llama", seed=0, vocab_size=VOCAB)
    return Pair(source, target, tokenizer, tokenizer_hash(tokenizer), "random")


def _items(task: str, count: int = 3):
    return [
        item
        for item in load_task(task, DATA, 400)
        if len(_tokenizer().encode(item.contexts[0])) < 200  # tiny models hold 256 positions
    ][:count]


def test_encode_pair_moves_trailing_spaces_and_splits_the_whole_encoding():
    tokenizer = _tokenizer()
    context, continuation = encode_pair(tokenizer, "Question: why?\nAnswer: ", "because")
    assert tokenizer.decode(context) == "Question: why?\nAnswer:"
    assert tokenizer.decode(continuation) == " because"


def test_encode_pair_equals_lm_evals_template():
    pytest.importorskip("lm_eval")
    from src.eval.harness import KVRelayLM

    lm = KVRelayLM(_two_models(), "native_target")
    for context, continuation in (("a b  ", "c"), ("Question: x\nAnswer:", " y z"), ("ctx", "ü€")):
        assert encode_pair(_tokenizer(), context, continuation) == tuple(lm._encode_pair(context, continuation))


@needs_data
@torch.no_grad()
def test_native_scores_equal_a_full_forward():
    pair = _two_models()
    items = _items("arc_easy")
    scores = score_task("native_target", pair, items)
    for item, loglikelihoods in zip(items, scores.loglikelihoods, strict=True):
        for choice, value in enumerate(loglikelihoods):
            context, continuation = encode_pair(pair.tokenizer, item.contexts[choice], item.continuations[choice])
            ids = torch.tensor(context + continuation)[None]  # [1, T]
            logprobs = pair.target(ids).logits.log_softmax(-1)[0, len(context) - 1 : -1]  # [L, V]
            assert value == pytest.approx(
                float(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum()), abs=1e-4
            )
    assert scores.prefill_fraction == [1.0] * len(items)


@needs_data
@pytest.mark.parametrize("task", ["arc_easy", "winogrande", "lambada"])
@pytest.mark.parametrize(("sink", "hold", "layers"), [(0, 0, 0), (4, 0, 0), (2, 8, 0), (500, 0, 0), (2, 8, 1)])
def test_exact_transfer_with_levers_equals_native(task, sink, hold, layers):
    pair, transfer, _ = _exact()
    items = _items(task, 2)
    native = _native(task, 2)
    mapped = score_task("transfer", pair, items, transfer, Levers(sink, hold, layers))
    np.testing.assert_allclose(mapped.loglikelihoods, native.loglikelihoods, atol=1e-4)
    assert mapped.greedy == native.greedy
    for item, fraction in zip(items, mapped.prefill_fraction, strict=True):
        prefixes = [
            len(encode_pair(pair.tokenizer, c, x)[0]) - 1
            for c, x in zip(item.contexts, item.continuations, strict=True)
        ]
        prefixes = prefixes[:1] if item.shared_context else prefixes
        native_tokens = [min(sink, p) + min(hold, p - min(sink, p)) for p in prefixes]
        spent = sum(n + (p - n) * layers / 3 for n, p in zip(native_tokens, prefixes, strict=True))  # 3 layers
        assert fraction == pytest.approx(spent / sum(prefixes))


@needs_data
@pytest.mark.parametrize(("sink", "hold", "layers"), [(0, 0, 0), (2, 8, 1), (500, 0, 0)])
def test_wrong_map_with_levers_differs_from_native(sink, hold, layers):
    """The exact-map equality above reads the source through the map: a wrong map differs wherever a token is
    mapped, and equals native only when the levers leave nothing mapped (a 500-token sink)."""
    pair, _, wrong = _exact()
    items = _items("arc_easy", 1)
    native = np.array(_native("arc_easy", 1).loglikelihoods)
    mapped = np.array(score_task("transfer", pair, items, wrong, Levers(sink, hold, layers)).loglikelihoods)
    if sink >= 500:
        np.testing.assert_allclose(mapped, native, atol=1e-4)
    else:
        assert np.abs(mapped - native).max() > 1e-2
    assert np.abs(np.array(_native("arc_easy", 1, "native_source").loglikelihoods) - native).max() > 1e-1


def _planted(correct: list[bool], task: str = "arc_easy") -> TaskScores:
    """Two-choice items whose choice 0 wins exactly where `correct` holds (label 0)."""
    return TaskScores(
        task=task,
        loglikelihoods=[[-1.0, -2.0] if hit else [-2.0, -1.0] for hit in correct],
        greedy=[[hit, False] for hit in correct],
        labels=[0] * len(correct),
        lengths=[[1, 1]] * len(correct),
        context_tokens=[10, 100, 200, 300][: len(correct)],
        prefill_fraction=[0.25] * len(correct),
    )


def test_compare_against_hand_computed_values():
    source = _planted([False, False, True, False])  # 0.25
    target = _planted([True, True, True, False])  # 0.75
    method = _planted([True, False, True, False])  # 0.50
    result = compare("arc_easy", source, target, method, n_boot=200)
    assert (result["acc_source"], result["acc_target"], result["acc"]) == (0.25, 0.75, 0.5)
    assert result["loss_points"] == pytest.approx(25.0)
    assert result["retention"] == pytest.approx(0.5 / 0.75)
    assert result["gap_recovered"] == pytest.approx(0.5)
    assert result["mcnemar_p"] == pytest.approx(1.0)  # one discordant item
    assert result["loss_points_low"] <= 25.0 <= result["loss_points_high"]
    assert result["prefill_fraction"] == 0.25
    lambada = compare(
        "lambada", *(_planted(c, "lambada") for c in ([False] * 4, [True] * 4, [True, True, False, False])), 50
    )
    assert lambada["acc"] == 0.5 and lambada["gap_recovered"] == 0.5  # LAMBADA's acc reads the greedy flag


def test_summarize_and_length_buckets():
    per_task = {
        "a": {"acc_source": 0.2, "acc_target": 0.6, "acc": 0.5, "loss_points": 10.0, "retention": 5 / 6,
              "gap_recovered": 0.75, "prefill_fraction": 0.0},
        "b": {"acc_source": 0.4, "acc_target": 0.8, "acc": 0.8, "loss_points": 0.0, "retention": 1.0,
              "gap_recovered": 1.0, "prefill_fraction": 0.5},
    }  # fmt: skip
    summary = summarize(per_task)
    assert summary["acc"] == pytest.approx(0.65) and summary["loss_points"] == pytest.approx(5.0)
    assert summary["max_loss_points"] == 10.0 and summary["prefill_fraction"] == 0.25
    assert summary["gap_recovered"] == pytest.approx((0.65 - 0.3) / 0.4)
    assert summary["mean_task_retention"] == pytest.approx((5 / 6 + 1) / 2)
    buckets = by_length(_planted([True, False, True, True]))
    assert buckets == {"acc_len_0_64": 1.0, "acc_len_64_128": 0.0, "acc_len_128_256": 1.0, "acc_len_256_512": 1.0}


@needs_data
def test_task_dev_text_holds_no_evaluated_item():
    text = dev_text(DATA)
    assert text.startswith("Question: ") and "\nAnswer: " in text
    for task in ("arc_easy", "arc_challenge", "mmlu"):
        for item in load_task(task, DATA, 200):
            assert item.contexts[0].split("\n\n")[-1] not in text, (task, item.index)  # question + options


@needs_data
def test_corpus_mixture_alternates_and_keeps_each_corpus_order():
    mixed = token_sequences(DATA, "gutenberg+task_dev+wikitext2_valid", 7, 32, None, 1000)  # [7, 32]
    parts = [token_sequences(DATA, name, 3, 32, None, 1000) for name in ("gutenberg", "task_dev", "wikitext2_valid")]
    expected = torch.stack(parts, dim=1).flatten(0, 1)[:7]
    assert torch.equal(mixed, expected) and torch.equal(mixed[1], parts[1][0])


@needs_data
def test_diagnostics_read_perfect_on_the_exact_map_only():
    pair, transfer, wrong = _exact()
    prompts = [torch.tensor(pair.tokenizer.encode(item.contexts[0])) for item in _items("arc_easy", 2)]
    fidelity = cache_fidelity(transfer, prompts)
    assert fidelity["prompt_r2_k"] == pytest.approx(1, abs=1e-4) and fidelity["prompt_r2_v"] == pytest.approx(
        1, abs=1e-4
    )
    assert max(v for k, v in fidelity.items() if k.startswith("relative_error")) < 1e-3
    assert {f"relative_error_{where}_{c}" for where in ("position0", "rest") for c in "kv"} <= set(fidelity)
    assert fidelity["attention_output_cosine"] == pytest.approx(1, abs=1e-4)
    off = cache_fidelity(wrong, prompts[:1])
    assert off["prompt_r2_k"] < 0.999 and off["prompt_r2_v"] < 0.999 and off["attention_output_cosine"] < 0.9999
    assert min(v for k, v in off.items() if k.startswith("relative_error")) > 1e-2
    streams = calibration_ids(2, 40, vocab=VOCAB, seed=5)
    native = float(continuation_nll(pair.target, prefill(pair.target, streams[:, :23]), streams, 24).mean())
    swaps = swap_nll(transfer, streams, 24)
    assert set(swaps) == {"nll_swap_k", "nll_swap_v", *(f"nll_swap_layer_{i}" for i in range(3))}
    assert all(value == pytest.approx(native, abs=1e-4) for value in swaps.values())
    wrong_swaps = swap_nll(wrong, streams, 24)  # keeps wrong V (the tiny models' near-uniform attention hides K)
    assert all(abs(value - native) > 1e-3 for name, value in wrong_swaps.items() if name != "nll_swap_v"), wrong_swaps
