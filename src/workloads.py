"""Routed workloads built from the local task data (`shared/data`, src/tasks.py): what the first model reads (the
history), the new turn the router escalates on, and the answers to score.

fewshot    lm-eval-style k-shot prompts: the shots (and an MMLU subject's header) are the history, the question the
           new turn. Shots come from a split that is never scored and that the calibration budget did not read
           (`SHOT_FILES`, else — or where it holds too few — the scored file's other items), never a scored item nor
           one with the same question. A list of shot counts cycles over the items (histories of several lengths).
passage    a BoolQ passage or a LAMBADA passage up to its final sentence is the history; the question / the final
           sentence (less its last word) the new turn.
multiturn  conversations of N turns chained from consecutive scored items, rendered append-only with the chat
           template (`Chat`); the answering model's pick joins the history as its answer.
switches   a fewshot / passage history cut into token chunks read by alternating models (`chunks`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from src.corpus import CORPORA, FEWSHOT_FILES
from src.tasks import DEV_FILES, LOADERS, Item, load_task, reported

SHOT_FILES = {  # lm-eval's few-shot split where shared/data has one (MMLU: the 5 dev exemplars per subject)
    "arc_easy": DEV_FILES["arc_easy"],
    "arc_challenge": DEV_FILES["arc_challenge"],
    "mmlu": "eval/mmlu/mmlu_dev.jsonl",
}
SCORED = "scored file"  # shots from the scored file's unscored items (HellaSwag, WinoGrande, PIQA: no other split)
DELIMITER = "\n\n"  # lm-eval's fewshot_delimiter


@dataclass(frozen=True)
class Example:
    """One routed item: the history read before the switch, the new turn (item.contexts[j] before choice j's
    continuation), and where every shot came from ("file#index")."""

    history: str
    item: Item
    shots: tuple[str, ...] = ()


def shot_ids(shots: tuple[str, ...]) -> dict[str, list[int]]:
    """Shots ("file#index") as {file: [index, …]} in their order: what a record keeps (200 shots in ≈ 1 KB, not 4)."""
    ids: dict[str, list[int]] = {}
    for shot in shots:
        source, index = shot.rsplit("#", 1)
        ids.setdefault(source, []).append(int(index))
    return ids


def calibration_files(corpus: str) -> frozenset[str]:
    """The data files (relative to shared/data) that a calibration corpus `a+b+…` reads."""
    files = set()
    for name in corpus.split("+"):
        if name == "task_dev":
            files |= set(DEV_FILES.values())
        elif name == "task_fewshot":
            files |= {relative for _, relative in FEWSHOT_FILES}
        elif name in CORPORA:
            files.add(CORPORA[name])
        else:
            raise ValueError(f"unknown corpus {name!r} in {corpus!r}")
    return frozenset(files)


def _header(context: str) -> tuple[str, str]:
    """(header, body): an MMLU prompt opens with one paragraph naming its subject, said once per few-shot prompt."""
    first, blank, rest = context.partition(DELIMITER)
    return (first + DELIMITER, rest) if blank and first.startswith("The following are") else ("", context)


def _gold(item: Item) -> str:
    return item.contexts[item.label] + item.continuations[item.label]


@cache
def _items(data_root: str | Path, task: str) -> tuple[Item, ...]:
    """Every item of the task's scored file (memoized: HellaSwag's takes seconds to parse)."""
    return tuple(load_task(task, data_root))


def _pool(
    data_root: str | Path, task: str, excluded: list[Item], calibration: frozenset[str]
) -> list[tuple[str, Item]]:
    """(where from, item) pairs that may serve as shots, in order of preference: the task's shot split
    (`SHOT_FILES`) unless the calibration read it, then the scored file's other items. Never an excluded (scored)
    item, nor one whose question (body) is one's; a shot split's item never repeats any question of the scored file."""
    pool, relative = [], SHOT_FILES.get(task)
    if relative is not None and relative not in calibration:
        path = Path(data_root) / relative
        if not path.is_file():
            raise FileNotFoundError(f"shot split of {task!r} not found at {path}; set paths.data to shared/data")
        questions = {_header(item.contexts[0])[1] for item in _items(data_root, task)}
        pool = [(relative, item) for item in LOADERS[task](path) if _header(item.contexts[0])[1] not in questions]
    questions = {_header(item.contexts[0])[1] for item in excluded} | {_header(i.contexts[0])[1] for _, i in pool}
    return pool + [(SCORED, item) for item in _items(data_root, task) if _header(item.contexts[0])[1] not in questions]


def fewshot(
    data_root: str | Path,
    task: str,
    limit: int | None,
    shots: int | Sequence[int],
    seed: int,
    calibration: frozenset[str],
    split: str = "test",
) -> list[Example]:
    """k-shot prompts for the scored items of `task` (lm-eval rendering: shots as gold answers joined by blank
    lines; an MMLU subject's header once, its shots that subject's). Shots come from the preferred source of the
    pool (`_pool`) when it holds k, else from the whole pool; drawn per item with a seeded sampler (MMLU: the
    subject's first k, lm-eval's first_n — topped up from the subject's unscored test items where some of its 5 dev
    exemplars repeat a test question). split="valid" scores the validation items (`tasks.subsample`), whose shots are
    never a reported test item either (`tasks.reported`); a test item's shots may be validation items (choices never
    read test items). A sequence of shot counts gives the n-th scored item shots[n mod its length] shots."""
    counts = list(shots) if isinstance(shots, Sequence) else [shots]
    if not counts or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in counts):
        raise ValueError(f"{task}: shots must be a count ≥ 0 or a non-empty list of them, not {shots!r}")
    scored = load_task(task, data_root, limit, split)
    everything = _items(data_root, task)
    excluded = (
        scored if split == "test" else [everything[i] for i in sorted(reported(len(everything), limit, task))] + scored
    )
    by_header: dict[str, list[tuple[str, Item]]] = {}
    for source, item in _pool(data_root, task, excluded, calibration):
        by_header.setdefault(_header(item.contexts[0])[0], []).append((source, item))
    examples = []
    for n, item in enumerate(scored):
        shots = counts[n % len(counts)]
        header = _header(item.contexts[0])[0]
        candidates = by_header.get(header, [])
        preferred = [c for c in candidates if c[0] == candidates[0][0]] if candidates else []
        candidates = preferred if len(preferred) >= shots else candidates
        if len(candidates) < shots:
            raise ValueError(f"{task}: {len(candidates)} shots available for item {item.index}, {shots} asked")
        chosen = (
            candidates[:shots] if header else random.Random(f"{seed}:{task}:{item.index}").sample(candidates, shots)
        )
        history = header + "".join(_header(_gold(shot))[1] + DELIMITER for _, shot in chosen)
        turn = Item(task, item.index, [_header(c)[1] for c in item.contexts], item.continuations, item.label)
        examples.append(Example(history, turn, tuple(f"{source}#{shot.index}" for source, shot in chosen)))
    return examples


_SENTENCE_END = re.compile(r"[.!?][\"'”’)]*(?=\s)")


def passage(data_root: str | Path, task: str, limit: int | None, split: str = "test") -> list[Example]:
    """BoolQ: the passage is the history, "\\nQuestion: …?\\nAnswer:" the turn. LAMBADA: the passage up to its final
    sentence is the history, the final sentence less its last word the turn (items of one sentence are left out)."""
    examples = []
    for item in load_task(task, data_root, limit, split):
        context = item.contexts[0]
        if task == "boolq":
            cut = context.rindex("\nQuestion: ")
        elif task == "lambada":
            ends = [m.end() for m in _SENTENCE_END.finditer(context)]
            if not ends:
                continue
            cut = ends[-1]
        else:
            raise ValueError(f"passage workloads read boolq or lambada, not {task!r}")
        turn = [c[cut:] for c in item.contexts]
        examples.append(Example(context[:cut], Item(task, item.index, turn, item.continuations, item.label)))
    return examples


def conversations(
    data_root: str | Path, task: str, limit: int | None, turns: int, split: str = "test"
) -> list[list[Item]]:
    """The scored items of `task` in order, `turns` per conversation (a remainder is left out); each item's one
    context is a user message, its choices the candidate answers."""
    items = load_task(task, data_root, limit, split)
    if any(not item.shared_context for item in items):
        raise ValueError(f"multiturn needs one question per item; {task}'s choices differ in the context")
    return [items[start : start + turns] for start in range(0, len(items) - turns + 1, turns)]


def chunks(ids: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """ids [T] cut into `parts` consecutive chunks of near-equal length (each ≥ 1 token)."""
    if not 1 <= parts <= ids.numel():
        raise ValueError(f"cannot cut {ids.numel()} tokens into {parts} chunks")
    edges = [round(i * ids.numel() / parts) for i in range(parts + 1)]
    return [ids[low:high] for low, high in zip(edges[:-1], edges[1:], strict=True)]


class Bytes:
    """The tokenizer of a pair without one (random weights, timing only): UTF-8 bytes mod the vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [byte % self.vocab_size for byte in text.encode("utf-8")]


class Chat:
    """Append-only chat rendering: each user turn (with the assistant header after it) and each answer (with its
    end-of-turn text) as a text piece; the tokenizer's chat template when it has one, else "User: …\\nAssistant:"."""

    def __init__(self, tokenizer):
        self.tokenizer, self.messages, self.rendered = tokenizer, [], ""

    def _render(self, messages: list[dict], prompt: bool) -> str:
        if self.tokenizer.chat_template is None:
            text = "".join(
                f"User: {m['content']}\nAssistant:" if m["role"] == "user" else f" {m['content']}\n" for m in messages
            )
            return text
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def _piece(self, message: dict, prompt: bool, commit: bool = True) -> str:
        text = self._render([*self.messages, message], prompt)
        if not text.startswith(self.rendered):
            raise ValueError("the chat template is not append-only: a turn rewrote the text before it")
        piece = text[len(self.rendered) :]
        if commit:
            self.messages.append(message)
            self.rendered = text
        return piece

    def user(self, content: str) -> str:
        """The user turn's text piece, ending with the assistant header."""
        return self._piece({"role": "user", "content": content}, True)

    def answer(self, content: str, commit: bool = True) -> tuple[str, str]:
        """(the answer as the assistant writes it, the end-of-turn text after it); joins the conversation unless
        `commit` is false (a candidate answer, for scoring)."""
        piece = self._piece({"role": "assistant", "content": content}, False, commit)
        head, found, tail = piece.partition(content)
        if not found:
            raise ValueError(f"the chat template does not reproduce the answer {content!r}")
        return head + content, tail
