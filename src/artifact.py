"""The mapper artifact: safetensors coefficients + a JSON manifest that says exactly what they are.

A save publishes the manifest and tensor bytes as one complete version of the artifact's directory, atomically
(src/artifact_store.py: versions, the pointer, the lock). Loading reads one save's bytes once each, its manifest
verified against the version id (their sha256: a manifest edited in place is refused), verifies the tensor bytes
against the manifest's sha256, and deserializes those same bytes; then the schema, the source/target fingerprints,
the tokenizer hash and every tensor's name, dtype and shape. Anything that differs is refused with a message that
names it. A directory of the older flat layout (the two files only) still loads.

The manifest may carry measured length evidence (`length_evidence`; `python -m src.length_evidence` publishes the same
tensor bytes under the amended manifest: a new version), so the version id verifies it with the rest — one integrity
check, no side file to keep in step. The version id proves the manifest was not edited, not that its evidence was
measured on these coefficients: the evidence names the coefficients it was measured on (their `tensor_sha256`), a
save whose tensor bytes differ (another coefficient dtype, a refit) drops it with a warning, and a load refuses
evidence bound to other coefficients. A load also checks that its `max_verified_length` is what its measurements show
and refuses evidence in a manifest no version id verifies (the flat layout): never silently used.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import transformers

from src.artifact_store import TENSOR_FILE, StoreError, publish, read, version_verifies

SCHEMA_VERSION = 1
COEFFICIENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EVIDENCE = "length_evidence"  # the manifest key of the measured length evidence (module docstring)
EVIDENCE_KEYS = ("margin_points", "min_items", "measurements", "max_verified_length", "verified_by", "tensor_sha256")
MEASUREMENT_KEYS = ("bin", "length", "items", "loss_points_high", "split", "run_id", "record")


class ArtifactError(ValueError):
    """A mapper artifact that is corrupt, incomplete, or belongs to another model pair."""


class EvidenceDroppedWarning(UserWarning):
    """A save dropped the manifest's length evidence: it was measured on other coefficients (module docstring)."""


@dataclass
class Mapper:
    """Affine maps for every target layer ℓ and head h: ẑ = x_ℓh · W + b, per component K/V."""

    source_layers: torch.Tensor  # [L_t, k]  S_ℓ
    head_index: torch.Tensor  # [H_t, f]  source heads admitted per target head
    weight_k: torch.Tensor  # [L_t, H_t, p, d_t]  p = k·f·d_s (+ 2·H_t·d_t with token features)
    bias_k: torch.Tensor  # [L_t, H_t, d_t]
    weight_v: torch.Tensor  # [L_t, H_t, p, d_t]
    bias_v: torch.Tensor  # [L_t, H_t, d_t]
    manifest: dict

    @property
    def token_features(self) -> bool:
        """True when every design also reads the target's token features (src/support.py)."""
        return bool(self.manifest.get("token_features", False))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("source_layers", "head_index", *COEFFICIENTS)}

    def to(self, device: str | torch.device, dtype: torch.dtype) -> Mapper:
        cast = lambda t: t.to(device=device, dtype=dtype)
        return Mapper(
            source_layers=self.source_layers.to(device),
            head_index=self.head_index.to(device),
            weight_k=cast(self.weight_k),
            bias_k=cast(self.bias_k),
            weight_v=cast(self.weight_v),
            bias_v=cast(self.bias_v),
            manifest=self.manifest,
        )


INDICES = ("source_layers", "head_index")
COEFFICIENTS = ("weight_k", "bias_k", "weight_v", "bias_v")


def library_versions() -> dict:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }


def save_mapper(mapper: Mapper, directory: str | Path, coefficient_dtype: str = "float32") -> Path:
    """Save the mapper (coefficients in `coefficient_dtype`) as the artifact at `directory`; returns the dir."""
    if coefficient_dtype not in COEFFICIENT_DTYPES:
        raise ValueError(f"coefficient_dtype must be one of {sorted(COEFFICIENT_DTYPES)}")
    dtype = lambda name: COEFFICIENT_DTYPES[coefficient_dtype] if name in COEFFICIENTS else torch.int64
    tensors = {name: t.detach().cpu().contiguous().to(dtype(name)) for name, t in mapper.tensors().items()}
    data = safetensors.torch.save(tensors)
    digest = hashlib.sha256(data).hexdigest()
    kept, block = dict(mapper.manifest), mapper.manifest.get(EVIDENCE)
    measured_on = block.get("tensor_sha256") if isinstance(block, dict) else None
    if block is not None and measured_on != digest:  # the evidence was measured on other coefficients
        warnings.warn(f"{directory}: the length evidence was measured on other coefficients than these "
                      f"({coefficient_dtype}, sha256 {digest[:12]}): dropped — measure again with "
                      "python -m src.length_evidence", EvidenceDroppedWarning, stacklevel=2)  # fmt: skip
        del kept[EVIDENCE]
    manifest = dict(
        kept,
        schema_version=SCHEMA_VERSION,
        coefficient_dtype=coefficient_dtype,
        shapes={name: list(t.shape) for name, t in tensors.items()},
        tensor_sha256=digest,
        tensor_bytes=len(data),
        libraries=library_versions(),
    )
    publish(directory, _manifest_bytes(manifest), data)
    mapper.manifest = manifest
    return Path(directory)


def amend_manifest(directory: str | Path, changes: dict) -> Mapper:
    """Publish the artifact at `directory` again with `changes` merged into its manifest and the very tensor bytes it
    holds, verified on the way in: a new version whose id is the sha256 of the new manifest, atomically (module
    docstring). Returns the mapper loaded back from it."""
    mapper, tensors = _load(Path(directory))
    manifest = mapper.manifest | changes
    length_evidence(manifest)  # evidence that does not hold is refused before anything is written
    publish(directory, _manifest_bytes(manifest), tensors)
    return load_mapper(directory)


def _manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()


def load_mapper(
    directory: str | Path,
    source_fingerprint: str | None = None,
    target_fingerprint: str | None = None,
    tokenizer_hash: str | None = None,
) -> Mapper:
    """Read and verify an artifact; pass the fingerprints of the models it will serve to check the pair."""
    return _load(Path(directory), source_fingerprint, target_fingerprint, tokenizer_hash)[0]


def _load(
    directory: Path,
    source_fingerprint: str | None = None,
    target_fingerprint: str | None = None,
    tokenizer_hash: str | None = None,
) -> tuple[Mapper, bytes]:
    """`load_mapper`, and the tensor bytes it verified."""
    try:
        manifest_path, manifest_bytes, tensor_bytes = read(directory)
    except StoreError as error:  # missing, or changed after it was saved
        raise ArtifactError(str(error)) from None
    tensor_path = manifest_path.parent / TENSOR_FILE
    try:
        manifest = json.loads(manifest_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({error})") from error
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{manifest_path} holds a JSON {type(manifest).__name__}, not a manifest object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"schema_version {manifest.get('schema_version')} ≠ supported {SCHEMA_VERSION}")
    if EVIDENCE in manifest:
        if not version_verifies(directory, manifest_path, manifest_bytes):
            raise ArtifactError(
                f"{manifest_path} carries length evidence but no version id verifies its bytes (the flat layout, or "
                f"a copy without versions/): re-add the evidence with python -m src.length_evidence"
            )
        length_evidence(manifest)
    actual = hashlib.sha256(tensor_bytes).hexdigest()
    if actual != manifest.get("tensor_sha256"):
        raise ArtifactError(
            f"{tensor_path} is corrupt or was replaced: sha256 {actual[:12]} ≠ manifest "
            f"{str(manifest.get('tensor_sha256'))[:12]}"
        )
    expected = {
        "source fingerprint": (manifest.get("source_fingerprint"), source_fingerprint),
        "target fingerprint": (manifest.get("target_fingerprint"), target_fingerprint),
        "tokenizer hash": (manifest.get("tokenizer_hash"), tokenizer_hash),
    }
    for what, (recorded, given) in expected.items():
        if given is not None and recorded != given:
            raise ArtifactError(
                f"mapper was fitted for another model pair: {what} {str(recorded)[:12]} ≠ this pair's {given[:12]}"
            )
    shapes = manifest.get("shapes")
    expected_names = {*INDICES, *COEFFICIENTS}
    if not isinstance(shapes, dict) or set(shapes) != expected_names:
        listed = set(shapes) if isinstance(shapes, dict) else set()
        raise ArtifactError(
            f"manifest shapes do not list exactly the mapper tensors: missing {sorted(expected_names - listed)}, "
            f"unexpected {sorted(listed - expected_names)}"
        )
    coefficient_dtype = COEFFICIENT_DTYPES.get(manifest.get("coefficient_dtype"))
    if coefficient_dtype is None:
        raise ArtifactError(
            f"coefficient_dtype {manifest.get('coefficient_dtype')!r} is not one of {sorted(COEFFICIENT_DTYPES)}"
        )
    try:
        tensors = safetensors.torch.load(tensor_bytes)  # the very bytes that were hashed
    except Exception as error:  # safetensors raises its own error types for malformed headers
        raise ArtifactError(f"{tensor_path} is not a readable safetensors file ({error})") from error
    for name, shape in shapes.items():
        if name not in tensors or list(tensors[name].shape) != shape:
            raise ArtifactError(f"tensor {name!r} missing or of the wrong shape (manifest says {shape})")
        dtype = coefficient_dtype if name in COEFFICIENTS else torch.int64
        if tensors[name].dtype != dtype:
            raise ArtifactError(f"tensor {name!r} is {tensors[name].dtype}, the manifest implies {dtype}")
    return Mapper(**{name: tensors[name] for name in shapes}, manifest=manifest), tensor_bytes


# --------------------------------------------------------------------------- length evidence


def verified_length(measurements: list[dict], margin: float, min_items: int) -> tuple[int, dict | None]:
    """The longest history length the measurements verify, and the measurement that showed it (None: none verified).

    A non-inferiority reading, per measurement (one routed run on validation items × one history-length bin
    (low, high], high None past the last edge): it passes when it scored ≥ `min_items` mapped items and the upper
    bound of the paired 95 % CI of the loss (native receiver − routed, points) is ≤ `margin`. A point estimate under
    the margin is not enough, nor a CI from a handful of items. Bins are read from the shortest measured one upwards;
    a bin is verified when every measurement in it passes; the reading stops at the first bin that is not, or at a
    gap (no measurement between two measured bins). The verified length is the longest history measured in the last
    verified bin — never a bin's edge that no item reached — and 0 when the shortest measured bin is not verified."""
    upper = lambda row: math.inf if row["bin"][1] is None else row["bin"][1]
    length, shown, reach = 0, None, None
    for high in sorted({upper(row) for row in measurements}):
        rows = [row for row in measurements if upper(row) == high]
        low = rows[0]["bin"][0]
        passed = all(passes(row, margin, min_items) for row in rows)
        if (reach is not None and low != reach) or not passed:
            break
        shown = max(rows, key=lambda row: row["length"])
        length, reach = shown["length"], high
    return length, shown


def passes(measurement: dict, margin: float, min_items: int) -> bool:
    """One measurement's non-inferiority reading (`verified_length`): enough mapped items, the CI's upper bound ≤ margin."""
    high = measurement["loss_points_high"]
    return measurement["items"] >= min_items and high is not None and high <= margin


def length_evidence(manifest: dict) -> tuple[int, str | None] | None:
    """(max_verified_length, the run that showed it) of the manifest's length evidence, None when it has none.
    Evidence that is malformed, reads test items, or whose max_verified_length is not what its measurements show
    (`verified_length`) is an ArtifactError naming the problem: never silently used."""
    evidence = manifest.get(EVIDENCE)
    if evidence is None:
        return None
    rows = evidence.get("measurements") if isinstance(evidence, dict) else None
    if not isinstance(rows, list) or any(not isinstance(row, dict) for row in rows):
        raise ArtifactError("length evidence is malformed: no list of measurement objects")
    for n, row in enumerate([evidence, *rows]):
        where = f"measurement {n - 1}" if n else "block"
        if missing := [key for key in (MEASUREMENT_KEYS if n else EVIDENCE_KEYS) if key not in row]:
            raise ArtifactError(f"length evidence {where} lacks {missing}")
        if n and row["split"] != "valid":
            raise ArtifactError(f"length evidence {where} ({row['run_id']}) read {row['split']!r} items: a length "
                                "threshold is chosen on validation items only")  # fmt: skip
    if evidence["tensor_sha256"] != manifest.get("tensor_sha256"):
        raise ArtifactError(
            f"length evidence was measured on other coefficients: sha256 {str(evidence['tensor_sha256'])[:12]} ≠ "
            f"this mapper's {str(manifest.get('tensor_sha256'))[:12]} — measure again with python -m src.length_evidence"
        )
    try:
        length, shown = verified_length(rows, evidence["margin_points"], evidence["min_items"])
    except TypeError as error:  # a count or a bound that is not a number
        raise ArtifactError(f"length evidence is malformed: {error}") from None
    by = None if shown is None else f"{shown['run_id']} ({shown['record']})"
    if (evidence["max_verified_length"], evidence["verified_by"]) != (length, by):
        raise ArtifactError(
            f"length evidence does not hold: it says max_verified_length {evidence['max_verified_length']} "
            f"(verified by {evidence['verified_by']}), its measurements show {length} (verified by {by})"
        )
    return length, by
