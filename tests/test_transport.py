"""The export transport's memories and leases (src/serving/transport.py): a receiver's lease keeps its sender from
removing an export mid-read, a part removed under a reader is refused, a device export's metadata is checked before
any memory is opened — and, on a GPU, a device export crosses processes through CUDA IPC with no copy to the host."""

from __future__ import annotations

import fcntl
import json
import multiprocessing

import pytest
import safetensors.torch
import torch

from src.serving import transport as transport_module
from src.serving.config import connector_config
from src.serving.transport import ExportError, Transport, publish


def _kv(layers=2, heads=2, tokens=6, d=4, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(layers, heads, tokens, d, generator=generator).to(device) for _ in range(2))


def _put(transport: Transport, export_id: str, keys: torch.Tensor, values: torch.Tensor) -> None:
    transport.put(
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
    assert list(tmp_path.iterdir()) == []


def test_a_worker_on_a_cpu_refuses_device_exports_before_any_model_loads(tmp_path, monkeypatch):
    """export_memory "device" on an engine that is not on CUDA: the worker side refuses at its start, naming the
    setting, before the TP group is read or any model loads (both would fail or cost minutes first)."""
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from types import SimpleNamespace as NS

    from src.serving import routes, vllm_connector

    monkeypatch.setattr(routes, "load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    extra = {"export_memory": "device", "transport": str(tmp_path)}
    config = NS(kv_transfer_config=NS(kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
                cache_config=NS(block_size=32), model_config=NS(model=str(tmp_path), tokenizer=None),
                device_config=NS(device=torch.device("cpu")))  # fmt: skip
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
