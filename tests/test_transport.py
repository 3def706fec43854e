"""The export transport's memories and leases (src/serving/transport.py): a receiver's lease keeps its sender from
removing an export mid-read, a part removed under a reader is refused, a device export's metadata is checked before
any memory is opened — and, on a GPU, a device export crosses processes through CUDA IPC with no copy to the host,
its own allocations or a region of its sender's export pool (src/serving/export_pool.py)."""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

from src.serving import export_pool as export_pool_module
from src.serving import transport as transport_module
from src.serving.config import connector_config
from src.serving.export_pool import ALIGNMENT, Region, Regions, lock_state, remove_dead_pools, sender_holds
from src.serving.transport import ExportError, Transport, id_tensor, publish


def _kv(layers=2, heads=2, tokens=6, d=4, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(layers, heads, tokens, d, generator=generator).to(device) for _ in range(2))


def _put(transport: Transport, export_id: str, keys: torch.Tensor, values: torch.Tensor) -> Path:
    return transport.put(
        export_id,
        keys,
        values,
        list(range(10, 10 + keys.shape[2])),
        "fp",
        "tok",
        (0, keys.shape[1], keys.shape[1]),
        fingerprint_dtype="float32",
    )


def test_an_export_is_published_whole_and_fsynced_only_where_it_holds_the_kv(tmp_path, monkeypatch):
    """A host export's file is fsynced (its bytes are the K/V), a device export's is not (handles to memory that dies
    with its sender); both appear whole under their name by a rename, and a failed write leaves nothing behind."""
    synced = []
    monkeypatch.setattr(transport_module.os, "fsync", lambda fd: synced.append(fd))
    _put(Transport(tmp_path), "h1", *_kv())
    assert len(synced) == 1  # the host export's put, through publish
    publish(tmp_path / "d.safetensors", b"handles", durable=False)
    assert len(synced) == 1 and (tmp_path / "d.safetensors").read_bytes() == b"handles"
    monkeypatch.setattr(transport_module.os, "replace", lambda *_: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        publish(tmp_path / "x.safetensors", b"never", durable=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors", "h1.rank0-of-1.safetensors"]


def test_a_receivers_lease_defers_its_senders_removal(tmp_path):
    transport = Transport(tmp_path)
    _put(transport, "e1", *_kv())
    _, _, lease = transport.load("e1", 0, 6)
    assert transport.remove("e1") is False  # a receiver reads it: nothing changes
    assert transport.header("e1").ids == tuple(range(10, 16))
    lease.release()
    assert transport.remove("e1") is True
    with pytest.raises(ExportError, match="no export"):
        transport.header("e1")
    assert transport.remove("e1") is True  # already gone: no error
    _put(transport, "e1", *_kv(tokens=3))
    assert transport.header("e1").ids == (10, 11, 12)  # published again: read as it is now, nothing kept
    transport.put("e1", *_kv(tokens=2), [7, 8], "fp", "tok", (0, 2, 2), fingerprint_dtype="float32")
    assert transport.header("e1").ids == (7, 8)  # republished under the same id


def test_a_part_removed_while_a_receiver_opens_it_is_refused(tmp_path, monkeypatch):
    transport = Transport(tmp_path)
    _put(transport, "e2", *_kv())
    real = fcntl.flock

    def sender_first(descriptor, operation):  # the sender removes the part between the reader's open and its lock
        if operation == fcntl.LOCK_SH:
            assert Transport(tmp_path).remove("e2")
        return real(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", sender_first)
    with pytest.raises(ExportError, match="removed by its sender"):
        transport.load("e2", 0, 6)


def test_export_memory_is_checked_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="export memory must be one of"):
        Transport(tmp_path, "gpu")
    with pytest.raises(ValueError, match="export_memory must be one of"):
        connector_config({"export_memory": "gpu"}, "recompute")
    assert connector_config({"export_memory": "device"}, "recompute").export_memory == "device"
    with pytest.raises(ExportError, match="a device export holds CUDA tensors"):
        _put(Transport(tmp_path, "device"), "e3", *_kv())
    with pytest.raises(ExportError, match="a device export holds CUDA tensors"):  # before a pool is allocated
        _put(Transport(tmp_path, "device", 1 << 20), "e3", *_kv())
    for memory, pool_bytes, match in (("host", 1 << 20, "an export pool holds device exports"),
                                      ("device", -1, "an integer ≥ 0"), ("device", 1.5, "an integer ≥ 0")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Transport(tmp_path, memory, pool_bytes)
    assert list(tmp_path.iterdir()) == []
    extra = {"export_memory": "device", "export_pool_mb": 64}
    assert connector_config(extra, "recompute").export_pool_mb == 64
    assert connector_config({}, "recompute").export_pool_mb == 0


def test_a_worker_on_a_cpu_refuses_device_exports_before_any_model_loads(tmp_path, monkeypatch):
    """export_memory "device" on an engine that is not on CUDA: the worker side refuses at its start, naming the
    setting, before the TP group is read or any model loads (both would fail or cost minutes first)."""
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from types import SimpleNamespace as NS

    from src.serving import routes, vllm_connector

    monkeypatch.setattr(routes, "load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    extra = {"export_memory": "device", "transport": str(tmp_path)}
    config = NS(kv_transfer_config=NS(kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
                cache_config=NS(block_size=32, cache_dtype="auto"), model_config=NS(model=str(tmp_path), tokenizer=None),
                device_config=NS(device=torch.device("cpu")), parallel_config=NS(pipeline_parallel_size=1))  # fmt: skip
    with pytest.raises(
        ValueError, match='export_memory "device" keeps exports in CUDA memory; this engine runs on cpu'
    ):
        vllm_connector.KVRelayConnector(config, base.KVConnectorRole.WORKER)


def _device_file(tmp_path, export_id: str, **changes) -> None:
    """A device export's file as a sender on another GPU writes it (its handles are never opened here)."""
    shared = {"device": 0, "handle": "AAAA", "bytes": 384, "offset": 0, "event": None, "sync": False,
              "storage_offset": 0, "stride": [48, 24, 4, 1]}  # fmt: skip
    metadata = {"source_fingerprint": "fp", "fingerprint_dtype": "float32", "tokenizer_hash": "tok",
                "heads": "0,2,2", "mapped": "", "memory": "device", "shape": "2,2,6,4", "dtype": "float32",
                "gpu": "GPU-00000000-0000-0000-0000-000000000000", "keys": json.dumps(shared),
                "values": json.dumps(shared)} | changes  # fmt: skip
    metadata = {key: value for key, value in metadata.items() if value is not None}  # None: the key left out
    tensors = {"ids": torch.arange(6)}  # [T] int64
    (tmp_path / f"{export_id}.rank0-of-1.safetensors").write_bytes(safetensors.torch.save(tensors, metadata))


def test_a_device_exports_header_reads_its_metadata_and_its_memory_opens_only_where_visible(tmp_path):
    transport = Transport(tmp_path)
    _device_file(tmp_path, "d1")
    header = transport.header("d1")
    assert (header.layers, header.heads, header.head_dim, header.ids) == (2, 2, 4, tuple(range(6)))
    with pytest.raises(ExportError, match="which this process cannot see"):
        transport.load("d1", 0, 6)
    _device_file(tmp_path, "d2", dtype="Tensor")
    with pytest.raises(ExportError, match="malformed metadata"):
        transport.load("d2", 0, 6)
    _device_file(tmp_path, "d3", memory="disk")
    with pytest.raises(ExportError, match="malformed metadata"):
        transport.header("d3")
    _device_file(tmp_path, "d4", shape="2,2")
    with pytest.raises(ExportError, match="malformed metadata"):
        transport.header("d4")
    assert transport.remove("d1")  # a failed load left no lock behind


def _sender(directory: str, commands, replies) -> None:
    """A sender process: publishes one device export (holding no other reference to it), then removes it when told;
    replies what remove returned and how many bytes of CUDA memory that freed."""
    transport = Transport(directory, "device")
    _put(transport, "g1", *_kv(tokens=40, device="cuda"))
    replies.put("published")
    while commands.get() == "remove":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        removed = transport.remove("g1")
        replies.put((removed, before - torch.cuda.memory_allocated()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA IPC between two processes)")
def test_a_device_export_crosses_processes_and_its_removal_frees_it_whoever_read_it(tmp_path):
    """Read twice by another process (torch's own IPC count would go negative and park the block for good: the
    sender's removal must free it), held by a lease (removal refused), then removed: its memory is freed."""
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    sender = context.Process(target=_sender, args=(str(tmp_path), commands, replies))
    sender.start()
    try:
        assert replies.get(timeout=120) == "published"
        keys, values = _kv(tokens=40)
        receiver = Transport(tmp_path)
        for _ in range(2):
            got_k, got_v, lease = receiver.load("g1", 5, 37, "cuda")
            assert got_k.is_cuda and torch.equal(got_k.cpu(), keys[:, :, 5:37])
            assert torch.equal(got_v.cpu(), values[:, :, 5:37])
            commands.put("remove")
            assert replies.get(timeout=60) == (False, 0)  # the receiver's lease holds it: nothing changes
            torch.cuda.synchronize()
            del got_k, got_v
            lease.release()
        commands.put("remove")
        removed, freed = replies.get(timeout=60)
        assert removed and freed >= keys.numel() * keys.element_size() * 2  # keys and values: no block kept in limbo
        with pytest.raises(ExportError, match="no export"):
            receiver.load("g1", 0, 40, "cuda")
    finally:
        commands.put("stop")
        sender.join(timeout=60)
    assert sender.exitcode == 0 and not any(p.name.startswith("g1") for p in tmp_path.iterdir())


def test_token_ids_travel_as_a_tensor_every_rank_repeats(tmp_path):
    transport = Transport(tmp_path)
    keys, values = _kv(heads=2)
    for rank, ids in enumerate(([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7])):  # rank 1 holds other tokens
        transport.put("r1", keys[:, rank : rank + 1], values[:, rank : rank + 1], ids, "fp", "tok", (rank, 1, 2),
                      None, rank, 2, fingerprint_dtype="float32")  # fmt: skip
    with pytest.raises(ExportError, match="its ranks disagree"):
        transport.header("r1")
    _device_file(tmp_path, "r2")
    path = tmp_path / "r2.rank0-of-1.safetensors"
    with safetensors.safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    for dtype, name in ((torch.float32, "F32"), (torch.float64, "F64")):  # float ids; F64: as many bytes as I64
        path.write_bytes(safetensors.torch.save({"ids": torch.arange(6, dtype=dtype)}, metadata))
        with pytest.raises(ExportError, match=rf"token ids {name} \[6\]"):
            transport.header("r2")


def test_a_part_that_is_not_a_whole_safetensors_file_is_refused_naming_why(tmp_path):
    """The header is read off the file's own bytes (its length, its JSON, the ids' bytes): whatever a file holds —
    cut short, not safetensors at all, a header that is no JSON object, empty — the receiver gets an ExportError,
    never another exception; and an export whose id begins another's is never mixed up with it."""
    transport = Transport(tmp_path)
    _put(transport, "e1", *_kv(tokens=600))
    whole = (tmp_path / "e1.rank0-of-1.safetensors").read_bytes()
    _put(transport, "e10", *_kv(tokens=3))
    assert transport.header("e1").ids == tuple(range(10, 610)) and transport.header("e10").ids == (10, 11, 12)
    length = int.from_bytes(whole[:8], "little")
    ids_end = 8 + length + json.loads(whole[8 : 8 + length])["ids"]["data_offsets"][1]
    broken = {
        "cut": whole[: ids_end - 8],  # the ids' last token missing
        "text": b"this is not a safetensors file, only some words",
        "list": len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]",
        "empty": b"",
    }
    for name, data in broken.items():
        (tmp_path / f"{name}.rank0-of-1.safetensors").write_bytes(data)
        with pytest.raises(ExportError, match="malformed metadata"):
            transport.header(name)
        with pytest.raises(ExportError, match="malformed metadata|is unreadable"):  # the cut one: at its bytes
            transport.load(name, 0, 1)


# ---------------------------------------------------------------------------------------------------- the export pool


def test_the_pools_regions_are_first_fit_aligned_and_coalesce_when_freed():
    regions = Regions(8 * ALIGNMENT + 100)  # the tail past the last whole ALIGNMENT is never handed out
    a, b, c = regions.take(1), regions.take(ALIGNMENT + 1), regions.take(ALIGNMENT)
    assert (a, b, c) == (Region(0, ALIGNMENT), Region(ALIGNMENT, 2 * ALIGNMENT), Region(3 * ALIGNMENT, ALIGNMENT))
    assert regions.take(0) == Region(4 * ALIGNMENT, ALIGNMENT)  # an empty export still gets a region of its own
    assert regions.take(4 * ALIGNMENT) is None  # 3 · ALIGNMENT free at the tail: full for this one
    regions.free(b)
    assert regions.take(ALIGNMENT) == Region(ALIGNMENT, ALIGNMENT)  # first fit: the freed hole before the tail
    regions.free(Region(ALIGNMENT, ALIGNMENT))
    for region in (a, c, Region(4 * ALIGNMENT, ALIGNMENT)):  # c joins b's hole and the tail: a, the hole's left
        regions.free(region)
    assert regions.take(8 * ALIGNMENT) == Region(0, 8 * ALIGNMENT)  # every range coalesced into one
    assert regions.take(1) is None  # full
    with pytest.raises(ValueError, match="not a region taken from this pool"):
        regions.free(Region(0, ALIGNMENT))  # another size than the one taken there
    regions.free(Region(0, 8 * ALIGNMENT))
    for unknown in (Region(0, 8 * ALIGNMENT), Region(ALIGNMENT, ALIGNMENT)):  # freed twice; never taken
        with pytest.raises(ValueError, match="not a region taken from this pool"):
            regions.free(unknown)


POOL_ID = "0123456789abcdef0123456789abcdef"


def _pooled_file(tmp_path, export_id: str, **changes) -> None:
    """A pooled device export's file as a sender on another GPU writes it: keys [2, 2, 6, 4] float32 (384 bytes) at
    byte 0 of a pool of 4096 bytes, values at 512."""
    memory = {"device": 0, "handle": "AAAA", "bytes": 4096, "offset": 0, "event": None, "sync": False,
              "storage_offset": 0, "stride": [1]}  # fmt: skip
    pooled = {"keys": None, "values": None, "pool": POOL_ID, "pool_memory": json.dumps(memory), "keys_offset": "0",
              "values_offset": "512", "event": base64.b64encode(bytes(64)).decode()}  # fmt: skip
    _device_file(tmp_path, export_id, **(pooled | changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"pool": "../escape"},  # names a file: 32 hex digits only
        {"pool": None},  # then read as its own allocations: no keys / values handles
        {"pool_memory": "{"},
        {"pool_memory": "[4096]"},
        {"pool_memory": json.dumps({"bytes": "4096", "storage_offset": 0})},
        {"keys_offset": "zero"},
        {"keys_offset": "-512"},
        {"keys_offset": "2"},  # inside a float32
        {"values_offset": "3840"},  # 384 bytes from there pass the pool's end
        {"values_offset": None},
        {"event": "not base64!"},
        {"event": base64.b64encode(bytes(10)).decode()},  # not a CUDA IPC event handle
        {"shape": "2,2,6"},
    ],
)
def test_a_pooled_exports_malformed_metadata_is_refused_naming_it_before_any_pool_is_opened(tmp_path, changes):
    transport = Transport(tmp_path)
    _pooled_file(tmp_path, "p1")  # the same file whole: refused later, for its pool (no sender here)
    with pytest.raises(ExportError, match="sender of export 'p1' is gone"):
        transport.load("p1", 0, 6)
    _pooled_file(tmp_path, "p2", **changes)
    with pytest.raises(ExportError, match="has malformed metadata"):
        transport.load("p2", 0, 6)
    assert transport.remove("p2")  # no lease left behind


def test_a_pools_sender_is_alive_while_it_holds_the_pools_lock(tmp_path):
    """A receiver uses a pool only while its sender holds the shared lock on the pool's file (a process's death drops
    it): a file nobody locks, or none, is the clear error; a lock another process holds lets the load go on — here
    to the GPU this process cannot see."""
    transport = Transport(tmp_path)
    _pooled_file(tmp_path, "p1")
    with pytest.raises(ExportError, match=r"sender of export 'p1' is gone \(its export pool's file is gone\)"):
        transport.load("p1", 0, 6)
    pool_file = tmp_path / f".pool-{POOL_ID}"
    pool_file.touch()
    with pytest.raises(ExportError, match=r"sender of export 'p1' is gone \(its export pool's lock is free\)"):
        transport.load("p1", 0, 6)
    sender = _holder(pool_file)
    try:
        assert sender.stdout.readline() == "held\n"
        for _ in range(2):  # met anew, then through the descriptor kept since
            with pytest.raises(ExportError, match="which this process cannot see"):
                transport.load("p1", 0, 6)
    finally:
        sender.communicate("")  # its stdin closed: it exits, and its lock drops
    with pytest.raises(ExportError, match=r"sender of export 'p1' is gone \(its export pool's lock is free\)"):
        transport.load("p1", 0, 6)
    probe = os.open(pool_file, os.O_RDWR)
    lock_state(probe, fcntl.F_OFD_SETLK, fcntl.F_WRLCK)  # the receiver's probes hold no lock (else: BlockingIOError)
    os.close(probe)
    assert transport.remove("p1")


def _holder(path: Path) -> subprocess.Popen:
    """A process holding a sender's read lock on `path` (export_pool.lock_state) until its stdin closes."""
    hold = ("import fcntl, os, sys; from src.serving.export_pool import lock_state; "
            "lock_state(os.open(sys.argv[1], os.O_RDONLY), fcntl.F_OFD_SETLK, fcntl.F_RDLCK); "
            "print('held', flush=True); sys.stdin.read()")  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", hold, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parents[1])  # fmt: skip


def test_receivers_probing_at_once_never_see_each_other_as_the_sender(tmp_path):
    """Two threads probe a pool file nobody holds, 20,000 times each: not once does a probe report a sender (a probe
    that took a lock, as flock's did, was seen as one by a probe at the same instant)."""
    pool_file = tmp_path / f".pool-{POOL_ID}"
    pool_file.touch()
    seen = []

    def probe() -> None:
        descriptor = os.open(pool_file, os.O_RDONLY)
        seen.append(sum(sender_holds(descriptor) for _ in range(20_000)))
        os.close(descriptor)

    threads = [threading.Thread(target=probe) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [0, 0]


def test_a_new_pool_removes_the_files_of_dead_senders_only(tmp_path):
    """A killed sender's pool file stays, unlocked: the next pool opened in the directory removes it; a living
    sender's file, and names that are not pool files, stay."""
    dead, alive = tmp_path / f".pool-{'a' * 32}", tmp_path / f".pool-{'b' * 32}"
    others = [tmp_path / f".pool-{'c' * 32}.new", tmp_path / "e1-0of1.safetensors"]
    for path in (dead, alive, *others):
        path.touch()
    sender = _holder(alive)
    try:
        assert sender.stdout.readline() == "held\n"
        assert remove_dead_pools(tmp_path) == [dead.name]
        assert not dead.exists() and alive.exists() and all(path.exists() for path in others)
    finally:
        sender.communicate("")
    assert remove_dead_pools(tmp_path) == [alive.name]


POOL_EXPORT = (
    2 * 2560
)  # bytes of one export of _kv(tokens=40): keys and values [2, 2, 40, 4] float32, 10 · ALIGNMENT each


def _pool_sender(directory: str, commands, replies) -> None:
    """A sender process with an export pool of two exports: ("put", id, seed) publishes _kv(tokens=40, seed) as the
    connector passes it (a non-contiguous view) and replies its keys' offset in the pool (None: its own allocations);
    ("remove", id) replies what remove returned; ("stop",) replies how many warnings the pool logged."""
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger(export_pool_module.__name__).addHandler(handler)
    transport = Transport(directory, "device", 2 * POOL_EXPORT)
    while (command := commands.get())[0] != "stop":
        if command[0] == "remove":
            replies.put(transport.remove(command[1]))
            continue
        keys, values = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _kv(tokens=40, seed=command[2],
                                                                                  device="cuda"))  # fmt: skip
        path = _put(transport, command[1], keys, values)
        del keys, values  # the pool holds the export's only copy
        with safetensors.safe_open(path, "pt") as handle:
            replies.put(handle.metadata().get("keys_offset"))
    replies.put(len(warnings))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA IPC between two processes)")
def test_a_senders_export_pool_is_opened_once_its_regions_reused_only_once_no_receiver_reads_them(
    tmp_path, monkeypatch
):
    """Exports placed in a pool of two: a third falls back to its own allocations (said once); the receiver opens the
    pool once, reads each export's bytes; a removal refused under a lease keeps the region (the next export falls
    back, the held one still reads its own bytes); once removed its region is reused; the sender's exit is the clear
    error at the next load."""
    opened = []
    real_open = export_pool_module.open_cuda
    monkeypatch.setattr(export_pool_module, "open_cuda", lambda *a: opened.append(a) or real_open(*a))
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    sender = context.Process(target=_pool_sender, args=(str(tmp_path), commands, replies))
    sender.start()
    receiver = Transport(tmp_path)

    def put(export_id: str, seed: int) -> str | None:
        commands.put(("put", export_id, seed))
        return replies.get(timeout=120)

    def equal(export_id: str, seed: int) -> bool:
        got_k, got_v, lease = receiver.load(export_id, 5, 37, "cuda")
        keys, values = _kv(tokens=40, seed=seed)
        same = torch.equal(got_k.cpu(), keys[:, :, 5:37]) and torch.equal(got_v.cpu(), values[:, :, 5:37])
        torch.cuda.synchronize()
        del got_k, got_v
        lease.release()
        return same

    try:
        assert [put("p0", 0), put("p1", 1), put("p2", 2)] == ["0", str(POOL_EXPORT), None]  # p2: no room
        assert equal("p0", 0) and equal("p1", 1) and equal("p2", 2) and equal("p0", 0)
        assert len(opened) == 1  # the pool, once; p2's own tensors opened by the transport
        held_k, held_v, lease = receiver.load("p0", 0, 40, "cuda")
        assert lease.opened == []  # a pooled export: nothing to close at its release
        commands.put(("remove", "p0"))
        assert replies.get(timeout=60) is False  # a receiver reads it: its region stays taken
        assert put("p3", 3) is None  # so p3 finds no room
        assert torch.equal(held_k.cpu(), _kv(tokens=40, seed=0)[0])
        torch.cuda.synchronize()
        del held_k, held_v  # no view of the pool outlives its sender here
        lease.release()
        commands.put(("remove", "p0"))
        assert replies.get(timeout=60) is True
        assert put("p4", 4) == "0"  # p0's region, reused
        assert equal("p4", 4) and equal("p1", 1) and equal("p3", 3)
        assert len(opened) == 1
        commands.put(("stop",))
        assert replies.get(timeout=60) == 1  # p2 and p3 fell back: said once
    finally:
        commands.put(("stop",))
        sender.join(timeout=60)
    assert sender.exitcode == 0
    with pytest.raises(ExportError, match=r"the sender of export 'p4' is gone"):
        receiver.load("p4", 0, 40, "cuda")


def test_token_ids_cross_to_a_tensor_unchanged_through_a_c_array():
    """`id_tensor` (the sender's ids, without torch.tensor's per-int conversion) gives torch.tensor's tensor."""
    for ids in ([], [0], [151_642, 7, 2**40, 0, 3], list(range(8192))):
        made = id_tensor(ids)
        assert made.dtype == torch.int64 and torch.equal(made, torch.tensor(ids, dtype=torch.int64))
