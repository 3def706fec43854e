"""The map's stores compile to 16-byte vectors for Hopper — checked on the CPU: Triton compiles `_map_kernel`
(kernels/apply_map.py) and `_epilogue_kernel` (kernels/apply_map_epilogue.py) for sm_90 here, without a GPU, and the
PTX is read. A target layer's address is the first layer's plus a loaded offset (`LayerViews`, for vLLM's per-layer
caches): a loaded value's alignment is unknown to the compiler, which then stores 2 bytes at a time — at f02ca17 every
store of the map, its Triton kernel 1.36 → 1.68 ms at 8K tokens on an H100 (BENCHMARKS § the tenth-session lease).
`LayerViews.multiple` is the hint that gives the alignment back; without it the same kernels store 2-byte scalars
(asserted too: the test can fail).

The launch is mimicked as Triton specializes one: pointers 16-byte aligned, integer arguments that are multiples of
16 marked so, a batch of 1 a constant; the pair's shapes (Qwen2.5-Coder 0.5B → 1.5B, bf16, k = 24, 8K tokens).

The other kernels are read the same way, each at its launch's shapes and settings — the receiver engine on the 1.5B
(`rope_write`, `rms_norm`, turn attention and its combine: 12 query and 2 KV heads of 128 channels, hidden 1,536, a
16,384-slot cache), the map's de-RoPE of the 0.5B's keys, the fused fit's passes (float32 traces, 128,000 rows) —
for the width of every global access: 16 bytes where a thread's share of a contiguous row is that long, else its
whole share at once. Narrower by design: per-row and per-column values (softmax statistics, column sums, int64
positions), and tiles smaller than the program: at 4 warps (Triton's default; neither wrapper names one)
`rope_write`'s 64-channel halves and the combine's 128-channel rows give a thread one element, so both are compiled
at 1 warp too, where a lost alignment would show. The fused fit's gathered rows loaded 4 bytes at a time until
2026-12-07 — their block offset is loaded from the schedule, of unknown alignment, as the map's layer offset was —
and load 16 now that the plan carries the schedule's offset multiple (`Plan.x_multiple`, a `tl.multiple_of`)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from kernels import fused_fit
from kernels.apply_map import DEROPE_BLOCK_T, _derope_kernel, _map_kernel
from kernels.apply_map_epilogue import EPILOGUE_BLOCK_M, _epilogue_kernel, pow2, rope_pairs
from kernels.jit import HAVE_TRITON, triton
from kernels.paged_read import BLOCK_T as READ_BLOCK_T
from kernels.paged_read import _read_kernel
from kernels.rms_norm import _rms_norm_kernel
from kernels.rope_write import _rope_write_kernel
from kernels.turn_attention import BLOCK_N, BLOCK_T, _combine_kernel, _turn_attention_kernel, split_count
from src.maps import ALIGN, LayerViews, offset_multiple

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (its compiler, not a GPU)")

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
            "layers_ptr": "*i64", "heads_ptr": "*i64", "offsets_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "flag_ptr": "*i32", "beyond_ptr": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16",
            "v_ptr": "*bf16", "q_out_ptr": "*bf16", "keys_ptr": "*bf16", "values_ptr": "*bf16", "pos_ptr": "*i64",
            "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "src": "*fp32", "offsets": "*i64",
            "sw_ptr": "*fp64", "center_ptr": "*fp64", "inv_ptr": "*fp64", "out_sum": "*fp64", "out_max": "*fp64",
            "out_sq": "*fp64", "panel": "*i8", "scale_ptr": "*fp64", "tiles": "*i32", "gram": "*fp64"}  # fmt: skip
SCALARS = {"batch": 1, "bound": float("inf")}  # launch values where not 16 (a multiple of 16)
ROPE = dict(HALF=64, S_LO=1, D_HI=64, COS_HI=64, ROPE=True, CHECK=True, BLOCK_HALF=64)  # d_t 128, half layout
Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, SLOTS = 12, 2, 128, 1536, 16384 + 1  # the engine on the 1.5B, capacity 16,384
SOURCE_DIM, TOKENS = 64, 8192  # the 0.5B's keys (2 KV heads, as the 1.5B's), 8K tokens
FIT_ROWS, FIT_CHUNK, FIT_BLOCKS = 128_000, 4096, 4  # the paper's fit: 128,000 rows, b = 4,096, k = 4 source blocks


def _ptx(kernel, constants: dict, num_warps: int, args: dict | None = None, num_stages: int = 3) -> str:
    """The PTX of `kernel` (a function or a JITFunction) for sm_90 with these constexprs. Every other argument is
    its entry in `args`, else POINTERS' or SCALARS', else 16: a pointer type (16-byte aligned), or the launch's value,
    specialized as Triton's launcher does (1 a constant, a multiple of 16 marked so — unless do_not_specialize)."""
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, native_specialize_impl

    jitted = kernel if isinstance(kernel, JITFunction) else triton.jit(kernel)
    given = {**POINTERS, **SCALARS, **(args or {})}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(jitted.params):
        name, value = param.name, given.get(param.name, 16)
        if name in constants:
            kind, spec = "constexpr", constants[name]
        elif isinstance(value, str):  # a pointer
            kind, spec = value, "D"
        else:
            kind, spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(jitted, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _stores(ptx: str) -> Counter:
    return Counter(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx))


def _accesses(ptx: str) -> Counter:
    """Global loads and stores by width (`ld.global.v4.b32`, …), copies to shared memory by size (`cp.async 0x10`)."""
    found = Counter(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*", ptx))
    copies = re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)
    return found + Counter(f"cp.async {size}" for size in copies)


def _only(accesses: Counter, prefix: str, suffix: str = "") -> Counter:
    return Counter({key: n for key, n in accesses.items() if key.startswith(prefix) and key.endswith(suffix)})


def _map_ptx(multiple: int, slots: bool, single_dot: bool = False) -> str:
    constants = dict(ROPE, K_SEL=24, FAN_IN=1, D_S=64, D_T=128, SLOTS=slots, PRECISION="ieee", UPCAST=False,
                     LAYERS_INNER=True, OFFSET_MULTIPLE=multiple, SINGLE_DOT=single_dot, BLOCK_M=128,
                     BLOCK_K=64)  # fmt: skip
    return _ptx(_map_kernel, constants, num_warps=8)


def _map_stores(multiple: int, slots: bool) -> Counter:
    return _stores(_map_ptx(multiple, slots))


def _epilogue_stores(multiple: int, slots: bool) -> Counter:
    constants = dict(ROPE, D_T=128, SLOTS=slots, OFFSET_MULTIPLE=multiple, BLOCK_M=EPILOGUE_BLOCK_M)
    return _stores(_ptx(_epilogue_kernel, constants, num_warps=4))


@pytest.mark.parametrize("slots", [False, True], ids=["rows", "slots"])
@pytest.mark.parametrize("stores", [_map_stores, _epilogue_stores], ids=["map", "epilogue"])
def test_the_maps_stores_are_16_byte_vectors_given_the_offsets_multiple(stores, slots):
    vectors, scalars = stores(ALIGN, slots), stores(1, slots)
    assert set(vectors) == {"st.global.v4.b32"}, vectors
    assert set(scalars) == {"st.global.b16"} and sum(scalars.values()) == 8 * sum(vectors.values()), scalars


@pytest.mark.parametrize(("single_dot", "width"), [(False, 64), (True, 128)], ids=["two-dots", "single-dot"])
def test_the_maps_dot_form_sets_the_wgmma_width_and_keeps_every_access(single_dot, width):
    """`KernelConfig.single_dot`: one m64n128 wgmma per 16 channels instead of two m64n64 (the RoPE halves), with the
    same 16-byte copies of the gathered rows and of W into shared memory, and the same 16-byte stores."""
    ptx = _map_ptx(ALIGN, False, single_dot)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == {str(width)}
    accesses = _accesses(ptx)
    copies = {"cp.async 0x10": 16, "cp.async 0x8": 3}  # the gathered rows and W; the int64 indices
    assert _only(accesses, "cp.async") == copies, accesses
    assert _only(accesses, "st.") == {"st.global.v4.b32": 8}, accesses


def test_the_offsets_multiple_is_the_largest_power_of_two_up_to_align_dividing_every_offset():
    assert offset_multiple([0, 4096, -8192]) == ALIGN and offset_multiple([0, 24, 40]) == 8
    assert offset_multiple([0, 6]) == 2 and offset_multiple([0, 7, 16]) == 1 and offset_multiple([0]) == ALIGN
    stacked = torch.zeros(3, 2, 5, 3)  # a layer step of 30 elements
    assert LayerViews.stacked(stacked).multiple == 2 and LayerViews.stacked(torch.zeros(3, 2, 8)).multiple == ALIGN
    assert LayerViews.stacked(torch.zeros(1, 7).expand(3, 7)).multiple == ALIGN  # one layer, broadcast: step 0
    base = torch.zeros(64)
    views = LayerViews.of([base[0:8], base[24:32], base[40:48]])
    assert views.multiple == 8 and views.offsets.tolist() == [0, 24, 40]


@pytest.mark.parametrize(("num_warps", "width"), [(4, "b16"), (1, "b32")], ids=["launch", "one-warp"])
def test_rope_write_moves_a_threads_channels_at_once(num_warps, width):
    # q, k, v: the projections viewed [T, heads, 128]; the engine's cos / sin tables in bf16
    args = {"cos_ptr": "*bf16", "sin_ptr": "*bf16", "sqt": Q_HEADS * HEAD_DIM, "sqh": HEAD_DIM,
            "skt": KV_HEADS * HEAD_DIM, "skh": HEAD_DIM, "svt": KV_HEADS * HEAD_DIM, "svh": HEAD_DIM,
            "slots": SLOTS}  # fmt: skip
    constants = dict(Q_HEADS=Q_HEADS, KV_HEADS=KV_HEADS, HALF=HEAD_DIM // 2)
    accesses = _accesses(_ptx(_rope_write_kernel, constants, num_warps, args))
    # a 64-channel half over 128 threads (the launch) is 1 channel a thread, over 32 is 2; position and slot: int64
    assert accesses == {"ld.global.b64": 2, f"ld.global.{width}": 8, f"st.global.{width}": 4}, accesses


def test_rms_norm_moves_16_byte_vectors():
    args = {"columns": HIDDEN, "eps": 1e-6, "stride_x": HIDDEN}
    accesses = _accesses(_ptx(_rms_norm_kernel, dict(BLOCK=triton.next_power_of_2(HIDDEN)), 4, args))
    assert accesses == {"ld.global.v4.b32": 4, "st.global.v4.b32": 2}, accesses  # 16 bf16 a thread of x, weight, out


@pytest.mark.parametrize("seq", [1, 64], ids=["decode", "turn"])
def test_turn_attention_moves_16_byte_vectors_but_per_query_values(seq):
    splits = split_count(Q_HEADS, seq, SLOTS)
    constants = dict(SPLIT_LEN=math.ceil(math.ceil(SLOTS / splits) / BLOCK_N) * BLOCK_N, GROUP=Q_HEADS // KV_HEADS,
                     HEAD_DIM=HEAD_DIM, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, IEEE=False, UPCAST=False)  # fmt: skip
    args = {"seq": seq, "scale": HEAD_DIM**-0.5, "sqh": HEAD_DIM, "sqt": Q_HEADS * HEAD_DIM, "skh": SLOTS * HEAD_DIM,
            "sks": HEAD_DIM, "svh": SLOTS * HEAD_DIM, "svs": HEAD_DIM}  # fmt: skip
    accesses = _accesses(_ptx(_turn_attention_kernel, constants, 4, args))
    # q [16, 128], k and v [64, 128] bf16: 2 + 8 + 8 vectors a thread; the partial acc [16, 128] fp32: 4
    vectors = {"ld.global.v4.b32": 18, "st.global.v4.b32": 4}
    # by design: the int64 positions, the running max and sum — one value a query
    assert accesses == {**vectors, "ld.global.b64": 3, "st.global.b32": 2}, accesses


@pytest.mark.parametrize(("num_warps", "load", "store"), [(4, "b32", "b16"), (1, "v4.b32", "v2.b32")],
                         ids=["launch", "one-warp"])  # fmt: skip
def test_turn_attention_combine_moves_a_threads_channels_at_once(num_warps, load, store):
    constants = dict(SPLITS=split_count(Q_HEADS, 1, SLOTS), HEAD_DIM=HEAD_DIM)  # a decode step's splits
    accesses = _accesses(_ptx(_combine_kernel, constants, num_warps, {"seq": 1}))
    # a 128-channel row over 128 threads (the launch) is 1 channel a thread, over 32 is 4; a split's max and sum: fp32
    assert _only(accesses, "st.") == {f"st.global.{store}": 1}, accesses
    assert set(_only(accesses, "ld.")) == {"ld.global.b32", f"ld.global.{load}"}, accesses


def test_derope_moves_a_threads_channels_at_once():
    half = SOURCE_DIM // 2
    constants = dict(HALF=half, HEAD_DIM=SOURCE_DIM, **rope_pairs("half", half), BLOCK_T=DEROPE_BLOCK_T,
                     BLOCK_HALF=pow2(half), BLOCK_PASS=pow2(SOURCE_DIM - 2 * half))  # fmt: skip
    layer = KV_HEADS * TOKENS * SOURCE_DIM  # keys [L_s, B, H_s, T, d_s], one table for the batch
    args = {"seq": TOKENS, "heads": KV_HEADS, "sxl": layer, "sxb": layer, "sxh": TOKENS * SOURCE_DIM,
            "sxt": SOURCE_DIM, "scb": 0}  # fmt: skip
    accesses = _accesses(_ptx(_derope_kernel, constants, 4, args))
    # a [16 tokens, 32 pairs] half over 128 threads: 4 channels a thread, 8 bytes of bf16 keys, 16 of fp32 tables
    assert accesses == {"ld.global.v2.b32": 2, "ld.global.v4.b32": 4, "st.global.v2.b32": 2}, accesses


@pytest.mark.parametrize("multiple", [ALIGN, 1], ids=["hinted", "unhinted"])
def test_the_exports_read_moves_16_byte_vectors_given_the_offsets_multiple(multiple):
    """The sender's export read (kernels/paged_read.py) of the 0.5B's flash caches (2 KV heads × 64 channels, blocks of
    16, NHD): each layer's K / V address is a loaded offset from the first, as the map's stores are — hinted, a thread
    loads and stores its 64 channels' share 16 bytes at a time; unhinted, its loads are 2-byte scalars."""
    args = {"k_offsets_ptr": "*i64", "v_offsets_ptr": "*i64", "slots_ptr": "*i64", "out_k_ptr": "*bf16",
            "out_v_ptr": "*bf16", "seq": TOKENS, "heads": KV_HEADS, "block_size": 16,
            "s_b": 16 * KV_HEADS * 2 * SOURCE_DIM, "s_h": 2 * SOURCE_DIM, "s_n": KV_HEADS * 2 * SOURCE_DIM}  # fmt: skip
    constants = dict(HEAD_DIM=SOURCE_DIM, OFFSET_MULTIPLE=multiple, BLOCK=READ_BLOCK_T)
    accesses = _accesses(_ptx(_read_kernel, constants, 4, args))
    loads = {"ld.global.v4.b32": 8} if multiple == ALIGN else {"ld.global.b16": 64}  # K and V: [64, 64] bf16 each
    assert accesses == {**loads, "st.global.v4.b32": 8, "ld.global.b64": 6}, accesses  # b64: slots and offsets


@pytest.mark.parametrize("multiple", [ALIGN, 1], ids=["hinted", "unhinted"])
@pytest.mark.parametrize("source", ["x", "y"])
def test_fused_fit_gathers_rows_and_stores_its_panel_16_bytes_at_a_time(source, multiple):
    blocks, width, col0 = (FIT_BLOCKS, SOURCE_DIM, 0) if source == "x" else (1, HEAD_DIM, FIT_BLOCKS * SOURCE_DIM)
    m = FIT_BLOCKS * SOURCE_DIM + HEAD_DIM  # p + d_t, already a multiple of 128 (m_pad)
    passes, segments, block_c = fused_fit.PassConfig(), FIT_CHUNK // fused_fit.SEGMENT_ROWS, min(width, 128)
    args = {"w_ptr": "*fp64", "rows": FIT_ROWS, "chunk": FIT_CHUNK, "segments": segments, "stride_n": width,
            "stride_d": 1, "width": width, "col0": col0, "m": m, "nb": blocks, "heads": KV_HEADS, "row0": FIT_CHUNK,
            "rows_here": FIT_CHUNK, "m_pad": m, "b_pad": FIT_CHUNK}  # fmt: skip
    seg_rows = fused_fit._round_up(-(-FIT_CHUNK // segments), passes.stats_rows)
    constants = dict(HAS_W=True, SEG_ROWS=seg_rows, BR=passes.stats_rows, BC=block_c, OFFSET_MULTIPLE=multiple)
    stats = _accesses(_ptx(fused_fit._stats_kernel, constants, passes.stats_warps, args))
    constants = dict(HAS_W=True, SLICES=fused_fit.SLICES, RADIX=fused_fit.RADIX, BR=passes.panel_rows, BC=block_c,
                     OFFSET_MULTIPLE=multiple)  # fmt: skip
    panel = _accesses(_ptx(fused_fit._panel_kernel, constants, passes.panel_warps, args))
    share = lambda rows, warps: rows * block_c // (32 * warps)  # a thread's elements of the [rows, columns] tile
    # the digits, 16 int8 rows a vector, 4 slices
    slices = fused_fit.SLICES * share(passes.panel_rows, passes.panel_warps) // 16
    assert _only(panel, "st.") == {"st.global.v4.b32": slices}, panel
    # by design: the column sums, maxima and squares, float64 scalars of a [columns] reduction
    assert _only(stats, "st.") == {"st.global.b64": 3}, stats
    # the gathered float32 rows: 4 a vector given the schedule's offset multiple (Plan.x_multiple), one at a time
    # without it — a loaded offset's alignment is unknown to the compiler
    for loads, (rows, warps) in ((stats, (passes.stats_rows, passes.stats_warps)),
                                 (panel, (passes.panel_rows, passes.panel_warps))):  # fmt: skip
        if multiple == ALIGN:
            assert _only(loads, "ld.", "b32") == {"ld.global.v4.b32": share(rows, warps) // 4}, loads
        else:
            assert _only(loads, "ld.", "b32") == {"ld.global.b32": share(rows, warps)}, loads


def test_the_fit_plan_carries_its_schedules_offset_multiples():
    rows_x, rows_y = torch.zeros(3, 2, 40, 16), torch.zeros(2, 40, 8)  # [L_s, H_s, n, d_s], [H_t, n, d_t]
    plan = fused_fit.make_plan(rows_x, rows_y, torch.tensor([0, 2]), torch.tensor([[0], [1]]), 64)
    assert (plan.x_multiple, plan.y_multiple) == (ALIGN, ALIGN)  # strides 1,280 / 640 and 320 elements
    odd = torch.zeros(3, 2, 41, 16)[:, :, :40]  # a layer and head step of 1,312 / 656: multiples of 16
    assert fused_fit.make_plan(odd, rows_y, torch.tensor([1]), torch.tensor([[1], [0]]), 64).x_multiple == ALIGN
    odd = torch.zeros(3, 2, 40, 17)[..., :16]  # steps of 1,360 / 680 elements: 8 divides both
    assert fused_fit.make_plan(odd, rows_y, torch.tensor([1]), torch.tensor([[1], [0]]), 64).x_multiple == 8


def test_fused_fit_gram_copies_and_flushes_16_bytes_at_a_time():
    config, m = fused_fit.GramConfig(), FIT_BLOCKS * SOURCE_DIM + HEAD_DIM
    constants = dict(B_PAD=FIT_CHUNK, LEVELS=5, RADIX=fused_fit.RADIX, BM=config.block_m, BN=config.block_n,
                     BK=config.block_k)  # fmt: skip
    accesses = _accesses(_ptx(fused_fit._gram_kernel, constants, config.num_warps, {"m_pad": m}, config.num_stages))
    # 8 int8 digit tiles [64, 64] a K step, 32 bytes a thread each: the 2 prologue steps and the loop's
    assert _only(accesses, "cp.async") == {"cp.async 0x10": 8 * 2 * config.num_stages}, accesses
    # the float64 Gram tile [64, 64], read and written back 2 values at a time (and the row and column scales)
    assert _only(accesses, "st.") == {"st.global.v2.b64": 16} and accesses["ld.global.v2.b64"] == 16 + 8, accesses
