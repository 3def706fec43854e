"""The connector's opt-in host timings (src/serving/timings.py), the TTFT bench's fold of them and the random mapper
it times, without an engine (a handoff over real engines writing every phase: tests/test_vllm_serving.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from src.serving.timings import ENV, PHASES, Timings

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    """scripts/bench_vllm_ttft.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_vllm_ttft", ROOT / "scripts" / "bench_vllm_ttft.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_unset_the_timings_read_no_clock_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    timings = Timings.from_environment("worker")
    assert timings.path is None
    first, second = timings.phase("map", "r", 64), timings.phase("write", "s", 32)
    assert first is second  # one shared null context: nothing allocated, no clock read
    with first:
        pass
    assert list(tmp_path.iterdir()) == []


def test_set_every_phase_appends_one_line_even_when_it_raises(tmp_path, monkeypatch):
    path = tmp_path / "timings.jsonl"
    monkeypatch.setenv(ENV, str(path))
    timings = Timings.from_environment("scheduler")
    with timings.phase("claim", "r-1", 4096):
        pass
    with pytest.raises(KeyError), timings.phase("header", "r-2", 128):
        raise KeyError("export")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["role"], e["phase"], e["request"], e["tokens"]) for e in lines] == [
        ("scheduler", "claim", "r-1", 4096),
        ("scheduler", "header", "r-2", 128),
    ]
    assert all(e["ms"] >= 0 and isinstance(e["pid"], int) for e in lines)


def test_the_bench_folds_a_requests_phase_once_and_skips_lines_before_its_offset(tmp_path):
    bench = _bench()
    path = tmp_path / "timings.jsonl"
    warm = Timings("worker", str(path))
    warm.write("map", "w", 8, 1000.0)  # the warm-up round: dropped
    offset = path.stat().st_size
    scheduler, worker = Timings("scheduler", str(path)), Timings("worker", str(path))
    for request, ms in (("a", 1.0), ("b", 3.0), ("c", 2.0)):
        worker.write("map", request, 8, ms)
        scheduler.write("claim", request, 8, ms / 2)
        scheduler.write("claim", request, 8, ms / 2)  # met twice (a request scheduled later): summed
    assert bench.phase_medians(path, offset) == {"scheduler": {"claim": 2.0}, "worker": {"map": 2.0}}


def test_the_phases_are_named_once_per_role():
    assert set(PHASES) == {"scheduler", "worker"}
    assert all(len(set(names)) == len(names) and "export" not in names for names in PHASES.values())


def test_the_maps_device_span_is_marked_only_when_timed_on_cuda(tmp_path):
    """`mark` queues an event only where timings are on and the device is CUDA; an unmarked span writes nothing."""
    timed, off = Timings("worker", str(tmp_path / "timings.jsonl")), Timings("worker")
    assert timed.mark(torch.device("cpu")) is None
    assert off.mark(torch.device("cuda", 0)) is None  # off: CUDA is never touched (no event, no stream)
    timed.elapsed((None, None), "r", 64)
    assert list(tmp_path.iterdir()) == []


def test_the_bench_folds_the_device_line_under_its_own_role(tmp_path):
    bench = _bench()
    path = tmp_path / "timings.jsonl"
    worker = Timings("worker", str(path))
    worker.write("map", "a", 8, 0.5)
    worker.write("map", "a", 8, 1.25, role="device")
    assert bench.phase_medians(path, 0) == {"device": {"map": 1.25}, "worker": {"map": 0.5}}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_maps_device_span_is_the_gpu_time_between_its_marks(tmp_path):
    path = tmp_path / "timings.jsonl"
    timings, device = Timings("worker", str(path)), torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=device)
    began = timings.mark(device)
    for _ in range(8):
        x = x @ x.T / 4096
    timings.elapsed((began, timings.mark(device)), "r", 4096)
    (line,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (line["role"], line["phase"], line["request"], line["tokens"]) == ("device", "map", "r", 4096)
    assert line["ms"] > 0


def test_the_random_bench_builds_a_mapper_of_k_source_layers_and_rebuilds_for_another_k(tmp_path):
    """scripts/bench_vllm_ttft.py `build` on the tiny random pair (4 → 6 layers): the mapper reads k source layers per
    target layer; the same --work is reused for the same k and rebuilt for another; k past the source's layers is a
    ValueError naming them (the bench turns it into a usage error before any engine starts)."""
    from src.artifact import load_mapper

    bench, pair = _bench(), ROOT / "conf" / "pair" / "tiny_random.yaml"
    *_, mapper = bench.build(pair, tmp_path, torch.float32, 3)
    assert load_mapper(mapper).source_layers.shape == (6, 3)
    stamp = (mapper / "manifest.json").stat().st_mtime_ns
    assert bench.build(pair, tmp_path, torch.float32, 3)[2] == mapper
    assert (mapper / "manifest.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    bench.build(pair, tmp_path, torch.float32, 4)
    assert load_mapper(mapper).source_layers.shape == (6, 4)
    with pytest.raises(ValueError, match="1 to the source's 4 layers"):
        bench.build(pair, tmp_path, torch.float32, 5)
