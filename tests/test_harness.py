"""The lm-eval adapter (`src.eval.harness`): in native_target mode `KVRelayLM` equals lm-eval's own `HFLM`
on the same tiny model and tokenizer — loglikelihood (1e-4, is_greedy per request), rolling perplexity and
greedy generation — the exact map of tests/exact_pair.py reproduces it (1e-4) while a wrong map and the source's
own scores do not (so native target state leaking into the transfer condition shows), each context is mapped
once, and the module imports without lm-eval. Tests that need lm-eval skip when it is not installed.
"""

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from src.apply import KVTransfer
from src.models import Pair, tokenizer_hash
from src.runtime.plan import NO_LEVERS, Levers
from tests.conftest import TINY, CountingTransfer, tiny
from tests.exact_pair import exact_pair

WORDS = [f"w{index}" for index in range(2, TINY["vocab_size"])]
CONTEXT = "w5 w17 w3 w40"
LONG = " ".join(WORDS[index % len(WORDS)] for index in range(300))  # > max_position_embeddings (256)


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny models' whole vocabulary: [UNK]=0, </s>=1, w2..w95."""
    vocab = {"[UNK]": 0, "</s>": 1, **{word: index for index, word in enumerate(WORDS, start=2)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")


@functools.cache
def _pair() -> Pair:
    tokenizer = _tokenizer()
    source, target = tiny("qwen2", seed=1), tiny("llama", seed=0)
    return Pair(
        source=source, target=target, tokenizer=tokenizer, tokenizer_hash=tokenizer_hash(tokenizer), weights="random"
    )


@functools.cache
def _exact() -> tuple[Pair, KVTransfer, KVTransfer]:
    """The exact-map pair (tests/exact_pair.py) with the word-level tokenizer, its exact and its wrong transfer."""
    tokenizer = _tokenizer()
    source, target, token_hash, exact, wrong = exact_pair(tokenizer_hash=tokenizer_hash(tokenizer))
    pair = Pair(source=source, target=target, tokenizer=tokenizer, tokenizer_hash=token_hash, weights="random")
    return pair, KVTransfer(exact, source, target, token_hash), KVTransfer(wrong, source, target, token_hash)


@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def hflm(lm_eval):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=_pair().target, tokenizer=_tokenizer(), batch_size=1)


def _instances(request_type: str, arguments: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=request_type, doc={}, arguments=args, idx=0) for args in arguments]


@torch.no_grad()
def _greedy_words(model, text: str, steps: int) -> str:
    tokenizer = _tokenizer()
    ids = torch.tensor([tokenizer.encode(text)])  # [1, T]
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # [1, T + 1]
    return " " + tokenizer.decode(ids[0, -steps:])


def _loglikelihood_requests() -> list[tuple[str, str]]:
    greedy = _greedy_words(_pair().target, CONTEXT, 3)
    return [
        (CONTEXT, " w8"),
        (CONTEXT, " w9 w10 w11 w12"),
        (CONTEXT, greedy),  # the model's own greedy continuation: is_greedy True
        (CONTEXT + " ", "w13 w14"),  # trailing context space moves onto the continuation
        ("w7", " w2 w3"),  # one-token context: nothing to prefill or map
        ("", "w4 w5"),  # empty context: lm-eval's prefix token (EOS here)
        ("w20 w21", " w22"),
        (LONG, " w3 w4"),  # left-truncated to max_length + 1 tokens as HFLM does
    ]


def _kvrelay(pair, mode, transfer=None, levers=NO_LEVERS):
    from src.eval.harness import KVRelayLM

    return KVRelayLM(pair, mode, transfer, levers)


def test_loglikelihood_equals_hflm(hflm):
    requests = _instances("loglikelihood", _loglikelihood_requests())
    ours = _kvrelay(_pair(), "native_target").loglikelihood(requests)
    theirs = hflm.loglikelihood(requests)
    assert len(ours) == len(theirs) == len(requests)
    for (value, greedy), (expected, expected_greedy) in zip(ours, theirs, strict=True):
        assert value == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy
    assert ours[2][1] and not ours[0][1]


def test_loglikelihood_transfer_equals_native_only_through_the_exact_map(lm_eval):
    pair, exact, wrong = _exact()
    requests = _instances("loglikelihood", _loglikelihood_requests())
    native = _kvrelay(pair, "native_target").loglikelihood(requests)
    mapped = _kvrelay(pair, "transfer", exact).loglikelihood(requests)
    short = requests[:-1]  # all but LONG, for the checks below
    spliced = _kvrelay(pair, "transfer", exact, Levers(native_sink=1, hold_back=1, native_layers=1)).loglikelihood(
        short
    )
    for ours in (mapped, spliced):
        for (value, greedy), (expected, expected_greedy) in zip(ours, native, strict=False):
            assert value == pytest.approx(expected, abs=1e-4)
            assert greedy == expected_greedy
    gap = lambda scores: max(abs(value - expected) for (value, _), (expected, _) in zip(scores, native, strict=False))
    assert gap(_kvrelay(pair, "transfer", wrong).loglikelihood(short)) > 1e-2
    assert gap(_kvrelay(pair, "native_source").loglikelihood(short)) > 1e-1


def test_loglikelihood_maps_each_context_once(lm_eval):
    pair, transfer, _ = _exact()
    counting = CountingTransfer(transfer)
    _kvrelay(pair, "transfer", counting).loglikelihood(_instances("loglikelihood", _loglikelihood_requests()))
    # contexts of ≥ 2 tokens: CONTEXT (4 requests, the trailing-space one included), "w20 w21", LONG
    assert counting.calls == 3


def test_loglikelihood_rolling_equals_hflm(hflm):
    requests = _instances("loglikelihood_rolling", [("w5 w6 w7",), (LONG,)])
    ours = _kvrelay(_pair(), "native_target").loglikelihood_rolling(requests)
    theirs = hflm.loglikelihood_rolling(requests)
    assert ours == pytest.approx(theirs, abs=1e-3)


def test_generate_until_equals_hflm(hflm):
    lm = _kvrelay(_pair(), "native_target")
    free = _instances("generate_until", [(CONTEXT, {"until": [], "max_gen_toks": 8})])
    text = lm.generate_until(free)[0]
    assert text == hflm.generate_until(free)[0]
    stop = text.split()[2]  # a word the model does generate: decoding stops right before it
    requests = _instances(
        "generate_until",
        [
            (CONTEXT, {"until": [stop], "max_gen_toks": 8}),
            ("w9 w30", {"until": ["\n\n"], "max_gen_toks": 5}),
            (LONG, {"until": [], "max_gen_toks": 8}),  # context left-truncated to max_length − max_gen_toks
        ],
    )
    ours = lm.generate_until(requests)
    assert ours == hflm.generate_until(requests)
    assert ours[0] == text[: text.index(stop)]


def test_generate_until_transfer_equals_native_only_through_the_exact_map(lm_eval):
    pair, exact, wrong = _exact()
    requests = _instances("generate_until", [(CONTEXT, {"until": [], "max_gen_toks": 8})])
    native = _kvrelay(pair, "native_target").generate_until(requests)
    assert _kvrelay(pair, "transfer", exact).generate_until(requests) == native
    assert _kvrelay(pair, "transfer", wrong).generate_until(requests) != native


def test_registered_and_refusals(lm_eval):
    from lm_eval.api.registry import get_model

    from src.eval.harness import KVRelayLM

    assert get_model("kvrelay") is KVRelayLM  # construction from model_args: tests/test_lm_eval_cli.py
    with pytest.raises(ValueError, match="needs a tokenizer"):
        KVRelayLM(Pair(_pair().source, _pair().target, None, "h", "random"), "native_target")
    with pytest.raises(ValueError, match="greedily"):
        _kvrelay(_pair(), "native_target").generate_until(
            _instances("generate_until", [(CONTEXT, {"do_sample": True, "temperature": 0.7})])
        )


def _load_fresh(module: str):
    path = Path(__file__).parents[1] / "src" / "eval" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_without_lm_eval_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def test_imports_without_lm_eval(monkeypatch):
    for name in [name for name in sys.modules if name == "lm_eval" or name.startswith("lm_eval.")] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import lm_eval…` now raises ModuleNotFoundError
    assert hasattr(_load_fresh("scoring"), "choice_loglikelihoods")
    harness = _load_fresh("harness")
    assert harness.LM_EVAL_AVAILABLE is False
    assert not hasattr(harness, "KVRelayLM")
