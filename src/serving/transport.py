"""Where a sender's exported K/V wait for a receiver: a directory of files, one per export and sender rank.

The directory is the transport: `/dev/shm/kvrelay` by default — tmpfs, host memory every process of the host
shares, so two engines (two `vllm serve` processes, or two `LLM` objects) hand K/V over without a network hop;
any other directory works (a disk, a mount two hosts share). A file is written under a staging name, flushed
and fsynced, then renamed into place: a reader sees a complete export or none — nothing half-written ever loads.

    <export>.rank<r>-of-<n>.safetensors
        keys, values   [L_s, H_r, T, d_s]  the sender's cache dtype; H_r: the heads sender rank r holds
        metadata       ids (JSON token ids), source_fingerprint, tokenizer_hash, heads ("first,count,of"),
                       mapped ("start,end" of a span that holds mapped K/V — never mapped again — or "")

An export id is 1–64 characters of [A-Za-z0-9_-] (it names a file). A sender removes its own oldest exports
(`remove`; the connector keeps `keep_exports` of them).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

DEFAULT_DIRECTORY = "/dev/shm/kvrelay"
EXPORT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
SUFFIX = ".safetensors"
SHARED = ("ids", "source_fingerprint", "tokenizer_hash", "mapped")  # metadata every rank's file repeats


class ExportError(ValueError):
    """An export that does not exist, is malformed, or cannot serve the request; the message names why."""


@dataclass(frozen=True)
class Header:
    """What an export holds, read from its files' metadata (no tensor bytes)."""

    export_id: str
    ids: tuple[int, ...]  # the token ids whose K/V it holds, positions 0..T−1
    source_fingerprint: str  # src.models.fingerprint of the sender's model
    tokenizer_hash: str  # the sender's tokenizer (src.models.tokenizer_hash)
    layers: int
    heads: int  # the sender's KV heads, all ranks together
    head_dim: int
    ranks: int
    mapped: tuple[int, int] | None  # positions whose K/V were mapped into the sender: never mapped again


def check_id(export_id: object) -> str:
    """The export id, or an ExportError naming what is wrong with it."""
    if not isinstance(export_id, str) or not EXPORT_ID.fullmatch(export_id):
        raise ExportError(f"export id {export_id!r} is not 1–64 characters of [A-Za-z0-9_-]")
    return export_id


class Transport:
    """Exports in `directory` (module docstring)."""

    def __init__(self, directory: str | Path = DEFAULT_DIRECTORY):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, export_id: str, rank: int, ranks: int) -> Path:
        return self.directory / f"{check_id(export_id)}.rank{rank}-of-{ranks}{SUFFIX}"

    def put(
        self,
        export_id: str,
        keys: torch.Tensor,
        values: torch.Tensor,
        ids: list[int],
        source_fingerprint: str,
        tokenizer_hash: str,
        heads: tuple[int, int, int],
        mapped: tuple[int, int] | None = None,
        rank: int = 0,
        ranks: int = 1,
    ) -> Path:
        """Publish one sender rank's part: keys / values [L_s, H_r, T, d_s] of token ids [T], heads (first, count,
        of all), atomically (module docstring). Returns the file."""
        if keys.shape != values.shape or keys.dim() != 4 or keys.shape[2] != len(ids) or keys.shape[1] != heads[1]:
            raise ExportError(f"export {export_id}: keys {tuple(keys.shape)} / values {tuple(values.shape)} do not "
                              f"hold {heads[1]} heads of {len(ids)} tokens")  # fmt: skip
        metadata = {
            "ids": json.dumps([int(i) for i in ids]),
            "source_fingerprint": source_fingerprint,
            "tokenizer_hash": tokenizer_hash,
            "heads": ",".join(str(n) for n in heads),
            "mapped": "" if mapped is None else f"{mapped[0]},{mapped[1]}",
        }
        data = safetensors.torch.save({"keys": keys.contiguous(), "values": values.contiguous()}, metadata)
        path = self._path(export_id, rank, ranks)
        handle, staging = tempfile.mkstemp(prefix=".staging-", dir=self.directory)
        try:
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
        return path

    def _parts(self, export_id: str) -> list[Path]:
        """The export's files, rank order; an ExportError unless every rank's file is there."""
        found = sorted(self.directory.glob(f"{check_id(export_id)}.rank*-of-*{SUFFIX}"))
        if not found:
            raise ExportError(f"no export {export_id!r} in {self.directory} (never written, or pruned)")
        ranks = {int(p.name.rsplit("-of-", 1)[1].removesuffix(SUFFIX)) for p in found}
        expected = [self._path(export_id, r, n) for n in ranks for r in range(n)]
        if len(ranks) != 1 or sorted(expected) != found:
            raise ExportError(f"export {export_id!r} is incomplete: {[p.name for p in found]}")
        return expected

    def header(self, export_id: str) -> Header:
        """The export's header (rank 0's metadata, checked against every rank's); an ExportError if it is missing,
        incomplete or malformed."""
        parts = self._parts(export_id)
        infos = []
        for path in parts:
            try:
                with safetensors.safe_open(path, "pt") as handle:
                    infos.append((handle.metadata() or {}, handle.get_slice("keys").get_shape()))
            except (OSError, safetensors.SafetensorError) as error:
                raise ExportError(f"export {export_id!r}: {path.name} is unreadable ({error})") from None
        try:
            metadata, (layers, _, tokens, head_dim) = infos[0]
            ids = tuple(json.loads(metadata["ids"]))
            mapped = tuple(int(n) for n in metadata["mapped"].split(",")) if metadata["mapped"] else None
            total = int(metadata["heads"].split(",")[2])
            if any([other.get(key) for key in SHARED] != [metadata[key] for key in SHARED] for other, _ in infos):
                raise ExportError(f"export {export_id!r}: its ranks disagree on what they hold")
            header = Header(export_id, ids, metadata["source_fingerprint"], metadata["tokenizer_hash"], layers, total,
                            head_dim, len(parts), mapped)  # fmt: skip
        except (KeyError, ValueError, IndexError, TypeError) as error:
            if isinstance(error, ExportError):
                raise
            raise ExportError(f"export {export_id!r} has malformed metadata ({error!r})") from None
        if len(ids) != tokens or any(not isinstance(i, int) for i in ids):
            raise ExportError(f"export {export_id!r}: {len(ids)} token ids for {tokens} cached tokens")
        return header

    def load(
        self, export_id: str, start: int, end: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L_s, H_s, end − start, d_s] of positions start..end−1, the sender ranks' heads in order
        (a head replicated over ranks once), on `device`; an ExportError when the export is missing, does not hold
        those positions or every head."""
        keys, values, total = {}, {}, 0  # first head → [L_s, H_r, n, d_s]; ranks replicating a head hold the same
        for path in self._parts(export_id):
            try:
                with safetensors.safe_open(path, "pt") as handle:
                    if not 0 <= start < end <= handle.get_slice("keys").get_shape()[2]:
                        raise ExportError(f"export {export_id!r} does not hold positions {start}..{end - 1}")
                    first, _, total = (int(n) for n in handle.metadata()["heads"].split(","))
                    keys[first] = handle.get_slice("keys")[:, :, start:end]
                    values[first] = handle.get_slice("values")[:, :, start:end]
            except (OSError, safetensors.SafetensorError) as error:
                raise ExportError(f"export {export_id!r}: {path.name} is unreadable ({error})") from None
        order = sorted(keys)
        if [h for first in order for h in range(first, first + keys[first].shape[1])] != list(range(total)):
            raise ExportError(f"export {export_id!r}: its ranks hold heads from {order}, not each of {total} once")
        return torch.cat([keys[f] for f in order], 1).to(device), torch.cat([values[f] for f in order], 1).to(device)

    def remove(self, export_id: str) -> None:
        """Delete an export's files (a sender dropping its oldest; a missing export is no error)."""
        for path in self.directory.glob(f"{check_id(export_id)}.rank*-of-*{SUFFIX}"):
            path.unlink(missing_ok=True)
