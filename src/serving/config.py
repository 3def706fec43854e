"""The connector's settings: `KVTransferConfig.kv_connector_extra_config`, checked once when an engine starts.

    kv_connector_extra_config = {
        "transport": "/dev/shm/kvrelay",     # the export directory (src/serving/transport.py)
        "export_memory": "host",             # host | device: where this engine's exports keep their K/V (transport.py)
        "export_pool_mb": 0,                 # device exports placed in one pool of this many MiB (0: each its own)
        "routes": [{"mapper": "/mappers/0p5b_to_1p5b", "source": "/models/qwen25coder_0p5b"}],  # into this engine
        "policy": {"levers": {"hold_back": 16}},  # over conf/policy/default.yaml (mode, levers, guards)
        "fingerprint_dtype": "float32",     # the dtype the mapper's pair was fingerprinted in (its fit's pair.dtype)
        "compute_dtype": "fitted",          # the map's coefficients: fitted (each mapper's own) or a dtype
        "apply_backend": "torch",           # torch | auto | triton | gemm (kernels/apply_map.py)
        "keep_exports": 16,                 # a sender keeps its newest exports, removes older ones
        "paged_writer": "backend",          # backend | stacked (FlashAttention: the map stores into the blocks)
    }

Every key has its default here (an engine that only exports needs none). Refused before serving, with the key named
(as the connector starts, and before vLLM loads a model by src/serving/preflight.py): an unknown key, a wrong type,
`kv_load_failure_policy` other than "recompute" (a late refusal must re-prefill, never fail the request), the
engines it cannot run in (`engine_refusal`: pipeline stages, a quantized KV cache, device exports off CUDA), and
the policies a connector cannot serve — mode `auto` (its measured costs live in a Session), `native_layers` and
`recompute` (a receiver forward inside the load: not without patching vLLM) — the latter refused by the very plan a
request's claim builds (src/serving/claim.py `paged_plan`: `check_splice` on a receiver without a forward), built
here once on a long prompt, so no second list of refusals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from src.apply import BACKENDS
from src.runtime.routing import Policy, policy_from
from src.serving.claim import paged_plan
from src.serving.paged import WRITERS
from src.serving.transport import DEFAULT_DIRECTORY, MEMORIES

POLICY_DEFAULTS = Path(__file__).resolve().parents[2] / "conf" / "policy" / "default.yaml"
DTYPES = ("float32", "bfloat16", "float16")
UNQUANTIZED_CACHES = ("auto", "bfloat16", "float16")  # vLLM's kv_cache_dtype values that store K/V as they are
LONG_PREFIX = 1 << 20  # prompt tokens the lever check assumes: every share is a positive count


@dataclass(frozen=True)
class RouteSpec:
    """A mapper into this engine and the directory of the model it maps from."""

    mapper: Path
    source: Path


@dataclass(frozen=True)
class ConnectorConfig:
    transport: str
    export_memory: str
    export_pool_mb: int  # MiB of the sender's export pool (src/serving/export_pool.py); 0: none
    routes: tuple[RouteSpec, ...]
    policy: Policy
    fingerprint_dtype: torch.dtype
    compute_dtype: torch.dtype | None  # None: each route's fitted compute dtype (`fitted_dtypes`)
    apply_backend: str
    keep_exports: int
    paged_writer: str


DEFAULTS = {
    "transport": DEFAULT_DIRECTORY,
    "export_memory": "host",
    "export_pool_mb": 0,
    "routes": [],
    "policy": {},
    "fingerprint_dtype": "float32",
    "compute_dtype": "fitted",
    "apply_backend": "torch",
    "keep_exports": 16,
    "paged_writer": "backend",
}


def connector_config(extra: Mapping | None, load_failure_policy: str) -> ConnectorConfig:
    """The checked settings of `kv_connector_extra_config` (module docstring), or a ValueError naming the key."""
    extra = dict(extra or {})
    if unknown := sorted(set(extra) - set(DEFAULTS)):
        raise ValueError(f"kvrelay: unknown kv_connector_extra_config keys {unknown} (known: {sorted(DEFAULTS)})")
    if load_failure_policy != "recompute":
        raise ValueError(
            f'kvrelay: KVTransferConfig(kv_load_failure_policy="recompute") is required, not {load_failure_policy!r}: '
            "a map refused on the worker (non-finite values, the magnitude guard, a missing export) must re-prefill "
            "its blocks, never fail the request"
        )
    values = DEFAULTS | extra
    for key in ("transport",):
        if not isinstance(values[key], str) or not values[key]:
            raise ValueError(f"kvrelay: {key} must be a directory path, not {values[key]!r}")
    if values["export_memory"] not in MEMORIES:
        raise ValueError(f"kvrelay: export_memory must be one of {MEMORIES}, not {values['export_memory']!r}")
    pool = values["export_pool_mb"]
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
        raise ValueError(f"kvrelay: export_pool_mb must be an integer ≥ 0 (MiB; 0: no pool), not {pool!r}")
    if pool and values["export_memory"] != "device":
        raise ValueError(f'kvrelay: export_pool_mb holds device exports: it needs export_memory "device", not '
                         f"{values['export_memory']!r}")  # fmt: skip
    for key, allowed in (("fingerprint_dtype", DTYPES), ("compute_dtype", ("fitted", *DTYPES))):
        if values[key] not in allowed:
            raise ValueError(f"kvrelay: {key} must be one of {allowed}, not {values[key]!r}")
    if values["apply_backend"] not in BACKENDS:
        raise ValueError(f"kvrelay: apply_backend must be one of {BACKENDS}, not {values['apply_backend']!r}")
    if values["paged_writer"] not in WRITERS:
        raise ValueError(f"kvrelay: paged_writer must be one of {WRITERS}, not {values['paged_writer']!r}")
    keep = values["keep_exports"]
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"kvrelay: keep_exports must be an integer ≥ 1, not {keep!r}")
    return ConnectorConfig(
        transport=values["transport"],
        export_memory=values["export_memory"],
        export_pool_mb=pool,
        routes=_routes(values["routes"]),
        policy=serving_policy(values["policy"]),
        fingerprint_dtype=getattr(torch, values["fingerprint_dtype"]),
        compute_dtype=None if values["compute_dtype"] == "fitted" else getattr(torch, values["compute_dtype"]),
        apply_backend=values["apply_backend"],
        keep_exports=keep,
        paged_writer=values["paged_writer"],
    )


def engine_refusal(config: ConnectorConfig, device_type: str, pipeline_stages: int, cache_dtype: str) -> str | None:
    """Why an engine on `device_type` split into `pipeline_stages` stages, its KV cache in `cache_dtype` (vLLM's
    `kv_cache_dtype`), cannot run the connector with `config`, or None. Pipeline stages each hold some of the model's
    layers, while an export holds every layer and a map writes every target layer from any source layer on one worker
    (tensor parallelism splits heads instead: served). A quantized cache keeps its values scaled, in bytes an export
    would read as they are and a map would write unscaled."""
    if cache_dtype not in UNQUANTIZED_CACHES:
        return (f"kvrelay: a quantized KV cache (kv_cache_dtype {cache_dtype!r}) is not served: an export would read "
                "its bytes without their scales and a map write values without them; use kv_cache_dtype \"auto\" (the "
                "model's dtype), \"bfloat16\" or \"float16\"")  # fmt: skip
    if pipeline_stages > 1:
        return (f"kvrelay: pipeline parallelism ({pipeline_stages} stages) is not served: a stage holds some of the "
                "model's layers, while an export holds every layer and a map writes every target layer on one worker; "
                "use tensor parallelism (each worker maps its own KV heads)")  # fmt: skip
    if config.export_memory == "device" and device_type != "cuda":
        return (f'kvrelay: export_memory "device" keeps exports in CUDA memory; this engine runs on {device_type} '
                '(use "host")')  # fmt: skip
    return None


def fitted_dtypes(manifest: Mapping) -> dict[str, str]:
    """The connector's dtype settings a mapper was fitted for: `fingerprint_dtype` its fit's `pair.dtype` (what its
    fingerprints were taken in), `compute_dtype` its fit's `pair.compute_dtype`; float32 where its manifest keeps
    no config (a mapper built outside the fit job)."""
    pair = manifest.get("config", {}).get("pair", {})
    return {"fingerprint_dtype": pair.get("dtype", "float32"), "compute_dtype": pair.get("compute_dtype", "float32")}


def _routes(routes: object) -> tuple[RouteSpec, ...]:
    if not isinstance(routes, list | tuple):
        raise ValueError(f"kvrelay: routes must be a list of {{mapper, source}} objects, not {routes!r}")
    specs = []
    for index, route in enumerate(routes):
        if not isinstance(route, Mapping) or set(route) != {"mapper", "source"}:
            raise ValueError(f"kvrelay: route {index} must name exactly a mapper and a source directory, not {route!r}")
        for key in ("mapper", "source"):
            if not isinstance(route[key], str) or not Path(route[key]).is_dir():
                raise ValueError(f"kvrelay: route {index} {key} {route[key]!r} is not a directory")
        specs.append(RouteSpec(Path(route["mapper"]), Path(route["source"])))
    return tuple(specs)


def serving_policy(overrides: object) -> Policy:
    """conf/policy/default.yaml with `overrides` merged in (nested `levers`), checked for what a connector serves."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"kvrelay: policy must be a mapping of conf/policy keys, not {overrides!r}")
    node = yaml.safe_load(POLICY_DEFAULTS.read_text())
    if unknown := sorted(set(overrides) - set(node)) + sorted(set(overrides.get("levers", {})) - set(node["levers"])):
        raise ValueError(f"kvrelay: unknown policy keys {unknown} (conf/policy/default.yaml lists them)")
    node = node | {k: v for k, v in overrides.items() if k != "levers"}
    node["levers"] = node["levers"] | dict(overrides.get("levers", {}))
    policy = policy_from(node)
    levers = policy.levers
    refused = {"mode auto (its measured costs live in a Session; choose map or reprefill)": policy.mode == "auto"}
    try:  # the claim's own plan (src/serving/claim.py) of a long prompt, one token left to vLLM; no model yet
        paged_plan(levers, 0, LONG_PREFIX - 1, LONG_PREFIX, 0)
    except ValueError as error:
        keys = [f"levers.{key} > 0" for key in ("native_layers", "recompute") if getattr(levers, key) > 0]
        refused[f"{' and '.join(keys)} ({error})"] = True
    if reasons := [reason for reason, bad in refused.items() if bad]:
        raise ValueError(f"kvrelay: the vLLM connector cannot serve {'; '.join(reasons)} without patching vLLM "
                         "(docs/serving.md, the levers)")  # fmt: skip
    return policy
