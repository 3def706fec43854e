"""A CUDA tensor shared with another process of the host by CUDA IPC, through torch's own handles (a device export's
keys and values, src/serving/transport.py): the sender describes it (`share_cuda`, JSON-able), a receiver maps it
into its own address space (`open_cuda`) — no copy through the host.
"""

from __future__ import annotations

import base64

import torch


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


# torch counts a shared block's consumers in a shared-memory counter: 1 when shared, − 1 when a consumer's storage
# dies, and a producer frees the block only at a count ≤ 0 — read as unsigned (torch ≥ 2.1), so one decrement too many
# (a second receiver of one share) parks the block in the producer's "limbo" for good. A share here has any number
# of receivers, or none: the sender gives its count back at once (0), and a receiver names a counter that does not
# exist (its decrement finds nothing; torch takes that as a producer gone), so the count stays 0 and the sender's
# removal frees the memory — the file locks alone keep it alive while it is read.
NO_COUNTER = b"/kvrelay-no-ipc-counter"


def share_cuda(tensor: torch.Tensor) -> dict:
    """A CUDA tensor's IPC description (JSON-able): torch's own handle, event and byte offsets; torch's consumer count
    given back (above)."""
    storage = tensor.untyped_storage()
    device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
    torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
    return {"device": device, "handle": _b64(handle), "bytes": size, "offset": offset, "event": _b64(event),
            "sync": sync, "storage_offset": tensor.storage_offset(), "stride": list(tensor.stride())}  # fmt: skip


def open_cuda(shared: dict, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
    """The tensor `share_cuda` described, mapped into this process on its device index `device`, counted by no one
    (above); the current stream waits on the sender's event (no host sync)."""
    decode = lambda key: b"" if shared[key] is None else base64.b64decode(shared[key])  # noqa: E731
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, decode("handle"), shared["bytes"], shared["offset"], NO_COUNTER, 0, decode("event"), shared["sync"]
    )
    return torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(
        storage, shared["storage_offset"], shape, shared["stride"]
    )


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)
