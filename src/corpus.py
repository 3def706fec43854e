"""Token streams from the offline corpora in `shared/data/corpora` (never copied into the repo).

Calibration text and evaluation streams come from different corpora, so they are disjoint; the NLL is
reported on WikiText-2 test and tuned on the last windows of WikiText-2 valid (`heldout_sequences`; conf/eval
`nll.corpus`, `nll.valid_corpus`), which calibration budgets mixing in WikiText-2 valid read from its start.
`task_dev` is task-format text from dev splits that are never evaluated (`dev_text`), `task_fewshot` the
same splits as few-shot prompts (`fewshot_text`); a dev item whose prompt an evaluated split also holds is
dropped from both. `a+b+c` mixes corpora sequence by sequence. A model pair without a tokenizer (random
weights, timing only) reads UTF-8 bytes folded into its vocabulary.
"""

from __future__ import annotations

import json
import lzma
from functools import cache
from pathlib import Path

import torch

from src.tasks import DEV_FILES, LOADERS, Item, load_task

CORPORA = {
    "gutenberg": "corpora/gutenberg/gutenberg_en_books_part1.jsonl.xz",
    "gutenberg_part2": "corpora/gutenberg/gutenberg_en_books_part2.jsonl.xz",
    "wikitext2_valid": "corpora/wikitext-2-raw/wiki.valid.raw",
    "wikitext2_test": "corpora/wikitext-2-raw/wiki.test.raw",
    "simplebooks_valid": "corpora/simplebooks-92/valid.txt",
    "simplebooks_test": "corpora/simplebooks-92/test.txt",
    "lambada_dev": "eval/lambada/lambada_development_plain_text.txt",
    "task_dev": "eval",  # dev splits of ARC and MMLU, rendered (dev_text)
    "task_fewshot": "eval",  # the same and MMLU's dev exemplars as few-shot prompts (fewshot_text)
}
FEWSHOT_FILES = (*DEV_FILES.items(), ("mmlu", "eval/mmlu/mmlu_dev.jsonl"))  # (task, file): never evaluated
SHOTS = 5  # shots per few-shot prompt (MMLU's 5-shot protocol)


def _header(text: str) -> tuple[str, str]:
    """(header, rest): an MMLU prompt's first paragraph names its subject; ARC prompts have none."""
    first, blank, rest = text.partition("\n\n")
    return (first, rest) if blank else ("", first)


def unscored_items(data_root: str | Path, task: str, relative: str) -> list[Item]:
    """The items of a never-evaluated split of `task`, less any whose question (prompt less header) an evaluated
    split of ARC or MMLU holds too (in shared/data: 27 of MMLU val's items, some under another subject, 5 of MMLU
    dev's, 2 of ARC-Challenge dev's)."""
    path = Path(data_root) / relative
    if not path.is_file():
        raise FileNotFoundError(f"dev split of {task!r} not found at {path}; set paths.data to shared/data")
    scored = _scored_questions(data_root)
    return [item for item in LOADERS[task](path) if _header(item.contexts[0])[1] not in scored]


@cache
def _scored_questions(data_root: str | Path) -> frozenset[str]:
    return frozenset(_header(item.contexts[0])[1] for task in DEV_FILES for item in load_task(task, data_root))


def _gold(item: Item) -> str:
    return item.contexts[item.label] + item.continuations[item.label]


@cache
def dev_text(data_root: str | Path) -> str:
    """Task-format text from splits that are never evaluated: each dev item rendered as its gold answer
    (context + gold continuation), items separated by blank lines."""
    items = [item for task, relative in DEV_FILES.items() for item in unscored_items(data_root, task, relative)]
    return "\n\n".join(_gold(item) for item in items)


def _prompts(items: list[Item], shots: int) -> list[str]:
    """Few-shot prompts of `shots` consecutive items with one header (an MMLU subject's first paragraph): the
    header once, then each item's question and gold answer, separated by blank lines."""
    groups: list[tuple[str, list[str]]] = []
    for item in items:
        header, body = _header(_gold(item))
        if not groups or groups[-1][0] != header or len(groups[-1][1]) == shots:
            groups.append((header, []))
        groups[-1][1].append(body)
    return ["\n\n".join([header] * bool(header) + bodies) for header, bodies in groups]


@cache
def fewshot_text(data_root: str | Path, shots: int = SHOTS) -> str:
    """Calibration text shaped like the workload: few-shot prompts (`_prompts`) of the never-evaluated splits
    (`FEWSHOT_FILES`), one prompt of each split in turn, prompts separated by blank lines."""
    prompts = [_prompts(unscored_items(data_root, task, relative), shots) for task, relative in FEWSHOT_FILES]
    turns = max(map(len, prompts))
    return "\n\n".join(split[turn] for turn in range(turns) for split in prompts if turn < len(split))


def read_text(data_root: str | Path, name: str, max_chars: int | None = None) -> str:
    """The first `max_chars` characters (None: all) of a named corpus (Gutenberg books concatenated in order)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {sorted(CORPORA)}")
    if name == "task_dev":
        return dev_text(data_root)[:max_chars]
    if name == "task_fewshot":
        return fewshot_text(data_root)[:max_chars]
    path = Path(data_root) / CORPORA[name]
    if not path.is_file():
        raise FileNotFoundError(f"corpus {name!r} not found at {path}; set paths.data to the shared/data folder")
    if path.suffix != ".xz":
        return path.read_text(encoding="utf-8")[:max_chars]
    pieces, total = [], 0
    with lzma.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            pieces.append(json.loads(line)["text"])
            total += len(pieces[-1])
            if max_chars is not None and total >= max_chars:
                break
    return "\n\n".join(pieces)[:max_chars]


def encode(text: str, tokenizer, vocab_size: int) -> torch.Tensor:
    """Token ids [N] from the pair's tokenizer, or UTF-8 bytes mod vocab_size when there is none."""
    if tokenizer is not None:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % vocab_size


def token_sequences(
    data_root: str | Path, name: str, count: int, length: int, tokenizer, vocab_size: int, chars_per_token: float = 6.0
) -> torch.Tensor:
    """`count` consecutive non-overlapping windows of `length` tokens: [count, length]. For a mixture
    `a+b+…` the windows alternate between the corpora (a, b, …, a, b, …), so every prefix keeps the mix."""
    names = name.split("+")
    if len(names) > 1:
        share = -(-count // len(names))  # windows drawn from each corpus
        parts = [token_sequences(data_root, n, share, length, tokenizer, vocab_size, chars_per_token) for n in names]
        return torch.stack(parts, dim=1).flatten(0, 1)[:count]  # [count, length]
    ids = encode(read_text(data_root, name, int(count * length * chars_per_token)), tokenizer, vocab_size)
    if ids.numel() < count * length:
        raise ValueError(f"corpus {name!r} gave {ids.numel()} tokens, need {count}×{length}")
    return ids[: count * length].view(count, length)


VALIDATION = "valid."  # the prefix of metrics computed on validation text / items: the only ones a sweep reads


def heldout_sequences(
    data_root: str | Path, name: str, count: int, length: int, tokenizer, vocab_size: int
) -> torch.Tensor:
    """The last `count` non-overlapping windows of `length` tokens of one corpus: [count, length]. Validation
    windows: calibration budgets read their windows from the start of the same corpora (`token_sequences`), so
    these stay disjoint from them while the corpus holds more than both."""
    if "+" in name:
        raise ValueError(f"held-out windows come from one corpus, not the mixture {name!r}")
    ids = encode(read_text(data_root, name), tokenizer, vocab_size)
    if ids.numel() < count * length:
        raise ValueError(f"corpus {name!r} gave {ids.numel()} tokens, need {count}×{length}")
    return ids[ids.numel() - count * length :].view(count, length)
