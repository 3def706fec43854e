"""Evaluation-set loaders on the real offline files in shared/data/eval (skipped when they are absent).

Counts are the README's; expected texts are lm-eval's renderings of the first item (HellaSwag's against
the published `hellaswag_val.jsonl` fields ctx_a / ctx_b, which the 6-line file no longer separates).
"""

import functools
import re
from pathlib import Path

import pytest

from src.tasks import (
    METRICS,
    REPORTED_LIMITS,
    REPORTED_TASK_LIMITS,
    TASKS,
    Item,
    choice_lengths,
    hellaswag_preprocess,
    load_task,
    reported,
    subsample,
)

DATA = Path(__file__).resolve().parents[2] / "shared/data"
if not (DATA / "eval").is_dir():
    pytest.skip(f"shared data not found at {DATA}", allow_module_level=True)

COUNTS = {
    "hellaswag": 10_042,
    "arc_easy": 2_376,
    "arc_challenge": 1_172,
    "winogrande": 1_267,
    "piqa": 1_838,
    "mmlu": 14_042,
    "lambada": 5_153,
    "boolq": 3_270,
}
CHOICES = {"hellaswag": {4}, "arc_easy": {3, 4, 5}, "arc_challenge": {3, 4, 5}, "winogrande": {2}, "piqa": {2}}
CHOICES |= {"mmlu": {4}, "lambada": {1}, "boolq": {2}}

# task → (substring of contexts[0], continuations, label) of item 0
FIRST = {
    "hellaswag": (
        "Roof shingle removal: A man is sitting on a roof. He",
        [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.", " is holding a rubik's cube."]
        + [" starts pulling up roofing on a roof."],
        3,
    ),
    "arc_easy": (
        "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:",
        [
            " Sunlight is the source of energy for nearly all ecosystems.",
            " Most ecosystems are found on land instead of in water.",
        ]
        + [" Carbon dioxide is more available than other gases.", " The producers in all ecosystems are plants."],
        0,
    ),
    "arc_challenge": (
        "Question: An astronomer observes that a planet rotates faster after a meteorite impact.",
        [" Planetary density will decrease.", " Planetary years will become longer."]
        + [" Planetary days will become shorter.", " Planetary gravity will become stronger."],
        2,
    ),
    "winogrande": ("Sarah was a much better surgeon than Maria so Sarah", [" always got the easier cases."] * 2, 1),
    "piqa": (
        "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
        [
            " Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, you will"
            " also need to supply it with a water bottle and a food dish.",
            " Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, you will"
            " also need to supply it with a water bottle and a food dish.",
        ],
        0,
    ),
    "mmlu": (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\nFind the degree for the"
        " given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:",
        [" A", " B", " C", " D"],
        1,
    ),
    "lambada": ("his mouth curved in a confident grin, I don't care about", [" signs"], 0),
    "boolq": ("\nQuestion: does ethanol take more energy make that produces?\nAnswer:", [" no", " yes"], 0),
}


@functools.cache
def items(name: str) -> tuple[Item, ...]:
    return tuple(load_task(name, DATA))


def test_task_tables_cover_every_task():
    assert set(COUNTS) == set(FIRST) == set(METRICS) == set(TASKS)
    assert all(set(metrics) <= {"acc", "acc_norm", "perplexity"} and metrics for metrics in METRICS.values())


@pytest.mark.parametrize("name", TASKS)
def test_counts_labels_and_layout(name):
    loaded = items(name)
    assert len(loaded) == COUNTS[name]
    assert [item.index for item in loaded] == list(range(len(loaded)))
    for item in loaded:
        assert item.task == name and 0 <= item.label < len(item.continuations)
        assert len(item.continuations) in CHOICES[name]
        assert item.shared_context == (name != "winogrande")  # winogrande: two contexts, one continuation
        assert all(c and c == c.rstrip() for c in item.contexts)  # no trailing space left in a context
        assert all(c.startswith(" ") for c in item.continuations)  # lm-eval's " " target delimiter


@pytest.mark.parametrize("name", TASKS)
def test_first_item_text(name):
    item = items(name)[0]
    print(f"\n{name}[0] label={item.label}\ncontexts={item.contexts!r}\ncontinuations={item.continuations!r}")
    context, continuations, label = FIRST[name]
    assert context in item.contexts[0]
    assert item.continuations == continuations and item.label == label


def test_hellaswag_query_matches_lm_eval_on_published_items():
    # preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()) for hellaswag_val.jsonl lines 2, 3, 9
    expected = {
        1: "Clean and jerk: A lady walks to a barbell. She bends down and grabs the pole. The lady",
        2: "Canoeing: Two women in a child are shown in a canoe while a man pulls the canoe while standing in the "
        "water, with other individuals visible in the background. The child and a different man",
        8: "Sharpening knives: A man is holding a pocket knife while sitting on some rocks in the wilderness. Then he",
    }
    for index, query in expected.items():
        assert items("hellaswag")[index].contexts[0] == query


def test_hellaswag_preprocess_is_lm_evals():
    # strip; " [title]" → ". "; drop every [...]; "  " → " "
    assert hellaswag_preprocess("Home and Garden: [header] How to x [title] Do y. [step] Z. ") == (
        "Home and Garden: How to x. Do y. Z."
    )
    # the file kept non-marker brackets ([www.kiddio.org]); lm-eval drops them too
    assert "Visit a site like to find loads of creative activities" in items("hellaswag")[3505].contexts[0]
    for item in items("hellaswag"):
        assert not any(re.search(r"\[.*?\]", text) for text in item.contexts + item.continuations)


def test_winogrande_partial_evaluation_and_labels_file():
    item = items("winogrande")[0]
    assert item.contexts == [
        "Sarah was a much better surgeon than Maria so Sarah",
        "Sarah was a much better surgeon than Maria so Maria",
    ]
    labels = (DATA / "eval/winogrande/dev-labels.lst").read_text().split()
    assert [str(item.label + 1) for item in items("winogrande")] == labels
    # the blank ends the sentence in some items: the shared continuation is then just " ."
    assert sum(item.continuations[0] == " ." for item in items("winogrande")) == 34


def test_arc_maps_answer_key_by_label():
    item = items("arc_challenge")[44]  # choices labelled 1–4, answerKey "2"
    assert item.label == 1 and item.continuations[1] == " Kinetic energy increases and potential energy decreases."
    item = items("arc_easy")[500]  # five choices A–E, answerKey "B"
    assert item.continuations[item.label] == " oxygen" and len(item.continuations) == 5


def test_boolq_piqa_mmlu_lambada_details():
    assert sum(item.label for item in items("boolq")) == 2_033  # README: 2,033 true / 1,237 false
    assert {item.label for item in items("piqa")} == {0, 1}
    last = items("mmlu")[-1]
    assert last.contexts[0].startswith(
        "The following are multiple choice questions (with answers) about world religions.\n\n"
    )
    assert last.contexts[0].endswith("\nD. Philosophical intellect\nAnswer:")
    # lm-eval splits the LAMBADA target on the last " ", so a word after a line break carries it along
    assert items("lambada")[426].continuations == [" of\n\nPower"]


def test_choice_lengths_are_lm_evals():
    assert choice_lengths(items("hellaswag")[0]) == [37, 27, 26, 36]  # the endings, without the " " delimiter
    assert choice_lengths(items("mmlu")[0]) == [1, 1, 1, 1]
    winogrande = items("winogrande")[0]
    assert choice_lengths(winogrande) == [len(c) for c in winogrande.contexts]  # its choices are the contexts


def test_subsample_is_systematic():
    assert subsample(10, 3) == [0, 3, 6]
    assert subsample(10, 10) == subsample(10, 25) == subsample(10, None) == list(range(10))
    assert subsample(2_376, 100) == list(range(0, 2_300, 23))
    with pytest.raises(ValueError):
        subsample(10, 0)


@pytest.mark.parametrize(("count", "limit"), [(1_000, 3), (2_376, 100), (3_270, 50), (1_172, 7), (1_000, 50)])
def test_validation_items_are_no_reported_test_item(count, limit):
    """As many validation items as asked, none of them an item a test run scores at its own limit or at any
    reported limit (a grid at 50 items chose the lever a 100-item test run reports: 3 items were shared)."""
    valid = subsample(count, limit, "valid")
    assert len(valid) == len(set(valid)) == limit and max(valid) < count
    for cap in {limit, *REPORTED_LIMITS}:
        assert not set(valid) & set(subsample(count, cap)), cap
    assert set(subsample(3_270, 50, "valid")) & set(subsample(3_270, 100)) == set()


@pytest.mark.parametrize("task", sorted(REPORTED_TASK_LIMITS))
def test_a_tasks_own_reported_limits_are_no_validation_items(task):
    """The 100-shot ARC run reported 40 items per task: its items are never that task's validation items, and the
    other tasks' validation items do not move (the recorded validation grids keep their items)."""
    count = 1_172
    valid = subsample(count, 30, "valid", task)
    for cap in REPORTED_TASK_LIMITS[task]:
        assert not set(valid) & set(subsample(count, cap)), cap
    assert subsample(count, 30, "valid", "boolq") == subsample(count, 30, "valid")


@pytest.mark.parametrize(
    ("task", "count", "limit", "first", "last", "reported_count"),
    [
        ("arc_challenge", 1_172, 20, [30, 91, 150, 210, 267, 326], [1032, 1090, 1138], 280),
        ("arc_easy", 2_376, 60, [17, 56, 97, 135, 174, 214], [2236, 2274, 2310], 347),
        ("boolq", 3_270, 40, [40, 121, 204, 285, 367, 449], [3065, 3147, 3227], 186),
        ("", 1_000, 10, [51, 151, 251, 351, 451, 551], [751, 851, 951], 100),
    ],
)
def test_the_reported_limits_select_the_recorded_validation_items(task, count, limit, first, last, reported_count):
    """The reported limits (conf/reported.yaml, a record of past runs) select the very validation items they selected
    when they lived in src/tasks.py: recorded validation grids keep their items."""
    valid = subsample(count, limit, "valid", task)
    assert valid[:6] == first and valid[-3:] == last and len(valid) == limit
    assert len(reported(count, limit, task)) == reported_count


@pytest.mark.parametrize(("count", "limit"), [(10, None), (10, 3), (100, 1), (300, 150), (5_000, None)])
def test_no_validation_items_when_the_test_items_leave_no_gap(count, limit):
    with pytest.raises(ValueError, match="no validation items"):
        subsample(count, limit, "valid")
    with pytest.raises(ValueError, match="unknown item split"):
        subsample(count, limit, "train")


def test_load_task_limit_is_deterministic_and_evenly_spaced():
    first, second = load_task("arc_easy", DATA, limit=100), load_task("arc_easy", str(DATA), limit=100)
    assert first == second and len(first) == 100
    indices = [item.index for item in first]
    assert indices[0] == 0 and {b - a for a, b in zip(indices, indices[1:], strict=False)} == {2_376 // 100}
    assert first == [items("arc_easy")[i] for i in indices]


def test_load_task_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        load_task("squad", DATA)
    with pytest.raises(FileNotFoundError):
        load_task("boolq", tmp_path)


def test_item_validates_its_shape():
    with pytest.raises(ValueError, match="label"):
        Item("t", 0, ["a", "a"], [" x", " y"], 2)
    with pytest.raises(ValueError, match="both differ"):
        Item("t", 0, ["a", "b"], [" x", " y"], 0)
    with pytest.raises(ValueError, match="contexts"):
        Item("t", 0, ["a"], [" x", " y"], 0)
