"""Host reads of tensor values, counted on the CPU: the ops that make the host wait for a GPU (`.item()`, `int()`,
`float()`, `bool()` of a tensor, `.nonzero()`, `torch.equal`), each with the line of src/ or kernels/ that asked.

    with HostReads() as reads:
        transfer.map_into(...)
    assert reads.sites == []

On a GPU each is a device sync when its tensor lives there (a read of a host-side tensor, e.g. positions built on
the host, is free: the sites say which). Copies to the host (`.cpu()`, `.tolist()`) do not dispatch on a CPU tensor
and are not seen here: the code is read for those.
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), int(), float(), bool() of a tensor
    torch.ops.aten.nonzero.default,  # its output shape depends on the values
    torch.ops.aten.equal.default,  # returns a host bool
    torch.ops.aten.is_nonzero.default,
}


class HostReads(TorchDispatchMode):
    """Records (op, file:line function) of every host read of a tensor value inside the block."""

    def __init__(self):
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            frames = [f for f in traceback.extract_stack() if "/src/" in f.filename or "/kernels/" in f.filename]
            where = f"{frames[-1].filename.split('/')[-2]}/{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} " \
                    f"{frames[-1].name}" if frames else "?"  # fmt: skip
            self.sites.append((func.__name__, where))
        return func(*args, **(kwargs or {}))
