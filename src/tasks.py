"""Offline multiple-choice / cloze evaluation sets in `shared/data/eval` (never copied into the repo).

Every task is rendered as lm-evaluation-harness renders it (0-shot, default templates), so an item's
choice j is scored as loglikelihood(contexts[j] + continuations[j]) over the continuation. Either all
contexts are equal (one shared prefix, one continuation per choice: the cache-transfer case) or, for
WinoGrande's partial evaluation, the contexts differ and the continuation is shared.
"""

from __future__ import annotations

import bz2
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

TASKS = ("hellaswag", "arc_easy", "arc_challenge", "winogrande", "piqa", "mmlu", "lambada", "boolq")

# what lm-eval reports per task, the usual headline metric first; acc_norm divides each choice's
# loglikelihood by its length (see choice_lengths), lambada's acc is "the continuation is the greedy one"
METRICS: dict[str, tuple[str, ...]] = {
    "hellaswag": ("acc_norm", "acc"),
    "arc_easy": ("acc", "acc_norm"),
    "arc_challenge": ("acc_norm", "acc"),
    "winogrande": ("acc",),
    "piqa": ("acc_norm", "acc"),
    "mmlu": ("acc",),
    "lambada": ("acc", "perplexity"),
    "boolq": ("acc",),
}

_FILES = {
    "hellaswag": "eval/hellaswag/hellaswag_val_full.txt.bz2",
    "arc_easy": "eval/arc/ARC-Easy-Test.jsonl",
    "arc_challenge": "eval/arc/ARC-Challenge-Test.jsonl",
    "winogrande": "eval/winogrande/dev.jsonl",
    "piqa": "eval/piqa/dev.jsonl",
    "mmlu": "eval/mmlu/mmlu_test.jsonl",
    "lambada": "eval/lambada/lambada_test_openai.jsonl",
    "boolq": "eval/boolq/dev.jsonl",
}


# dev/validation splits that are never evaluated: task-format calibration text (`corpus.dev_text`)
DEV_FILES = {
    "arc_easy": "eval/arc/ARC-Easy-Dev.jsonl",
    "arc_challenge": "eval/arc/ARC-Challenge-Dev.jsonl",
    "mmlu": "eval/mmlu/mmlu_val.jsonl",
}


@dataclass(frozen=True)
class Item:
    """One evaluation item: choice j is contexts[j] + continuations[j]; label is the gold choice."""

    task: str
    index: int  # position in the source file, stable under subsampling
    contexts: list[str]
    continuations: list[str]
    label: int

    def __post_init__(self) -> None:
        if len(self.contexts) != len(self.continuations) or not self.contexts:
            raise ValueError(
                f"{self.task}[{self.index}]: {len(self.contexts)} contexts, {len(self.continuations)} continuations"
            )
        if len(set(self.contexts)) > 1 and len(set(self.continuations)) > 1:
            raise ValueError(f"{self.task}[{self.index}]: contexts and continuations both differ")
        if not 0 <= self.label < len(self.contexts):
            raise ValueError(f"{self.task}[{self.index}]: label {self.label} out of range")

    @property
    def shared_context(self) -> bool:
        """True when every choice continues the same prefix (one prefill, or one transferred cache)."""
        return len(set(self.contexts)) == 1


def choice_lengths(item: Item) -> list[int]:
    """lm-eval's acc_norm lengths: characters of each choice string (the continuation without the " "
    target delimiter; WinoGrande's choices are its contexts)."""
    if item.shared_context:
        return [len(c.removeprefix(" ")) for c in item.continuations]
    return [len(c) for c in item.contexts]


SPLITS = ("test", "valid")  # the scored items that are reported | items no reported run scores, for choices only
_REPORTED = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/reported.yaml").read_text())
REPORTED_LIMITS = tuple(_REPORTED["limits"])  # the item limits of reported (test) runs: never validation items
REPORTED_TASK_LIMITS = {task: tuple(limits) for task, limits in _REPORTED["tasks"].items()}  # … and of one task's


def subsample(count: int, limit: int | None, split: str = "test", task: str = "") -> list[int]:
    """test: indices 0, s, 2s, … (`limit` of them, s = ⌊count/limit⌋) — the same items for every run and method;
    valid: `limit` indices spread evenly over those no test run scores (`reported`), for tuning and selection only."""
    if split not in SPLITS:
        raise ValueError(f"unknown item split {split!r}; choose one of {SPLITS}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be ≥ 1, got {limit}")
    if split == "test":
        step = 1 if limit is None or limit >= count else count // limit
        return list(range(0, step * min(limit or count, count), step))
    free = sorted(set(range(count)) - reported(count, limit, task))
    if limit is None or len(free) < limit:
        raise ValueError(
            f"no validation items: {len(free)} of {count} items are outside every reported test subsample "
            f"(limits {limit}, {REPORTED_LIMITS} and {REPORTED_TASK_LIMITS.get(task, ())}), {limit} asked — set a smaller limit"
        )
    step = len(free) // limit
    return free[step // 2 :: step][:limit]


def reported(count: int, limit: int | None, task: str = "") -> set[int]:
    """The indices a test run scores at `limit` or at any reported limit (`REPORTED_LIMITS`, and the task's own)."""
    caps = {limit, *REPORTED_LIMITS, *REPORTED_TASK_LIMITS.get(task, ())}
    return {i for cap in caps for i in subsample(count, cap)}


def load_task(name: str, data_root: str | Path, limit: int | None = None, split: str = "test") -> list[Item]:
    """The task's items in file order, systematically subsampled to `limit` (`split`: `subsample`)."""
    if name not in LOADERS:
        raise ValueError(f"unknown task {name!r}; choose one of {TASKS}")
    path = Path(data_root) / _FILES[name]
    if not path.is_file():
        raise FileNotFoundError(f"task {name!r} not found at {path}; set paths.data to the shared/data folder")
    items = LOADERS[name](path)
    return [items[i] for i in subsample(len(items), limit, split, name)]


# --------------------------------------------------------------------------- per-task rendering


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split()


def _shared(task: str, index: int, context: str, choices: list[str], label: int) -> Item:
    """One prefix, continuations " {choice}" (lm-eval's default target delimiter)."""
    return Item(task, index, [context] * len(choices), [" " + c for c in choices], label)


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag cleanup of WikiHow artifacts."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_query(line: str) -> str:
    """lm-eval's query `preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())` from the
    file's first line `activity_label: ctx_a ctx_b`, whose ctx_b was not capitalized.

    ctx_b is non-empty exactly for ActivityNet items: their line never ends a sentence (WikiHow lines
    always do), and ctx_b is the unfinished sentence after the last ". " / "! " / "? ".
    """
    if not line.endswith((".", "!", "?")):
        label, ctx = line.split(": ", 1)
        cut = [m.end() for m in re.finditer(r"[.!?] ", ctx)][-1]
        line = f"{label}: {ctx[:cut]}{ctx[cut:].capitalize()}"
    return hellaswag_preprocess(line)


def _hellaswag(path: Path) -> list[Item]:
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")[:-1]  # 6 lines per item: context, gold, 4 endings
    return [
        _shared(
            "hellaswag",
            i,
            hellaswag_query(lines[6 * i]),
            [hellaswag_preprocess(e) for e in lines[6 * i + 2 : 6 * i + 6]],
            int(lines[6 * i + 1]),
        )
        for i in range(len(lines) // 6)
    ]


def _arc(task: str) -> Callable[[Path], list[Item]]:
    def load(path: Path) -> list[Item]:
        items = []
        for i, doc in enumerate(_jsonl(path)):
            choices = doc["question"]["choices"]
            labels = [c["label"] for c in choices]  # A–E or 1–5, answerKey uses the same scheme
            context = f"Question: {doc['question']['stem']}\nAnswer:"
            items.append(_shared(task, i, context, [c["text"] for c in choices], labels.index(doc["answerKey"])))
        return items

    return load


def _winogrande(path: Path) -> list[Item]:
    """Partial evaluation: the option fills the blank in the context, the rest is the shared continuation."""
    items = []
    for i, doc in enumerate(_jsonl(path)):
        sentence = doc["sentence"]
        blank = sentence.index("_")
        contexts = [sentence[:blank] + doc["option1"], sentence[:blank] + doc["option2"]]
        continuation = " " + sentence[blank + 1 :].strip()
        items.append(Item("winogrande", i, contexts, [continuation] * 2, int(doc["answer"]) - 1))
    return items


def _piqa(path: Path) -> list[Item]:
    labels = _lines(path.with_name("dev-labels.lst"))
    docs = _jsonl(path)
    if len(labels) != len(docs):
        raise ValueError(f"piqa: {len(docs)} questions but {len(labels)} labels")
    return [
        _shared("piqa", i, f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(label))
        for i, (doc, label) in enumerate(zip(docs, labels, strict=True))
    ]


def _mmlu(path: Path) -> list[Item]:
    items = []
    for i, doc in enumerate(_jsonl(path)):
        header = (
            f"The following are multiple choice questions (with answers) about {doc['subject'].replace('_', ' ')}.\n\n"
        )
        options = "".join(f"\n{letter}. {choice}" for letter, choice in zip("ABCD", doc["choices"], strict=True))
        context = f"{header}{doc['question'].strip()}{options}\nAnswer:"
        items.append(_shared("mmlu", i, context, list("ABCD"), "ABCD".index(doc["answer"])))
    return items


def _lambada(path: Path) -> list[Item]:
    """lm-eval's split on the last " " (so a final word after a line break keeps the break)."""
    items = []
    for i, doc in enumerate(_jsonl(path)):
        context, word = doc["text"].rsplit(" ", 1)
        items.append(Item("lambada", i, [context], [" " + word], 0))
    return items


def _boolq(path: Path) -> list[Item]:
    return [
        _shared(
            "boolq", i, f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ["no", "yes"], int(doc["answer"])
        )
        for i, doc in enumerate(_jsonl(path))
    ]


LOADERS: dict[str, Callable[[Path], list[Item]]] = {
    "hellaswag": _hellaswag,
    "arc_easy": _arc("arc_easy"),
    "arc_challenge": _arc("arc_challenge"),
    "winogrande": _winogrande,
    "piqa": _piqa,
    "mmlu": _mmlu,
    "lambada": _lambada,
    "boolq": _boolq,
}
