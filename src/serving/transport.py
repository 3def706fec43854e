"""Where a sender's exported K/V wait for a receiver: a directory of files, one per export and sender rank.

The directory is the rendezvous: `/dev/shm/kvrelay` by default — tmpfs, which every process of the host shares, so
two engines (two `vllm serve` processes, or two `LLM` objects) hand K/V over without a network hop; any other
directory works for host exports (a disk, a mount two hosts share). A file is written under a staging name, flushed
(and fsynced where it holds the K/V: a host export), then renamed into place: a reader sees a complete export or none —
nothing half-written ever loads. A device export's file is not fsynced: its bytes are handles to memory that dies with
the sender's process, so durability past a crash buys nothing, and an fsync on a disk costs the sender's request a
disk flush (the rename alone is what readers rely on).

    <export>.rank<r>-of-<n>.safetensors
        keys, values   [L_s, H_r, T, d_s]  the sender's cache dtype; H_r: the heads sender rank r holds
                       (memory "host"; a "device" export holds no tensor bytes: see below)
        ids            [T] int64: the token ids whose K/V it holds (every rank's file repeats them)
        metadata       source_fingerprint, fingerprint_dtype (the dtype it was computed in), tokenizer_hash,
                       heads ("first,count,of"),
                       mapped ("start,end" of a span that holds mapped K/V — never mapped again — or ""),
                       memory ("host" | "device"), and for "device": shape ("L,H,T,d"), dtype, gpu (the sender
                       GPU's UUID), keys / values (the CUDA IPC handles of the sender's two tensors, JSON) — or,
                       placed in the sender's export pool, pool, pool_memory, keys_offset, values_offset, event
                       (src/serving/export_pool.py)

Where the bytes live is the sender's choice (`memory`), read by every receiver from the file:
- host: in the file. A copy to host memory and back: ≈ 100 MB per 8K tokens of a 0.5B sender, which cost more than
  the re-prefill it saves on an H100 (BENCHMARKS, vLLM on the GPU).
- device: on the sender's GPU, in two tensors [L_s, H_r, T, d_s] the sender keeps until it removes the export; the
  file carries their CUDA IPC handles (torch's own: the receiver's stream waits on the sender's event, no host sync).
  Receivers on the same host open them (the same GPU, or a peer GPU: the receiver copies its span over). No copy
  through the host; the cost is the sender's GPU memory, L_s·H_r·T·d_s·2 elements per export, outside vLLM's KV
  budget (keep `keep_exports` small). With `pool_bytes`, a sender places its device exports in one allocation made
  once (its export pool: src/serving/export_pool.py), which a receiver opens once and keeps mapped while the sender
  lives, instead of opening two allocations per load; an export that does not fit the pool's free space gets its own
  two tensors, as without one.

A receiver holds a shared lock (flock) on each file from `load` until `Lease.release` — once its reads of the span
have completed on the device; a sender removes an export only under an exclusive lock taken without waiting, so it
never frees device memory a receiver is still reading: a busy export stays, and the sender tries again later.

An export id is 1–64 characters of [A-Za-z0-9_-] (it names a file). Each sender rank removes its own part of its
oldest exports (`remove`; the connector keeps `keep_exports` of them); a receiver finding a part gone refuses.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from src.models import dtype_name
from src.serving.cuda_ipc import gpu_uuid, open_cuda, share_cuda
from src.serving.export_pool import ExportPool, OpenedPools, Placement, SenderGone, pooled

DEFAULT_DIRECTORY = "/dev/shm/kvrelay"
EXPORT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
SUFFIX = ".safetensors"
PART = re.compile(rf"(?P<id>{EXPORT_ID.pattern})\.rank\d+-of-(?P<ranks>\d+){re.escape(SUFFIX)}")  # a part's file
HEADER_LIMIT = 100_000_000  # the most bytes of JSON a safetensors header may hold (safetensors' own bound)
MEMORIES = ("host", "device")
# the metadata every rank's file repeats (and the ids)
SHARED = ("source_fingerprint", "fingerprint_dtype", "tokenizer_hash", "mapped")


class ExportError(ValueError):
    """An export that does not exist, is malformed, or cannot serve the request; the message names why."""


def id_tensor(ids: list[int]) -> torch.Tensor:
    """Token ids as int64 [T] through a C array: `torch.tensor` of a list converts each int as a Python object
    (≈ 0.6 ms for 8K ids on this project's CPU, on the sender's step; this ≈ 0.15 ms)."""
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class Header:
    """What an export holds, read from its files' metadata (no tensor bytes)."""

    export_id: str
    ids: tuple[int, ...]  # the token ids whose K/V it holds, positions 0..T−1
    source_fingerprint: str  # src.models.fingerprint of the sender's model
    fingerprint_dtype: str  # the dtype it was fingerprinted in (the sender's `fingerprint_dtype`), e.g. "bfloat16"
    tokenizer_hash: str  # the sender's tokenizer (src.models.tokenizer_hash)
    layers: int
    heads: int  # the sender's KV heads, all ranks together
    head_dim: int
    ranks: int
    mapped: tuple[int, int] | None  # positions whose K/V were mapped into the sender: never mapped again


@dataclass
class Lease:
    """A receiver's shared locks on an export's files, and the sender's device memory it opened through them: held
    until its reads of the span have completed on the device (after them, `release`)."""

    descriptors: list[int] = field(default_factory=list)
    opened: list[torch.Tensor] = field(default_factory=list)  # the sender's tensors, mapped into this process

    def release(self) -> None:
        self.opened.clear()
        for descriptor in self.descriptors:
            os.close(descriptor)  # closing drops the lock
        self.descriptors.clear()

    def __del__(self) -> None:  # a lease nobody released (a caller's error path) still lets its sender go
        self.release()


def check_id(export_id: object) -> str:
    """The export id, or an ExportError naming what is wrong with it."""
    if not isinstance(export_id, str) or not EXPORT_ID.fullmatch(export_id):
        raise ExportError(f"export id {export_id!r} is not 1–64 characters of [A-Za-z0-9_-]")
    return export_id


def publish(path: Path, data: bytes, durable: bool) -> None:
    """`data` at `path`, atomically: written under a staging name beside it, flushed (fsynced when `durable`), renamed
    into place — a reader sees the whole file or none; nothing is left behind on a failure."""
    handle, staging = tempfile.mkstemp(prefix=".staging-", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            if durable:
                os.fsync(stream.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def local_device(uuid: str) -> int:
    """This process's index of the GPU whose UUID is `uuid`, or an ExportError: it cannot see the sender's GPU."""
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if gpu_uuid(index) == uuid:
            return index
    raise ExportError(f"the export lives on GPU {uuid}, which this process cannot see (another host, or "
                      "CUDA_VISIBLE_DEVICES hides it): device exports need sender and receiver on one host")  # fmt: skip


def header_table(descriptor: int) -> tuple[dict, int]:
    """The JSON table of an open safetensors file — {"__metadata__": {str: str}, tensor name: {"dtype", "shape",
    "data_offsets"}} — and where its tensor bytes begin: the file opens with n, 8 bytes little-endian, then n bytes of
    JSON, then the bytes (data_offsets count from there). A ValueError for a file that is not one."""
    size = os.fstat(descriptor).st_size
    (length,) = struct.unpack("<Q", os.pread(descriptor, 8, 0).ljust(8, b"\0"))
    if not 2 <= length <= min(size - 8, HEADER_LIMIT):
        raise ValueError(f"a safetensors header of {length} bytes in a file of {size}")
    table = json.loads(os.pread(descriptor, length, 8))
    if not isinstance(table, dict):
        raise ValueError("a safetensors header that is not a JSON object")
    return table, 8 + length


class Transport:
    """Exports in `directory`, their bytes in the sender's `memory`; device exports placed in an export pool of
    `pool_bytes` where > 0 (module docstring)."""

    def __init__(self, directory: str | Path = DEFAULT_DIRECTORY, memory: str = "host", pool_bytes: int = 0):
        if memory not in MEMORIES:
            raise ValueError(f"kvrelay: export memory must be one of {MEMORIES}, not {memory!r}")
        if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes < 0:
            raise ValueError(f"kvrelay: an export pool's size is an integer ≥ 0 of bytes, not {pool_bytes!r}")
        if pool_bytes and memory != "device":
            raise ValueError(f'kvrelay: an export pool holds device exports; this transport\'s memory is "{memory}"')
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.memory = memory
        self.pool_bytes = pool_bytes
        self._pool: ExportPool | None = None  # allocated at the first device export
        self._held: dict[Path, tuple[torch.Tensor, torch.Tensor]] = {}  # a sender's device exports, kept alive
        self._placed: dict[Path, Placement] = {}  # a sender's device exports in its pool
        self._pools = OpenedPools(self.directory)  # a receiver's opened pools

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
        *,
        fingerprint_dtype: str,
    ) -> Path:
        """Publish one sender rank's part: keys / values [L_s, H_r, T, d_s] of token ids [T], heads (first, count,
        of all), atomically (module docstring); source_fingerprint is in fingerprint_dtype. Returns the file."""
        if keys.shape != values.shape or keys.dim() != 4 or keys.shape[2] != len(ids) or keys.shape[1] != heads[1]:
            raise ExportError(f"export {export_id}: keys {tuple(keys.shape)} / values {tuple(values.shape)} do not "
                              f"hold {heads[1]} heads of {len(ids)} tokens")  # fmt: skip
        metadata = {
            "source_fingerprint": source_fingerprint,
            "fingerprint_dtype": fingerprint_dtype,
            "tokenizer_hash": tokenizer_hash,
            "heads": ",".join(str(n) for n in heads),
            "mapped": "" if mapped is None else f"{mapped[0]},{mapped[1]}",
            "memory": self.memory,
        }
        placed = None
        if self.memory == "device":
            if not keys.is_cuda:
                raise ExportError(f"export {export_id}: a device export holds CUDA tensors, not {keys.device} ones")
            metadata |= {"shape": ",".join(str(n) for n in keys.shape), "dtype": dtype_name(keys.dtype),
                         "gpu": gpu_uuid(keys.device)}  # fmt: skip
            if (placed := self._place(keys, values)) is not None:  # copied into the pool
                metadata |= self._pool.metadata(placed)
            else:
                keys, values = keys.contiguous(), values.contiguous()
                metadata |= {"keys": json.dumps(share_cuda(keys)), "values": json.dumps(share_cuda(values))}
            tensors = {}
        else:
            tensors = {"keys": keys.contiguous().cpu(), "values": values.contiguous().cpu()}
        tensors["ids"] = id_tensor(ids)  # [T] (a tensor: no JSON of T numbers to parse)
        path = self._path(export_id, rank, ranks)
        try:
            publish(path, safetensors.torch.save(tensors, metadata), durable=self.memory == "host")
        except BaseException:
            if placed is not None:
                self._pool.free(placed)
            raise
        if self.memory == "device":
            self._forget(path)  # an id published again: its earlier memory goes
            if placed is not None:
                self._placed[path] = placed
            else:
                self._held[path] = (keys, values)
        return path

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> Placement | None:
        """keys and values [L_s, H_r, T, d_s] copied into the export pool (allocated at the first), or None: no pool,
        or no room in it (the export gets its own allocations)."""
        if self.pool_bytes and self._pool is None:
            self._pool = ExportPool(self.directory, self.pool_bytes, keys.device)
        return None if self._pool is None else self._pool.place(keys, values)

    def _forget(self, path: Path) -> None:
        """A device export's memory freed: its tensors dropped, or its regions of the pool free again."""
        self._held.pop(path, None)
        if (placed := self._placed.pop(path, None)) is not None:
            self._pool.free(placed)

    def _parts(self, export_id: str) -> list[Path]:
        """The export's files, rank order; an ExportError unless every rank's file is there."""
        check_id(export_id)
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        named = {n: m for n in names if (m := PART.fullmatch(n)) and m["id"] == export_id}
        found = sorted(named)
        if not found:
            raise ExportError(f"no export {export_id!r} in {self.directory} (never written, or pruned)")
        ranks = {int(m["ranks"]) for m in named.values()}
        expected = [self._path(export_id, r, n) for n in ranks for r in range(n)]
        if len(ranks) != 1 or sorted(p.name for p in expected) != found:
            raise ExportError(f"export {export_id!r} is incomplete: {found}")
        return expected

    @staticmethod
    def _info(export_id: str, path: Path, ids: bool = False) -> tuple[dict, list[int], tuple[int, ...] | None]:
        """A part's metadata, the shape [L_s, H_r, T, d_s] of its keys and (`ids`) its token ids [T], or an
        ExportError. Read off the file's safetensors header (`header_table`) and, for the ids, their T·8 bytes: no
        tensor is mapped or built."""
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise ExportError(f"export {export_id!r}: {path.name} is unreadable ({error})") from None
        try:
            table, data = header_table(descriptor)
            metadata = table["__metadata__"]
            if metadata["memory"] not in MEMORIES:
                raise ValueError(f"memory {metadata['memory']!r}")
            if metadata["memory"] == "host":
                shape = [int(n) for n in table["keys"]["shape"]]
            else:
                shape = [int(n) for n in metadata["shape"].split(",")]
            tokens = None
            if ids:
                entry = table["ids"]
                begin, end = (int(n) for n in entry["data_offsets"])
                if entry["dtype"] != "I64" or entry["shape"] != shape[2:3] or end - begin != 8 * shape[2]:
                    raise ExportError(f"export {export_id!r}: token ids {entry['dtype']} {entry['shape']} for "
                                      f"{shape[2]} cached tokens")  # fmt: skip
                raw = os.pread(descriptor, end - begin, data + begin)  # fewer bytes past the file's end: struct.error
                tokens = struct.unpack(f"<{shape[2]}q", raw)  # little-endian int64, as safetensors stores them
            return metadata, shape, tokens
        except OSError as error:
            raise ExportError(f"export {export_id!r}: {path.name} is unreadable ({error})") from None
        except ExportError:
            raise
        except (KeyError, ValueError, IndexError, TypeError, struct.error) as error:
            raise ExportError(f"export {export_id!r} has malformed metadata ({error!r})") from None
        finally:
            os.close(descriptor)

    def header(self, export_id: str) -> Header:
        """The export's header (rank 0's metadata, checked against every rank's); an ExportError if it is missing,
        incomplete or malformed."""
        parts = self._parts(export_id)
        infos = [self._info(export_id, path, ids=True) for path in parts]
        try:
            metadata, (layers, _, _, head_dim), ids = infos[0]
            mapped = tuple(int(n) for n in metadata["mapped"].split(",")) if metadata["mapped"] else None
            total = int(metadata["heads"].split(",")[2])
            if any([other.get(key) for key in SHARED] != [metadata[key] for key in SHARED] or rank != ids
                   for other, _, rank in infos):  # fmt: skip
                raise ExportError(f"export {export_id!r}: its ranks disagree on what they hold")
            header = Header(export_id, ids, metadata["source_fingerprint"], metadata["fingerprint_dtype"],
                            metadata["tokenizer_hash"], layers, total, head_dim, len(parts), mapped)  # fmt: skip
        except (KeyError, ValueError, IndexError, TypeError) as error:
            if isinstance(error, ExportError):
                raise
            raise ExportError(f"export {export_id!r} has malformed metadata ({error!r})") from None
        return header

    @staticmethod
    def _lock(export_id: str, path: Path) -> int:
        """A descriptor of the part holding a shared lock, or an ExportError: its sender removed it meanwhile."""
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ExportError(f"export {export_id!r} was removed by its sender (pruned) while being read") from None
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        try:
            same = os.stat(path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(descriptor)
            raise ExportError(f"export {export_id!r} was removed by its sender (pruned) while being read")
        return descriptor

    def load(
        self, export_id: str, start: int, end: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, Lease]:
        """Keys and values [L_s, H_s, end − start, d_s] of positions start..end−1, the sender ranks' heads in order
        (a head replicated over ranks once), on `device`, and the lease to release once they have been read on the
        device; an ExportError when the export is missing, does not hold those positions or every head."""
        keys, values, total = {}, {}, 0  # first head → [L_s, H_r, n, d_s]; ranks replicating a head hold the same
        lease = Lease()
        try:
            for path in self._parts(export_id):
                lease.descriptors.append(self._lock(export_id, path))
                metadata, shape, _ = self._info(export_id, path)
                if not 0 <= start < end <= shape[2]:
                    raise ExportError(f"export {export_id!r} does not hold positions {start}..{end - 1}")
                first, _, total = (int(n) for n in metadata["heads"].split(","))
                keys[first], values[first] = self._span(export_id, path, metadata, shape, start, end, lease)
            order = sorted(keys)
            if [h for first in order for h in range(first, first + keys[first].shape[1])] != list(range(total)):
                raise ExportError(f"export {export_id!r}: its ranks hold heads from {order}, not each of {total} once")
            if len(order) == 1:  # one part: its span as it is (a view of device memory: the map reads it in place)
                return keys[order[0]].to(device), values[order[0]].to(device), lease
            return (torch.cat([keys[f] for f in order], 1).to(device),
                    torch.cat([values[f] for f in order], 1).to(device), lease)  # fmt: skip
        except BaseException:
            lease.release()
            raise

    def _span(
        self, export_id: str, path: Path, metadata: dict, shape: list[int], start: int, end: int, lease: Lease
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One part's keys and values [L_s, H_r, end − start, d_s]: read from the file, or views of the sender's
        device memory — its export pool (opened once, kept) or its export's own tensors (opened into `lease`)."""
        if metadata["memory"] == "host":  # checked by `_info`
            try:
                with safetensors.safe_open(path, "pt") as handle:
                    return handle.get_slice("keys")[:, :, start:end], handle.get_slice("values")[:, :, start:end]
            except (OSError, safetensors.SafetensorError) as error:
                raise ExportError(f"export {export_id!r}: {path.name} is unreadable ({error})") from None
        try:
            dtype, gpu = getattr(torch, metadata["dtype"]), metadata["gpu"]
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype {metadata['dtype']!r}")
            place = pooled(metadata, shape, dtype) if "pool" in metadata else None
            shared = [json.loads(metadata[key]) for key in ("keys", "values")] if place is None else []
        except (KeyError, ValueError, AttributeError, TypeError, IndexError) as error:
            raise ExportError(f"export {export_id!r} has malformed metadata ({error!r})") from None
        if place is not None:
            try:
                self._pools.check(place.pool_id)
            except SenderGone as gone:
                raise ExportError(f"the sender of export {export_id!r} is gone ({gone})") from None
        index = local_device(gpu)
        try:
            if place is not None:  # the pool stays mapped: nothing to close at the lease's release
                pair = self._pools.views(place, shape, dtype, index)
            else:
                pair = [open_cuda(part, tuple(shape), dtype, index) for part in shared]
                lease.opened.extend(pair)
        except (RuntimeError, KeyError, TypeError) as error:
            raise ExportError(f"export {export_id!r}: the sender's device memory cannot be opened ({error})") from None
        return pair[0][:, :, start:end], pair[1][:, :, start:end]

    def remove(self, export_id: str, rank: int = 0, ranks: int = 1) -> bool:
        """Delete a sender rank's part of an export and free the device memory it kept; False, nothing changed, while
        a receiver holds it (try again later). A missing part is no error."""
        path = self._path(export_id, rank, ranks)
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(path)
            return True
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return False
        path.unlink(missing_ok=True)
        self._forget(path)
        os.close(descriptor)
        return True
