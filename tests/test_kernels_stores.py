"""The map's stores compile to 16-byte vectors for Hopper — checked on the CPU: Triton compiles `_map_kernel`
(kernels/apply_map.py) and `_epilogue_kernel` (kernels/apply_map_epilogue.py) for sm_90 here, without a GPU, and the
PTX is read. A target layer's address is the first layer's plus a loaded offset (`LayerViews`, for vLLM's per-layer
caches): a loaded value's alignment is unknown to the compiler, which then stores 2 bytes at a time — at f02ca17 every
store of the map, its Triton kernel 1.36 → 1.68 ms at 8K tokens on an H100 (BENCHMARKS § the tenth-session lease).
`LayerViews.multiple` is the hint that gives the alignment back; without it the same kernels store 2-byte scalars
(asserted too: the test can fail).

The launch is mimicked as Triton specializes one: pointers 16-byte aligned, integer arguments that are multiples of
16 marked so, a batch of 1 a constant; the pair's shapes (Qwen2.5-Coder 0.5B → 1.5B, bf16, k = 24, 8K tokens)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from kernels.apply_map import _map_kernel
from kernels.apply_map_epilogue import EPILOGUE_BLOCK_M, _epilogue_kernel
from kernels.jit import HAVE_TRITON, triton
from src.maps import ALIGN, LayerViews, offset_multiple

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (its compiler, not a GPU)")

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
            "layers_ptr": "*i64", "heads_ptr": "*i64", "offsets_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "flag_ptr": "*i32", "beyond_ptr": "*i32"}  # fmt: skip
ROPE = dict(HALF=64, S_LO=1, D_HI=64, COS_HI=64, ROPE=True, CHECK=True, BLOCK_HALF=64)  # d_t 128, half layout


def _ptx(kernel, constants: dict, num_warps: int) -> str:
    """The PTX of `kernel` for sm_90 with these constexprs; every other argument a pointer (POINTERS), the float
    `bound`, `batch` = 1, or an int32 that is a multiple of 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jitted = triton.jit(kernel)
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(jitted.arg_names):
        if name in constants or name == "batch":
            signature[name], constexprs[(index,)] = "constexpr", constants.get(name, 1)
        elif name == "bound":
            signature[name] = "fp32"
        else:
            signature[name] = POINTERS.get(name, "i32")
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(jitted, signature, constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return compiled.asm["ptx"]


def _stores(ptx: str) -> Counter:
    return Counter(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx))


def _map_stores(multiple: int, slots: bool) -> Counter:
    constants = dict(ROPE, K_SEL=24, FAN_IN=1, D_S=64, D_T=128, SLOTS=slots, PRECISION="ieee", UPCAST=False,
                     LAYERS_INNER=True, OFFSET_MULTIPLE=multiple, BLOCK_M=128, BLOCK_K=64)  # fmt: skip
    return _stores(_ptx(_map_kernel, constants, num_warps=8))


def _epilogue_stores(multiple: int, slots: bool) -> Counter:
    constants = dict(ROPE, D_T=128, SLOTS=slots, OFFSET_MULTIPLE=multiple, BLOCK_M=EPILOGUE_BLOCK_M)
    return _stores(_ptx(_epilogue_kernel, constants, num_warps=4))


@pytest.mark.parametrize("slots", [False, True], ids=["rows", "slots"])
@pytest.mark.parametrize("stores", [_map_stores, _epilogue_stores], ids=["map", "epilogue"])
def test_the_maps_stores_are_16_byte_vectors_given_the_offsets_multiple(stores, slots):
    vectors, scalars = stores(ALIGN, slots), stores(1, slots)
    assert set(vectors) == {"st.global.v4.b32"}, vectors
    assert set(scalars) == {"st.global.b16"} and sum(scalars.values()) == 8 * sum(vectors.values()), scalars


def test_the_offsets_multiple_is_the_largest_power_of_two_up_to_align_dividing_every_offset():
    assert offset_multiple([0, 4096, -8192]) == ALIGN and offset_multiple([0, 24, 40]) == 8
    assert offset_multiple([0, 6]) == 2 and offset_multiple([0, 7, 16]) == 1 and offset_multiple([0]) == ALIGN
    stacked = torch.zeros(3, 2, 5, 3)  # a layer step of 30 elements
    assert LayerViews.stacked(stacked).multiple == 2 and LayerViews.stacked(torch.zeros(3, 2, 8)).multiple == ALIGN
    assert LayerViews.stacked(torch.zeros(1, 7).expand(3, 7)).multiple == ALIGN  # one layer, broadcast: step 0
    base = torch.zeros(64)
    views = LayerViews.of([base[0:8], base[24:32], base[40:48]])
    assert views.multiple == 8 and views.offsets.tolist() == [0, 24, 40]
