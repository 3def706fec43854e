"""Token streams from the offline corpora in `shared/data/corpora` (never copied into the repo).

Calibration text and evaluation streams come from different corpora, so they are disjoint. `task_dev`
is task-format text from dev splits that are never evaluated (`dev_text`); `a+b+c` mixes corpora
sequence by sequence. A model pair without a tokenizer (random weights, timing only) reads UTF-8 bytes
folded into its vocabulary.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import torch

from src.tasks import DEV_FILES, LOADERS

CORPORA = {
    "gutenberg": "corpora/gutenberg/gutenberg_en_books_part1.jsonl.xz",
    "gutenberg_part2": "corpora/gutenberg/gutenberg_en_books_part2.jsonl.xz",
    "wikitext2_valid": "corpora/wikitext-2-raw/wiki.valid.raw",
    "wikitext2_test": "corpora/wikitext-2-raw/wiki.test.raw",
    "simplebooks_valid": "corpora/simplebooks-92/valid.txt",
    "simplebooks_test": "corpora/simplebooks-92/test.txt",
    "lambada_dev": "eval/lambada/lambada_development_plain_text.txt",
    "task_dev": "eval",  # dev splits of ARC and MMLU, rendered (dev_text)
}


def dev_text(data_root: str | Path) -> str:
    """Task-format text from splits that are never evaluated: each dev item rendered as its gold answer
    (context + gold continuation), items separated by blank lines."""
    items = []
    for name, relative in DEV_FILES.items():
        path = Path(data_root) / relative
        if not path.is_file():
            raise FileNotFoundError(f"dev split of {name!r} not found at {path}; set paths.data to shared/data")
        items += LOADERS[name](path)
    return "\n\n".join(item.contexts[item.label] + item.continuations[item.label] for item in items)


def read_text(data_root: str | Path, name: str, max_chars: int) -> str:
    """The first `max_chars` characters of a named corpus (Gutenberg books are concatenated in order)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {sorted(CORPORA)}")
    if name == "task_dev":
        return dev_text(data_root)[:max_chars]
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
            if total >= max_chars:
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
