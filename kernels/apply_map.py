"""Fused mapper application: a source KV cache → the target's K/V in cache layout, in three kernel launches.

Per target layer ℓ, target head h and token t — what `src.apply.KVTransfer` computes (Eqs. 7, 11):

    x_ℓh = [content(source layer S_ℓ[j], source head a_h[g])  for j < k, g < f]     # [T, p], p = k·f·d_s
    k̂ = RoPE_target(x_K · W_K[ℓ, h] + b_K[ℓ, h]),   v̂ = x_V · W_V[ℓ, h] + b_V[ℓ, h]   # [T, d_t]

Fast path (Triton, CUDA): `_derope_kernel` takes the source RoPE off every source key once (a source layer
feeds ≈ k·L_t/L_s target layers, so this beats de-rotating inside every GEMM prologue) and rounds it as the
reference does; `_map_kernel`, once per component, gathers by pointer arithmetic inside its K-loop (no feature
copy), multiplies with `tl.dot` (compute-dtype inputs, fp32 accumulator), adds the bias, rotates the fp32
accumulator with the target's RoPE, casts and stores straight into [L_t, B, H_t, T, d_t] — each target layer
at its own offset from the first (`LayerViews`: a stacked tensor's constant step, or per-layer allocations at any
addresses, as vLLM's GPU runner gives its paged caches), at slots when given. Each program
computes one target head's columns as two halves — the two members of every RoPE pair — so the rotation needs
no register shuffles; the interleaved layout is the same code with stride-2 column offsets. `KernelConfig.single_dot`
multiplies both halves in one dot of 2·BLOCK_HALF columns and splits the accumulator after the K-loop: on Hopper one
m64n128 wgmma where the halves issue two m64n64 (tests/test_kernels_stores.py reads the PTX); the default for 16-bit
inputs since an H100 timed it (`default_config`).
Full-Head (every target head reads the same source heads) is the same kernel: the H_t programs of one token block read the
same feature tiles back to back, i.e. one GEMM against W viewed as [p, H_t·d_t] tiled by head, out of L2.

`map_cache_ref` is the pure-torch reference (`src.apply.map_layers`) and the fallback: no triton, CPU
tensors, partial rotary on the target, source head dims that are not a multiple of 16.
Triton is optional (guarded import; kernels are decorated on first use): without it this module imports and falls back.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.apply_map_epilogue import pow2, rope_pairs, rope_table, store_mapped
from kernels.apply_map_gemm import PackedMapper, gemm_unsupported, head_products, map_cache_gemm, packed_weights
from kernels.jit import HAVE_TRITON, interpreting, jit, tl, triton
from src.artifact import Mapper
from src.maps import LayerViews, layer_groups, map_layers, set_flags, shares_heads, store_slots
from src.rope import apply_rope, remove_rope

LAYOUTS = ("half", "interleaved")
DEROPE_BLOCK_T = 16  # tokens per `_derope_kernel` program (memory bound: small tiles, few registers)
Layers = torch.Tensor | Sequence[torch.Tensor]  # stacked [L_s, B, H_s, T, d_s] or L_s tensors [B, H_s, T, d_s]
Destination = torch.Tensor | LayerViews  # a map's stores of one component: stacked [L_t, ...], or per-layer views


@dataclass(frozen=True)
class KernelConfig:
    """Tile of `_map_kernel`: block_m tokens × one target head; block_k feature channels per K step."""

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    layers_inner: bool = True  # launch order: every target layer of one token block together (False: layer by layer)
    single_dot: bool = False  # both RoPE halves in one tl.dot of 2·BLOCK_HALF columns, split after the K-loop


def default_config(seq: int, compute_dtype: torch.dtype, head_dim: int = 128) -> KernelConfig:
    """fp32 tiles take half the channels per stage (shared memory); short prefixes use 64-token blocks. 16-bit
    inputs and target heads of ≤ 128 channels: one dot at 4 warps, the fastest of the sweep at 16K on an H100 (1.145
    ms at 8K against 1.376 for two dots at 8 warps; results/vllm-h100-2026-12-07c/apply.json). Wider heads keep two
    dots at 8 warps: one dot's 128 × 256 fp32 accumulator over 4 warps spills (ptxas, sm_90); fp32 too (not timed)."""
    block_m = 64 if seq <= 64 else 128
    if compute_dtype == torch.float32:
        return KernelConfig(block_m=block_m, block_k=32)
    if head_dim > 128:
        return KernelConfig(block_m=block_m, block_k=64)
    return KernelConfig(block_m=block_m, block_k=64, num_warps=4, single_dot=True)


# --------------------------------------------------------------------------- kernels


def _derope_kernel(
    x_ptr,  # [L_s, B, H_s, T, d_s] RoPE'd source keys, channels contiguous
    out_ptr,  # [L_s, B, H_s, T, d_s] content keys, contiguous, compute dtype
    cos_ptr,  # [B or 1, T, rope_dim] float32
    sin_ptr,
    seq,
    batch,
    heads,
    sxl,
    sxb,
    sxh,
    sxt,
    scb,  # batch stride of cos/sin (0: one table for the batch)
    HALF: tl.constexpr,  # rope_dim // 2 rotated pairs
    HEAD_DIM: tl.constexpr,
    S_LO: tl.constexpr,  # channel of pair i: lo = i·S_LO, hi = i·S_LO + D_HI ("half": 1, HALF; "interleaved": 2, 1)
    D_HI: tl.constexpr,
    COS_HI: tl.constexpr,  # column of cos/sin for a pair's hi member: HALF ("half") or 0 ("interleaved")
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # next_pow2(HEAD_DIM − 2·HALF), 0 for full rotary
):
    """content = R(θ)ᵀ·key / (cos² + sin²) in fp32, rounded to the cache dtype, stored in the compute dtype."""
    row = tl.program_id(0)  # over (L_s, B, H_s): grid axis 0, the only one not capped at 65,535
    h, b, layer = row % heads, (row // heads) % batch, row // (heads * batch)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask = (t < seq)[:, None] & (i < HALF)[None, :]  # [BLOCK_T, BLOCK_HALF]
    x_row = x_ptr + layer.to(tl.int64) * sxl + b.to(tl.int64) * sxb + h * sxh + t[:, None] * sxt  # [BLOCK_T, 1]
    lo = tl.load(x_row + i[None, :] * S_LO, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_HALF]
    hi = tl.load(x_row + i[None, :] * S_LO + D_HI, mask=mask, other=0.0).to(tl.float32)
    c_row = b * scb + t[:, None] * (2 * HALF)  # [BLOCK_T, 1]
    cos_lo = tl.load(cos_ptr + c_row + i[None, :], mask=mask, other=1.0)  # [BLOCK_T, BLOCK_HALF]
    sin_lo = tl.load(sin_ptr + c_row + i[None, :], mask=mask, other=0.0)
    cos_hi = tl.load(cos_ptr + c_row + COS_HI + i[None, :], mask=mask, other=1.0)
    sin_hi = tl.load(sin_ptr + c_row + COS_HI + i[None, :], mask=mask, other=0.0)
    content_lo = (lo * cos_lo + hi * sin_lo) / (cos_lo * cos_lo + sin_lo * sin_lo)  # remove_rope, lo member
    content_hi = (hi * cos_hi - lo * sin_hi) / (cos_hi * cos_hi + sin_hi * sin_hi)
    cache_dtype = x_ptr.dtype.element_ty  # (one name per statement: codegen cannot unpack a tuple of dtypes)
    out_dtype = out_ptr.dtype.element_ty
    out_row = out_ptr + (row.to(tl.int64) * seq + t[:, None]) * HEAD_DIM  # [BLOCK_T, 1]
    tl.store(out_row + i[None, :] * S_LO, content_lo.to(cache_dtype).to(out_dtype), mask=mask)
    tl.store(out_row + i[None, :] * S_LO + D_HI, content_hi.to(cache_dtype).to(out_dtype), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: the channels past rope_dim pass through
        c = 2 * HALF + tl.arange(0, BLOCK_PASS)  # [BLOCK_PASS]
        pass_mask = (t < seq)[:, None] & (c < HEAD_DIM)[None, :]  # [BLOCK_T, BLOCK_PASS]
        kept = tl.load(x_row + c[None, :], mask=pass_mask, other=0.0)  # [BLOCK_T, BLOCK_PASS]
        tl.store(out_row + c[None, :], kept.to(out_dtype), mask=pass_mask)


def _map_kernel(
    x_ptr,  # [L_s, B, H_s, T, d_s] source content rows (keys de-rotated, or values), channels contiguous
    w_ptr,  # [L_t, H_t, p, d_t] contiguous, compute dtype
    bias_ptr,  # [L_t, H_t, d_t]
    layers_ptr,  # [L_t, K_SEL] int64 source layer of each selected block
    heads_ptr,  # [H_t, FAN_IN] int64 source heads of each target head
    out_ptr,  # layer 0's [B, H_t, T, d_t], or with SLOTS [N_blocks, H_t, block_size, d_t]; channels contiguous
    offsets_ptr,  # [L_t] int64: target layer ℓ's first element − out's, in elements (any sign: separate allocations)
    cos_ptr,  # [B or 1, T, d_t] float32 (target RoPE; unused when not ROPE)
    sin_ptr,
    flag_ptr,  # [L_t] int32: set to 1 where a stored value is not finite (when CHECK)
    beyond_ptr,  # [L_t] int32: set to 1 where a stored |value| is finite and above `bound` (when CHECK)
    slot_ptr,  # [T] int64: token t's slot, block slot // block_size, row slot % block_size (when SLOTS)
    bound,  # float: the magnitude guard (inf: none)
    block_size,
    seq,
    batch,
    target_heads,
    sxl,
    sxb,
    sxh,
    sxt,
    scb,
    sob,
    soh,
    sot,
    K_SEL: tl.constexpr,
    FAN_IN: tl.constexpr,
    D_S: tl.constexpr,
    D_T: tl.constexpr,
    HALF: tl.constexpr,  # D_T // 2
    S_LO: tl.constexpr,
    D_HI: tl.constexpr,
    COS_HI: tl.constexpr,
    ROPE: tl.constexpr,
    CHECK: tl.constexpr,
    SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, so multiply in fp32
    LAYERS_INNER: tl.constexpr,  # grid (H_t, L_t·B, token blocks); else (H_t, token blocks, L_t·B)
    OFFSET_MULTIPLE: tl.constexpr,  # a power of two dividing every layer offset (LayerViews.multiple)
    SINGLE_DOT: tl.constexpr,  # one [BLOCK_K, 2·BLOCK_HALF] tile per K step (else one tl.dot per RoPE half)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """out[ℓ, b, h, t] = RoPE(Σ_q x[S_ℓ[j], b, a_h[g], t] · W[ℓ, h, q] + bias[ℓ, h]) over feature blocks q = (j, g)."""
    h = tl.program_id(0)  # fastest: Full-Head's H_t programs of one token block share their feature tiles
    rows, blocks = (tl.program_id(1), tl.program_id(2)) if LAYERS_INNER else (tl.program_id(2), tl.program_id(1))
    b, layer = rows % batch, rows // batch
    t = blocks * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    c = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    t_mask, i_mask = t < seq, i < HALF
    col_lo, col_hi = i * S_LO, i * S_LO + D_HI  # [BLOCK_HALF] output columns of each pair's two members
    x_tok = x_ptr + b.to(tl.int64) * sxb + t[:, None] * sxt + c[None, :]  # [BLOCK_M, BLOCK_K]
    w_head = w_ptr + (layer * target_heads + h).to(tl.int64) * (K_SEL * FAN_IN * D_S * D_T)
    if SINGLE_DOT:  # one tile of columns: every pair's lo member, then every hi member
        n = tl.arange(0, 2 * BLOCK_HALF)  # [2·BLOCK_HALF]
        col = tl.where(n < BLOCK_HALF, n * S_LO, (n - BLOCK_HALF) * S_LO + D_HI)  # [2·BLOCK_HALF] ("half": n)
        n_mask = (n % BLOCK_HALF) < HALF
        acc = tl.full((BLOCK_M, 2 * BLOCK_HALF), 0.0, tl.float32)  # builtins only: the interpreter runs them unpatched
    else:
        acc_lo = tl.full((BLOCK_M, BLOCK_HALF), 0.0, tl.float32)
        acc_hi = tl.full((BLOCK_M, BLOCK_HALF), 0.0, tl.float32)
    for kk in range(0, K_SEL * FAN_IN * D_S, BLOCK_K):
        q = kk // D_S  # feature block: selected layer j, admitted head g
        j, g = q // FAN_IN, q % FAN_IN
        source_layer = tl.load(layers_ptr + layer * K_SEL + j)
        source_head = tl.load(heads_ptr + h * FAN_IN + g)
        x_block = x_tok + source_layer * sxl + source_head * sxh + (kk - q * D_S)  # the gather
        x = tl.load(x_block, mask=t_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_rows = w_head + (kk + c)[:, None] * D_T  # [BLOCK_K, 1]
        if SINGLE_DOT:
            w = tl.load(w_rows + col[None, :], mask=n_mask[None, :], other=0.0)  # [BLOCK_K, 2·BLOCK_HALF]
            x = x.to(w.dtype)  # what gather_features(...).to(weight dtype) does
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BLOCK_M, 2·BLOCK_HALF]
        else:
            w_lo = tl.load(w_rows + col_lo[None, :], mask=i_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_HALF]
            w_hi = tl.load(w_rows + col_hi[None, :], mask=i_mask[None, :], other=0.0)
            x = x.to(w_lo.dtype)
            if UPCAST:
                x, w_lo, w_hi = x.to(tl.float32), w_lo.to(tl.float32), w_hi.to(tl.float32)
            acc_lo = tl.dot(x, w_lo, acc_lo, input_precision=PRECISION)  # [BLOCK_M, BLOCK_HALF]
            acc_hi = tl.dot(x, w_hi, acc_hi, input_precision=PRECISION)
    if SINGLE_DOT:  # [BLOCK_M, 2·BLOCK_HALF] → [BLOCK_M, 2, BLOCK_HALF] → the two halves [BLOCK_M, BLOCK_HALF]
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_HALF)), (0, 2, 1)))
    bias_row = bias_ptr + (layer * target_heads + h) * D_T
    acc_lo += tl.load(bias_row + col_lo, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    acc_hi += tl.load(bias_row + col_hi, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    mask = t_mask[:, None] & i_mask[None, :]  # [BLOCK_M, BLOCK_HALF]
    if ROPE:  # apply_rope on the fp32 accumulator: (lo, hi) → (lo·cos − hi·sin, hi·cos + lo·sin)
        c_row = b * scb + t[:, None] * D_T  # [BLOCK_M, 1]
        cos_lo = tl.load(cos_ptr + c_row + i[None, :], mask=mask, other=0.0)  # [BLOCK_M, BLOCK_HALF]
        sin_lo = tl.load(sin_ptr + c_row + i[None, :], mask=mask, other=0.0)
        rotated_lo = acc_lo * cos_lo - acc_hi * sin_lo
        cos_hi = tl.load(cos_ptr + c_row + COS_HI + i[None, :], mask=mask, other=0.0)
        sin_hi = tl.load(sin_ptr + c_row + COS_HI + i[None, :], mask=mask, other=0.0)
        acc_hi = acc_hi * cos_hi + acc_lo * sin_hi
        acc_lo = rotated_lo
    out_dtype = out_ptr.dtype.element_ty
    y_lo, y_hi = acc_lo.to(out_dtype), acc_hi.to(out_dtype)  # [BLOCK_M, BLOCK_HALF]
    if SLOTS:  # the epilogue's address only: token t → its slot's block and row (a static cache's or paged blocks)
        slot = tl.load(slot_ptr + t, mask=t_mask, other=0)  # [BLOCK_M] int64
        block, row = slot // block_size, slot % block_size
    else:
        block, row = (b + 0 * t).to(tl.int64), t.to(tl.int64)  # [BLOCK_M]
    offset = tl.multiple_of(tl.load(offsets_ptr + layer), OFFSET_MULTIPLE)  # without the hint: scalar stores
    out_layer = out_ptr + offset + h * soh  # layer ℓ's cache, wherever it was allocated
    out_row = out_layer + (block * sob + row * sot)[:, None]  # [BLOCK_M, 1]
    tl.store(out_row + col_lo[None, :], y_lo, mask=mask)
    tl.store(out_row + col_hi[None, :], y_hi, mask=mask)
    if CHECK:  # instead of an isfinite pass over the output: an atomic per non-finite (or too large) entry only
        z_lo, z_hi = tl.abs(y_lo.to(tl.float32)), tl.abs(y_hi.to(tl.float32))
        finite_lo, finite_hi = z_lo < float("inf"), z_hi < float("inf")  # NaN compares false
        at_layer = 0 * (t[:, None] + i[None, :])  # [BLOCK_M, BLOCK_HALF], all at flag[ℓ]
        ones = tl.full((BLOCK_M, BLOCK_HALF), 1, tl.int32)
        tl.atomic_max(flag_ptr + layer + at_layer, ones, mask=mask & ((finite_lo & finite_hi) == 0))
        large = (finite_lo & (z_lo > bound)) | (finite_hi & (z_hi > bound))
        tl.atomic_max(beyond_ptr + layer + at_layer, ones, mask=mask & large)


# --------------------------------------------------------------------------- host side


def _stacked(layers: Layers) -> torch.Tensor:
    """[L_s, B, H_s, T, d_s] with contiguous channels; a list of layers costs one copy (torch.stack)."""
    x = layers if isinstance(layers, torch.Tensor) else torch.stack(list(layers))  # [L_s, B, H_s, T, d_s]
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_unsupported(
    source_keys: torch.Tensor, mapper: Mapper, source_cos: torch.Tensor, target_cos: torch.Tensor, layouts: tuple
) -> str | None:
    """Why the Triton path cannot run on these inputs (None: it can). source_keys: one layer or the stack."""
    d_s, d_t = source_keys.shape[-1], mapper.weight_k.shape[-1]
    reasons = {
        "triton is not installed": not HAVE_TRITON,
        "tensors are not on CUDA (set TRITON_INTERPRET=1 for the CPU interpreter)": source_keys.device.type != "cuda"
        and not (interpreting() and source_keys.device.type == "cpu"),
        f"RoPE layouts {layouts} not in {LAYOUTS}": any(layout not in LAYOUTS for layout in layouts),
        f"source head_dim {d_s} is not a multiple of 16": d_s % 16 != 0,
        f"target head_dim {d_t} is odd": d_t % 2 != 0,
        f"partial rotary on the target ({target_cos.shape[-1]} of {d_t} channels)": target_cos.shape[-1] != d_t,
        f"source rope_dim {source_cos.shape[-1]} is odd": source_cos.shape[-1] % 2 != 0,
        f"compute dtype {mapper.weight_k.dtype}": mapper.weight_k.dtype
        not in (torch.bfloat16, torch.float16, torch.float32),
    }
    return next((reason for reason, failed in reasons.items() if failed), None)


def derope_keys(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, dtype: torch.dtype
) -> torch.Tensor:
    """Triton `remove_rope` of stacked keys [L_s, B, H_s, T, d_s] → content keys [L_s, B, H_s, T, d_s] in dtype."""
    num_layers, batch, heads, seq, head_dim = keys.shape
    cos, stride = rope_table(cos, seq)  # [B or 1, T, rope_dim]
    sin, _ = rope_table(sin, seq)
    half = cos.shape[-1] // 2
    out = torch.empty(keys.shape, dtype=dtype, device=keys.device)  # [L_s, B, H_s, T, d_s]
    block_t = DEROPE_BLOCK_T
    grid = (num_layers * batch * heads, triton.cdiv(seq, block_t))
    jit(_derope_kernel, interpreting())[grid](
        keys, out, cos, sin, seq, batch, heads, *keys.stride()[:4], stride,
        HALF=half, HEAD_DIM=head_dim, **rope_pairs(layout, half),
        BLOCK_T=block_t, BLOCK_HALF=pow2(half), BLOCK_PASS=pow2(head_dim - 2 * half),
        num_warps=4,
    )  # fmt: skip
    return out


def _map_component(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mapper: Mapper,
    rope: tuple[torch.Tensor, torch.Tensor, str] | None,
    out: LayerViews,
    flags: tuple[torch.Tensor, torch.Tensor, float] | None,
    slots: torch.Tensor | None,
    config: KernelConfig,
    precision: str,
) -> None:
    """One launch of `_map_kernel`: x [L_s, B, H_s, T, d_s] → out's L_t layers [B, H_t, T, d_t] (RoPE'd when rope),
    or with slots [T] → out's L_t layers [N_blocks, H_t, block_size, d_t] at their slots, each layer at its offset
    from out.base; flags: (non-finite [L_t], beyond [L_t], bound), the int32 flags set in the epilogue."""
    _, batch, _, seq, d_s = x.shape
    target_layers, target_heads, _, d_t = weight.shape
    weight, bias = weight.contiguous(), bias.contiguous()  # no copies for a loaded mapper
    layers, heads = (
        mapper.source_layers.long().contiguous(),
        mapper.head_index.long().contiguous(),
    )  # [L_t, k], [H_t, f]
    half = d_t // 2
    base = out.base  # [B or N_blocks, H_t, T or block_size, d_t]: layer 0's; layer ℓ at out.offsets[ℓ] from it
    cos, sin, layout = rope if rope is not None else (base, base, "half")  # dummies: never read without ROPE
    if rope is not None:
        cos, stride = rope_table(cos, seq)  # [B or 1, T, d_t]
        sin, _ = rope_table(sin, seq)
    else:
        stride = 0
    block_k = min(config.block_k, d_s & -d_s)  # the largest power of two dividing d_s (≥ 16)
    # layers inner: the L_t·H_t programs that run together read one token block's source rows, which stay in L2 (a
    # source layer feeds ≈ k·L_t/L_s target layers); layers outer re-reads the whole source once per target layer
    rows, blocks = target_layers * batch, triton.cdiv(seq, config.block_m)
    grid = (target_heads, rows, blocks) if config.layers_inner else (target_heads, blocks, rows)
    nonfinite, beyond, bound = flags if flags is not None else (base, base, 0.0)  # dummies: untouched without CHECK
    block_size = base.shape[2] if slots is not None else seq
    interpret = interpreting()
    jit(_map_kernel, interpret)[grid](
        x, weight, bias, layers, heads, base, out.offsets, cos, sin, nonfinite, beyond,
        slots if slots is not None else layers, bound, block_size, seq, batch, target_heads, *x.stride()[:4], stride,
        *base.stride()[:3],
        K_SEL=layers.shape[1], FAN_IN=heads.shape[1], D_S=d_s, D_T=d_t, HALF=half,
        **rope_pairs(layout, half), ROPE=rope is not None, CHECK=flags is not None, SLOTS=slots is not None,
        PRECISION=precision,
        UPCAST=interpret and weight.dtype != torch.float32,
        LAYERS_INNER=config.layers_inner, OFFSET_MULTIPLE=out.multiple, SINGLE_DOT=config.single_dot,
        BLOCK_M=config.block_m, BLOCK_K=block_k, BLOCK_HALF=pow2(half),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _fp32_precision() -> str:
    """Follow torch's own fp32 matmul setting (the reference's baddbmm): TF32 only where torch allows it."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def map_cache(
    source_keys: Layers,
    source_values: Layers,
    mapper: Mapper,
    source_cos: torch.Tensor,
    source_sin: torch.Tensor,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    source_layout: str = "half",
    target_layout: str = "half",
    out_dtype: torch.dtype | None = None,
    nonfinite: torch.Tensor | None = None,
    backend: str = "auto",
    config: KernelConfig | None = None,
    precision: str | None = None,
    out: tuple[Destination, Destination] | None = None,
    slots: torch.Tensor | None = None,
    beyond: torch.Tensor | None = None,
    bound: float | None = None,
    packed: PackedMapper | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source cache → target (keys, values), each [L_t, B, H_t, T, d_t] (`keys[ℓ]` is layer ℓ's cache): new contiguous
    tensors, or `out` — two [L_t, B, H_t, T, d_t] views with contiguous channels, or with `slots` [T] (long, on the
    device; B = 1) two [L_t, N_blocks, H_t, block_size, d_t] destinations where token t lands in block
    slots[t] // block_size, row slots[t] % block_size (a static cache's slots, `Engine.blocks`, or paged blocks) —
    written in place by the kernel (the reference stores into them), and returned as given. Either destination
    may instead be a `LayerViews` of L_t layers [B or N_blocks, H_t, T or block_size, d_t] at any addresses (vLLM's
    per-layer paged caches, `paged.Writer`). Nothing here reads a value on the host.

    source_keys / source_values: stacked [L_s, B, H_s, T, d_s] or a sequence of L_s layers [B, H_s, T, d_s]
    (RoPE'd keys, as cached). mapper: already on the device in the compute dtype (`KVTransfer.mapper`).
    cos / sin: `src.rope.rope_cos_sin` of each model's rotary module at the cache positions ([B or 1, 1, T, r]).
    out_dtype: the target model's dtype (default: the source cache's). nonfinite: optional int32 [L_t], set to 1
    (0 otherwise) for every target layer with a non-finite mapped entry; beyond: optional int32 [L_t], set to 1 for
    every target layer with a finite |mapped entry| above `bound` (None: no bound). backend: "auto" (Triton where
    supported, else the reference), "triton" (raise if unsupported), "torch", or "gemm" (one GEMM per target head,
    kernels/apply_map_gemm.py, finished where Triton runs by the epilogue kernel of kernels/apply_map_epilogue.py,
    elsewhere in torch; `packed`: the mapper's `packed_weights`, held by the caller — packed per call without
    it). precision: tl.dot input precision for fp32 coefficients ("ieee", "tf32", "tf32x3"; default: follow
    torch.backends.cuda.matmul.allow_tf32)."""
    if backend not in ("auto", "triton", "torch", "gemm"):
        raise ValueError(f"backend must be auto, triton, torch or gemm, not {backend!r}")
    if nonfinite is not None and nonfinite.dtype != torch.int32:
        raise ValueError(f"nonfinite must be an int32 [L_t] tensor, not {nonfinite.dtype}")
    if beyond is not None and beyond.dtype != torch.int32:
        raise ValueError(f"beyond must be an int32 [L_t] tensor, not {beyond.dtype}")
    keys = _stacked(source_keys)  # [L_s, B, H_s, T, d_s]
    out_dtype = out_dtype or keys.dtype
    views = None if out is None else tuple(_layer_views(given) for given in out)  # (K, V), L_t layers each
    if views is not None:
        _check_out(views, keys, mapper, out_dtype, slots)
    elif slots is not None:
        raise ValueError("slots address `out`: pass the destinations")
    reason = triton_unsupported(keys, mapper, source_cos, target_cos, (source_layout, target_layout))
    if backend == "triton" and reason is not None:
        raise ValueError(f"Triton path unavailable: {reason}")
    fused_gemm = backend == "gemm" and reason is None and keys.shape[3] > 0  # the GEMMs, then `store_mapped`
    if fused_gemm:
        packed = _packed(mapper, packed, keys.shape[0])  # its refusals before anything is written
    if not fused_gemm and (backend in ("torch", "gemm") or reason is not None or keys.shape[3] == 0):
        args = (source_cos, source_sin, target_cos, target_sin, source_layout, target_layout, out_dtype)
        if backend == "gemm":
            target_k, target_v = _map_gemm(keys, source_values, mapper, packed, reason, *args, nonfinite, beyond, bound)
        else:
            target_k, target_v = map_cache_ref(keys, source_values, mapper, *args, nonfinite, beyond, bound)
        if out is None:
            return target_k, target_v
        for destination, mapped in zip(views, (target_k, target_v), strict=True):
            if slots is None:
                for layer, layer_mapped in zip(destination.views, mapped, strict=True):
                    layer.copy_(layer_mapped)  # [B, H_t, T, d_t]
            else:
                store_slots(destination.views, mapped[:, 0], slots)  # [L_t, H_t, T, d_t] at the slots
        return out
    values = _stacked(source_values)  # [L_s, B, H_s, T, d_s]
    _, batch, _, seq, _ = keys.shape
    target_layers, target_heads, _, d_t = mapper.weight_k.shape
    compute = mapper.weight_k.dtype
    precision = precision or (_fp32_precision() if compute == torch.float32 else "tf32")  # tf32: ignored for bf16
    config = config or default_config(seq, compute, d_t)
    content = derope_keys(keys, source_cos, source_sin, source_layout, compute)  # [L_s, B, H_s, T, d_s]
    shape = (target_layers, batch, target_heads, seq, d_t)
    if out is None:
        target_k = torch.empty(shape, dtype=out_dtype, device=keys.device)  # [L_t, B, H_t, T, d_t]
        target_v = torch.empty(shape, dtype=out_dtype, device=keys.device)  # [L_t, B, H_t, T, d_t]
        views = (LayerViews.stacked(target_k), LayerViews.stacked(target_v))
    rope = (target_cos, target_sin, target_layout)
    flags = None
    if nonfinite is not None or beyond is not None:
        nonfinite, beyond = (
            given.zero_() if given is not None else torch.zeros(target_layers, dtype=torch.int32, device=keys.device)
            for given in (nonfinite, beyond)
        )  # [L_t] each
        flags = (nonfinite, beyond, float("inf") if bound is None else float(bound))
    if fused_gemm:
        mapped = head_products(content, values, packed)  # Y_K, Y_V [H_t, B·T, L_t·d_t]
        store_mapped(mapped[0], packed.bias_k, batch, rope, views[0], flags, slots)
        store_mapped(mapped[1], packed.bias_v, batch, None, views[1], flags, slots)
    else:
        common = (flags, slots, config, precision)
        _map_component(content, mapper.weight_k, mapper.bias_k, mapper, rope, views[0], *common)
        _map_component(values, mapper.weight_v, mapper.bias_v, mapper, None, views[1], *common)
    return (target_k, target_v) if out is None else out


def _map_gemm(
    keys: torch.Tensor,
    source_values: Layers,
    mapper: Mapper,
    packed: PackedMapper | None,
    triton_reason: str | None,
    source_cos: torch.Tensor,
    source_sin: torch.Tensor,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    source_layout: str,
    target_layout: str,
    out_dtype: torch.dtype,
    nonfinite: torch.Tensor | None,
    beyond: torch.Tensor | None,
    bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`map_cache(backend="gemm")` into new tensors [L_t, B, H_t, T, d_t]: the keys de-RoPE'd (`derope_keys` where
    Triton runs, else `remove_rope`, both rounded to the cache dtype), then `map_cache_gemm`. A ValueError naming why
    where the mapper cannot run as one GEMM per head, or `packed` is not this mapper's shape."""
    packed = _packed(mapper, packed, keys.shape[0])
    if triton_reason is None:
        compute = mapper.weight_k.dtype
        content = derope_keys(keys, source_cos, source_sin, source_layout, compute)  # [L_s, B, H_s, T, d_s]
    else:
        content = remove_rope(keys, source_cos, source_sin, source_layout)  # [L_s, B, H_s, T, d_s]
    args = (target_cos, target_sin, target_layout, out_dtype, nonfinite, beyond, bound)
    return map_cache_gemm(content, _stacked(source_values), packed, *args)


def _packed(mapper: Mapper, packed: PackedMapper | None, source_layers: int) -> PackedMapper:
    """`packed`, checked against the mapper's shapes, or the mapper packed now; a ValueError naming why where the
    mapper cannot run as one GEMM per head, or `packed` is not this mapper's shape."""
    if reason := gemm_unsupported(mapper):
        raise ValueError(f"the gemm map cannot serve this mapper: {reason}")
    target_layers, target_heads, width, d_t = mapper.weight_k.shape
    expected = (target_heads, source_layers * width // mapper.source_layers.shape[1], target_layers * d_t)
    packed = packed if packed is not None else packed_weights(mapper, source_layers)
    if tuple(packed.weight_k.shape) != expected or tuple(packed.bias_k.shape) != (target_heads, target_layers, d_t):
        raise ValueError(f"packed weights {tuple(packed.weight_k.shape)} are not this mapper's: expected {expected}")
    return packed


def _layer_views(out: Destination) -> LayerViews:
    """A destination as per-layer views: a stacked tensor's layers a constant step apart, or the views as given."""
    return out if isinstance(out, LayerViews) else LayerViews.stacked(out)


@torch.no_grad()
def _check_out(
    out: tuple[LayerViews, LayerViews], keys: torch.Tensor, mapper: Mapper, dtype: torch.dtype, slots
) -> None:
    """A ValueError unless `out` is two sets of L_t layers [B, H_t, T, d_t] — with slots [T] (long, keys' device,
    B = 1): [N_blocks, H_t, block_size, d_t] — of the out dtype, on the keys' device, channels contiguous, with
    L_t int64 offsets there."""
    target_layers, target_heads, _, d_t = mapper.weight_k.shape
    if slots is None:
        shape = (target_layers, keys.shape[1], target_heads, keys.shape[3], d_t)
    else:
        seq = keys.shape[3]
        if (
            keys.shape[1] != 1
            or tuple(slots.shape) != (seq,)
            or slots.dtype != torch.long
            or slots.device != keys.device
        ):
            raise ValueError(
                f"slots: {tuple(slots.shape)} {slots.dtype} on {slots.device} for a batch of "
                f"{keys.shape[1]}; expected [{seq}] long slots of one conversation on {keys.device}"
            )
        shape = (target_layers, out[0].base.shape[0], target_heads, out[0].base.shape[2], d_t)
    for name, views in zip(("keys", "values"), out, strict=True):
        t, offsets = views.base, views.offsets  # [B or N_blocks, H_t, T or block_size, d_t], [L]
        given = (len(offsets), *t.shape)
        if given != shape or t.dtype != dtype or t.device != keys.device or t.stride(-1) != 1:
            raise ValueError(
                f"out {name}: {given} {t.dtype} on {t.device} (channel stride {t.stride(-1)}); expected "
                f"{shape} {dtype} on {keys.device}, channels contiguous"
            )
        if offsets.dtype != torch.long or offsets.device != keys.device or len(views.views) != len(offsets):
            raise ValueError(f"out {name}: {len(views.views)} layers, offsets {offsets.dtype} on {offsets.device}; "
                             f"expected one int64 offset per layer on {keys.device}")  # fmt: skip


def map_cache_ref(
    source_keys: Layers,
    source_values: Layers,
    mapper: Mapper,
    source_cos: torch.Tensor,
    source_sin: torch.Tensor,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    source_layout: str = "half",
    target_layout: str = "half",
    out_dtype: torch.dtype | None = None,
    nonfinite: torch.Tensor | None = None,
    beyond: torch.Tensor | None = None,
    bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, the computation of `src.apply.KVTransfer.__call__` (without its checks): same arguments and
    result as `map_cache` (new tensors only)."""
    keys = _stacked(source_keys)  # [L_s, B, H_s, T, d_s]
    values = _stacked(source_values)  # [L_s, B, H_s, T, d_s]
    out_dtype = out_dtype or keys.dtype
    _, batch, _, seq, _ = keys.shape
    to_rows = lambda t: t.to(mapper.weight_k.device).transpose(1, 2).flatten(2, 3)  # [L_s, H_s, B·T, d_s]
    content_k = to_rows(remove_rope(keys, source_cos, source_sin, source_layout))  # [L_s, H_s, B·T, d_s]
    content_v = to_rows(values)  # [L_s, H_s, B·T, d_s]
    to_cache = lambda t: t.unflatten(2, (batch, seq)).transpose(1, 2)  # [g, B, H_t, T, d_t]
    shared = shares_heads(mapper)
    mapped_k, mapped_v = [], []
    for group in layer_groups(mapper, batch * seq, shared):
        target_k, target_v = map_layers(mapper, group, content_k, content_v, shared)  # [g, H_t, B·T, d_t]
        mapped_k.append(apply_rope(to_cache(target_k), target_cos, target_sin, target_layout).to(out_dtype))
        mapped_v.append(to_cache(target_v).to(out_dtype))
    target_k, target_v = torch.cat(mapped_k), torch.cat(mapped_v)  # [L_t, B, H_t, T, d_t]
    set_flags(target_k, target_v, nonfinite, beyond, bound)
    return target_k, target_v


# --------------------------------------------------------------------------- CUDA graph for a fixed shape


class CapturedMapCache:
    """`map_cache` captured once in a CUDA graph for one (batch, seq, dtypes): its launches replay as one.

    A call copies its inputs into the graph's static buffers and replays; the returned (keys, values) ARE the
    static output buffers, overwritten by the next call — consume or clone them first."""

    def __init__(
        self,
        example_keys: Layers,
        example_values: Layers,
        mapper: Mapper,
        source_cos: torch.Tensor,
        source_sin: torch.Tensor,
        target_cos: torch.Tensor,
        target_sin: torch.Tensor,
        source_layout: str = "half",
        target_layout: str = "half",
        out_dtype: torch.dtype | None = None,
        **options,
    ):
        """Arguments as `map_cache` (options: nonfinite, backend, config, precision); the examples fix the shapes."""
        self.keys = _stacked(example_keys).clone()  # [L_s, B, H_s, T, d_s] static inputs
        self.values = _stacked(example_values).clone()  # [L_s, B, H_s, T, d_s]
        self.tables = [t.clone() for t in (source_cos, source_sin, target_cos, target_sin)]  # static cos/sin
        layouts = (source_layout, target_layout, out_dtype)
        run = lambda: map_cache(self.keys, self.values, mapper, *self.tables, *layouts, **options)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run()  # (keys, values) [L_t, B, H_t, T, d_t], static

    def __call__(
        self, source_keys: Layers, source_values: Layers, *tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs shaped like the examples (layers or stacked), optionally new cos/sin tables of the same shapes."""
        for static, given in ((self.keys, source_keys), (self.values, source_values)):
            if isinstance(given, torch.Tensor):
                static.copy_(given)
            else:
                torch.stack(list(given), out=static)
        for static, given in zip(self.tables, tables, strict=False):
            static.copy_(given)
        self.graph.replay()
        return self.out
