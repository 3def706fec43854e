"""Systems jobs at synthetic shapes (tiny pair, CPU), the JSON tracking backend and its MLflow import."""

import json

import torch
from transformers import DynamicCache

import src.bench
from src.eval.ttft import transport
from src.models import describe_kv
from src.support import coefficient_count
from src.synthetic import synthetic_mapper, synthetic_traces
from src.tracking import import_records
from tests.conftest import tiny
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
    cfg = config(ws, "+experiment=handoff", *SYNTHETIC, "tracking.backend=json", f"tracking.json_dir={records}")
    src.bench.handoff(cfg)
    (record_file,) = records.glob("*/record.json")
    record = json.loads(record_file.read_text())
    logged = {(m["key"], m["step"]) for m in record["metrics"]}
    for name in (
        "ttft_transfer_ms_p50",
        "ttft_prefill_ms_p50",
        "ttft_cache_hit_ms_p50",
        "map_ms_p50",
        "ttft_speedup_vs_prefill",
        "gpu_peak_mb_transfer",
        "gpu_peak_mb_prefill",
        "cache_bytes",
    ):
        assert {(name, 16), (name, 32)} <= logged
    assert record["tags"]["weights"] == "random" and record["params"]["job"] == "handoff"
    assert (record_file.parent / "artifacts/plots/ttft_vs_prefix.png").is_file()
    uri = f"sqlite:///{tmp_path / 'imported.db'}"
    assert import_records(records, uri, str(tmp_path / "artifacts")) == 1
    (run,) = runs(uri, "handoff")
    assert run.data.metrics["ttft_transfer_ms_p50"] > 0 and run.data.tags["job"] == "handoff"


def test_transport_counts_the_source_cache_bytes():
    cache = DynamicCache()
    for layer in range(3):  # [batch, kv_heads, seq, head_dim]
        cache.update(
            torch.zeros(1, 2, 5, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 5, 4, dtype=torch.bfloat16), layer
        )
    assert transport(cache, repeats=1, warmup=0, device=torch.device("cpu")) == {"cache_bytes": 3 * 2 * 40 * 2.0}
