"""Systems jobs at synthetic shapes (tiny pair, CPU), the JSON tracking backend and its MLflow import; the
handoff TTFT paths on the exact-map pair (tests/exact_pair.py): the three paths give the same next token
through the exact map (and not through a wrong one), the map runs inside the timed transfer path, and every timed
call is kept, giving back each p50 and each ratio's interval."""

import json
import math
import statistics

import pytest
import torch
from transformers import DynamicCache

import src.bench
import src.eval.latency
from src.apply import KVTransfer
from src.eval.intervals import median_ratio_interval
from src.eval.ttft import ENGINES, engine_paths, handoff_paths, handoff_ttft, recompute_path, transport
from src.forward import prefill
from src.mlflow_store import import_records
from src.models import describe_kv
from src.report.engine_table import engine as engine_table
from src.report.rows import record_rows
from src.support import coefficient_count
from src.synthetic import synthetic_mapper, synthetic_traces
from tests.conftest import CountingTransfer, calibration_ids, tiny
from tests.exact_pair import exact_pair
from tests.test_run import config, runs, ws  # noqa: F401  (ws is a fixture)

SYNTHETIC = [
    "budget=synthetic_paper",
    "pair.device=cpu",
    "budget.storage_dtype=float32",
    "budget.sequences=8",
    "budget.seq_len=64",
    "eval.handoff.prefix_lens=[16,32]",
    "eval.handoff.new_turn=4",
    "eval.handoff.repeats=2",
    "eval.handoff.prefill_repeats=1",
    "eval.handoff.warmup=1",
]


def test_synthetic_shapes_follow_the_pair():
    source, target = describe_kv(tiny("qwen3")), describe_kv(tiny("llama", num_hidden_layers=5))
    traces = synthetic_traces(source, target, 3, 7, "cpu", torch.float32, seed=0)
    assert traces.source_k.shape == (3, 2, 21, 16) and traces.target_v.shape == (5, 2, 21, 16)
    assert traces.attn_k.shape == (5, 2, 21) and bool((traces.attn_k >= 0).all())
    for support, fan_in in (("local", 1), ("full", 2)):
        mapper = synthetic_mapper(source, target, support, 2, {"weights": "random"}, seed=0)
        assert mapper.weight_k.shape == (5, 2, 2 * fan_in * 16, 16) and mapper.manifest["synthetic"]
        count = mapper.weight_k.numel() + mapper.weight_v.numel()
        assert mapper.manifest["coefficient_count"] == count == coefficient_count(5, 2, 2, fan_in, 16, 16)


def test_handoff_job_json_backend_and_import(ws, tmp_path):  # noqa: F811
    records = tmp_path / "records"
    cfg = config(
        ws, "+experiment=handoff", *SYNTHETIC, "tracking.backend=json", f"tracking.json_dir={records}",
        "eval.handoff.profile=true",
    )  # fmt: skip
    src.bench.handoff(cfg)
    (record_file,) = records.glob("*/record.json")
    record = json.loads(record_file.read_text())
    logged = {(m["key"], m["step"]) for m in record["metrics"]}
    for name in (
        "ttft.hf.map_ms_p50",
        "ttft.hf.reprefill_ms_p50",
        "ttft.hf.hit_ms_p50",
        "ttft.static.map_ms_p50",
        "ttft.graph.hit_ms_p50",
        "ttft.graph.recompute_0.25_ms_p50",
        "check.graph.map_logit_diff",
        "map_ms_p50",
        "speedup.hf.map",
        "speedup.graph.map",
        "graph.map_over_hit",
        "gpu_peak_mb_map",
        "gpu_peak_mb_reprefill",
        "cache_bytes",
    ):
        assert {(name, 16), (name, 32)} <= logged
    assert record["tags"]["weights"] == "random" and record["params"]["job"] == "handoff"
    assert (record_file.parent / "artifacts/plots/ttft_vs_prefix.png").is_file()
    logged = {m["key"]: m["value"] for m in record["metrics"]}
    assert math.isnan(logged["speedup.graph.map_lo"]) and math.isnan(logged["graph.map_over_hit_hi"])  # 2 repeats
    kept = json.loads((record_file.parent / "artifacts/handoff.json").read_text())["samples"]
    assert set(kept) == {"16", "32"} and len(kept["16"]["graph.map"]) == 2 and len(kept["32"]["hf.reprefill"]) == 1
    table = engine_table(record_rows(records))  # the intervals logged, undefined at 2 / 1 repeats
    assert "× [—, —], " in table and "| recompute 25% |" in table and "recompute 25% hi" not in table
    tables = json.loads((record_file.parent / "artifacts/profiles/prefix_16.json").read_text())
    assert {"map", "graph.map", "graph.hit", "graph.recompute_0.25"} <= set(tables) and "Self CPU" in tables["map"]
    uri = f"sqlite:///{tmp_path / 'imported.db'}"
    assert import_records(records, uri, str(tmp_path / "artifacts")) == 1
    (run,) = runs(uri, "handoff")
    assert run.data.metrics["ttft.hf.map_ms_p50"] > 0 and run.data.tags["job"] == "handoff"


def test_a_bench_job_that_fails_leaves_a_failed_record(ws, tmp_path, monkeypatch):  # noqa: F811
    """The tracked run spans the job: a measurement that raises ends it FAILED with the error, not without a record."""
    records = tmp_path / "records"
    cfg = config(ws, "+experiment=handoff", *SYNTHETIC, "tracking.backend=json", f"tracking.json_dir={records}")

    def broken(*args, **kwargs):
        raise RuntimeError("planted: the measurement broke")

    monkeypatch.setattr(src.bench, "handoff_ttft", broken)
    with pytest.raises(RuntimeError, match="planted"):
        src.bench.handoff(cfg)
    (record_file,) = records.glob("*/record.json")
    record = json.loads(record_file.read_text())
    assert record["status"] == "FAILED" and "planted" in record["tags"]["error"]


def test_recompute_paths_are_named_for_the_engine_table():
    """The deviation rule at progressive 1 keeps its old path name; other rules and progressive selection add theirs,
    and the engine table reads every name back into a column of its own."""
    names = [recompute_path(0.25, "deviation", 1.0), recompute_path(0.1, "turn", 1.0)]
    names.append(recompute_path(0.25, "deviation", 0.5))
    assert names == ["recompute_0.25", "recompute_0.1_turn", "recompute_0.25_deviation_p0.5"]
    row = {"params.job": "handoff", "start_time": 0, "series.map_ms_p50": {16: 1.0}}
    row |= {f"series.speedup.graph.{name}": {16: speedup} for name, speedup in zip(names, (2.0, 3.0, 4.0), strict=True)}
    header, _, line = engine_table([row]).splitlines()[2:5]
    assert header.endswith("| recompute 10% turn | recompute 25% | recompute 25% deviation p0.5 |")
    assert line.endswith("| 3.00× | 2.00× | 4.00× |")


def test_the_engine_table_shows_each_ratio_with_its_interval():
    """A record with intervals shows each ratio as 'r× [lo, hi]' ('[—, —]' where too few repeats gave none); an older
    record the bare ratio, and says once that it predates them."""
    row = {"params.job": "handoff", "start_time": 0, "series.map_ms_p50": {16: 1.0}}
    ratios = {"speedup.graph.map": (8.08, 7.9, 8.3), "graph.map_over_hit": (1.5, math.nan, math.nan)}
    ratios["speedup.graph.recompute_0.25"] = (2.0, 1.75, 2.25)
    old = row | {f"series.{name}": {16: point} for name, (point, _, _) in ratios.items()}
    new = old | {
        f"series.{name}_{end}": {16: bounds[i]} for name, bounds in ratios.items() for i, end in ((1, "lo"), (2, "hi"))
    }
    caption, _, header, _, line = engine_table([new]).splitlines()[:5]
    assert line.endswith("| 8.08× [7.90, 8.30], 1.50× [—, —] | 2.00× [1.75, 2.25] |") and "predates" not in caption
    assert header.endswith("| recompute 25% |")
    caption, _, _, _, line = engine_table([old]).splitlines()[:5]
    assert line.endswith("| 8.08×, 1.50× | 2.00× |") and caption.endswith("(no interval: record predates samples)")


def test_transport_counts_the_source_cache_bytes():
    cache = DynamicCache()
    for layer in range(3):  # [batch, kv_heads, seq, head_dim]
        cache.update(
            torch.zeros(1, 2, 5, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 5, 4, dtype=torch.bfloat16), layer
        )
    assert transport(cache, repeats=1, warmup=0, device=torch.device("cpu")) == {"cache_bytes": 3 * 2 * 40 * 2.0}


def _prefix_turn() -> tuple[torch.Tensor, torch.Tensor]:
    ids = calibration_ids(1, 24, seed=11)  # [1, 24]
    return ids[:, :20], ids[:, 20:]  # prefix [1, 20], new turn [1, 4]


@torch.no_grad()
def test_ttft_paths_agree_only_through_the_exact_map():
    source, target, token_hash, exact, wrong = exact_pair()
    prefix, turn = _prefix_turn()
    source_cache = prefill(source, prefix)
    logits = {}
    for name, mapper in (("exact", exact), ("wrong", wrong)):
        paths = handoff_paths(KVTransfer(mapper, source, target, token_hash), source_cache, prefix, turn)
        logits[name] = {path: run() for path, run in paths.items()}  # [1, V] each
        assert torch.equal(paths["hit"](), logits[name]["hit"])  # the hit path restores its cache
        transfer = KVTransfer(mapper, source, target, token_hash)
        engine, _ = engine_paths(transfer, source_cache, prefix, turn, (0.5,), ("deviation", "turn"))
        assert {"recompute_0.5", "recompute_0.5_turn"} <= set(engine)
        for path, run in engine.items():  # the static engine's paths compute what the hf paths do
            reference = logits[name]["map" if path.startswith("recompute") else path.removesuffix("_graph")]
            if path.startswith("recompute") and name == "wrong":
                reference = logits[name]["reprefill"]  # half recomputed: between the two
                assert (run() - logits[name]["map"]).abs().max() > 1e-3
                continue
            torch.testing.assert_close(run(), reference, atol=1e-4, rtol=0)
    exact_logits, reference = logits["exact"], logits["exact"]["reprefill"]
    for path in ("map", "hit"):
        torch.testing.assert_close(exact_logits[path], reference, atol=1e-4, rtol=0)
        assert torch.equal(exact_logits[path].argmax(-1), reference.argmax(-1))  # the same first token
    assert (logits["wrong"]["map"] - reference).abs().max() > 1e-2  # the map path reads the map
    source_logits = source(torch.cat([prefix, turn], 1)).logits[:, -1]
    assert (source_logits - reference).abs().max() > 1e-1  # the target is not the source


class _ClockedTransfer(CountingTransfer):
    """A KVTransfer whose every handoff advances a fake clock by one second; each read of it by 1 µs."""

    def __init__(self, transfer):
        super().__init__(transfer)
        self.device, self.token_features, self.now = transfer.device, transfer.token_features, 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def __call__(self, cache, **kwargs):
        self.now += 1.0
        return super().__call__(cache, **kwargs)

    def into(self, out, cache, **kwargs):
        self.now += 1.0
        return super().into(out, cache, **kwargs)


def test_ttft_times_the_map_inside_the_transfer_path(monkeypatch):
    source, target, token_hash, exact, _ = exact_pair()
    prefix, turn = _prefix_turn()
    clocked = _ClockedTransfer(KVTransfer(exact, source, target, token_hash))
    monkeypatch.setattr(src.eval.latency, "time", clocked)  # time_ms reads the fake clock
    metrics = handoff_ttft(clocked, prefix, turn, repeats=2, prefill_repeats=1, warmup=1, engines=("hf", "static"))
    second = pytest.approx(1e3, abs=0.01)
    for name in ("ttft.hf.map_ms_p50", "ttft.hf.map_ms_p95", "ttft.static.map_ms_p50", "map_ms_p50"):
        assert metrics[name] == second, name  # one map per timed call, inside the timed region on every engine
    for engine in ("hf", "static"):
        assert metrics[f"ttft.{engine}.hit_ms_p95"] < 0.01 and metrics[f"ttft.{engine}.reprefill_ms_p95"] < 0.01
        assert metrics[f"speedup.{engine}.map"] < 1e-5
    # map alone, each engine's map path: (warm-up + timed + the logit check); one peak-memory call
    assert clocked.calls == (1 + 2) + 2 * (1 + 2 + 1) + 1


def test_handoff_keeps_every_timed_call_and_an_interval_for_each_ratio():
    """Every timed call's ms are kept (4 decimals) and give back each p50 and each ratio with its 95 % interval
    (`median_ratio_interval` of the kept samples: the engine's re-prefills over the path; map over hit), which brackets
    the ratio; at 5 re-prefill repeats no speedup has an interval (NaN: a median at 97.5 % needs 7 values) while
    routed / hit, 7 repeats a side, has one."""
    source, target, token_hash, exact, _ = exact_pair()
    prefix, turn = _prefix_turn()
    transfer = KVTransfer(exact, source, target, token_hash)
    for prefill_repeats in (5, 7):
        samples: dict[str, list[float]] = {}
        metrics = handoff_ttft(transfer, prefix, turn, 7, prefill_repeats, 0, shares=(0.5,), samples=samples)
        assert set(samples) == {"map"} | {
            f"{engine}.{path}"
            for engine in ENGINES
            for path in (
                "map",
                "reprefill",
                "hit",
                *(("reprefill_graph", "recompute_0.5") if engine == "graph" else ()),
            )
        }
        for key, ms in samples.items():
            slow = key.split(".", 1)[-1].startswith(("reprefill", "recompute"))
            assert len(ms) == (prefill_repeats if slow else 7) and all(t > 0 and round(t, 4) == t for t in ms)
            median = metrics["map_ms_p50" if key == "map" else f"ttft.{key}_ms_p50"]
            assert median == pytest.approx(statistics.median(ms), rel=1e-12)
        for engine in ENGINES:
            paths = [key.split(".", 1)[1] for key in samples if key.startswith(f"{engine}.")]
            bases = [samples[f"{engine}.{path}"] for path in paths if path.startswith("reprefill")]
            ratios = {f"speedup.{engine}.{path}": (bases, samples[f"{engine}.{path}"]) for path in paths}
            ratios[f"{engine}.map_over_hit"] = ([samples[f"{engine}.map"]], samples[f"{engine}.hit"])
            for name, (numerators, denominator) in ratios.items():
                point, low, high = (metrics[name], metrics[f"{name}_lo"], metrics[f"{name}_hi"])
                assert [point, low, high] == pytest.approx(median_ratio_interval(numerators, denominator), nan_ok=True)
                defined = prefill_repeats == 7 or name.endswith("map_over_hit")
                assert math.isfinite(low) == math.isfinite(high) == defined, name
                assert not defined or low <= point <= high, name
