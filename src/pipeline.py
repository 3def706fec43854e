"""Config → objects, shared by every job (src/run.py, src/bench.py, src/routed.py): the pair, its calibration
traces, the fit / held-out split, the fitted (or cached) mapper bound to the pair, and the run tags.

The on-disk caches live under `paths.home`: traces keyed by pair fingerprints + corpus hash + budget, mappers by
that + fit / support / weighting, native task scores by fingerprints + attention implementation + data path +
the code that scores them. A multirun in one process loads each pair and each calibration set once (`_MEMO`).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from src.apply import KVTransfer
from src.artifact import ArtifactError, Mapper, load_mapper, save_mapper
from src.corpus import token_sequences
from src.eval.accuracy import TaskScores, score_task
from src.fit import fit_transfer
from src.forward import greedy_continuation
from src.models import Pair, describe_kv, fingerprint, load_pair
from src.synthetic import synthetic_mapper, synthetic_traces
from src.tasks import load_task
from src.traces import Traces, collect_traces, corpus_hash, load_traces, save_traces

_MEMO: dict[str, object] = {}  # pair / traces / native task scores already built in this process
_SCORING_CODE = ("tasks.py", "eval/scoring.py", "eval/accuracy.py", "forward.py")  # what native scores depend on


def spec(node) -> dict:
    """A config node as a plain dict (interpolations resolved)."""
    return OmegaConf.to_container(node, resolve=True)


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load(cfg: DictConfig) -> Pair:
    """The pair of `cfg.pair` (one pair resident per process)."""
    key = cache_key("pair", spec(cfg.pair))
    if key not in _MEMO:
        _MEMO.clear()  # one pair (and its traces) resident at a time
        p = cfg.pair
        _MEMO[key] = load_pair(
            spec(p.source),
            spec(p.target),
            p.weights,
            getattr(torch, p.dtype),
            p.device,
            p.allow_sliding_window,
            p.attn_implementation,
        )
    return _MEMO[key]


def vocab_size(pair: Pair) -> int:
    return pair.target.config.get_text_config().vocab_size


def text_ids(cfg: DictConfig, pair: Pair, corpus: str, count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` tokens of a named corpus: [count, length]."""
    return token_sequences(cfg.paths.data, corpus, count, length, pair.tokenizer, vocab_size(pair))


def calibration(cfg: DictConfig, pair: Pair) -> tuple[Traces, str]:
    """Traces for the budget, from the cache keyed by pair fingerprints + corpus hash + budget."""
    budget = cfg.budget
    if budget.synthetic:
        kvs = describe_kv(pair.source), describe_kv(pair.target)
        storage = getattr(torch, budget.storage_dtype)
        traces = synthetic_traces(
            *kvs, budget.sequences, budget.seq_len // budget.stride, cfg.pair.device, storage, cfg.seed
        )
        return traces, f"synthetic-{cfg.seed}"
    ids = text_ids(cfg, pair, budget.corpus, budget.sequences, budget.seq_len)
    if budget.continuation:  # the target's own greedy continuation of each window's head (calibration like it writes)
        keep = budget.seq_len - round(budget.continuation * budget.seq_len)
        ids = greedy_continuation(pair.target, ids, keep, vocab_size(pair))
    mixing = cfg.fit.v_space == "attention"  # the target's attention between sampled rows, for the V fit
    key = cache_key(
        fingerprint(pair.source),
        fingerprint(pair.target),
        corpus_hash(ids),
        spec(budget),
        *(("mixing",) if mixing else ()),
    )
    if f"traces:{key}" in _MEMO:
        return _MEMO[f"traces:{key}"], key
    path = Path(cfg.paths.home) / "traces" / key
    traces = load_traces(path)
    if traces is None:
        began = time.perf_counter()
        traces = collect_traces(
            pair.source,
            pair.target,
            ids,
            budget.stride,
            budget.batch_size,
            getattr(torch, budget.storage_dtype),
            budget.attention_boundaries,
            budget.first_boundary,
            mixing=mixing,
        )
        traces.meta["collect_seconds"] = time.perf_counter() - began
        save_traces(traces, path)
    traces = traces.to(cfg.pair.device)  # statistics are built where the models run
    _MEMO[f"traces:{key}"] = traces
    return traces, key


def split_rows(cfg: DictConfig, traces: Traces) -> tuple[Traces, Traces]:
    """Fit rows and held-out rows; with `fit.sequences` (the budget lever) only the first N fit sequences."""
    fit_rows, heldout = traces.split_heldout(cfg.budget.heldout_fraction)
    if cfg.fit.sequences is not None:
        fit_rows = fit_rows.select_rows(torch.nonzero(fit_rows.sequence_index < cfg.fit.sequences)[:, 0])
    return fit_rows, heldout


def build_mapper(cfg: DictConfig, pair: Pair, traces: Traces | None, traces_key: str | None, support) -> Mapper:
    """Fit on the non-held-out rows (or reuse the verified cached artifact for the same inputs)."""
    fit = cfg.fit
    if cfg.budget.synthetic:
        identity = {
            "source_fingerprint": fingerprint(pair.source),
            "target_fingerprint": fingerprint(pair.target),
            "tokenizer_hash": pair.tokenizer_hash,
            "weights": pair.weights,
        }
        kvs = describe_kv(pair.source), describe_kv(pair.target)
        return synthetic_mapper(*kvs, support.kind, fit.k, identity, cfg.seed)
    key = cache_key(traces_key, cfg.budget.heldout_fraction, spec(fit), spec(support), spec(cfg.weighting))
    directory = Path(cfg.paths.home) / "mappers" / key
    identity = fingerprint(pair.source), fingerprint(pair.target), pair.tokenizer_hash
    if (directory / "manifest.json").is_file():
        try:
            return load_mapper(directory, *identity)
        except ArtifactError as stale:
            print(f"refitting: cached mapper at {directory} rejected ({stale})")
    fit_rows, _ = split_rows(cfg, traces)
    began = time.perf_counter()
    mapper = fit_transfer(
        pair.source,
        pair.target,
        fit_rows,
        pair.tokenizer_hash,
        support=support.kind,
        k=fit.k,
        selection=support.selection,
        weighting=cfg.weighting.kind,
        lam=fit.lam,
        lam_relative=fit.lam_relative,
        shift=support.shift,
        chunk_rows=fit.chunk_rows,
        alpha_cap=cfg.weighting.alpha_cap,
        token_features=fit.token_features,
        statistics=fit.statistics,
        v_space=fit.v_space,
    )
    mapper.manifest["construction_seconds"] = time.perf_counter() - began
    mapper.manifest["weights"] = pair.weights
    mapper.manifest["config"] = OmegaConf.to_container(cfg, resolve=True)
    save_mapper(mapper, directory, fit.coefficient_dtype)
    return load_mapper(directory, *identity)


def make_transfer(cfg: DictConfig, pair: Pair, mapper: Mapper) -> KVTransfer:
    """The mapper bound to the pair, computing in `pair.compute_dtype` on `pair.apply_backend`."""
    compute = getattr(torch, cfg.pair.compute_dtype)
    return KVTransfer(mapper, pair.source, pair.target, pair.tokenizer_hash, compute, cfg.pair.apply_backend)


def tags(cfg: DictConfig, pair: Pair, job: str) -> dict[str, str]:
    """Identity of a run: job, weights, pair and direction, fingerprints, tokenizer hash, seed."""
    return {
        "job": job,
        "weights": pair.weights,
        "pair": cfg.pair.name,
        "direction": cfg.pair.direction,
        "source_fingerprint": fingerprint(pair.source),
        "target_fingerprint": fingerprint(pair.target),
        "tokenizer_hash": pair.tokenizer_hash,
        "attn_implementation": cfg.pair.attn_implementation,
        "seed": str(cfg.seed),
        "note": "random weights: timing/plumbing only, no quality claim" if pair.weights == "random" else "",
    }


def _code_version() -> str:
    """Hash of the modules that native task scores depend on (a change invalidates the cached scores)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in _SCORING_CODE:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


def native_scores(cfg: DictConfig, pair: Pair, mode: str, task: str) -> TaskScores:
    """Per-item scores of a native model on a task (memoized per process, cached on disk by everything they
    depend on: fingerprints, tokenizer, attention implementation, dtype, data path, item count, scoring code)."""
    limit = cfg.eval.tasks.limit
    p = cfg.pair
    key = cache_key(
        "native",
        mode,
        task,
        limit,
        fingerprint(pair.source),
        fingerprint(pair.target),
        pair.tokenizer_hash,
        p.attn_implementation,
        p.dtype,
        str(Path(cfg.paths.data).resolve()),
        _code_version(),
    )
    path = Path(cfg.paths.home) / "task_scores" / f"{key}.json"
    if key not in _MEMO:
        if path.is_file():
            _MEMO[key] = TaskScores(**json.loads(path.read_text()))
        else:
            _MEMO[key] = score_task(mode, pair, load_task(task, cfg.paths.data, limit))
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(vars(_MEMO[key])))
            partial.replace(path)  # never a half-written score file
    return _MEMO[key]
