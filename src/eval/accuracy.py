"""The task protocol: local lm-eval-style tasks scored natively and through a transferred cache.

Each item is tokenized as lm-eval's `TemplateLM._encode_pair` does, every context is prefilled (and in
`transfer` mode mapped) once and all its continuations are read in one batch (`src.eval.scoring`). The
per-item scores of every mode are kept, so methods are compared item by item: accuracy, loss in points,
retention, gap recovered with paired bootstrap CIs, McNemar p against the native target, and accuracy by
context-length bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from src.apply import KVTransfer
from src.eval.metrics import (
    accuracy_by_length,
    accuracy_difference_ci,
    choice_correct,
    gap_recovered,
    gap_recovered_ci,
    mcnemar_p,
    retention,
    retention_ci,
)
from src.eval.scoring import choice_loglikelihoods
from src.models import Pair
from src.runtime.plan import NO_LEVERS, Levers, spent
from src.tasks import METRICS, Item, choice_lengths

LENGTH_EDGES = (0, 64, 128, 256, 512, 1 << 20)  # context-length buckets (tokens)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing context spaces move onto the continuation, the pair is encoded whole and
    the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


@dataclass
class TaskScores:
    """Per-item results of one mode on one task."""

    task: str
    loglikelihoods: list[list[float]]  # [N][C] sum log p of each choice
    greedy: list[list[bool]]  # [N][C] continuation is the greedy decode
    labels: list[int]  # [N]
    lengths: list[list[int]]  # [N][C] acc_norm lengths (characters)
    context_tokens: list[int]  # [N] tokens of the (first) context
    prefill_fraction: list[float]  # [N] share of the context prefix the target prefilled itself

    def correct(self, metric: str) -> np.ndarray:
        """Per-item correctness [N] under lm-eval's `acc`, `acc_norm`, or LAMBADA's greedy `acc`."""
        if self.task == "lambada":
            return np.array([g[0] for g in self.greedy], dtype=bool)
        return choice_correct(self.loglikelihoods, self.labels, self.lengths if metric == "acc_norm" else None)


@torch.no_grad()
def score_task(
    mode: str, pair: Pair, items: list[Item], transfer: KVTransfer | None = None, levers: Levers = NO_LEVERS
) -> TaskScores:
    """Every choice of every item scored in `mode` (with the levers in `transfer` mode)."""
    if not items:
        raise ValueError("no items to score")
    layers = pair.target.config.get_text_config().num_hidden_layers
    scores = TaskScores(items[0].task, [], [], [], [], [], [])
    spent_levers = spent(transfer, levers) if mode == "transfer" else None  # + the mapper's own target prefill
    for item in tqdm(items, desc=f"{items[0].task}:{mode}", unit="item", leave=False):
        encoded = [encode_pair(pair.tokenizer, c, x) for c, x in zip(item.contexts, item.continuations, strict=True)]
        if item.shared_context:
            groups = [(encoded[0][0], [x for _, x in encoded])]  # one context, every continuation
        else:
            groups = [(c, [x]) for c, x in encoded]  # one continuation after each context
        results = []
        for context, continuations in groups:
            results += choice_loglikelihoods(
                mode, pair, torch.tensor(context), [torch.tensor(x) for x in continuations], transfer, levers
            )
        prefixes = [len(context) - 1 for context, _ in groups]
        charged = [
            spent_levers.prefill_fraction(p, layers, query_len=1) * p if spent_levers is not None else p
            for p in prefixes
        ]
        scores.loglikelihoods.append([r[0] for r in results])
        scores.greedy.append([r[1] for r in results])
        scores.labels.append(item.label)
        scores.lengths.append(choice_lengths(item))
        scores.context_tokens.append(len(encoded[0][0]))
        scores.prefill_fraction.append(sum(charged) / sum(prefixes) if sum(prefixes) else 1.0)
    return scores


def compare(task: str, source: TaskScores, target: TaskScores, method: TaskScores, n_boot: int) -> dict[str, float]:
    """Headline-metric comparison of a method against both native models on the same items.

    Returns accuracies (fractions), loss in absolute points (100·(target − method)), retention, gap
    recovered — each with a paired bootstrap 95% CI — McNemar p against the target, and the mean
    prefill fraction the method spent."""
    metric = METRICS[task][0]
    s, t, m = (scores.correct(metric) for scores in (source, target, method))
    loss = accuracy_difference_ci(t, m, n_boot)
    keep = retention_ci(m, t, n_boot)
    gap = gap_recovered_ci(m, s, t, n_boot)
    return {
        "items": float(len(m)),
        "acc_source": float(s.mean()),
        "acc_target": float(t.mean()),
        "acc": float(m.mean()),
        "loss_points": 100 * loss.estimate,
        "loss_points_low": 100 * loss.low,
        "loss_points_high": 100 * loss.high,
        "retention": keep.estimate,
        "retention_low": keep.low,
        "retention_high": keep.high,
        "gap_recovered": gap.estimate,
        "gap_recovered_low": gap.low,
        "gap_recovered_high": gap.high,
        "mcnemar_p": mcnemar_p(m, t),
        "prefill_fraction": float(np.mean(method.prefill_fraction)),
    }


def by_length(scores: TaskScores) -> dict[str, float]:
    """Headline accuracy per context-length bucket (`acc_len_<low>_<high>`, empty buckets left out)."""
    correct = scores.correct(METRICS[scores.task][0])
    return {
        f"acc_len_{int(b.low)}_{int(b.high)}": b.accuracy
        for b in accuracy_by_length(correct, scores.context_tokens, LENGTH_EDGES)
        if b.count
    }


def summarize(per_task: dict[str, dict[str, float]]) -> dict[str, float]:
    """Task means: accuracy, retention and gap recovered of the mean accuracies (and the mean of the
    per-task ratios), worst-task loss, mean prefill fraction."""
    source = float(np.mean([r["acc_source"] for r in per_task.values()]))
    target = float(np.mean([r["acc_target"] for r in per_task.values()]))
    method = float(np.mean([r["acc"] for r in per_task.values()]))
    return {
        "acc_source": source,
        "acc_target": target,
        "acc": method,
        "loss_points": 100 * (target - method),
        "max_loss_points": max(r["loss_points"] for r in per_task.values()),
        "retention": float(retention(method, target)),
        "gap_recovered": float(gap_recovered(method, source, target)),
        "mean_task_retention": float(np.nanmean([r["retention"] for r in per_task.values()])),
        "mean_task_gap_recovered": float(np.nanmean([r["gap_recovered"] for r in per_task.values()])),
        "prefill_fraction": float(np.mean([r["prefill_fraction"] for r in per_task.values()])),
    }
