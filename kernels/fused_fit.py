"""Fused-Fit (CacheBridge §3.4): the weighted, centered statistics A_h, B_h (Eqs. 20–21) of one target layer ×
component, gathered straight from the traces by a static schedule and accumulated on integer tensor cores.

Features per target head are z = [x, y], x the k·f head-local source blocks (layer j, head g, channel; the order of
`src.support.gather_features`), y the target row; m = p + d_t. Per (target layer, component):

  centre    c = the plain mean of ≤ 1,024 evenly spaced rows (`provisional_center`): any c near the data will do
  pass 1    one read per row segment: Σ w (z − c), max |√w (z − c)|, Σ w (z − c)² in float64 (2-D accumulators,
            partials summed in a fixed order) → δ = μ − c, the chunk scales s, yy
  pass 2    per row chunk of b rows: `_panel_kernel` gathers the blocks from rows [L_s, H_s, n, d_s], centres on c,
            weights by √w and writes √w (z − c)/s as 4 signed base-254 digits into a contiguous per-head int8 panel
            [H_t, 4, m, b] (rows contiguous: the K-major operand of int8 MMA); `_gram_kernel` forms the upper
            triangle of G_c = Σ_r √w(z − c) (√w(z − c))ᵀ tile by tile with 10 / 13 / 15 int8 GEMMs (digit pairs of
            order < levels) into int32, flushed to float64 once per chunk.
  extract   A = G_c[:p, :p] − W δ_x δ_xᵀ (Eq. 20), B = G_c[:p, p:] − W δ_x δ_yᵀ (Eq. 21): the Gram about c is the
            Gram about μ plus the rank-one W δ δᵀ (Σ w (z − μ) = 0), removed in float64.

Centring on c instead of μ is what lets the means, scales and yy come from one read: the weighted mean is not needed
before the scales. Cost: the scales cover |z − c| instead of |z − μ|, a few per cent wider when c is near μ.

Precision: centering and weighting are float64 before anything is rounded (offsets cost nothing). A value is
s·(q₀ + q₁/254 + q₂/254² + q₃/254³), |q| ≤ 127, s = (its column's max over the chunk)/127: error ≤ 2.4e-10 of the
column max. levels = 5 (default) keeps the 13 digit pairs of order ≤ 4 (the dropped ones ≤ 2e-12 of the product of
the two column maxima); levels = 4 keeps 10 (order ≤ 3), but the dropped q₂q₂, q₁q₃ terms are systematic between
nearly collinear columns: W 3e-5 from float64 on the ill-conditioned test support (levels 5: 2e-7), so 4 is a
measured option only. The Gram diagonal is replaced by pass 1's exact float64 Σ w (z − c)² (the digits' own squares
are biased). int32 sums are exact for b ≤ 32,768 (|Σ| ≤ b·4·127² < 2³¹); flushes and chunk sums are float64.
Per-column scales make the error relative to each feature's own range (outlier channels cost nothing). Measured
(tests, heavy-tailed weights): A, B within ~1e-9 of float64; W inherits that times the ridge problem's conditioning.
Integer sums have no order, so the Gram is bitwise independent of the Gram tile configuration; pass 1's float64
partials follow a fixed order set by `PassConfig.stats_rows`: the result is bitwise repeatable run to run.
Scratch per chunk (Eq. 22): the int8 panel, 4·H_t·b·(p + d_t) bytes, plus the float64 Gram it feeds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:  # optional: CPU CI may lack triton; every backend but "triton" works without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

from src.maps import offset_multiple
from src.stats import Moments, streaming_moments
from src.support import gather_features

SLICES, RADIX, DIGIT = 4, 254, 127  # base-254 digits in [−127, 127]
LEVELS = (4, 5, 6)  # digit pairs of order t + u < levels are multiplied: 10, 13 or 15 int8 GEMMs
MAX_CHUNK = 32768  # int32 exactness: MAX_CHUNK · 4 pairs · 127² < 2³¹
ALIGN = 128  # chunk rows and panel width are padded to this; every tile config divides it
BOUND_PAD = 1 + 2**-20  # keeps |z|/s strictly below 127 so the leading digit cannot overflow
SEGMENT_ROWS = 256  # rows per pass-1 program: many short programs (partials reduced in a fixed order)
CENTER_ROWS = 1024  # rows averaged for the provisional centre c
BACKENDS = ("auto", "triton", "emulate", "reference")


@dataclass(frozen=True)
class GramConfig:
    block_m: int = 64  # measured on one H200 (BENCHMARKS.md): 64×64×64, 4 warps, 3 stages beat 128×64×64, 8 warps
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# tried in order; the result does not depend on which one runs (exact integer sums, same per-element flush)
GRAM_CONFIGS = (GramConfig(), GramConfig(num_stages=2), GramConfig(128, 64, 64, 8, 3))


@dataclass(frozen=True)
class PassConfig:
    """Row tiles and warps of the float64 passes: pass 1 reads [stats_rows, ≤128] (its float64 summation order, so
    its bits, follow stats_rows), the panel writer [panel_rows, ≤128]. Defaults measured best on one H200."""

    stats_rows: int = 32
    stats_warps: int = 8
    panel_rows: int = 32
    panel_warps: int = 4
    offset_hint: bool = True  # the schedule's offset multiple hinted (Plan.x_multiple); False: 1, the loads of before


@dataclass(frozen=True)
class Plan:
    """Static gather schedule and padded sizes for one (layers, head_index) support."""

    heads: int
    rows: int
    p: int
    m: int
    m_pad: int
    chunk: int
    x_offsets: torch.Tensor  # [H_t, k·f] int64 element offset of block (layer j, head g) in rows_x
    y_offsets: torch.Tensor  # [H_t, 1]   int64 element offset of head h in rows_y
    x_multiple: int  # the largest power of two ≤ 16 dividing every x offset: the kernels' alignment hint
    y_multiple: int  # (a loaded offset's alignment is unknown to Triton: rows were gathered 4 bytes at a time)

    def spans(self) -> list[slice]:
        return [slice(s, min(s + self.chunk, self.rows)) for s in range(0, self.rows, self.chunk)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def gather_schedule(rows_x: torch.Tensor, layers: torch.Tensor, head_index: torch.Tensor) -> torch.Tensor:
    """Element offsets [H_t, k·f] of the source blocks feeding each target head, in gather_features order."""
    layer_part = layers.to(torch.int64)[None, :, None] * rows_x.stride(0)  # [1, k, 1]
    head_part = head_index.to(torch.int64)[:, None, :] * rows_x.stride(1)  # [H_t, 1, f]
    return (layer_part + head_part).flatten(1)  # [H_t, k·f]


def make_plan(
    rows_x: torch.Tensor, rows_y: torch.Tensor, layers: torch.Tensor, head_index: torch.Tensor, chunk_rows: int
) -> Plan:
    """Balanced row chunks of ≤ min(chunk_rows, MAX_CHUNK) rows (multiples of ALIGN) and the gather schedule."""
    heads, rows = head_index.shape[0], rows_x.shape[2]
    p = layers.numel() * head_index.shape[1] * rows_x.shape[3]
    m = p + rows_y.shape[-1]
    count = -(-rows // min(max(chunk_rows, 1), MAX_CHUNK))  # balanced chunks ≤ chunk_rows (and ≤ MAX_CHUNK)
    chunk = min(_round_up(-(-rows // count), ALIGN), MAX_CHUNK)
    y_offsets = torch.arange(heads, dtype=torch.int64)[:, None] * rows_y.stride(0)  # [H_t, 1]
    schedule = gather_schedule(rows_x, layers.cpu(), head_index.cpu())  # [H_t, k·f]
    move = lambda t: t.to(rows_x.device, non_blocking=True)
    multiples = (offset_multiple(schedule.flatten().tolist()), offset_multiple(y_offsets.flatten().tolist()))
    return Plan(heads, rows, p, m, _round_up(m, ALIGN), chunk, move(schedule), move(y_offsets), *multiples)


# --------------------------------------------------------------------------- the numerical scheme (pure torch)


def chunk_scale(bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column maxima [..., m] → digit scale s and its inverse (0 for all-zero columns)."""
    scale = bound * (BOUND_PAD / DIGIT)  # [..., m]
    inverse = torch.where(scale > 0, 1 / scale.clamp_min(torch.finfo(scale.dtype).tiny), torch.zeros_like(scale))
    return scale, inverse


def to_digits(t: torch.Tensor) -> torch.Tensor:
    """t = z/s in (−127, 127), float64 → digits [SLICES, ...] with t ≈ Σ_s q_s·254^−s (Eq. 22 panel values)."""
    digits = []
    for _ in range(SLICES):
        q = torch.floor(t + 0.5)
        digits.append(q)
        t = (t - q) * RADIX
    return torch.stack(digits)


def digit_pairs(level: int) -> list[tuple[int, int]]:
    """Digit pairs (t, u), 0-based, of order t + u = level."""
    return [(t, level - t) for t in range(level + 1) if t < SLICES and level - t < SLICES]


def combine_levels(levels: list[torch.Tensor]) -> torch.Tensor:
    """Σ_L 254^−L · level_L by Horner, float64 (the per-chunk flush of the Gram kernel)."""
    total = levels[-1].double()
    for level in reversed(levels[:-1]):
        total = total / RADIX + level.double()
    return total


def _emulated_gram(digits: torch.Tensor, levels: int) -> torch.Tensor:
    """digits [SLICES, H, b, m] (integers in float64) → Σ_L 254^−L Σ_{t+u=L} q_tᵀ q_u [H, m, m] (exact sums)."""
    sums = [sum(digits[t].transpose(1, 2) @ digits[u] for t, u in digit_pairs(level)) for level in range(levels)]
    return combine_levels(sums)


def _cut(t: torch.Tensor | None, span: slice) -> torch.Tensor | None:
    return None if t is None else t[:, span]


def _weights(weights: torch.Tensor | None, rows: int, heads: int, device: torch.device):
    """Mean-one weights w [H_t, n] → (w, √w, Σw) in float64; None → (None, None, n)."""
    if weights is None:
        return None, None, torch.full((heads,), float(rows), dtype=torch.float64, device=device)
    w = weights.to(torch.float64).contiguous()
    if bool((w < 0).any()):
        raise ValueError("fused_moments needs nonnegative weights (it weights rows by √w)")
    return w, w.sqrt(), w.sum(-1)


def provisional_center(
    rows_x: torch.Tensor, rows_y: torch.Tensor, layers: torch.Tensor, head_index: torch.Tensor
) -> torch.Tensor:
    """c [H_t, m] float64: the plain mean of ≤ CENTER_ROWS evenly spaced rows (a centre near μ; exactness not needed)."""
    index = torch.arange(0, rows_x.shape[2], max(1, rows_x.shape[2] // CENTER_ROWS), device=rows_x.device)
    x = gather_features(rows_x[:, :, index], layers, head_index).double().mean(1)  # [H_t, p]
    return torch.cat([x, rows_y[:, index].double().mean(1)], -1).contiguous()  # [H_t, m]


def _extract(gram, squares, center, delta, total, plan: Plan) -> Moments:
    """Upper-triangle Gram about c [H, ≥m, ≥m] and its exact float64 diagonal squares [H, m] = Σ w (z − c)² →
    Moments about μ = c + δ (A symmetrized from its upper triangle)."""
    p, m = plan.p, plan.m
    rank_one = total[:, None, None] * delta[:, :p, None] * delta[:, None, :]  # [H_t, p, m]   W δ_x δᵀ
    upper = torch.triu(gram[:, :p, :p], 1) + torch.diag_embed(squares[:, :p])  # [H_t, p, p]   exact diagonal
    upper = torch.triu(upper - rank_one[..., :p])  # [H_t, p, p]
    xx = upper + torch.triu(upper, 1).transpose(1, 2)  # [H_t, p, p]   A_h (Eq. 20)
    xy = (gram[:, :p, p:m] - rank_one[..., p:]).contiguous()  # [H_t, p, d_t]   B_h (Eq. 21)
    yy = squares[:, p:].sum(-1) - total * (delta[:, p:] ** 2).sum(-1)  # [H_t]   Σ w ‖y − μ_y‖²
    mean = center + delta  # [H_t, m]
    return Moments(mean_x=mean[:, :p], mean_y=mean[:, p:], xx=xx, xy=xy, yy=yy, rows=plan.rows)


# --------------------------------------------------------------------------- public API


def fused_moments_ref(
    rows_x: torch.Tensor,
    rows_y: torch.Tensor,
    weights: torch.Tensor | None,
    layers: torch.Tensor,
    head_index: torch.Tensor,
    chunk_rows: int,
) -> Moments:
    """Pure-torch float64 reference: src.stats.streaming_moments over src.support.gather_features panels."""
    chunk = lambda span: (gather_features(rows_x[:, :, span], layers, head_index), rows_y[:, span], _cut(weights, span))
    return streaming_moments(chunk, rows_x.shape[2], chunk_rows)


def fused_moments(
    rows_x: torch.Tensor,
    rows_y: torch.Tensor,
    weights: torch.Tensor | None,
    layers: torch.Tensor,
    head_index: torch.Tensor,
    chunk_rows: int,
    backend: str = "auto",
    config: GramConfig | None = None,
    levels: int = 5,
    passes: PassConfig = PassConfig(),
) -> Moments:
    """Moments of features gather_features(rows_x, layers, head_index) → rows_y under weights (non-PCA supports).

    rows_x [L_s, H_s, n, d_s] source K or V rows (any float dtype), rows_y [H_t, n, d_t] target rows of this layer,
    weights [H_t, n] nonnegative (None = uniform), layers [k], head_index [H_t, f]. backend: "triton" (CUDA, or CPU
    under TRITON_INTERPRET=1), "emulate" (the same integer scheme in torch), "reference" (float64 streaming), "auto"
    (triton on CUDA when importable, else emulate: the kernels' numbers, not their speed). levels: digit pairs of
    order < levels are multiplied — 4 (10 GEMMs), 5 (13) or 6 (15; W several times closer on ill-conditioned
    supports). passes: tiles of the float64 passes (speed only). Returns float64 Moments, as
    src.stats.streaming_moments does for the same features."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if levels not in LEVELS:
        raise ValueError(f"levels must be one of {LEVELS}")
    if backend == "auto":
        backend = "triton" if rows_x.is_cuda and triton_available() else "emulate"
    if backend == "reference":
        return fused_moments_ref(rows_x, rows_y, weights, layers, head_index, chunk_rows)
    plan = make_plan(rows_x, rows_y, layers, head_index, chunk_rows)
    w, sqrt_w, total = _weights(weights, plan.rows, plan.heads, rows_x.device)
    if backend == "emulate":
        return _emulated_moments(rows_x, rows_y, w, sqrt_w, total, layers, head_index, plan, levels)
    center = provisional_center(rows_x, rows_y, layers, head_index)  # [H_t, m]
    return _triton_moments(rows_x, rows_y, w, sqrt_w, total, center, plan, config, levels, passes)


def _emulated_moments(rows_x, rows_y, w, sqrt_w, total, layers, head_index, plan: Plan, levels: int) -> Moments:
    """The kernels' arithmetic in torch: float64 centering on c, base-254 digits, exact integer Gram, float64 flush."""
    center = provisional_center(rows_x, rows_y, layers, head_index)  # [H_t, m]
    features = lambda span: (
        torch.cat([gather_features(rows_x[:, :, span], layers, head_index).double(), rows_y[:, span].double()], -1)
        - center[:, None]
    )  # [H_t, b, m]   z − c
    spans = plan.spans()
    weighted = lambda z, wc: z if wc is None else z * wc[..., None]
    sums = torch.stack([weighted(features(span), _cut(w, span)).sum(1) for span in spans])  # [C, H_t, m]
    delta = sums.sum(0) / total[:, None]  # [H_t, m]   δ = μ − c
    gram = torch.zeros(plan.heads, plan.m, plan.m, dtype=torch.float64, device=rows_x.device)  # [H_t, m, m]
    squares = torch.zeros(plan.heads, plan.m, dtype=torch.float64, device=rows_x.device)  # [H_t, m]
    for span in spans:
        z = weighted(features(span), _cut(sqrt_w, span))  # [H_t, b, m]   √w (z − c)
        scale, inverse = chunk_scale(z.abs().amax(1))  # [H_t, m]
        digits = to_digits(z * inverse[:, None])  # [SLICES, H_t, b, m]
        gram += _emulated_gram(digits, levels) * (scale[:, :, None] * scale[:, None, :])  # [H_t, m, m]   G_c
        squares += (z**2).sum(1)  # the diagonal in float64 (the digits' own squares would bias it)
    return _extract(gram, squares, center, delta, total, plan)


# --------------------------------------------------------------------------- Triton path


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _stats_kernel(
        src, offsets, w_ptr, sw_ptr, center_ptr, out_sum, out_max, out_sq, rows, chunk, segments, stride_n, stride_d,
        width, col0, m, nb, heads,
        HAS_W: tl.constexpr, SEG_ROWS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, OFFSET_MULTIPLE: tl.constexpr,
    ):  # fmt: skip
        """Pass 1, one read: Σ w (z − c), max |√w (z − c)| and Σ w (z − c)² per (segment, head, column)."""
        seg, hb = tl.program_id(0), tl.program_id(1)
        head = hb // nb
        ch = tl.program_id(2) * BC + tl.arange(0, BC)  # [BC] channels of block (h, j)
        ch_ok = ch < width
        col = col0 + (hb % nb) * width + ch  # [BC] feature columns
        base = tl.multiple_of(tl.load(offsets + hb), OFFSET_MULTIPLE)  # block (layer j, head g): the schedule
        chunk_id = seg // segments
        start = chunk_id * chunk + (seg % segments) * SEG_ROWS
        stop = tl.minimum(tl.minimum(start + SEG_ROWS, (chunk_id + 1) * chunk), rows)
        c = tl.load(center_ptr + head * m + col, mask=ch_ok, other=0.0)  # [BC] float64
        acc_sum = tl.zeros([BR, BC], dtype=tl.float64)  # elementwise accumulators, reduced once at the end
        acc_max = tl.zeros([BR, BC], dtype=tl.float64)
        acc_sq = tl.zeros([BR, BC], dtype=tl.float64)
        for r0 in range(0, SEG_ROWS, BR):  # a fixed, sequential reduction order
            r = start + r0 + tl.arange(0, BR)  # [BR]
            r_ok = r < stop
            ok = r_ok[:, None] & ch_ok[None, :]
            x_ptrs = src + base + r[:, None].to(tl.int64) * stride_n + ch[None, :] * stride_d
            z = tl.where(ok, tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float64) - c[None, :], 0.0)  # [BR, BC]
            if HAS_W:
                acc_sum += z * tl.load(w_ptr + head * rows + r, mask=r_ok, other=0.0)[:, None]  # w (z − c)
                z = z * tl.load(sw_ptr + head * rows + r, mask=r_ok, other=0.0)[:, None]  # √w (z − c)
            else:
                acc_sum += z
            acc_max = tl.maximum(acc_max, tl.abs(z))
            acc_sq += z * z
        out = (seg * heads + head) * m + col  # [BC] into [C·S, H_t, m]
        tl.store(out_sum + out, tl.sum(acc_sum, axis=0), mask=ch_ok)
        tl.store(out_max + out, tl.max(acc_max, axis=0), mask=ch_ok)
        tl.store(out_sq + out, tl.sum(acc_sq, axis=0), mask=ch_ok)

    @triton.jit(do_not_specialize=["row0", "rows_here", "rows"])
    def _panel_kernel(
        src, offsets, w_ptr, center_ptr, inv_ptr, panel, row0, rows_here, rows, stride_n, stride_d,
        width, col0, m, nb, m_pad, b_pad,
        HAS_W: tl.constexpr, SLICES: tl.constexpr, RADIX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
        OFFSET_MULTIPLE: tl.constexpr,
    ):  # fmt: skip
        """Gather → centre → √w → digits of (z − c)·√w / s into panel [H_t, SLICES, m_pad, b_pad] (rows contiguous)."""
        hb = tl.program_id(1)
        head = hb // nb
        ch = tl.program_id(2) * BC + tl.arange(0, BC)  # [BC]
        ch_ok = ch < width
        col = col0 + (hb % nb) * width + ch  # [BC]
        r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] rows of this chunk
        r_ok = r < rows_here
        ok = r_ok[:, None] & ch_ok[None, :]
        base = tl.multiple_of(tl.load(offsets + hb), OFFSET_MULTIPLE)  # Plan.x_multiple / y_multiple
        x_ptrs = src + base + (row0 + r)[:, None].to(tl.int64) * stride_n + ch[None, :] * stride_d
        x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float64)  # [BR, BC]
        z = x - tl.load(center_ptr + head * m + col, mask=ch_ok, other=0.0)[None, :]  # [BR, BC]   x − c
        if HAS_W:
            z = z * tl.load(w_ptr + head * rows + row0 + r, mask=r_ok, other=0.0)[:, None]  # √w (x − c)
        t = tl.where(ok, z * tl.load(inv_ptr + head * m + col, mask=ch_ok, other=0.0)[None, :], 0.0)  # |t| < 127
        out = panel + head.to(tl.int64) * SLICES * m_pad * b_pad + col[None, :].to(tl.int64) * b_pad + r[:, None]
        keep = (r < b_pad)[:, None] & ch_ok[None, :]
        for s in tl.static_range(SLICES):
            q = tl.floor(t + 0.5)  # [BR, BC] digit in [−127, 127]
            tl.store(out + s * m_pad * b_pad, q.to(tl.int32).to(tl.int8), mask=keep)
            t = (t - q) * RADIX

    @triton.jit
    def _dot(a, b, acc):
        return tl.dot(a, b, acc, out_dtype=tl.int32)  # int8 × int8 → int32, exact

    @triton.jit
    def _gram_kernel(
        panel, scale_ptr, tiles, gram, m_pad, B_PAD: tl.constexpr, LEVELS: tl.constexpr, RADIX: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """gram[h, I, J] += s_I s_Jᵀ ⊙ Σ_{L<LEVELS} 254^−L Σ_{t+u=L} Q_tᵀ Q_u over one chunk (int8 MMA, exact int32).

        LEVELS ∈ {4, 5, 6}: 10, 13 or 15 int8 dots per K step."""
        tile, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
        fi = tl.load(tiles + 2 * tile) * BM + tl.arange(0, BM)  # [BM] Gram rows
        fj = tl.load(tiles + 2 * tile + 1) * BN + tl.arange(0, BN)  # [BN] Gram columns
        k = tl.arange(0, BK)
        slab = m_pad * B_PAD
        base = panel + head * 4 * slab
        a_ptrs = base + fi[:, None] * B_PAD + k[None, :]  # [BM, BK] K-major
        b_ptrs = base + fj[None, :] * B_PAD + k[:, None]  # [BK, BN] K-major
        acc0 = tl.zeros([BM, BN], dtype=tl.int32)
        acc1 = tl.zeros([BM, BN], dtype=tl.int32)
        acc2 = tl.zeros([BM, BN], dtype=tl.int32)
        acc3 = tl.zeros([BM, BN], dtype=tl.int32)
        if LEVELS > 4:
            acc4 = tl.zeros([BM, BN], dtype=tl.int32)
        if LEVELS > 5:
            acc5 = tl.zeros([BM, BN], dtype=tl.int32)
        for _ in range(0, B_PAD, BK):
            a0, a1 = tl.load(a_ptrs), tl.load(a_ptrs + slab)
            a2, a3 = tl.load(a_ptrs + 2 * slab), tl.load(a_ptrs + 3 * slab)
            b0, b1 = tl.load(b_ptrs), tl.load(b_ptrs + slab)
            b2, b3 = tl.load(b_ptrs + 2 * slab), tl.load(b_ptrs + 3 * slab)
            acc0 = _dot(a0, b0, acc0)  # digit order 0
            acc1 = _dot(a1, b0, _dot(a0, b1, acc1))  # order 1
            acc2 = _dot(a2, b0, _dot(a1, b1, _dot(a0, b2, acc2)))  # order 2
            acc3 = _dot(a3, b0, _dot(a2, b1, _dot(a1, b2, _dot(a0, b3, acc3))))  # order 3
            if LEVELS > 4:
                acc4 = _dot(a3, b1, _dot(a2, b2, _dot(a1, b3, acc4)))  # order 4
            if LEVELS > 5:
                acc5 = _dot(a3, b2, _dot(a2, b3, acc5))  # order 5
            a_ptrs += BK
            b_ptrs += BK
        g = acc3.to(tl.float64)  # [BM, BN]   Horner, as combine_levels
        if LEVELS > 4:
            g = acc4.to(tl.float64)
            if LEVELS > 5:
                g = acc5.to(tl.float64) / RADIX + g
            g = g / RADIX + acc3.to(tl.float64)
        g = g / RADIX + acc2.to(tl.float64)
        g = g / RADIX + acc1.to(tl.float64)
        g = g / RADIX + acc0.to(tl.float64)
        si = tl.load(scale_ptr + head * m_pad + fi)  # [BM]
        sj = tl.load(scale_ptr + head * m_pad + fj)  # [BN]
        out = gram + head * m_pad * m_pad + fi[:, None] * m_pad + fj[None, :]
        tl.store(out, tl.load(out) + g * (si[:, None] * sj[None, :]))  # float64 flush, once per chunk


_working_config: dict[str, GramConfig] = {}


def _block_c(width: int) -> int:
    return min(triton.next_power_of_2(width), 128)


def _launch_stats(source, w, sqrt_w, center, outs, plan: Plan, segments: int, passes: PassConfig) -> None:
    rows, offsets, stride_n, stride_d, width, col0, multiple = source
    nb, block_c = offsets.shape[1], _block_c(width)
    seg_rows = _round_up(-(-plan.chunk // segments), passes.stats_rows)
    grid = (len(plan.spans()) * segments, plan.heads * nb, triton.cdiv(width, block_c))
    _stats_kernel[grid](
        rows, offsets, center if w is None else w, center if sqrt_w is None else sqrt_w, center, *outs,
        plan.rows, plan.chunk, segments, stride_n, stride_d, width, col0, plan.m, nb, plan.heads,
        HAS_W=w is not None, SEG_ROWS=seg_rows, BR=passes.stats_rows, BC=block_c,
        OFFSET_MULTIPLE=multiple if passes.offset_hint else 1,
        num_warps=passes.stats_warps,
    )  # fmt: skip


def _launch_panel(source, sqrt_w, center, inverse, panel, span: slice, plan: Plan, passes: PassConfig) -> None:
    rows, offsets, stride_n, stride_d, width, col0, multiple = source
    nb, block_c = offsets.shape[1], _block_c(width)
    grid = (plan.chunk // passes.panel_rows, plan.heads * nb, triton.cdiv(width, block_c))
    _panel_kernel[grid](
        rows, offsets, center if sqrt_w is None else sqrt_w, center, inverse, panel, span.start,
        span.stop - span.start, plan.rows, stride_n, stride_d, width, col0, plan.m, nb, plan.m_pad, plan.chunk,
        HAS_W=sqrt_w is not None, SLICES=SLICES, RADIX=RADIX, BR=passes.panel_rows, BC=block_c,
        OFFSET_MULTIPLE=multiple if passes.offset_hint else 1, num_warps=passes.panel_warps,
    )  # fmt: skip


@functools.cache
def _tiles(p: int, m: int, m_pad: int, block_m: int, block_n: int, device: str) -> torch.Tensor:
    """Tiles (I, J) touching the upper triangle of Gram rows < p: [T, 2] int32 on device."""
    tiles = [
        (i, j)
        for i in range(m_pad // block_m)
        if i * block_m < p
        for j in range(m_pad // block_n)
        if (j + 1) * block_n > i * block_m and j * block_n < m
    ]
    return torch.tensor(tiles, dtype=torch.int32).to(device)


def _launch_gram(panel, scale, gram, plan: Plan, config: GramConfig | None, levels: int) -> GramConfig:
    key = str(panel.device)
    candidates = [config] if config is not None else [c for c in (_working_config.get(key),) if c] + list(GRAM_CONFIGS)
    for candidate in candidates:
        tiles = _tiles(plan.p, plan.m, plan.m_pad, candidate.block_m, candidate.block_n, key)
        try:
            _gram_kernel[(tiles.shape[0], plan.heads)](
                panel, scale, tiles, gram, plan.m_pad, B_PAD=plan.chunk, LEVELS=levels, RADIX=RADIX,
                BM=candidate.block_m, BN=candidate.block_n, BK=candidate.block_k,
                num_warps=candidate.num_warps, num_stages=candidate.num_stages,
            )  # fmt: skip
        except triton.runtime.errors.OutOfResources:
            continue
        _working_config[key] = candidate
        return candidate
    raise RuntimeError(f"no Gram kernel configuration fits this device (tried {candidates})")


def _triton_moments(
    rows_x, rows_y, w, sqrt_w, total, center, plan: Plan, config: GramConfig | None, levels: int, passes: PassConfig
) -> Moments:
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    heads, m, device = plan.heads, plan.m, rows_x.device
    sources = (  # (rows, schedule [H_t, nb], row stride, channel stride, block width, first column, offset multiple)
        (rows_x, plan.x_offsets, rows_x.stride(2), rows_x.stride(3), rows_x.shape[3], 0, plan.x_multiple),
        (rows_y, plan.y_offsets, rows_y.stride(1), rows_y.stride(2), rows_y.shape[2], plan.p, plan.y_multiple),
    )
    segments, chunks = max(1, plan.chunk // SEGMENT_ROWS), len(plan.spans())
    sums, bound, squares = torch.zeros(3, chunks * segments, heads, m, dtype=torch.float64, device=device)
    for source in sources:  # pass 1, one read: Σ w (z − c), max |√w (z − c)|, Σ w (z − c)²   [C·S, H_t, m] each
        _launch_stats(source, w, sqrt_w, center, (sums, bound, squares), plan, segments, passes)
    delta = sums.sum(0) / total[:, None]  # [H_t, m]   δ = μ − c, fixed-order partial sums
    if not bool(torch.isfinite(delta).all()):  # digits of NaN would be silent zeros; the float64 paths raise later
        raise FloatingPointError("non-finite traces or weights (the weighted means are not finite)")
    scale, inverse = chunk_scale(bound.unflatten(0, (chunks, segments)).amax(1))  # [C, H_t, m]
    scale = torch.nn.functional.pad(scale, (0, plan.m_pad - m)).contiguous()  # [C, H_t, m_pad]
    panel = torch.zeros(heads, SLICES, plan.m_pad, plan.chunk, dtype=torch.int8, device=device)  # Eq. 22 scratch
    gram = torch.zeros(heads, plan.m_pad, plan.m_pad, dtype=torch.float64, device=device)  # [H_t, m_pad, m_pad]
    for index, span in enumerate(plan.spans()):  # pass 2: panels → Gram about c, one chunk of b rows at a time
        for source in sources:
            _launch_panel(source, sqrt_w, center, inverse[index], panel, span, plan, passes)
        _launch_gram(panel, scale[index], gram, plan, config, levels)
    return _extract(gram, squares.sum(0), center, delta, total, plan)


def gram_config_in_use(device: str | torch.device) -> GramConfig | None:
    """The Gram tile configuration the Triton path settled on for this device (None before the first launch)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _working_config.get(str(device))


def scratch_bytes(plan: Plan) -> dict[str, int]:
    """Bytes the Triton path holds besides the traces: the per-chunk int8 panel (Eq. 22) and the float64 Gram."""
    panel = plan.heads * SLICES * plan.m_pad * plan.chunk
    gram = 8 * plan.heads * plan.m_pad * plan.m_pad
    return {"panel": panel, "gram": gram, "total": panel + gram}
