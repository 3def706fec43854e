"""What every Triton kernel module here shares: the guarded import (CPU CI runs without triton: the torch references
only) and decoration on first use, once per interpreter setting — `triton.jit` reads TRITON_INTERPRET when it
decorates, so a test that turns the interpreter on after import still gets an interpreted kernel."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # annotations in the kernel modules still need `tl.constexpr`
    triton = None
    HAVE_TRITON = False
    tl = SimpleNamespace(constexpr=int)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def jit(kernel: Callable, interpret: bool) -> Callable:
    """`kernel` decorated with triton.jit (cached per interpreter setting: `interpret` is part of the key only)."""
    del interpret
    return triton.jit(kernel)


def unavailable(tensor) -> str | None:
    """Why no Triton kernel can run on this tensor's device here, or None."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if not tensor.is_cuda and not interpreting():
        return "tensors are on the CPU (and TRITON_INTERPRET is not set)"
    return None
