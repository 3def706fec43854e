"""What a request asks of the connector: `SamplingParams(extra_args={"kv_transfer_params": {"kvrelay": {...}}})`
(or the OpenAI server's `kv_transfer_params` field), built by the router and read by the connector.

    {"export": true}                                        export this prompt's K/V once its prefill is done
    {"handoff": {"export": "<id>", "mapper": "<mapper id>"}}  map that export into this request's blocks
    {"mapped": {"start": s, "end": e, "mapper": "<id>"}}    this engine's cache of the conversation holds a mapped
                                                            span s..e−1 (an earlier handoff): key the prefix cache
                                                            as that handoff did (src/serving/provenance.py)

Any combination may appear. `parse` never raises: a malformed request gets the reason, and the connector serves it
as an ordinary prefill (nothing mapped, nothing re-keyed).
"""

from __future__ import annotations

from dataclasses import dataclass

KEY = "kvrelay"


@dataclass(frozen=True)
class Handoff:
    export_id: str
    mapper_id: str


@dataclass(frozen=True)
class Mapped:
    start: int
    end: int
    mapper_id: str


@dataclass(frozen=True)
class RelayParams:
    export: bool = False
    handoff: Handoff | None = None
    mapped: Mapped | None = None


def request_params(export: bool = False, handoff: Handoff | None = None, mapped: Mapped | None = None) -> dict:
    """The `kv_transfer_params` of a request (module docstring)."""
    spec: dict = {"export": True} if export else {}
    if handoff is not None:
        spec["handoff"] = {"export": handoff.export_id, "mapper": handoff.mapper_id}
    if mapped is not None:
        spec["mapped"] = {"start": mapped.start, "end": mapped.end, "mapper": mapped.mapper_id}
    return {KEY: spec}


def prompt(ids: list[int], salt: str | None = None) -> dict:
    """vLLM's prompt of token ids; with `salt`, its `cache_salt` (the conversation's provenance salt:
    src/serving/provenance.py)."""
    return {"prompt_token_ids": ids} | ({} if salt is None else {"cache_salt": salt})


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse(params: object) -> RelayParams | str:
    """The request's kvrelay parameters (empty RelayParams when there are none), or why they are malformed."""
    if params is None or (isinstance(params, dict) and KEY not in params):
        return RelayParams()
    if not isinstance(params, dict):
        return f"kv_transfer_params must be a dict, not {type(params).__name__}"
    spec = params[KEY]
    if not isinstance(spec, dict) or set(spec) - {"export", "handoff", "mapped"}:
        return f"kv_transfer_params[{KEY!r}] must be a dict of export / handoff / mapped, not {spec!r}"
    export = spec.get("export", False)
    if not isinstance(export, bool):
        return f"{KEY}.export must be true or false, not {export!r}"
    handoff = mapped = None
    if "handoff" in spec:
        h = spec["handoff"]
        if not isinstance(h, dict) or set(h) != {"export", "mapper"} or not all(isinstance(v, str) for v in h.values()):
            return f"{KEY}.handoff must be {{'export': str, 'mapper': str}}, not {h!r}"
        handoff = Handoff(h["export"], h["mapper"])
    if "mapped" in spec:
        m = spec["mapped"]
        if (
            not isinstance(m, dict)
            or set(m) != {"start", "end", "mapper"}
            or not (_count(m["start"]) and _count(m["end"]) and m["start"] < m["end"])
            or not isinstance(m["mapper"], str)
        ):
            return f"{KEY}.mapped must be {{'start': int, 'end': int > start, 'mapper': str}}, not {m!r}"
        mapped = Mapped(m["start"], m["end"], m["mapper"])
    return RelayParams(export, handoff, mapped)
