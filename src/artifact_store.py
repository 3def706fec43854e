"""The mapper artifact's directory: each save a complete, immutable version; a pointer to the current one, swapped
atomically; a reader that always gets one whole save (src/artifact.py decides what the bytes are and verifies them).

On disk, one directory per artifact:

    versions/<id>/mapper.json, versions/<id>/mapper.safetensors   one complete save each: manifest and tensors
                                                                  (<id>: sha256 of the manifest bytes, which hold
                                                                  the tensors' sha256)
    current -> versions/<id>                                      the pointer, replaced atomically by each save
    manifest.json -> current/mapper.json,                         stable names (`artifact_exists`)
    mapper.safetensors -> current/mapper.safetensors
    .lock                                                         writers publish under an exclusive flock

A save (`publish`) writes and fsyncs a private staging directory, then — under the lock — renames it to its version,
swaps the pointer and removes the other versions: the last writer wins, two writers never mix, and a save killed at
any point leaves the previous artifact loadable. A read (`read`) resolves the pointer once, reads each file's bytes
once and verifies the manifest bytes against the version id (their sha256: a manifest edited in place is refused). A
directory of the older flat layout (the two files only) still reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

TENSOR_FILE, MANIFEST_FILE = "mapper.safetensors", "manifest.json"
VERSION_MANIFEST = "mapper.json"  # a version's manifest: named apart, so a scan for manifest.json finds each one once
POINTER, VERSIONS, LOCK = "current", "versions", ".lock"
STAGING = ".staging-"  # + host-pid-random: a save in progress (or killed: swept by the next save)
LOAD_ATTEMPTS = 20  # a load retries while concurrent saves replace the version it was reading


class StoreError(ValueError):
    """The directory holds no complete save to read, or its manifest changed after it was saved (src/artifact.py
    refuses it as an ArtifactError with this message)."""


def artifact_exists(directory: str | Path) -> bool:
    """True when `directory` holds a saved mapper (either layout); `load_mapper` still verifies it."""
    return (Path(directory) / MANIFEST_FILE).is_file()


def publish(directory: str | Path, manifest: bytes, tensors: bytes) -> Path:
    """Make these manifest and tensor bytes the artifact at `directory`, atomically (module docstring);
    returns the version directory."""
    directory = Path(directory)
    versions = directory / VERSIONS
    versions.mkdir(parents=True, exist_ok=True)
    version = versions / hashlib.sha256(manifest).hexdigest()
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(), dir=versions))
    try:
        for name, data in ((TENSOR_FILE, tensors), (VERSION_MANIFEST, manifest)):
            with (staging / name).open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        _fsync_directory(staging)
        with _locked(directory):
            if version.exists() and not _holds(version, manifest, tensors):
                shutil.rmtree(version)  # a damaged copy of this very content: replace it
            if not version.exists():
                os.rename(staging, version)
                _fsync_directory(versions)
            _link(directory / POINTER, f"{VERSIONS}/{version.name}")
            for name, target in ((MANIFEST_FILE, VERSION_MANIFEST), (TENSOR_FILE, TENSOR_FILE)):
                _link(directory / name, f"{POINTER}/{target}")
            _fsync_directory(directory)
            _sweep(versions, keep=version.name)
            _sweep(directory, keep=None)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # still there when this content was already saved
    return version


def read(directory: Path) -> tuple[Path, bytes, bytes]:
    """(manifest path, manifest bytes, tensor bytes) of one complete save, the manifest verified against its version
    id; a StoreError names the file that is missing or the version whose manifest changed."""
    manifest_path, manifest, tensors = _read(directory)
    _verify_version(manifest_path, manifest)
    return manifest_path, manifest, tensors


def version_verifies(directory: Path, manifest_path: Path, manifest: bytes) -> bool:
    """True when a version id verifies these manifest bytes: the version they were read from, or one of `directory`'s
    versions, is named by their sha256 (never in the flat layout, nor in a copy without versions/)."""
    digest = hashlib.sha256(manifest).hexdigest()
    return manifest_path.parent.name == digest or (directory / VERSIONS / digest).is_dir()


def _manifest_path(directory: Path) -> Path:
    """The manifest of one complete save: where `manifest.json` leads now (through the pointer into a version; in
    the flat layout, or a copy that followed the links, the file itself). The tensors lie beside it."""
    return Path(os.path.realpath(directory / MANIFEST_FILE))


def _read(directory: Path) -> tuple[Path, bytes, bytes]:
    """(manifest path, manifest bytes, tensor bytes), each file read once, both from one save."""
    for _ in range(LOAD_ATTEMPTS):
        manifest = _manifest_path(directory)
        try:
            return manifest, manifest.read_bytes(), (manifest.parent / TENSOR_FILE).read_bytes()
        except FileNotFoundError as missing:
            if _manifest_path(directory) == manifest:  # no save replaced it meanwhile: it is really missing
                raise StoreError(f"mapper artifact incomplete: {missing.filename} is missing") from None
    raise StoreError(f"{directory} was replaced {LOAD_ATTEMPTS} times while loading it (concurrent saves)")


def _verify_version(manifest_path: Path, manifest_bytes: bytes) -> None:
    """A version directory's name is the sha256 of its manifest's bytes: a manifest edited after the save (its
    calibration length, a fingerprint) is refused, naming the directory and both digests. A manifest outside a
    version directory (the flat layout, a copy that followed the links) has no id to check."""
    version = manifest_path.parent
    if version.parent.name != VERSIONS:
        return
    actual = hashlib.sha256(manifest_bytes).hexdigest()
    if actual != version.name:
        raise StoreError(
            f"{version}: the manifest was changed after it was saved: its sha256 {actual} ≠ the version id {version.name}"
        )


def _holds(version: Path, manifest: bytes, tensors: bytes) -> bool:
    """True when `version` already holds exactly these bytes."""
    try:
        return (version / VERSION_MANIFEST).read_bytes() == manifest and (version / TENSOR_FILE).read_bytes() == tensors
    except OSError:
        return False


def _staging_prefix() -> str:
    return f"{STAGING}{socket.gethostname()}-{os.getpid()}-"


def _abandoned(name: str) -> bool:
    """A staging entry whose writer (on this host) is gone."""
    parts = name[len(STAGING) :].rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _sweep(folder: Path, keep: str | None) -> None:
    """Remove abandoned staging entries of `folder`, and, when `keep` is given, every version but `keep`."""
    for entry in folder.iterdir():
        staging = entry.name.startswith(STAGING)
        if (staging and _abandoned(entry.name)) or (keep is not None and not staging and entry.name != keep):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _link(path: Path, target: str) -> None:
    """Point the symlink `path` at `target`, atomically (a new link renamed over the old one)."""
    if path.is_symlink() and os.readlink(path) == target:
        return
    if path.is_dir() and not path.is_symlink():  # a copy that followed the links: the pointer became a directory
        shutil.rmtree(path)
    temporary = path.with_name(f"{_staging_prefix()}{os.urandom(6).hex()}")
    os.symlink(target, temporary)
    os.replace(temporary, path)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on `directory/.lock` (released by the kernel if the holder dies)."""
    with (directory / LOCK).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
