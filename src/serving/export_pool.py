"""An export pool: device memory a sender allocates once and places its device exports in, its CUDA IPC handle shared
once, so a receiver opens it once and keeps it mapped — instead of opening (cudaIpcOpenMemHandle) and closing two
allocations per handoff (src/serving/transport.py, `pool_bytes`).

Why a pool, not kept mappings of each export's own tensors: CUDA leaves it undefined when an exporter frees memory an
importer still maps, and a sender's caching allocator frees its segments on `empty_cache`. The pool is never freed
while its sender's Transport lives; what marks that life is a read lock the sender holds on the pool's file in the
export directory (`.pool-<id>`) — an open file description's lock (Linux `F_OFD_SETLK`), which a process's death drops.
A receiver checks it before each use of a pool it keeps mapped by asking (`F_OFD_GETLK`) whether a write lock would
conflict: it takes no lock, so receivers probing at one instant never see each other as a sender. The file is locked
before it gets its name (created as `.pool-<id>.new`, renamed), so a pool file nobody locks is a dead sender's: the
next pool opened in that directory removes it.

    buffer      [pool_bytes] uint8 on the sender's GPU; each export's keys and values [L_s, H_r, T, d_s] a region of
                it (ALIGNMENT-aligned), first fit over the free regions, freed ones coalesced (`Regions`)
    metadata    pool (its id: 32 hex digits, naming its file), pool_memory (its IPC description, JSON: cuda_ipc.py),
                keys_offset / values_offset (bytes into it), event (the IPC handle of a CUDA event recorded after the
                export's copies, base64: the receiver's stream waits on it — no host sync)

A region is reused only once its export is removed, which a sender does only under the export file's exclusive lock
(transport.py): the receivers' shared locks on an export's file keep its region from being reused while read.
"""

from __future__ import annotations

import base64
import bisect
import fcntl
import json
import logging
import os
import re
import struct
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from src.serving.cuda_ipc import open_cuda, share_cuda

ALIGNMENT = 256  # bytes: every region begins at a multiple of it (any dtype's elements, and coalesced loads)
POOL_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex
POOL_FILE = re.compile(r"\.pool-[0-9a-f]{32}")  # a pool's file, named only once locked
FLOCK = "hhqqi4x"  # struct flock (LP64 Linux): l_type, l_whence, l_start, l_len, l_pid (0 for an OFD lock)
EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)

logger = logging.getLogger(__name__)


def pool_path(directory: Path, pool_id: str) -> Path:
    return directory / f".pool-{pool_id}"


def lock_state(descriptor: int, command: int, kind: int) -> int:
    """fcntl's open-file-description lock `command` (F_OFD_SETLK takes, F_OFD_GETLK asks) of `kind` over the whole
    file; the lock type the kernel reports back (for F_OFD_GETLK: F_UNLCK where none would conflict)."""
    reply = fcntl.fcntl(descriptor, command, struct.pack(FLOCK, kind, os.SEEK_SET, 0, 0, 0))
    return struct.unpack(FLOCK, reply)[0]


def aligned(size: int) -> int:
    """The bytes a region of `size` bytes takes: a whole number of ALIGNMENT, at least one."""
    return max(ALIGNMENT, -(-size // ALIGNMENT) * ALIGNMENT)


@dataclass(frozen=True)
class Region:
    offset: int  # bytes into the pool, a multiple of ALIGNMENT
    size: int  # bytes, a multiple of ALIGNMENT


class Regions:
    """First fit over the free byte ranges of a pool of `size` bytes: `take` the lowest free range that holds a
    request (rounded up to ALIGNMENT), `free` a taken region back — merged with free neighbours into one range."""

    def __init__(self, size: int):
        self._free: list[tuple[int, int]] = [(0, size - size % ALIGNMENT)]  # (offset, size), by offset
        self._taken: dict[int, int] = {}  # offset → size

    def take(self, size: int) -> Region | None:
        """A free region of at least `size` bytes, or None: no free range holds it."""
        size = aligned(size)
        for index, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, length - size)
                self._taken[offset] = size
                return Region(offset, size)
        return None

    def free(self, region: Region) -> None:
        """`region` free again; a ValueError for one not taken from here (never freed twice)."""
        if self._taken.get(region.offset) != region.size:
            raise ValueError(f"{region} is not a region taken from this pool")
        del self._taken[region.offset]
        offset, size = region.offset, region.size
        index = bisect.bisect(self._free, (offset, size))
        if index < len(self._free) and self._free[index][0] == offset + size:  # the next range follows it
            size += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == offset:  # the previous range ends where it begins
            index -= 1
            offset, size = self._free[index][0], self._free.pop(index)[1] + size
        self._free.insert(index, (offset, size))


@dataclass
class Placement:
    """Where one export lies in a pool, and the event its copies recorded (kept alive with the export)."""

    keys: Region
    values: Region
    event: torch.cuda.Event


class ExportPool:
    """A sender's pool (module docstring): `pool_bytes` of device memory, allocated once on `device`, described once,
    its life marked by a shared lock on its file in `directory`."""

    def __init__(self, directory: Path, pool_bytes: int, device: torch.device):
        self.buffer = torch.empty(pool_bytes, dtype=torch.uint8, device=device)  # [pool_bytes]
        self.pool_id = uuid.uuid4().hex
        self.memory = json.dumps(share_cuda(self.buffer))
        self.regions = Regions(pool_bytes)
        self.warned = False  # that an export found no room (said once)
        remove_dead_pools(directory)
        path = pool_path(directory, self.pool_id)
        unnamed = path.with_name(path.name + ".new")
        descriptor = os.open(unnamed, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
        lock_state(descriptor, fcntl.F_OFD_SETLK, fcntl.F_RDLCK)  # held while this pool lives (module docstring)
        os.rename(unnamed, path)
        weakref.finalize(self, _close, descriptor, path)

    def place(self, keys: torch.Tensor, values: torch.Tensor) -> Placement | None:
        """keys and values [L_s, H_r, T, d_s] (any strides) copied into two free regions, an event recorded after the
        copies; None, nothing taken, where they do not fit (said once) or live on another device."""
        size = keys.numel() * keys.element_size()
        if keys.device != self.buffer.device:
            return None
        taken = []
        for _ in range(2):
            if (region := self.regions.take(size)) is None:
                for region in taken:
                    self.regions.free(region)
                self._no_room(2 * aligned(size))
                return None
            taken.append(region)
        for region, tensor in zip(taken, (keys, values), strict=True):
            target = self.buffer[region.offset : region.offset + size].view(keys.dtype).view(keys.shape)  # [L,H,T,d]
            target.copy_(tensor)
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(self.buffer.device))
        return Placement(taken[0], taken[1], event)

    def _no_room(self, needed: int) -> None:
        if not self.warned:
            self.warned = True
            logger.warning("kvrelay: an export of %d bytes (keys and values) found no room in the export pool of %d "
                           "bytes (export_pool_mb; the exports a sender keeps, and those receivers still read, hold "
                           "theirs): it and any other that does not fit get their own allocations — correct, slower "
                           "to load (said once)", needed, self.buffer.numel())  # fmt: skip

    def free(self, placement: Placement) -> None:
        self.regions.free(placement.keys)
        self.regions.free(placement.values)

    def metadata(self, placement: Placement) -> dict[str, str]:
        """A pooled export's metadata (module docstring), beside a device export's shape, dtype and gpu."""
        return {"pool": self.pool_id, "pool_memory": self.memory, "keys_offset": str(placement.keys.offset),
                "values_offset": str(placement.values.offset),
                "event": base64.b64encode(placement.event.ipc_handle()).decode()}  # fmt: skip


def _close(descriptor: int, path: Path) -> None:
    path.unlink(missing_ok=True)
    os.close(descriptor)  # drops the lock: receivers refuse the pool's exports from now on


@dataclass(frozen=True)
class Pooled:
    """A pooled export as its metadata names it (module docstring), checked."""

    pool_id: str
    memory: dict  # the pool's IPC description (cuda_ipc.share_cuda)
    offsets: tuple[int, int]  # bytes into the pool: keys, values
    event: bytes  # a cudaIpcEventHandle_t


def pooled(metadata: Mapping[str, str], shape: list[int], dtype: torch.dtype) -> Pooled:
    """The pooled export's place, or a ValueError / KeyError naming the malformed field: its offsets inside the pool,
    on its dtype's elements."""
    pool_id = metadata["pool"]
    if not POOL_ID.fullmatch(pool_id):
        raise ValueError(f"pool {pool_id!r}")
    memory = json.loads(metadata["pool_memory"])
    if not isinstance(memory, dict) or not all(isinstance(memory.get(key), int) for key in ("bytes", "storage_offset")):
        raise ValueError(f"pool_memory {metadata['pool_memory']!r}")
    length = memory["bytes"] - memory["storage_offset"]  # the pool's bytes
    size = dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3]  # keys' (and values') bytes
    offsets = []
    for key in ("keys_offset", "values_offset"):
        offset = int(metadata[key])
        if offset < 0 or offset % dtype.itemsize or offset + size > length:
            raise ValueError(f"{key} {offset}: {size} bytes there are not {dtype} elements inside a pool of "
                             f"{length} bytes")  # fmt: skip
        offsets.append(offset)
    event = base64.b64decode(metadata["event"], validate=True)
    if len(event) != EVENT_HANDLE_BYTES:
        raise ValueError(f"event of {len(event)} bytes, not a CUDA IPC event handle's {EVENT_HANDLE_BYTES}")
    return Pooled(pool_id, memory, (offsets[0], offsets[1]), event)


class SenderGone(Exception):
    """A pool whose sender no longer holds its file's lock (or whose file is gone); the message says which."""


def sender_holds(descriptor: int) -> bool:
    """Whether anyone holds a lock on the pool's file — its sender, for life (module docstring); takes none."""
    return lock_state(descriptor, fcntl.F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK


def remove_dead_pools(directory: Path) -> list[str]:
    """Remove the pool files in `directory` whose senders are gone (killed: their files stay, unlocked); their
    names. A pool file is locked before it is named, so an unlocked one is never a pool being opened."""
    removed = []
    for name in os.listdir(directory):
        if not POOL_FILE.fullmatch(name):
            continue
        try:
            descriptor = os.open(directory / name, os.O_RDONLY)
        except FileNotFoundError:  # its sender closed it meanwhile
            continue
        try:
            if not sender_holds(descriptor):
                (directory / name).unlink(missing_ok=True)
                removed.append(name)
        finally:
            os.close(descriptor)
    return removed


class OpenedPools:
    """A receiver's pools in `directory`, each opened once and kept mapped while its sender lives."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict[str, int] = {}  # pool id → a descriptor of its file (the liveness probe's)
        self._opened: dict[str, torch.Tensor] = {}  # pool id → its memory [pool bytes] uint8, mapped here

    def check(self, pool_id: str) -> None:
        """Nothing, while the pool's sender lives; else SenderGone, and the pool is dropped (its mapping closed)."""
        descriptor = self._files.get(pool_id)
        if descriptor is None:
            try:
                descriptor = self._files[pool_id] = os.open(pool_path(self.directory, pool_id), os.O_RDONLY)
            except FileNotFoundError:
                raise SenderGone("its export pool's file is gone") from None
        if not sender_holds(descriptor):
            self._opened.pop(pool_id, None)
            os.close(self._files.pop(pool_id))
            raise SenderGone("its export pool's lock is free")

    def views(self, place: Pooled, shape: list[int], dtype: torch.dtype, device: int) -> tuple[torch.Tensor, ...]:
        """The export's keys and values [L_s, H_r, T, d_s], views of its pool (opened on `device` the first time:
        `check` it first); the current stream waits on the export's event. A RuntimeError where CUDA refuses."""
        pool = self._opened.get(place.pool_id)
        if pool is None:
            length = place.memory["bytes"] - place.memory["storage_offset"]
            pool = self._opened[place.pool_id] = open_cuda(place.memory, (length,), torch.uint8, device)  # [bytes]
        torch.cuda.Event.from_ipc_handle(device, place.event).wait(torch.cuda.current_stream(device))
        return tuple(
            torch.empty(0, dtype=dtype, device=pool.device).set_(
                pool.untyped_storage(), (pool.storage_offset() + offset) // dtype.itemsize, shape, strides(shape)
            )
            for offset in place.offsets
        )


def strides(shape: list[int]) -> list[int]:
    """A contiguous tensor's strides (elements) of `shape`."""
    steps = [1]
    for size in reversed(shape[1:]):
        steps.insert(0, steps[0] * size)
    return steps
