"""The comparison of scripts/vllm_parity.py on synthetic runtimes (no engine, no model): the gap is taken against
the right reference (the mapped turn against kvrelay's mapped turn, not its re-prefill), the tolerance is 10 × the
run's largest floor, a disagreement counts only where it is no near-tie, and the aggregate counts what it says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scripts_vllm_parity", ROOT / "scripts/vllm_parity.py")
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

VOCAB = 64


def runtime_pair(seed: int, noise: float, map_noise: float | None = None) -> tuple[dict, dict]:
    """One item as the two phases write it (JSON: string ids): kvrelay's mapped and re-prefill log-softmax (the map
    moves the distribution far: the wrong reference is far away), and vLLM's, the same plus `noise` (the mapped path
    plus `map_noise`, default `noise`); greedy tokens are the argmax repeated."""
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(VOCAB, generator=g, dtype=torch.float64) * 3
    mapped = plain + torch.randn(VOCAB, generator=g, dtype=torch.float64) * 3
    vllm_out, hf_out = {}, {}
    for path, logits, eps in (("mapped", mapped, noise if map_noise is None else map_noise), ("plain", plain, noise)):
        ours = (logits + eps * torch.randn(VOCAB, generator=g, dtype=torch.float64)).log_softmax(-1)
        theirs = logits.log_softmax(-1)
        top = ours.topk(parity.TOP).indices.tolist()
        vllm_out[path] = {
            "tokens": [top[0]] * parity.STEPS,
            "top": [{str(t): float(ours[t]) for t in top}] * parity.STEPS,
        }
        hf_out[path] = {"tokens": [int(theirs.argmax())] * parity.STEPS,
                        "logprobs": {str(t): float(theirs[t]) for t in range(VOCAB)}}  # fmt: skip
    return vllm_out, hf_out


def run(noises: list[tuple[float, float]]) -> list[dict]:
    ran, hf = [], []
    for seed, (noise, map_noise) in enumerate(noises):
        ours, theirs = runtime_pair(seed, noise, map_noise)
        ran.append({"key": f"item#{seed}", **ours})
        hf.append({"key": f"item#{seed}", **theirs})
    return parity.judged(json.loads(json.dumps(ran)), json.loads(json.dumps(hf)))


def test_the_mapped_turn_is_compared_with_kvrelays_mapped_turn():
    """vLLM's mapped turn within 1e-6 of kvrelay's mapped turn: a gap of that order — against the re-prefill (the
    map moves the distribution by whole nats) it would be ≫ 1."""
    items = run([(1e-6, 1e-6)] * 4)
    for item in items:
        assert item["row"]["mapped"]["max_abs_logprob_gap"] < 1e-4
        assert item["row"]["plain"]["max_abs_logprob_gap"] < 1e-4
        assert item["row"]["mapped"]["top1_agree"] and item["row"]["mapped"]["greedy_agree"]
    assert not parity.verdict(items)["adds_difference"]


def test_a_mapped_gap_past_ten_floors_is_a_difference_and_is_named():
    items = run([(1e-4, 1e-4), (1e-4, 1e-4), (1e-4, 5e-2), (1e-4, 1e-4)])
    judged = parity.verdict(items)
    floor = max(item["row"]["plain"]["max_abs_logprob_gap"] for item in items)
    assert judged["tolerance"] == pytest.approx(10 * floor)
    assert judged["items_over_tolerance"] == ["item#2"]
    assert judged["adds_difference"]
    within = parity.verdict(run([(1e-4, 5e-4)] * 4))  # a few floors: within the rule
    assert not within["adds_difference"] and not within["items_over_tolerance"]


def test_a_disagreement_counts_unless_it_is_a_near_tie():
    steps = [{5: -0.69, 7: -0.70, 9: -3.0}] * 3
    assert parity.near_tie(steps, [5, 5, 5], [5, 5, 5], 0.0)
    assert parity.near_tie(steps, [5, 5, 5], [5, 7, 5], 0.02)  # step 1: 7 trails 5 by 0.01
    assert not parity.near_tie(steps, [5, 5, 5], [5, 9, 5], 0.02)  # by 2.31
    assert not parity.near_tie(steps, [5, 5, 5], [11, 5, 5], 1e9)  # outside vLLM's top: no tie
    items = run([(1e-5, 1e-5)] * 3)
    hf = items[1]["hf"]["mapped"]
    other = next(t for t in items[1]["vllm"]["mapped"]["top"][0] if t != items[1]["vllm"]["mapped"]["tokens"][0])
    hf["tokens"] = [other] * parity.STEPS  # kvrelay picks vLLM's runner-up: far from a tie at 1e-5 noise
    items[1]["row"] = parity.compare(items[1])
    judged = parity.verdict(items)
    assert not items[1]["row"]["mapped"]["top1_agree"]
    assert judged["unexplained_disagreements"] == ["item#1"] and judged["adds_difference"]


def test_the_aggregate_counts_agreement_and_the_ratio():
    items = run([(1e-4, 1e-4)] * 7)
    items[0]["hf"]["mapped"]["tokens"] = [-1] * parity.STEPS
    items[0]["row"] = parity.compare(items[0])
    summary = parity.aggregate([item["row"] for item in items])
    assert summary["items"] == 7
    assert summary["mapped"]["top1_agree"][:2] == [6, 7] and summary["plain"]["top1_agree"][:2] == [7, 7]
    low, high = summary["mapped"]["top1_agree"][2:]
    assert 0.42 < low < 6 / 7 < high < 1.0  # Clopper–Pearson 95 % for 6 / 7
    median, low, high = summary["gap_ratio_mapped_over_floor"]["median_ci95"]
    assert low <= median <= high and 0.1 < median < 10


def test_phases_of_different_items_are_refused():
    ran, hf = runtime_pair(0, 0.0)
    with pytest.raises(ValueError, match="different items"):
        parity.judged([{"key": "boolq#1", **ran}], [{"key": "boolq#2", **hf}])


def test_the_gap_is_the_worst_of_vllms_top_ids():
    """Over every id of vLLM's top (not its first alone), at kvrelay's value of that id; ids outside it unread."""
    reference = torch.tensor([-0.1, -2.0, -3.0, -9.0])
    assert parity.logprob_gap({0: -0.1, 1: -2.5, 2: -3.0}, reference) == pytest.approx(0.5)
    assert parity.logprob_gap({1: -2.0, 0: -0.1}, reference) < 1e-6


def test_the_engines_follow_the_options_and_the_mappers_fitted_dtypes():
    """The CPU defaults are the recorded CPU runs' settings; on a GPU vLLM sizes its cache from its memory share, and
    both connectors run the dtypes the mapper was fitted in, whatever the engines' dtype (the sender fingerprints its
    exports in it)."""
    from argparse import Namespace

    cpu = Namespace(device="cpu", dtype="float32", block=32, cuda_graphs=False, apply_backend="torch")
    settings, connector = parity.engine_settings(cpu, {})
    assert settings == {"max_model_len": 1024, "dtype": "float32", "block_size": 32, "enforce_eager": True,
                        "kv_cache_memory_bytes": 160 << 20}  # fmt: skip
    assert connector == {"fingerprint_dtype": "float32", "compute_dtype": "float32", "apply_backend": "torch"}
    gpu = Namespace(device="cuda", dtype="bfloat16", block=16, cuda_graphs=True, apply_backend="auto")
    fitted = {"config": {"pair": {"dtype": "bfloat16", "compute_dtype": "float32"}}}
    settings, connector = parity.engine_settings(gpu, fitted)
    assert settings["kv_cache_memory_bytes"] is None and settings["gpu_memory_utilization"] == 0.35
    assert (settings["dtype"], settings["block_size"], settings["enforce_eager"]) == ("bfloat16", 16, False)
    assert connector == {"fingerprint_dtype": "bfloat16", "compute_dtype": "float32", "apply_backend": "auto"}
    # the writer is the receiver's alone (a sender writes no mapped K/V), and the command line's choice
    assert parity.receiver_settings(Namespace(paged_writer="stacked")) == {"paged_writer": "stacked"}
    assert "paged_writer" not in connector
