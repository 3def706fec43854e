"""Routed workload builders (src/workloads.py) on real items from shared/data: no scored item (nor one with a scored
item's question) among the shots, no shot from a file the calibration read, lm-eval's rendering, passage splits,
conversations that use each item once, token chunks, and append-only chat rendering."""

from pathlib import Path

import pytest
import torch

from src.tasks import _FILES, load_task
from src.workloads import (
    SCORED,
    Bytes,
    Chat,
    _header,
    _pool,
    calibration_files,
    chunks,
    conversations,
    fewshot,
    passage,
    shot_ids,
)
from tests.conftest import budget_spec

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data"
if not (DATA / "eval").is_dir():
    pytest.skip(f"shared data not found at {DATA}", allow_module_level=True)
BUDGETS = {p.stem: budget_spec(p.stem)["corpus"] for p in (REPO / "conf/budget").glob("*.yaml")}
SHOTS = {"arc_easy": 25, "arc_challenge": 25, "hellaswag": 10, "mmlu": 5, "winogrande": 5, "piqa": 5}
LIMIT = 6


def _source(shot: str) -> str:
    return shot.rsplit("#", 1)[0]


CASES = [(task, "paper_mix") for task in sorted(SHOTS)]
CASES += [(task, budget) for task in ("arc_challenge", "arc_easy", "mmlu") for budget in ("paper", "paper_fewshot")]


@pytest.mark.parametrize(("task", "budget"), CASES)
def test_fewshot_never_shows_a_scored_or_calibration_item(task, budget):
    if budget not in BUDGETS:
        pytest.skip(f"no budget {budget}")
    calibration = calibration_files(BUDGETS[budget])
    assert _FILES[task] not in calibration  # the scored split is never calibration text
    scored = load_task(task, DATA, LIMIT)
    pool = _pool(DATA, task, scored, calibration)  # every shot any item could draw, (source, item)
    assert pool and not {source for source, _ in pool} & calibration
    questions = {_header(c)[1] for item in scored for c in item.contexts}
    assert not {_header(c)[1] for _, item in pool for c in item.contexts} & questions
    every_question = {_header(c)[1] for i in load_task(task, DATA) for c in i.contexts}
    for source, item in pool:
        if source == SCORED:
            assert item.index not in {i.index for i in scored}
        else:  # another split: none of its items repeats any question of the evaluated file
            assert not {_header(c)[1] for c in item.contexts} & every_question
    examples = fewshot(DATA, task, LIMIT, SHOTS[task], 0, calibration)
    assert [ex.item.index for ex in examples] == [item.index for item in scored]
    scored_indices = {item.index for item in scored}
    for example, item in zip(examples, scored, strict=True):
        assert len(example.shots) == len(set(example.shots)) == SHOTS[task]  # k distinct shots
        for shot in example.shots:
            assert _source(shot) not in calibration
            if _source(shot) == SCORED:
                assert int(shot.rsplit("#", 1)[1]) not in scored_indices
        for question in questions:  # no scored question (and so no scored item) in any history
            assert question not in example.history
        assert example.item.continuations == item.continuations and example.item.label == item.label
        assert example.history.endswith("\n\n") and example.history.count("\n\n") >= SHOTS[task]
        if task == "mmlu":  # lm-eval: the subject's header once, then its dev exemplars
            header = _header(item.contexts[0])[0]
            assert example.history.startswith(header) and example.history.count("The following are") == 1
            assert example.item.contexts[0] == item.contexts[0][len(header) :]
        else:
            assert example.item.contexts == item.contexts
    if budget == "paper":  # calibration reads books only: the dev splits are the shots
        expected = {"arc_easy": "eval/arc/ARC-Easy-Dev.jsonl", "mmlu": "eval/mmlu/mmlu_dev.jsonl"}.get(task, SCORED)
        if task != "arc_challenge":
            assert {_source(s) for ex in examples for s in ex.shots} == {expected}
    if budget == "paper_mix" and task.startswith("arc"):  # task_dev read ARC dev: shots come from elsewhere
        assert {_source(s) for ex in examples for s in ex.shots} == {SCORED}


def test_mmlu_subjects_whose_dev_exemplars_repeat_test_questions_are_topped_up_from_unscored_test_items():
    """Some subjects' dev exemplars repeat a test question (dropped): the 100 scored items at the paper_mix budget
    (the routed H200 run of 2026-12-03 stopped on 'mmlu: 3 shots available for item 560')."""
    scored = {item.index: item for item in load_task("mmlu", DATA, 100)}
    examples = fewshot(DATA, "mmlu", 100, 5, 0, calibration_files(BUDGETS["paper_mix"]))
    sources = [[_source(s) for s in ex.shots] for ex in examples]
    assert all(len(set(ex.shots)) == 5 for ex in examples)
    assert any(SCORED in row for row in sources) and all(SCORED not in row[:1] for row in sources)  # dev first
    for ex, row in zip(examples, sources, strict=True):
        assert row == sorted(row, key=lambda source: source == SCORED)
        for shot in ex.shots:
            assert _source(shot) == SCORED or _source(shot) == "eval/mmlu/mmlu_dev.jsonl"
            assert _source(shot) != SCORED or int(shot.rsplit("#", 1)[1]) not in scored
    mixed = next(ex.shots for ex, row in zip(examples, sources, strict=True) if SCORED in row)
    ids = shot_ids(mixed)  # the record's form: every shot once, each file's in order
    assert len(ids) == 2 and [f"{f}#{i}" for f, indices in ids.items() for i in indices] == list(mixed)


@pytest.mark.parametrize("task", ["arc_easy", "hellaswag", "mmlu"])
def test_validation_items_never_meet_a_test_item(task, monkeypatch):
    """workload.split=valid scores the items between the test items, and their shots are never test items; the test
    prompts are those of test runs before validation items existed (a test item's shots may be validation items)."""
    import src.workloads

    calibration = calibration_files(BUDGETS["paper_mix"])
    test = {item.index: item for item in load_task(task, DATA, LIMIT)}
    excluded, pool = [], src.workloads._pool
    monkeypatch.setattr(src.workloads, "_pool", lambda *a: excluded.append({i.index for i in a[2]}) or pool(*a))
    valid = fewshot(DATA, task, LIMIT, SHOTS[task], 0, calibration, "valid")
    assert set(test) | {ex.item.index for ex in valid} <= excluded[0]  # no test item can be drawn as a shot
    assert [ex.item.index for ex in valid] == [item.index for item in load_task(task, DATA, LIMIT, "valid")]
    assert not {ex.item.index for ex in valid} & set(test)
    questions = {_header(c)[1] for item in test.values() for c in item.contexts}
    for example in valid:
        assert not {int(s.rsplit("#", 1)[1]) for s in example.shots if _source(s) == SCORED} & set(test)
        assert not any(question in example.history for question in questions)
    passages = passage(DATA, "boolq", LIMIT, "valid")
    assert not {ex.item.index for ex in passages} & {ex.item.index for ex in passage(DATA, "boolq", LIMIT)}


def test_a_list_of_shot_counts_cycles_over_the_items():
    """fewshot_long (conf/workload/fewshot_long.yaml): the n-th scored item gets shots[n mod len] shots, each item's
    shots drawn as a single count would draw them (the same seeded sampler); bad counts are refused."""
    calibration = calibration_files("gutenberg")
    cycled = fewshot(DATA, "piqa", 5, [1, 3], 0, calibration)
    assert [len(ex.shots) for ex in cycled] == [1, 3, 1, 3, 1]
    single = {k: fewshot(DATA, "piqa", 5, k, 0, calibration) for k in (1, 3)}
    assert [ex.history for ex in cycled] == [single[len(ex.shots)][n].history for n, ex in enumerate(cycled)]
    for bad in ([], [2, -1], [True], 2.5):
        with pytest.raises(ValueError, match="piqa: shots must be a count ≥ 0 or a non-empty list"):
            fewshot(DATA, "piqa", 2, bad, 0, calibration)


def test_fewshot_is_seeded_and_refuses_too_few_shots():
    calibration = calibration_files("gutenberg")
    first, again = (fewshot(DATA, "piqa", 3, 5, 0, calibration) for _ in range(2))
    assert first == again
    assert fewshot(DATA, "piqa", 3, 5, 1, calibration)[0].shots != first[0].shots
    with pytest.raises(ValueError, match="shots available"):
        fewshot(DATA, "mmlu", 2, 10**4, 0, calibration)  # more than a subject's dev + unscored test items
    with pytest.raises(ValueError, match="unknown corpus"):
        calibration_files("gutenberg+nope")


def test_passages_split_history_from_the_new_turn():
    boolq, lambada = passage(DATA, "boolq", 5), passage(DATA, "lambada", 5)
    for example, item in zip(boolq, load_task("boolq", DATA, 5), strict=True):
        assert example.history + example.item.contexts[0] == item.contexts[0]
        assert example.item.contexts[0].startswith("\nQuestion: ") and example.item.continuations == [" no", " yes"]
    items = {item.index: item for item in load_task("lambada", DATA, 5)}
    assert lambada
    for example in lambada:
        assert example.history + example.item.contexts[0] == items[example.item.index].contexts[0]
        assert example.history[-1] in ".!?\"'”’)" and example.item.contexts[0][0].isspace()
    with pytest.raises(ValueError, match="boolq or lambada"):
        passage(DATA, "piqa", 2)


def test_conversations_use_each_item_once():
    chained = conversations(DATA, "arc_easy", 20, 6)
    assert [len(c) for c in chained] == [6, 6, 6]
    indices = [item.index for conversation in chained for item in conversation]
    assert len(set(indices)) == 18 and indices == [item.index for item in load_task("arc_easy", DATA, 20)][:18]
    with pytest.raises(ValueError, match="one question per item"):
        conversations(DATA, "winogrande", 4, 2)


def test_chunks():
    ids = torch.arange(10)
    parts = chunks(ids, 4)
    assert [p.numel() for p in parts] == [2, 3, 3, 2] and torch.equal(torch.cat(parts), ids)
    assert len(chunks(ids, 10)) == 10
    with pytest.raises(ValueError, match="cannot cut"):
        chunks(ids, 11)


TOKENIZER = Path.home() / ".cache/kvrelay/models/qwen25coder_0p5b"


@pytest.mark.parametrize("kind", ["bytes", "qwen"])
def test_chat_rendering_is_append_only(kind):
    if kind == "qwen":
        if not (TOKENIZER / "tokenizer.json").is_file():
            pytest.skip("the real tokenizer is not fetched")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    else:
        tokenizer = Bytes(96)
    chat, text = Chat(tokenizer), ""
    for question, answer in (("What is 2+2?", "4"), ("And 3+3?", "6")):
        user = chat.user(question)
        candidate = chat.answer(answer, commit=False)
        assert chat.answer(answer) == candidate and candidate[0].endswith(answer)
        text += user + "".join(candidate)
    assert text == chat.rendered
    if kind == "qwen":
        assert text == tokenizer.apply_chat_template(chat.messages, tokenize=False)
        assert user.endswith("<|im_start|>assistant\n")
    else:
        assert tokenizer.encode("é") == [0xC3 % 96, 0xA9 % 96]
