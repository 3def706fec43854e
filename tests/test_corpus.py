"""Token streams (src/corpus.py): validation windows disjoint from test windows and from every calibration budget
(asserted on ids), few-shot calibration prompts built only from never-evaluated items."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from src.corpus import (
    CORPORA,
    FEWSHOT_FILES,
    SHOTS,
    _prompts,
    dev_text,
    fewshot_text,
    heldout_sequences,
    read_text,
    token_sequences,
)
from src.tasks import DEV_FILES, Item, load_task
from tests.conftest import budget_spec

CONF = Path(__file__).resolve().parents[1] / "conf"
DATA = Path(__file__).resolve().parents[2] / "shared/data"
if not (DATA / "corpora").is_dir():
    pytest.skip(f"shared data not found at {DATA}", allow_module_level=True)
BYTES = 256  # no tokenizer: ids are the text's UTF-8 bytes
NLL = yaml.safe_load((CONF / "eval/default.yaml").read_text())["nll"]
BUDGETS = sorted(path.stem for path in (CONF / "budget").glob("*.yaml"))


def windows(ids: torch.Tensor) -> set[bytes]:
    return {bytes(row) for row in ids.tolist()}


def test_validation_and_test_nll_streams_are_disjoint():
    valid_corpus, test_corpus = NLL["valid_corpus"], NLL["corpus"]
    assert CORPORA[valid_corpus] != CORPORA[test_corpus]  # different files
    length = NLL["prefix_len"] + NLL["horizon"]
    valid = heldout_sequences(DATA, valid_corpus, NLL["streams"], length, None, BYTES)
    test = token_sequences(DATA, test_corpus, NLL["streams"], length, None, BYTES)
    assert valid.shape == test.shape == (NLL["streams"], length)
    assert not windows(valid) & windows(test)
    test_text = read_text(DATA, test_corpus).encode("utf-8")
    assert not any(window in test_text for window in windows(valid))  # not even at another offset


@pytest.mark.parametrize("budget", BUDGETS)
def test_validation_windows_are_disjoint_from_every_calibration_budget(budget):
    spec = budget_spec(budget)
    names = spec["corpus"].split("+")
    if NLL["valid_corpus"] not in names:
        assert CORPORA[NLL["valid_corpus"]] not in {CORPORA[name] for name in names}
        return
    share = math.ceil(spec["sequences"] / len(names))  # windows the budget reads from the start of the corpus
    length = NLL["prefix_len"] + NLL["horizon"]
    valid = heldout_sequences(DATA, NLL["valid_corpus"], NLL["streams"], length, None, BYTES)
    calibration = token_sequences(DATA, NLL["valid_corpus"], share, spec["seq_len"], None, BYTES)
    read = b"".join(windows(calibration))
    assert not any(window in read for window in windows(valid))
    # with any tokenizer: calibration reads at most share · seq_len · 6 characters, the validation tail from the end
    assert (share * spec["seq_len"] + NLL["streams"] * length) * 6 <= len(read_text(DATA, NLL["valid_corpus"]))


def test_heldout_windows_are_the_corpus_tail():
    text = read_text(DATA, "wikitext2_valid").encode("utf-8")
    tail = heldout_sequences(DATA, "wikitext2_valid", 3, 50, None, BYTES)
    assert bytes(tail.flatten().tolist()) == text[-150:]
    with pytest.raises(ValueError, match="one corpus"):
        heldout_sequences(DATA, "wikitext2_valid+gutenberg", 1, 8, None, BYTES)


@pytest.mark.parametrize("render", [dev_text, fewshot_text])
def test_calibration_text_holds_no_evaluated_item(render):
    text = render(DATA)
    answered = {p[: p.rindex("\nAnswer:") + 8] for p in text.split("\n\n") if "\nAnswer:" in p}  # up to "Answer:"
    assert len(answered) > 2000
    for task in ("arc_easy", "arc_challenge", "mmlu"):  # every evaluated item, not a subsample
        for item in load_task(task, DATA):
            if item.contexts[0].split("\n\n")[-1] in answered:  # its last paragraph is there: is all of it?
                question = item.contexts[0].partition("\n\n")[2] if task == "mmlu" else item.contexts[0]
                assert question not in text, (task, item.index)


def test_fewshot_prompts_write_a_header_once_per_prompt_of_at_most_the_shots():
    mmlu = lambda subject, i: Item("mmlu", i, [f"About {subject}.\n\nQ{i}\nA. x\nAnswer:"], [" A"], 0)
    arc = lambda i: Item("arc_easy", i, [f"Question: q{i}\nAnswer:"], [f" a{i}"], 0)
    items = [mmlu("algebra", i) for i in range(7)] + [mmlu("law", 7)]
    prompts = _prompts(items, 5)
    assert [p.count("About ") for p in prompts] == [1, 1, 1] and [p.count("Answer: A") for p in prompts] == [5, 2, 1]
    assert prompts[0] == "About algebra.\n\n" + "\n\n".join(f"Q{i}\nA. x\nAnswer: A" for i in range(5))
    assert _prompts([arc(i) for i in range(6)], 5) == [
        "\n\n".join(f"Question: q{i}\nAnswer: a{i}" for i in range(5)),
        "Question: q5\nAnswer: a5",
    ]


def test_fewshot_text_interleaves_the_never_evaluated_splits():
    assert {task for task, _ in FEWSHOT_FILES} == set(DEV_FILES) and SHOTS == 5
    text = fewshot_text(DATA)
    first = text.split("\n\n")
    assert first[0].startswith("Question: ") and first[SHOTS].startswith("Question: ")  # ARC-Easy, ARC-Challenge
    assert first[2 * SHOTS].startswith("The following are multiple choice questions")  # then MMLU val
    mixed = token_sequences(DATA, "gutenberg+task_dev+wikitext2_valid+task_fewshot", 8, 32, None, BYTES)
    assert torch.equal(mixed[3], token_sequences(DATA, "task_fewshot", 1, 32, None, BYTES)[0])
