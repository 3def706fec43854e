"""The mapper artifact: safetensors coefficients + a JSON manifest that says exactly what they are.

Loading verifies the schema, the tensor file's sha256, every tensor's shape against the manifest, and
(when models are given) the source/target fingerprints and the tokenizer hash. Anything that differs
is refused with a message that names it.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
import transformers
from safetensors.torch import load_file, save_file

SCHEMA_VERSION = 1
TENSOR_FILE, MANIFEST_FILE = "mapper.safetensors", "manifest.json"
COEFFICIENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ArtifactError(ValueError):
    """A mapper artifact that is corrupt, incomplete, or belongs to another model pair."""


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
        return {name: getattr(self, name) for name in ("source_layers", "head_index", *_COEFFICIENTS)}

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


_COEFFICIENTS = ("weight_k", "bias_k", "weight_v", "bias_v")


def library_versions() -> dict:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_mapper(mapper: Mapper, directory: str | Path, coefficient_dtype: str = "float32") -> Path:
    """Write mapper.safetensors (coefficients in `coefficient_dtype`) and manifest.json; returns the dir."""
    if coefficient_dtype not in COEFFICIENT_DTYPES:
        raise ValueError(f"coefficient_dtype must be one of {sorted(COEFFICIENT_DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().cpu().contiguous().to(COEFFICIENT_DTYPES[coefficient_dtype])
        if name in _COEFFICIENTS
        else t.detach().cpu().contiguous().to(torch.int64)
        for name, t in mapper.tensors().items()
    }
    save_file(tensors, directory / TENSOR_FILE)
    manifest = dict(
        mapper.manifest,
        schema_version=SCHEMA_VERSION,
        coefficient_dtype=coefficient_dtype,
        shapes={name: list(t.shape) for name, t in tensors.items()},
        tensor_sha256=_sha256(directory / TENSOR_FILE),
        tensor_bytes=(directory / TENSOR_FILE).stat().st_size,
        libraries=library_versions(),
    )
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    mapper.manifest = manifest
    return directory


def load_mapper(
    directory: str | Path,
    source_fingerprint: str | None = None,
    target_fingerprint: str | None = None,
    tokenizer_hash: str | None = None,
) -> Mapper:
    """Read and verify an artifact; pass the fingerprints of the models it will serve to check the pair."""
    directory = Path(directory)
    manifest_path, tensor_path = directory / MANIFEST_FILE, directory / TENSOR_FILE
    for path in (manifest_path, tensor_path):
        if not path.is_file():
            raise ArtifactError(f"mapper artifact incomplete: {path} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({error})") from error
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{manifest_path} holds a JSON {type(manifest).__name__}, not a manifest object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"schema_version {manifest.get('schema_version')} ≠ supported {SCHEMA_VERSION}")
    actual = _sha256(tensor_path)
    if actual != manifest.get("tensor_sha256"):
        raise ArtifactError(
            f"{tensor_path} is corrupt or was replaced: sha256 {actual[:12]} ≠ manifest {str(manifest.get('tensor_sha256'))[:12]}"
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
    expected_names = {"source_layers", "head_index", *_COEFFICIENTS}
    if not isinstance(shapes, dict) or set(shapes) != expected_names:
        listed = set(shapes or {})
        raise ArtifactError(
            f"manifest shapes do not list exactly the mapper tensors: missing {sorted(expected_names - listed)}, "
            f"unexpected {sorted(listed - expected_names)}"
        )
    tensors = load_file(tensor_path)
    for name, shape in shapes.items():
        if name not in tensors or list(tensors[name].shape) != shape:
            raise ArtifactError(f"tensor {name!r} missing or of the wrong shape (manifest says {shape})")
    return Mapper(**{name: tensors[name] for name in shapes}, manifest=manifest)
