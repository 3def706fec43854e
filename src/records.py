"""Committed run records read as data, without MLflow: a record folder (record.json + artifacts/, the JSON tracking
backend's layout, src/tracking.py; named by `record_dir`) and its routed items. Every record reader goes through
`read_record` / `read_items`: a truncated file, or one without a key the reader needs, is a RecordError that names
the file and the key, never a bare JSON or key error. Committed records keep their items packed (`items.json.gz`, the
same JSON gzipped: `pack`): `items_path` finds a run's items either way and `read_json` reads both. Records made
before a config key moved name it the old way; `read_record` (and the MLflow rows of src/report/rows.py) hand params
over under today's names (`current_params`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import zlib
from pathlib import Path


class RecordError(ValueError):
    """A JSON record (record.json) or its items artifact that is truncated, not JSON, or lacks a key a reader needs;
    the message names the file and the key."""


RECORD_KEYS = ("name", "params", "tags", "metrics")  # what every record reader needs (`experiment` too, to import)
METRIC_KEYS = ("key", "value", "step")
ITEMS = "artifacts/routed/items.json"  # a routed run's per-item scores, beside its record.json
PACKED = ".gz"  # a JSON artifact stored gzipped (committed records): read, and imported, as the plain file


def require(mapping: dict, key: str, where: str | Path) -> object:
    """mapping[key], or a RecordError naming `where` and the missing key."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise RecordError(f"{where}: no {key!r} (the record lacks what this reader needs)")
    return mapping[key]


def unpacked(path: Path, name: str | Path | None = None) -> bytes:
    """The bytes of the file at `path`, gunzipped when it is packed (`PACKED`); a RecordError naming it (`name`) when
    it is missing or a damaged gzip."""
    name = path if name is None else name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RecordError(f"{name}: no such file") from None
    if not path.name.endswith(PACKED):
        return data
    try:
        return gzip.decompress(data)
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:  # a cut stream is an EOFError
        raise RecordError(f"{name}: not a valid gzip file, truncated or damaged ({error})") from None


def read_json(path: Path, name: str | Path | None = None) -> object:
    """The JSON document at `path` (gunzipped where packed), or a RecordError naming it (`name`: what to call it, e.g.
    the artifact URI it was downloaded from) when it is missing, truncated or not JSON."""
    name = path if name is None else name
    try:
        return json.loads(unpacked(path, name))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RecordError(f"{name}: not valid JSON, truncated or damaged ({error})") from None


def stored(path: Path) -> Path:
    """The file a record keeps for the JSON artifact `path`: `path`, or its packed copy (`path` + PACKED) where only
    that exists; `path` itself where neither does. Both present is a RecordError naming both (they could disagree)."""
    packed = path.with_name(path.name + PACKED)
    if path.is_file() and packed.is_file():
        raise RecordError(f"{path} and {packed}: both present, which may disagree (keep one: `pack` packs the first)")
    return packed if packed.is_file() else path


def record_digest(params: dict[str, str]) -> str:
    """The 8 hex digits that name a JSON record's folder: its params' digest (a rerun of one config replaces it)."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]


def record_dir(root: Path, name: str, digest: str) -> Path:
    """A JSON record's folder under root: its run name (filesystem-safe) and its params' digest."""
    return root / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{digest}"


def items_path(run: str | Path) -> Path:
    """The items artifact of the routed run whose record folder is `run`: artifacts/routed/items.json, or
    items.json.gz where packed (`stored`); check `.is_file()` where a run may have kept none."""
    return stored(Path(run) / ITEMS)


# Params renamed since records were first made: old key (a trailing "." renames every key under it) → today's.
# Before 2026-12-05 the policy lived in conf/eval (`eval.levers`) and conf/workload; now in conf/policy/default.yaml.
RENAMED_PARAMS = {
    "eval.levers.": "policy.levers.",
    "workload.policy": "policy.mode",
    "workload.max_length_factor": "policy.max_length_factor",
    "workload.guard_max_abs": "policy.guard_max_abs",
}


def current_params(params: dict[str, str]) -> dict[str, str]:
    """A run's params (flattened config keys) under today's names (`RENAMED_PARAMS`), in their order; a record made
    after a rename passes unchanged."""

    def current(key: str) -> str:
        for old, new in RENAMED_PARAMS.items():
            if key == old or (old.endswith(".") and key.startswith(old)):
                return new + key[len(old) :]
        return key

    return {current(key): value for key, value in params.items()}


def read_record(path: str | Path) -> dict:
    """A record.json, checked: a JSON object with name, params, tags and metrics, every metric a key, value and
    step; its params under today's names (`current_params`). Anything else is a RecordError naming the file and what
    is missing."""
    path = Path(path)
    record = read_json(path)
    if not isinstance(record, dict):
        raise RecordError(f"{path}: holds a JSON {type(record).__name__}, not a record object")
    for key in RECORD_KEYS:
        require(record, key, path)
    if not isinstance(record["params"], dict):
        raise RecordError(f"{path}: 'params' is a {type(record['params']).__name__}, not a mapping of config keys")
    for n, metric in enumerate(record["metrics"]):
        for key in METRIC_KEYS:
            require(metric, key, f"{path} metrics[{n}]")
    return record | {"params": current_params(record["params"])}


def metric_values(record: dict, path: str | Path) -> dict[str, float]:
    """The record's unstepped metrics, key → value (a read_record record; `path` names it in errors)."""
    return {m["key"]: m["value"] for m in require(record, "metrics", path) if m["step"] is None}


def items_of(document: object, where: str | Path) -> list[dict]:
    """The per-item rows of a routed run's items artifact ({"items": [...]}), or a RecordError naming it."""
    items = require(document, "items", where)
    if not isinstance(items, list):
        raise RecordError(f"{where}: 'items' is a {type(items).__name__}, not a list of rows")
    return items


def rows_with(rows: object, keys: tuple[str, ...], where: str | Path) -> list[dict]:
    """`rows` (a list of a record's rows: items, handoff records), each checked to be an object holding every key a
    reader needs; else a RecordError naming `where`, the row and the key — never a bare KeyError later."""
    if not isinstance(rows, list):
        raise RecordError(f"{where}: a {type(rows).__name__}, not a list of rows")
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RecordError(f"{where}[{n}]: a {type(row).__name__}, not a row object")
        if missing := [key for key in keys if key not in row]:
            raise RecordError(
                f"{where}[{n}]: no {', '.join(map(repr, missing))} (the row lacks what this reader needs)"
            )
    return rows


def read_items(run: str | Path) -> list[dict]:
    """The per-item rows of the routed run whose record folder is `run` (its items artifact: `items_path`)."""
    path = items_path(run)
    return items_of(read_json(path), path)


def pack(directories: list[str | Path]) -> list[Path]:
    """Store every routed run's items under `directories` packed: each artifacts/routed/items.json replaced by
    items.json.gz (gzip, mtime 0: the same JSON gives the same bytes), checked to gunzip to the identical bytes, written
    whole (a temporary file, synced, renamed) before the plain file goes; where both were present, the plain one is
    packed over the old copy. Packed items are left as they are, so packing twice changes nothing. Returns the files
    written; a folder that is not one is a ValueError before anything is packed."""
    if missing := [str(directory) for directory in directories if not Path(directory).is_dir()]:
        raise ValueError(f"{', '.join(missing)}: no such folder")
    written = []
    for path in sorted({p for directory in directories for p in Path(directory).glob(f"**/{ITEMS}")}):
        data = path.read_bytes()
        blob = gzip.compress(data, compresslevel=9, mtime=0)
        if gzip.decompress(blob) != data:
            raise RecordError(f"{path}: its gzip does not give back the same bytes; left unpacked")
        target = path.with_name(path.name + PACKED)
        staging = target.with_name(f".{target.name}.tmp")
        try:
            with open(staging, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            os.replace(staging, target)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        path.unlink()
        written.append(target)
    return written
