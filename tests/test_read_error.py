"""The receiver's read error (src/eval/read_error.py): exactly zero through the exact map of tests/exact_pair.py
(whose target differs from its source), above zero through a perturbed map and growing with the perturbation, zero
in the layers a lever keeps native; the per-token shares sum to one and name the token whose value is wrong."""

from dataclasses import replace

import pytest
import torch

from src.eval.read_error import item_summary, layer_read_error, read_error_metrics
from src.routed_runs import Run, single_turn
from src.runtime.plan import Levers
from src.runtime.routing import Policy, bind
from src.tasks import Item
from src.workloads import Bytes, Example
from tests.exact_pair import exact_pair, max_cache_diff

EXAMPLES = [
    Example("The cat sat on the mat. It was warm and", Item("piqa", 0, [" the cat"] * 2, [" slept", " ran"], 0)),
    Example("Rain fell all day; the river", Item("winogrande", 1, [" rose so", " fell so"], [" it flooded"] * 2, 1)),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=1)


def perturbed(mapper, scale: float, seed: int = 0):
    """The mapper with every coefficient moved by scale · N(0, 1) (the same draw at every scale)."""
    generator = torch.Generator().manual_seed(seed)
    noise = lambda w: w + scale * torch.randn(w.shape, generator=generator, dtype=w.dtype)
    return replace(mapper, weight_k=noise(mapper.weight_k), weight_v=noise(mapper.weight_v))


def read_errors(pair, mapper, levers: Levers | None = None) -> list[dict]:
    route = {("source", "target"): bind(pair.source, pair.target, mapper, pair.tokenizer_hash)}
    policy = Policy(levers=levers) if levers is not None else Policy()
    models = {"source": pair.source, "target": pair.target}
    run = Run(models, route, policy, Bytes(96), warmup=0, same_work_every=8, read_error=True)
    rows, _ = single_turn(run, EXAMPLES)
    return [row["read_error"] for row in rows]


def test_exact_map_reads_no_error_and_a_perturbed_one_grows_with_the_perturbation(pair):
    from src.forward import prefill

    ids = torch.tensor([[5, 17, 3, 60, 9]])
    assert max_cache_diff(prefill(pair.source, ids), prefill(pair.target, ids)) > 0.5  # the target is not the source
    exact = read_errors(pair, pair.exact)
    layers = pair.target.config.num_hidden_layers
    assert all(len(r["layers"]) == layers and r["max"] < 1e-10 for r in exact)  # float32 rounding of an exact map
    means = [[r["mean"] for r in read_errors(pair, perturbed(pair.exact, s))] for s in (0.01, 0.03, 0.1)]
    for item in range(len(EXAMPLES)):
        small, middle, large = (m[item] for m in means)
        assert 1e-8 < small < middle < large
    wrong = read_errors(pair, pair.wrong)
    assert all(abs(sum(r["share_deciles"]) + r["share_sink"] + r["share_turn"] - 1) < 1e-9 for r in wrong)
    assert all(r["max"] == r["layers"][r["max_layer"]] for r in wrong)


def test_layers_a_lever_keeps_native_read_no_error(pair):
    """native_layers = 2: the first two target layers hold the target's own K/V of the history — no read error
    there — while the layers above still read the wrong map."""
    found = read_errors(pair, pair.wrong, replace(Policy().levers, native_layers=2))
    for r in found:
        assert max(r["layers"][:2]) < 1e-10 and min(r["layers"][2:]) > 1e-4


def _layer(generator: torch.Generator, heads=4, kv_heads=2, turn=3, total=9, d=8, hidden=12):
    q = torch.randn(heads, turn, d, generator=generator, dtype=torch.float64)  # [H_q, T, d]
    keys = torch.randn(kv_heads, total, d, generator=generator, dtype=torch.float64)  # [H_kv, S, d]
    values = torch.randn(kv_heads, total, d, generator=generator, dtype=torch.float64)
    weight = torch.randn(hidden, heads * d, generator=generator, dtype=torch.float64)  # [hidden, H_q·d]
    bias = torch.randn(hidden, generator=generator, dtype=torch.float64)
    return q, keys, values, weight, bias


def test_the_share_names_the_token_whose_value_is_wrong():
    """A wrong value at one token: its share is all of the error (the weights are unchanged), and the error is
    quadratic in the perturbation; a wrong key spreads it, still summing to one; equal caches read no error."""
    generator = torch.Generator().manual_seed(0)
    q, keys, values, weight, bias = _layer(generator)
    error, shares = layer_read_error(q, (keys, values), (keys, values), weight, bias, 0.35)
    assert error == 0.0 and not shares.any()
    push = torch.randn(values.shape[0], values.shape[2], generator=generator, dtype=torch.float64)  # [H_kv, d]
    found = []
    for scale in (0.1, 0.2):
        moved = values.clone()
        moved[:, 4] += scale * push
        error, shares = layer_read_error(q, (keys, values), (keys, moved), weight, bias, 0.35)
        assert shares[4] == pytest.approx(1.0, abs=1e-12) and shares.abs().sum() == pytest.approx(1.0, abs=1e-12)
        found.append(error)
    assert found[1] == pytest.approx(4 * found[0], rel=1e-9)
    moved = keys + 0.3 * torch.randn(keys.shape, generator=generator, dtype=torch.float64)
    error, shares = layer_read_error(q, (keys, values), (moved, values), weight, bias, 0.35)
    assert error > 0 and float(shares.sum()) == pytest.approx(1.0, abs=1e-12) and (shares != 0).sum() > 2


def test_an_item_s_shares_split_into_sink_deciles_and_turn_and_a_run_has_its_means():
    errors = torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64)  # [L]
    shares = torch.zeros(3, 25, dtype=torch.float64)  # history 21 tokens + a turn of 4
    shares[0, 5] = 1.0  # a layer without error: weighted out
    shares[1, 0], shares[1, 22] = 0.5, 0.5
    shares[2, 1], shares[2, 20] = 0.25, 0.75
    summary = item_summary(errors, shares, 21)
    assert (summary["mean"], summary["max"], summary["max_layer"]) == (4 / 3, 3.0, 2)
    assert summary["share_sink"] == 0.125 and summary["share_turn"] == 0.125
    assert summary["share_deciles"][0] == 0.1875 and summary["share_deciles"][-1] == 0.5625
    items = [{"read_error": item_summary(errors * k, shares, 21)} for k in (1.0, 2.0, 3.0)] + [{}]
    metrics = read_error_metrics(items, 200, 0)
    assert metrics["read_error.mean"] == pytest.approx(8 / 3) and metrics["read_error.items"] == 3
    assert metrics["read_error.mean_low"] < 8 / 3 < metrics["read_error.mean_high"]
    assert metrics["read_error.layer_2"] == 6.0 and metrics["read_error.share_decile_9"] == 0.5625
    assert read_error_metrics([{}], 200, 0) == {}
