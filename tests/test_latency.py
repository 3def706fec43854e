"""src/eval/latency.py's timers on CPU: what is timed, what is warm-up, and what runs untimed before each call."""

import torch

from src.eval import latency


def test_wall_ms_times_only_the_calls_after_warm_up_with_the_hook_untimed(monkeypatch):
    clock, calls = iter(float(t) for t in range(100)), []
    monkeypatch.setattr(latency.time, "perf_counter", lambda: next(clock))  # each read: one second later
    before = lambda: calls.append("before")
    times = latency.wall_ms(lambda: calls.append("call"), 3, 2, (torch.device("cpu"),), before)
    assert calls == ["before", "call"] * 5  # the hook before every call, warm-up included
    assert times == [1000.0] * 3  # the 3 timed calls only, each from its start to its end (not the hook)


def test_percentiles_name_the_path():
    found = latency.percentiles([1.0, 2.0, 3.0, 4.0, 5.0], "map")
    assert found == {"map_ms_p50": 3.0, "map_ms_p95": 4.8}
