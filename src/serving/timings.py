"""Where a handoff's host time goes inside vLLM, opt-in: with `KVRELAY_TIMINGS=<path>` in an engine's environment
(read when its connector starts), the connector appends one JSON line per phase per request to <path>:

    {"role": "scheduler" | "worker", "phase": "claim", "request": "<vLLM's request id>", "tokens": 4096,
     "ms": 0.41, "pid": 1234}

tokens: the request's prompt on the scheduler, the mapped span on the worker (an export: its prompt). ms: host wall
time (`time.perf_counter`) around the phase's Python — the GPU work it queues is not included, and no host sync is
added (a phase that waits by design includes its wait: the worker's "check" waits for the map's flags). Every
process of an engine appends to the same file (one `os.write` of one line, O_APPEND). Unset, `phase` hands back one
shared null context: no clock read, no file. The phases, in the order one handoff meets them:

    scheduler  header   the export's metadata (Transport.header)            export  the Save of a prompt's blocks
               claim    the decision (claim.claim)
               rekey    the provenance keys from the first mapped block (provenance.rekey)
               alloc    the Load, once vLLM allocated the span's blocks
    worker     load     the span from the transport (Transport.load)        export  the K/V read and published
               slots    the span's slots on the device
               map      the mapper (routes.Bound.map; Bound.map_into: straight into the blocks)
               write    the paged blocks (paged.write_mapped)
               guard    the magnitude guard's peak
               check    the finiteness flags and the peak (or beyond flags) read once the map has run (not
                        the forward queued after it: routes.LoadFlags), the lease released
                        (get_block_ids_with_load_errors)

"write" and "guard" do not occur where the map stores into the blocks itself (paged_writer "stacked" on
FlashAttention's layout, paged.Writer): its "map" includes the stores, and the guard is the kernel's beyond flags.

On CUDA the worker also writes the map's **device** time, role "device", phase "map": two CUDA events (`mark`), one
queued before the map's first kernel and one after its last (after the write and the guard where those run), read at
the check, which waits for the map anyway (`elapsed`: no sync added). Its ms is the GPU's time between the two points —
the map's kernels, and anything else the stream ran between them — so a "check" that waits longer than it says the
map started late (work queued before it), not that it ran slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from contextlib import AbstractContextManager

import torch

ENV = "KVRELAY_TIMINGS"
PHASES = {
    "scheduler": ("header", "claim", "rekey", "alloc"),
    "worker": ("load", "slots", "map", "write", "guard", "check"),
}  # a handoff's phases; an export adds "export" on either side
_OFF = contextlib.nullcontext()
Span = tuple[torch.cuda.Event | None, torch.cuda.Event | None]  # a device span's two `mark`s (None: not timed)


class _Phase:
    """One phase being timed: its line is written when it ends (also when it raises)."""

    __slots__ = ("timings", "phase", "request_id", "tokens", "began")

    def __init__(self, timings: Timings, phase: str, request_id: str, tokens: int):
        self.timings, self.phase, self.request_id, self.tokens = timings, phase, request_id, tokens

    def __enter__(self) -> None:
        self.began = time.perf_counter()

    def __exit__(self, *exc) -> None:
        ms = (time.perf_counter() - self.began) * 1e3
        self.timings.write(self.phase, self.request_id, self.tokens, ms)


class Timings:
    """The timing lines of one connector role (module docstring), appended to `path`; off where it is None."""

    def __init__(self, role: str, path: str | None = None):
        self.role, self.path = role, path
        self._descriptor: int | None = None

    @classmethod
    def from_environment(cls, role: str) -> Timings:
        return cls(role, os.environ.get(ENV) or None)

    def phase(self, phase: str, request_id: str, tokens: int) -> AbstractContextManager[None]:
        """`with timings.phase("claim", request_id, n): ...` times the block; a shared no-op when off."""
        return _OFF if self.path is None else _Phase(self, phase, request_id, tokens)

    def mark(self, device: torch.device) -> torch.cuda.Event | None:
        """A CUDA event queued on the current stream of `device` (module docstring); None when off or not on CUDA."""
        if self.path is None or device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def elapsed(self, span: Span, request_id: str, tokens: int) -> None:
        """The device line of a span (began, ended) from two `mark`s, once its end has run; nothing where unmarked."""
        began, ended = span
        if began is not None and ended is not None:
            ended.synchronize()  # the check has waited for the map's flags, queued before `ended`: no extra wait
            self.write("map", request_id, tokens, began.elapsed_time(ended), role="device")

    def write(self, phase: str, request_id: str, tokens: int, ms: float, role: str | None = None) -> None:
        if self._descriptor is None:
            self._descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = {"role": role or self.role, "phase": phase, "request": request_id, "tokens": tokens, "ms": round(ms, 4),
                "pid": os.getpid()}  # fmt: skip
        os.write(self._descriptor, (json.dumps(line) + "\n").encode())
