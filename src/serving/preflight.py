"""An engine's kvrelay settings checked before vLLM loads its model. vLLM builds a KV connector only once the model
is loaded and its KV cache sized (both roles, in 0.26 and 0.32: `initialize_from_config` on the worker, the
scheduler after it), so every refusal the connector raises at its start — an unknown key, a policy it cannot serve,
pipeline stages, a quantized KV cache, a mapper fitted for another model or tokenizer, device exports on a CPU
engine — comes after that load: minutes for a large model, and a server that never comes up. This runs the same
checks first, by the same functions (config.py, routes.py), with no vLLM and no weights loaded (the fingerprints
stream from the safetensors files, src/model_identity.py):

    python -m src.serving.preflight --model DIR --kv-transfer-config JSON [--tokenizer DIR]
        [--pipeline-parallel-size N] [--kv-cache-dtype auto] [--device cuda|cpu]

JSON is what `vllm serve --kv-transfer-config` takes. Exit 0 with one line per route the engine will serve; exit 2
with the reason. Nothing is written (the export directory is created by the engine, not here).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from src.serving.config import connector_config, engine_refusal
from src.serving.routes import bound_routes, model_tokenizer_hash, scheduled_routes

CONNECTOR = ("KVRelayConnector", "src.serving.vllm_connector")  # kv_connector, kv_connector_module_path


def preflight(
    model: Path,
    transfer: Mapping,
    device_type: str,
    pipeline_stages: int = 1,
    tokenizer: Path | None = None,
    cache_dtype: str = "auto",
) -> list[str]:
    """What an engine of `model` (its tokenizer at `tokenizer`, default the model's directory) on `device_type` in
    `pipeline_stages` stages, its KV cache in `cache_dtype` (vLLM's kv_cache_dtype), will serve with the KV transfer
    config `transfer` (a dict, as vLLM's JSON): one line per route; a ValueError naming the first setting the connector
    would refuse."""
    named = (transfer.get("kv_connector"), transfer.get("kv_connector_module_path"))
    if named != CONNECTOR:
        raise ValueError(f"kvrelay: kv_connector / kv_connector_module_path {named} do not name the kvrelay "
                         f"connector {CONNECTOR}")  # fmt: skip
    config = connector_config(transfer.get("kv_connector_extra_config"), transfer.get("kv_load_failure_policy", "fail"))
    if refusal := engine_refusal(config, device_type, pipeline_stages, cache_dtype):
        raise ValueError(refusal)
    scheduled = scheduled_routes(config.routes, model_tokenizer_hash(Path(tokenizer or model)))  # the scheduler's
    bound_routes(config.routes, Path(model), config.fingerprint_dtype, config.compute_dtype, config.apply_backend,
                 "cpu")  # the worker's checks, its mappers bound on the host  # fmt: skip
    lines = [f"transport {config.transport} ({config.export_memory} exports), policy mode {config.policy.mode}"]
    for (identity, route), spec in zip(scheduled.items(), config.routes, strict=True):
        evidence = f"verified to {route.route.verified_length}" if route.route.verified_length else "no evidence"
        lines.append(f"route {identity}: {spec.source} → {model} (calibrated at {route.route.calibrated_length} "
                     f"tokens, length {evidence}; its sender sets fingerprint_dtype "
                     f"{route.fingerprint_dtype})")  # fmt: skip
    return lines if config.routes else [*lines, "no routes: this engine only exports"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--kv-transfer-config", required=True, help="the JSON `vllm serve` takes")
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        transfer = json.loads(args.kv_transfer_config)
        if not isinstance(transfer, dict):
            raise ValueError(f"kvrelay: --kv-transfer-config must be a JSON object, not {args.kv_transfer_config!r}")
        lines = preflight(args.model, transfer, args.device, args.pipeline_parallel_size, args.tokenizer,
                          args.kv_cache_dtype)  # fmt: skip
    except (ValueError, OSError) as error:  # json.JSONDecodeError is a ValueError
        print(f"preflight: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
