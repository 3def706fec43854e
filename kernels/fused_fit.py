"""Fused-Fit (CacheBridge §3.4): the weighted, centered statistics A_h, B_h (Eqs. 20–21) of one target layer ×
component, gathered straight from the traces by a static schedule and accumulated on integer tensor cores.

Features per target head are z = [x, y], x the k·f head-local source blocks (layer j, head g, channel; the order of
`src.support.gather_features`), y the target row; m = p + d_t. Per (target layer, component):

  pass 1    per row segment: Σ w·z in float64, partials summed in a fixed order            → weighted means μ
  pass 1b   per row segment: max |√w (z − μ)| and Σ w (z − μ)²                              → chunk scales s, and yy
  pass 2    per row chunk of b rows: `_panel_kernel` gathers the blocks from rows [L_s, H_s, n, d_s], centers,
            weights by √w and writes √w (z − μ)/s as 4 signed base-254 digits into a contiguous per-head int8 panel
            [H_t, 4, m, b] (rows contiguous: the K-major operand of int8 MMA); `_gram_kernel` forms the upper
            triangle of Σ_r z_r z_rᵀ tile by tile with 13 int8 GEMMs (digit pairs of order ≤ 4) into int32, flushed
            to float64 once per chunk. A = Gram[:p, :p] (Eq. 20), B = Gram[:p, p:] (Eq. 21).

Precision: centering and weighting are float64 before anything is rounded (offsets cost nothing). A value is
s·(q₀ + q₁/254 + q₂/254² + q₃/254³), |q| ≤ 127, s = (its column's max over the chunk)/127: error ≤ 2.4e-10 of the
column max. Products keep the 13 digit pairs of order ≤ 4; the dropped ones are ≤ 2e-12 of the product of the two
column maxima. int32 sums are exact for b ≤ 32,768 (|Σ| ≤ b·4·127² < 2³¹); flushes and chunk sums are float64.
Per-column scales make the error relative to each feature's own range (outlier channels cost nothing). Measured
(tests, heavy-tailed weights): A, B within ~2e-10 of float64; W inherits that times the ridge problem's conditioning.
Integer sums have no order, so the result is bitwise repeatable and independent of the tile configuration.
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

from src.stats import Moments, streaming_moments
from src.support import gather_features

SLICES, RADIX, DIGIT = 4, 254, 127  # base-254 digits in [−127, 127]
LEVELS = (5, 6)  # digit pairs of order t + u < levels are multiplied: 13 (default) or 15 int8 GEMMs
MAX_CHUNK = 32768  # int32 exactness: MAX_CHUNK · 4 pairs · 127² < 2³¹
ALIGN = 128  # chunk rows and panel width are padded to this; every tile config divides it
BOUND_PAD = 1 + 2**-20  # keeps |z|/s strictly below 127 so the leading digit cannot overflow
SEGMENT_ROWS = 2048  # rows per pass-1 program (partials reduced in a fixed order)
BACKENDS = ("auto", "triton", "emulate", "reference")


@dataclass(frozen=True)
class GramConfig:
    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


# tried in order; the result does not depend on which one runs (exact integer sums, same per-element flush)
GRAM_CONFIGS = (GramConfig(), GramConfig(num_stages=2), GramConfig(64, 64, 64, 4, 2))


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
    return Plan(heads, rows, p, m, _round_up(m, ALIGN), chunk, move(schedule), move(y_offsets))


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


def _extract(gram: torch.Tensor, mean: torch.Tensor, yy: torch.Tensor, plan: Plan) -> Moments:
    """Upper-triangle Gram [H, m_pad, m_pad] → Moments (A symmetrized from its upper triangle)."""
    p, m = plan.p, plan.m
    upper = torch.triu(gram[:, :p, :p])  # [H_t, p, p]
    xx = upper + torch.triu(upper, 1).transpose(1, 2)  # [H_t, p, p]   A_h (Eq. 20)
    xy = gram[:, :p, p:m].contiguous()  # [H_t, p, d_t]   B_h (Eq. 21)
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
) -> Moments:
    """Moments of features gather_features(rows_x, layers, head_index) → rows_y under weights (non-PCA supports).

    rows_x [L_s, H_s, n, d_s] source K or V rows (any float dtype), rows_y [H_t, n, d_t] target rows of this layer,
    weights [H_t, n] nonnegative (None = uniform), layers [k], head_index [H_t, f]. backend: "triton" (CUDA, or CPU
    under TRITON_INTERPRET=1), "emulate" (the same integer scheme in torch), "reference" (float64 streaming), "auto"
    (triton on CUDA when importable, else reference). levels: digit pairs of order < levels are multiplied — 5 (13
    GEMMs) or 6 (15 GEMMs; W several times closer on ill-conditioned supports). Returns float64 Moments, as
    src.stats.streaming_moments does for the same features."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if levels not in LEVELS:
        raise ValueError(f"levels must be one of {LEVELS}")
    if backend == "auto":
        backend = "triton" if rows_x.is_cuda and triton_available() else "reference"
    if backend == "reference":
        return fused_moments_ref(rows_x, rows_y, weights, layers, head_index, chunk_rows)
    plan = make_plan(rows_x, rows_y, layers, head_index, chunk_rows)
    w, sqrt_w, total = _weights(weights, plan.rows, plan.heads, rows_x.device)
    if backend == "emulate":
        return _emulated_moments(rows_x, rows_y, w, sqrt_w, total, layers, head_index, plan, levels)
    return _triton_moments(rows_x, rows_y, w, sqrt_w, total, plan, config, levels)


def _emulated_moments(rows_x, rows_y, w, sqrt_w, total, layers, head_index, plan: Plan, levels: int) -> Moments:
    """The kernels' arithmetic in torch: float64 centering, base-254 digits, exact integer Gram, float64 flush."""
    features = lambda span: torch.cat(
        [gather_features(rows_x[:, :, span], layers, head_index).double(), rows_y[:, span].double()], -1
    )  # [H_t, b, m]
    spans = plan.spans()
    weighted = lambda z, wc: z if wc is None else z * wc[..., None]
    sums = torch.stack([weighted(features(span), _cut(w, span)).sum(1) for span in spans])  # [C, H_t, m]
    mean = sums.sum(0) / total[:, None]  # [H_t, m]   two-pass means
    gram = torch.zeros(plan.heads, plan.m, plan.m, dtype=torch.float64, device=rows_x.device)  # [H_t, m, m]
    yy = torch.zeros(plan.heads, dtype=torch.float64, device=rows_x.device)  # [H_t]
    for span in spans:
        z = weighted(features(span) - mean[:, None], _cut(sqrt_w, span))  # [H_t, b, m]   √w (z − μ)
        scale, inverse = chunk_scale(z.abs().amax(1))  # [H_t, m]
        digits = to_digits(z * inverse[:, None])  # [SLICES, H_t, b, m]
        gram += _emulated_gram(digits, levels) * (scale[:, :, None] * scale[:, None, :])  # [H_t, m, m]  Eqs. 20–21
        yy += (z[..., plan.p :] ** 2).sum((1, 2))
    return _extract(gram, mean, yy, plan)


# --------------------------------------------------------------------------- Triton path


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _reduce_kernel(
        src, offsets, w_ptr, mean_ptr, out_a, out_b, rows, chunk, segments, stride_n, stride_d, width, col0, m, nb,
        heads, HAS_W: tl.constexpr, MODE: tl.constexpr, SEG_ROWS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        """MODE 0: Σ w·z per (segment, head, column); MODE 1: max |√w (z − μ)| and Σ w (z − μ)² (w_ptr = √w)."""
        seg, hb = tl.program_id(0), tl.program_id(1)
        head = hb // nb
        ch = tl.program_id(2) * BC + tl.arange(0, BC)  # [BC] channels of block (h, j)
        ch_ok = ch < width
        col = col0 + (hb % nb) * width + ch  # [BC] feature columns
        base = tl.load(offsets + hb)  # int64 offset of block (layer j, head g): the static gather schedule
        chunk_id = seg // segments
        start = chunk_id * chunk + (seg % segments) * SEG_ROWS
        stop = tl.minimum(tl.minimum(start + SEG_ROWS, (chunk_id + 1) * chunk), rows)
        if MODE == 1:
            mu = tl.load(mean_ptr + head * m + col, mask=ch_ok, other=0.0)  # [BC] float64
        acc = tl.zeros([BC], dtype=tl.float64)
        acc2 = tl.zeros([BC], dtype=tl.float64)
        for r0 in range(0, SEG_ROWS, BR):  # a fixed, sequential reduction order
            r = start + r0 + tl.arange(0, BR)  # [BR]
            r_ok = r < stop
            ok = r_ok[:, None] & ch_ok[None, :]
            x_ptrs = src + base + r[:, None].to(tl.int64) * stride_n + ch[None, :] * stride_d
            x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float64)  # [BR, BC]
            if MODE == 0:
                if HAS_W:
                    x = x * tl.load(w_ptr + head * rows + r, mask=r_ok, other=0.0)[:, None]
                acc += tl.sum(x, axis=0)
            else:
                z = x - mu[None, :]  # [BR, BC]
                if HAS_W:
                    z = z * tl.load(w_ptr + head * rows + r, mask=r_ok, other=0.0)[:, None]
                z = tl.where(ok, z, 0.0)
                acc = tl.maximum(acc, tl.max(tl.abs(z), axis=0))
                acc2 += tl.sum(z * z, axis=0)
        out = (seg * heads + head) * m + col  # [BC] into [C·S, H_t, m]
        tl.store(out_a + out, acc, mask=ch_ok)
        if MODE == 1:
            tl.store(out_b + out, acc2, mask=ch_ok)

    @triton.jit(do_not_specialize=["row0", "rows_here", "rows"])
    def _panel_kernel(
        src, offsets, w_ptr, mean_ptr, inv_ptr, panel, row0, rows_here, rows, stride_n, stride_d,
        width, col0, m, nb, m_pad, b_pad,
        HAS_W: tl.constexpr, SLICES: tl.constexpr, RADIX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        """Gather → center → √w → digits of (z − μ)·√w / s into panel [H_t, SLICES, m_pad, b_pad] (rows contiguous)."""
        hb = tl.program_id(1)
        head = hb // nb
        ch = tl.program_id(2) * BC + tl.arange(0, BC)  # [BC]
        ch_ok = ch < width
        col = col0 + (hb % nb) * width + ch  # [BC]
        r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] rows of this chunk
        r_ok = r < rows_here
        ok = r_ok[:, None] & ch_ok[None, :]
        base = tl.load(offsets + hb)
        x_ptrs = src + base + (row0 + r)[:, None].to(tl.int64) * stride_n + ch[None, :] * stride_d
        x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float64)  # [BR, BC]
        z = x - tl.load(mean_ptr + head * m + col, mask=ch_ok, other=0.0)[None, :]  # [BR, BC]   x − μ (Eq. 20)
        if HAS_W:
            z = z * tl.load(w_ptr + head * rows + row0 + r, mask=r_ok, other=0.0)[:, None]  # √w (x − μ)
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
        """gram[h, I, J] += s_I s_Jᵀ ⊙ Σ_{L<LEVELS} 254^−L Σ_{t+u=L} Q_tᵀ Q_u over one chunk (int8 MMA, exact int32)."""
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
            acc4 = _dot(a3, b1, _dot(a2, b2, _dot(a1, b3, acc4)))  # order 4
            if LEVELS > 5:
                acc5 = _dot(a3, b2, _dot(a2, b3, acc5))  # order 5
            a_ptrs += BK
            b_ptrs += BK
        g = acc4.to(tl.float64)  # [BM, BN]   Horner, as combine_levels
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


REDUCE_ROWS, PANEL_ROWS = 64, 64  # [64, 128] float64 tiles over 8 warps
_working_config: dict[str, GramConfig] = {}


def _block_c(width: int) -> int:
    return min(triton.next_power_of_2(width), 128)


def _launch_reduce(source, weight, mean, outs, plan: Plan, segments: int, mode: int) -> None:
    rows, offsets, stride_n, stride_d, width, col0 = source
    nb, block_c = offsets.shape[1], _block_c(width)
    seg_rows = _round_up(-(-plan.chunk // segments), REDUCE_ROWS)
    grid = (len(plan.spans()) * segments, plan.heads * nb, triton.cdiv(width, block_c))
    dummy = outs[0]
    _reduce_kernel[grid](
        rows, offsets, dummy if weight is None else weight, dummy if mean is None else mean, outs[0], outs[-1],
        plan.rows, plan.chunk, segments, stride_n, stride_d, width, col0, plan.m, nb, plan.heads,
        HAS_W=weight is not None, MODE=mode, SEG_ROWS=seg_rows, BR=REDUCE_ROWS, BC=block_c, num_warps=8,
    )  # fmt: skip


def _launch_panel(source, sqrt_w, mean, inverse, panel, span: slice, plan: Plan) -> None:
    rows, offsets, stride_n, stride_d, width, col0 = source
    nb, block_c = offsets.shape[1], _block_c(width)
    grid = (plan.chunk // PANEL_ROWS, plan.heads * nb, triton.cdiv(width, block_c))
    _panel_kernel[grid](
        rows, offsets, mean if sqrt_w is None else sqrt_w, mean, inverse, panel, span.start, span.stop - span.start,
        plan.rows, stride_n, stride_d, width, col0, plan.m, nb, plan.m_pad, plan.chunk,
        HAS_W=sqrt_w is not None, SLICES=SLICES, RADIX=RADIX, BR=PANEL_ROWS, BC=block_c, num_warps=8,
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


def _triton_moments(rows_x, rows_y, w, sqrt_w, total, plan: Plan, config: GramConfig | None, levels: int) -> Moments:
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    heads, m, device = plan.heads, plan.m, rows_x.device
    sources = (  # (rows, schedule [H_t, nb], row stride, channel stride, block width, first feature column)
        (rows_x, plan.x_offsets, rows_x.stride(2), rows_x.stride(3), rows_x.shape[3], 0),
        (rows_y, plan.y_offsets, rows_y.stride(1), rows_y.stride(2), rows_y.shape[2], plan.p),
    )
    segments, chunks = max(1, plan.chunk // SEGMENT_ROWS), len(plan.spans())
    sums = torch.zeros(chunks * segments, heads, m, dtype=torch.float64, device=device)  # [C·S, H_t, m]
    for source in sources:  # pass 1: Σ w z
        _launch_reduce(source, w, None, (sums,), plan, segments, mode=0)
    mean = sums.sum(0) / total[:, None]  # [H_t, m]   weighted means, fixed-order partial sums
    if not bool(torch.isfinite(mean).all()):  # digits of NaN would be silent zeros; the float64 paths raise later
        raise FloatingPointError("non-finite traces or weights (the weighted means are not finite)")
    bound, squares = torch.zeros_like(sums), torch.zeros_like(sums)  # [C·S, H_t, m]
    for source in sources:  # pass 1b: max |√w (z − μ)|, Σ w (z − μ)²
        _launch_reduce(source, sqrt_w, mean, (bound, squares), plan, segments, mode=1)
    scale, inverse = chunk_scale(bound.unflatten(0, (chunks, segments)).amax(1))  # [C, H_t, m]
    scale = torch.nn.functional.pad(scale, (0, plan.m_pad - m)).contiguous()  # [C, H_t, m_pad]
    yy = squares[..., plan.p :].sum((0, 2))  # [H_t]
    panel = torch.zeros(heads, SLICES, plan.m_pad, plan.chunk, dtype=torch.int8, device=device)  # Eq. 22 scratch
    gram = torch.zeros(heads, plan.m_pad, plan.m_pad, dtype=torch.float64, device=device)  # [H_t, m_pad, m_pad]
    for index, span in enumerate(plan.spans()):  # pass 2: panels → Gram, one chunk of b rows at a time
        for source in sources:
            _launch_panel(source, sqrt_w, mean, inverse[index].contiguous(), panel, span, plan)
        _launch_gram(panel, scale[index], gram, plan, config, levels)
    return _extract(gram, mean, yy, plan)


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
