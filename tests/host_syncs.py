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
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), int(), float(), bool() of a tensor
    torch.ops.aten.nonzero.default,  # its output shape depends on the values
    torch.ops.aten.equal.default,  # returns a host bool
    torch.ops.aten.is_nonzero.default,
}


def _site() -> str:
    """The src/ or kernels/ line that asked for a read ("runtime/engine.py:256 _inputs"), or "?"."""
    frames = [f for f in traceback.extract_stack() if "/src/" in f.filename or "/kernels/" in f.filename]
    return f"{'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"


class HostReads(TorchDispatchMode):
    """Records (op, file:line function) of every host read of a tensor value inside the block."""

    def __init__(self):
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.sites.append((func.__name__, _site()))
        return func(*args, **(kwargs or {}))


class DeviceReads(TorchFunctionMode):
    """Host reads of values that would live on a GPU, counted on the CPU (where every tensor is a host tensor and
    `HostReads` cannot tell a free read of host-built positions from a device sync — nor see `int()` under
    inference mode, nor `.cpu()` / `.tolist()`): the device is modelled by provenance.

    On the device: the tensors given, every tensor made with `device=` or moved by `.to(device)` where that device is
    one of the `devices` given (by identity: an engine's and a transfer's `.device`, which on the CPU equal every
    host tensor's), `.to(other)` of a device tensor other, and every result of an op that reads one. A host read of one
    — `.cpu()`, `.tolist()`, `.item()`, int / float / bool / index of it, `torch.equal`, `.nonzero()`, a boolean-mask
    index — is recorded with the src/ or kernels/ line that asked (each a device sync on a GPU); a `.cpu()` copy is
    on the host from then on, so reading it is free. Reads of host tensors (positions built from ints) are not
    recorded.

        with DeviceReads(*model.parameters(), input_ids, devices=(engine.device,)) as reads:
            engine_handoff(...)
        assert [site for _, site in reads.sites] == ["src/maps.py:… map_refusal"]
    """

    READS = frozenset({"cpu", "tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__", "equal",
                       "nonzero", "argwhere", "masked_select", "unique", "__repr__", "__format__"})  # fmt: skip

    def __init__(self, *on_device: torch.Tensor, devices: tuple[torch.device, ...] = ()):
        super().__init__()
        self.devices = devices
        self.sites: list[tuple[str, str]] = []
        self._device: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        for t in on_device:
            self._mark(t)

    def _mark(self, t: torch.Tensor) -> None:
        self._device[id(t)] = t

    def on_device(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and self._device.get(id(t)) is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = any(self.on_device(t) for t in inputs)
        masked = name in ("__getitem__", "__setitem__") and any(
            t.dtype == torch.bool and self.on_device(t) for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)
        )
        if (device and name in self.READS) or masked:
            self.sites.append((name, _site()))
        out = func(*args, **kwargs)
        if name == "cpu":
            return out if out is not args[0] else out.detach()  # a host copy (on the CPU .cpu() would be itself)
        to_device = lambda a: any(a is d for d in self.devices)
        moved = name == "to" and any(to_device(a) or self.on_device(a) for a in (*args[1:], *kwargs.values()))
        if device or moved or to_device(kwargs.get("device")):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
            if name.endswith("_") or name == "__setitem__":  # written in place by a device value
                self._mark(args[0])
        return out
