"""src/serving/preflight.py: an engine's kvrelay settings checked before vLLM loads the model — on the tests' tiny
serving pair (tests/vllm_pair.py: small → large fitted, large → large identity), with no vLLM engine. The checks are
the connector's own (config.py, routes.py); the connector's start is tested to refuse pipeline stages by the same
function where vLLM is importable."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from src.artifact import load_mapper
from src.runtime.routing import mapper_id
from src.serving.preflight import main, preflight
from tests.vllm_pair import CONNECTOR, serving_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return serving_pair(tmp_path_factory.mktemp("preflight"))


def transfer(pair, exports: Path, **extra) -> dict:
    """The receiver's --kv-transfer-config: the fitted route small → large into exports, with `extra` over it."""
    routes = [{"mapper": str(pair.fitted), "source": str(pair.small)}]
    return CONNECTOR | {"kv_connector_extra_config": {"transport": str(exports), "routes": routes} | extra}


def test_a_served_route_is_named_with_its_calibration_and_nothing_is_written(pair, tmp_path):
    exports = tmp_path / "exports"
    lines = preflight(pair.large, transfer(pair, exports), "cpu")
    assert lines[0].startswith(f"transport {exports} (host exports), policy mode map")
    assert lines[1:] == [f"route {mapper_id(load_mapper(pair.fitted))}: {pair.small} → {pair.large} (calibrated at "
                         "64 tokens, length no evidence; its sender sets fingerprint_dtype float32)"]  # fmt: skip
    assert not exports.exists()  # the engine makes its export directory, not the check
    sender = CONNECTOR | {"kv_connector_extra_config": {"transport": str(exports)}}
    assert preflight(pair.small, sender, "cpu")[-1] == "no routes: this engine only exports"


def _bad(pair, exports: Path, case: str) -> tuple[dict, dict]:
    """A config the connector refuses at its start, and preflight's other arguments."""
    good = transfer(pair, exports)
    extra = lambda **changes: transfer(pair, exports, **changes)  # noqa: E731
    route = lambda mapper, source: extra(routes=[{"mapper": str(mapper), "source": str(source)}])  # noqa: E731
    return {
        "another connector": (good | {"kv_connector": "LMCacheConnectorV1"}, {}),
        "vLLM's default load failure policy": ({k: v for k, v in good.items() if k != "kv_load_failure_policy"}, {}),
        "an unknown key": (extra(keep_export=4), {}),
        "a lever needing a forward": (extra(policy={"levers": {"recompute": 0.1}}), {}),
        "pipeline stages": (good, {"pipeline_stages": 2}),
        "a quantized KV cache": (good, {"cache_dtype": "fp8"}),
        "device exports on a CPU engine": (extra(export_memory="device"), {}),
        "a mapper into another model": (good, {"model": pair.small}),
        "a route from another source": (route(pair.fitted, pair.large), {}),
        "a missing mapper": (route(exports / "none", pair.small), {}),
    }[case]


REASONS = {
    "another connector": "do not name the kvrelay connector",
    "vLLM's default load failure policy": "kv_load_failure_policy=\"recompute\"\\) is required, not 'fail'",
    "an unknown key": r"unknown kv_connector_extra_config keys \['keep_export'\]",
    "a lever needing a forward": "cannot serve levers.recompute > 0",
    "pipeline stages": r"pipeline parallelism \(2 stages\) is not served",
    "a quantized KV cache": r"a quantized KV cache \(kv_cache_dtype 'fp8'\) is not served",
    "device exports on a CPU engine": 'export_memory "device" keeps exports in CUDA memory; this engine runs on cpu',
    "a mapper into another model": "cannot serve: mapper refused",
    "a route from another source": "cannot serve: mapper refused",
    "a missing mapper": "is not a directory",
}


@pytest.mark.parametrize("case", sorted(REASONS))
def test_each_setting_the_connector_refuses_is_refused_first_by_name(pair, tmp_path, case):
    config, changes = _bad(pair, tmp_path / "exports", case)
    arguments = {"model": pair.large, "device_type": "cpu"} | changes
    with pytest.raises(ValueError, match=REASONS[case]):
        preflight(arguments.pop("model"), config, **arguments)
    assert not (tmp_path / "exports").exists()


def test_the_command_exits_0_with_the_routes_and_2_with_the_reason(pair, tmp_path, capsys):
    good = json.dumps(transfer(pair, tmp_path / "exports"))
    assert main(["--model", str(pair.large), "--kv-transfer-config", good, "--device", "cpu"]) == 0
    assert "route " in capsys.readouterr().out
    for argv, reason in (
        (["--kv-transfer-config", good, "--pipeline-parallel-size", "2"], "pipeline parallelism (2 stages)"),
        (["--kv-transfer-config", good, "--kv-cache-dtype", "fp8_e5m2"], "a quantized KV cache"),
        (["--kv-transfer-config", "{not json"], "preflight: Expecting property name"),
        (["--kv-transfer-config", "[1]"], "must be a JSON object"),
    ):
        assert main(["--model", str(pair.large), "--device", "cpu", *argv]) == 2
        assert reason in capsys.readouterr().err


def test_the_connector_refuses_pipeline_stages_as_it_starts_before_its_export_directory(pair, tmp_path):
    """The connector's own start (both roles) by the same function: vLLM's worker and scheduler build it after the
    model has loaded, so this is the refusal preflight runs first."""
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from src.serving.vllm_connector import KVRelayConnector

    extra = transfer(pair, tmp_path / "exports")["kv_connector_extra_config"]
    config = NS(kv_transfer_config=NS(kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
                device_config=NS(device=torch.device("cpu")), parallel_config=NS(pipeline_parallel_size=2),
                cache_config=NS(cache_dtype="auto", block_size=32))  # fmt: skip
    for role in (base.KVConnectorRole.SCHEDULER, base.KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=REASONS["pipeline stages"]):
            KVRelayConnector(config, role)
    assert not (tmp_path / "exports").exists()
