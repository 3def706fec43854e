"""Fused-Fit (CacheBridge §3.4, Eqs. 20–23): the integer-digit statistics of kernels/fused_fit.py against the float64
statistics of src.stats on awkward shapes (p not a power of two, n not a multiple of the chunk, f > 1 heads per target
head, no / heavy-tailed weights, offsets of 1e3), the CPU fallback, determinism, and — under TRITON_INTERPRET=1 on
CPU, or on CUDA — the Triton kernels themselves. GPU tests skip without CUDA.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.fused_fit import (
    ALIGN,
    GRAM_CONFIGS,
    LEVELS,
    MAX_CHUNK,
    RADIX,
    SLICES,
    GramConfig,
    PassConfig,
    _emulated_gram,
    chunk_scale,
    fused_moments,
    make_plan,
    scratch_bytes,
    to_digits,
    triton_available,
)
from src.stats import Moments, reference_moments, ridge_solve
from src.support import gather_features, head_assignment

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("mean_x", "mean_y", "xx", "xy", "yy")
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")

# name: (source layers, source heads, target heads, support, selected layers, d_s, d_t, rows)
SHAPES = {
    "local-f2": (4, 4, 2, "local", [3, 0, 2], 24, 40, 533),  # f = 2 (GQA group ownership), p = 144
    "local-gqa-up": (3, 2, 4, "local", [1, 2], 20, 12, 515),  # two target heads per source head, p = 40
    "full": (3, 3, 2, "full", [2, 0], 12, 20, 400),  # f = H_s = 3, p = 72
    "tiny": (3, 4, 2, "local", [2, 0], 12, 8, 300),  # f = 2, p = 48: for the Triton interpreter
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These problems are tiny: one CPU thread is faster and immune to a busy machine's oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _case(shape: str, weights: str, offset: float = 1e3, dtype=torch.float32, device="cpu", seed=0):
    """rows_x [L_s, H_s, n, d_s], rows_y [H_t, n, d_t], weights [H_t, n] | None, layers [k], head_index [H_t, f]."""
    source_layers, source_heads, target_heads, support, layers, d_s, d_t, rows = SHAPES[shape]
    generator = torch.Generator().manual_seed(seed)
    mix = torch.eye(d_s) + 0.3 * torch.randn(d_s, d_s, generator=generator) / d_s**0.5  # correlated channels
    rows_x = torch.randn(source_layers, source_heads, rows, d_s, generator=generator) @ mix * 2 + offset
    head_index = head_assignment(support, source_heads, target_heads)
    layers = torch.tensor(layers)
    features = gather_features(rows_x - offset, layers, head_index)  # [H_t, n, p]
    planted = torch.randn(target_heads, features.shape[-1], d_t, generator=generator) / features.shape[-1] ** 0.5
    rows_y = features @ planted + 0.5 * torch.randn(target_heads, rows, d_t, generator=generator) - 0.3 * offset
    w = None
    if weights == "heavy":  # Attn-Repair-like: heavy-tailed, mean one, a few exact zeros
        raw = torch.exp(1.5 * torch.randn(target_heads, rows, generator=generator, dtype=torch.float64))
        raw[:, ::97] = 0
        w = raw / raw.mean(-1, keepdim=True)
    move = lambda t: None if t is None else t.to(device)
    return move(rows_x.to(dtype)), move(rows_y.to(dtype)), move(w), layers, head_index


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _materialized(rows_x, rows_y, w, layers, head_index) -> Moments:
    return reference_moments(gather_features(rows_x, layers, head_index), rows_y, w)


def _assert_matches_float64(got: Moments, want: Moments, stats_tol: float, w_tol: float = 1e-6) -> None:
    for name in ("mean_x", "mean_y", "yy"):
        assert _relative(getattr(got, name), getattr(want, name)) < 1e-12, name
    for name in ("xx", "xy"):
        assert _relative(getattr(got, name), getattr(want, name)) < stats_tol, name
    assert got.rows == want.rows
    for lam in (1e-2, 1e2):  # the artifact: W, b after the float64 ridge solve (Eq. 23)
        (weight, bias), (weight_ref, bias_ref) = ridge_solve(got, lam, False), ridge_solve(want, lam, False)
        assert _relative(weight, weight_ref) < w_tol and _relative(bias, bias_ref) < w_tol


def _assert_bitwise(a: Moments, b: Moments) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# --------------------------------------------------------------------------- CPU: fallback and the numerical scheme


@pytest.mark.parametrize("weights", ["none", "heavy"])
def test_auto_on_cpu_runs_the_integer_scheme_not_float64(weights):
    """Without CUDA, backend="auto" (what fit.statistics=fused calls) is the kernels' emulated arithmetic: not
    silently the float64 streaming path; "reference" is that float64 path."""
    case = _case("local-f2", weights)
    got = fused_moments(*case, chunk_rows=200)
    _assert_bitwise(got, fused_moments(*case, chunk_rows=200, backend="emulate"))
    reference = fused_moments(*case, chunk_rows=200, backend="reference")
    assert not torch.equal(got.xx, reference.xx)  # digits leave a ~1e-10 trace: the integer path really ran
    _assert_matches_float64(got, _materialized(*case), stats_tol=1e-8, w_tol=1e-7)
    _assert_matches_float64(reference, _materialized(*case), stats_tol=1e-12, w_tol=1e-10)


@pytest.mark.parametrize("weights", ["none", "heavy"])
@pytest.mark.parametrize("shape", ["local-f2", "local-gqa-up", "full"])
def test_integer_digit_scheme_matches_float64(shape, weights):
    """The kernels' arithmetic (emulated in torch) is ~1e-10 from float64; W far inside the 1e-6 contract."""
    rows_x, rows_y, w, layers, head_index = _case(shape, weights)  # offsets of 1e3 (x) and −300 (y)
    got = fused_moments(rows_x, rows_y, w, layers, head_index, chunk_rows=300, backend="emulate")
    _assert_matches_float64(got, _materialized(rows_x, rows_y, w, layers, head_index), stats_tol=1e-8, w_tol=1e-7)


def test_offsets_cost_no_precision():
    """Centering happens in float64 before the digits: an offset of 1e3 leaves the error where it was."""
    errors = []
    for offset in (0.0, 1e3):
        case = _case("local-gqa-up", "heavy", offset)
        got, want = fused_moments(*case, 300, backend="emulate"), _materialized(*case)
        errors.append(max(_relative(got.xx, want.xx), _relative(got.xy, want.xy)))
    assert max(errors) < 1e-8 and errors[1] < 3 * errors[0]


@pytest.mark.parametrize("levels", [5, 6])
def test_ill_conditioned_support(levels):
    """Nearly collinear source layers (cond(corr) ≈ 6e3) and ×100 outlier channels: W still within 1e-6 (≈1.5e-7).

    W's error is the statistics' (~1e-10) times the conditioning: at cond ≈ 2e5 levels=5 reaches ~2e-6."""
    generator = torch.Generator().manual_seed(0)
    spread = torch.logspace(0, 2, 32)  # [d_s] per-channel scale
    base = torch.randn(1, 2, 4000, 32, generator=generator) * spread
    rows_x = (base + 0.05 * torch.randn(4, 2, 4000, 32, generator=generator) * spread).float() + 500
    layers, head_index = torch.arange(4), head_assignment("local", 2, 2)
    features = gather_features(rows_x, layers, head_index).double()  # [H_t, n, 128]
    noise = 0.1 * torch.randn(2, 4000, 32, generator=generator, dtype=torch.float64)
    rows_y = (features[..., :32] - features[..., 32:64] + noise).float() - 200
    raw = torch.exp(1.5 * torch.randn(2, 4000, generator=generator, dtype=torch.float64))
    w = raw / raw.mean(-1, keepdim=True)
    got = fused_moments(rows_x, rows_y, w, layers, head_index, 1500, backend="emulate", levels=levels)
    _assert_matches_float64(got, _materialized(rows_x, rows_y, w, layers, head_index), stats_tol=1e-8)


def test_bf16_traces_and_chunk_larger_than_rows():
    rows_x, rows_y, w, layers, head_index = _case("local-f2", "heavy", dtype=torch.bfloat16)
    got = fused_moments(rows_x, rows_y, w, layers, head_index, chunk_rows=10**6, backend="emulate")
    _assert_matches_float64(got, _materialized(rows_x, rows_y, w, layers, head_index), stats_tol=1e-8, w_tol=1e-7)


def test_integer_gram_has_no_summation_order():
    """The Gram of the digits is an exact integer sum: reversing the rows cannot change a bit (what makes the kernels'
    result independent of tile shapes and launch order). A float32 or otherwise rounded product sum would."""
    generator = torch.Generator().manual_seed(3)  # 4,000 rows: digit sums pass 2²⁴, float32 would round them
    z = torch.randn(2, 4000, 40, generator=generator, dtype=torch.float64) * torch.logspace(0, 2, 40)  # [H, n, m]
    digits = to_digits(z * chunk_scale(z.abs().amax(1))[1][:, None])  # [SLICES, H, n, m]
    for levels in LEVELS:
        assert torch.equal(_emulated_gram(digits, levels), _emulated_gram(digits.flip(2), levels)), levels


def test_digits_cover_the_value_within_half_a_last_digit():
    t = (torch.rand(10_000, dtype=torch.float64) * 2 - 1) * 127 * (1 - 1e-9)
    t[:4] = torch.tensor([0.0, 126.99999, -126.99999, 0.5])
    digits = to_digits(t)  # [SLICES, N]
    assert digits.abs().max() <= 127 and torch.equal(digits, digits.round())
    value = sum(digits[s] * float(RADIX) ** -s for s in range(SLICES))
    assert float((value - t).abs().max()) <= 0.5 * RADIX ** -(SLICES - 1) * (1 + 1e-6)
    scale, inverse = chunk_scale(torch.tensor([0.0, 3.0], dtype=torch.float64))
    assert scale[0] == 0 and inverse[0] == 0 and float(3.0 * inverse[1]) < 127


def test_plan_chunks_are_balanced_aligned_and_int32_exact():
    rows_x, rows_y, _, layers, head_index = _case("local-f2", "none")
    plan = make_plan(rows_x, rows_y, layers, head_index, chunk_rows=200)  # 533 rows → 3 chunks of 178 → 256
    assert plan.chunk % ALIGN == 0 and plan.chunk == 256 and len(plan.spans()) == 3
    assert plan.spans()[-1] == slice(512, 533) and plan.m == 144 + 40 and plan.m_pad == 256
    big = make_plan(
        torch.empty(1, 1, 100_000, 8), torch.empty(1, 100_000, 8), torch.tensor([0]), head_index[:1, :1], 10**6
    )
    assert big.chunk <= MAX_CHUNK and MAX_CHUNK * 4 * 127**2 < 2**31  # int32 sums of ≤ 4 digit pairs stay exact
    panel = scratch_bytes(plan)["panel"]  # Eq. 22: O(H_t · b · (p + d_t)), int8 × 4 digits
    assert panel == plan.heads * SLICES * plan.m_pad * plan.chunk


def test_static_schedule_reproduces_gather_features():
    rows_x, _, _, layers, head_index = _case("full", "none")
    plan = make_plan(rows_x, torch.empty(2, rows_x.shape[2], 4), layers, head_index, 128)
    flat, d_s = rows_x.flatten(), rows_x.shape[3]
    channel = torch.arange(rows_x.shape[2])[:, None] * rows_x.stride(2) + torch.arange(d_s)[None, :]  # [n, d_s]
    gathered = torch.stack(
        [torch.cat([flat[offset + channel] for offset in plan.x_offsets[h].tolist()], -1) for h in range(plan.heads)]
    )  # [H_t, n, k·f·d_s]
    assert torch.equal(gathered, gather_features(rows_x, layers, head_index))


def test_arguments_are_checked():
    rows_x, rows_y, w, layers, head_index = _case("local-f2", "heavy")
    with pytest.raises(ValueError, match="backend"):
        fused_moments(rows_x, rows_y, w, layers, head_index, 128, backend="cuda")
    with pytest.raises(ValueError, match="nonnegative"):
        fused_moments(rows_x, rows_y, -w, layers, head_index, 128, backend="emulate")


INTERPRETED = """
import torch
import triton
import triton.language as tl


@triton.jit
def _probe(out, N: tl.constexpr):  # the language features the kernels use, nothing of ours
    acc = tl.zeros([16, 16], dtype=tl.int32)
    for _ in range(0, N, 16):
        acc = tl.dot(tl.full([16, 16], 3, tl.int8), tl.full([16, 16], 2, tl.int8), acc, out_dtype=tl.int32)
    tl.store(out + tl.arange(0, 16), tl.floor(tl.sum(acc, axis=0).to(tl.float64) + 0.5).to(tl.int32))


try:
    _probe[(1,)](torch.zeros(16, dtype=torch.int32), 32)
except Exception as error:  # this triton / numpy pair cannot interpret: not a finding about our kernels
    print("UNSUPPORTED", repr(error)[:300])
    raise SystemExit(0)

from kernels.fused_fit import GramConfig, PassConfig, fused_moments
from tests.test_kernels_fit import _assert_bitwise, _assert_matches_float64, _case, _materialized, _relative

case = _case("tiny", "heavy")  # 300 rows in 2 chunks of 256: the last one padded
got = fused_moments(*case, 200, backend="triton")
emulated = fused_moments(*case, 200, backend="emulate")
for name in ("xx", "xy"):
    assert _relative(getattr(got, name), getattr(emulated, name)) < 1e-9, name
_assert_matches_float64(got, _materialized(*case), stats_tol=1e-8, w_tol=1e-7)
_assert_bitwise(got, fused_moments(*case, 200, backend="triton", config=GramConfig(128, 64, 64, 8, 3)))  # exact sums

case = _case("tiny", "none")  # unweighted, 10 digit pairs, other pass tiles
passes = PassConfig(stats_rows=16, stats_warps=4, panel_rows=64, panel_warps=8)
got = fused_moments(*case, 200, backend="triton", levels=4, passes=passes)
emulated = fused_moments(*case, 200, backend="emulate", levels=4)
for name in ("xx", "xy"):
    assert _relative(getattr(got, name), getattr(emulated, name)) < 1e-9, name
_assert_matches_float64(got, _materialized(*case), stats_tol=1e-7, w_tol=1e-6)
print("OK")
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernels_under_the_interpreter(tmp_path):
    """The real kernels on CPU (TRITON_INTERPRET=1, in a subprocess: the mode is fixed when the kernels are built)."""
    script = tmp_path / "interpreted.py"
    script.write_text(INTERPRETED)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.stdout.startswith("UNSUPPORTED"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------- GPU: the compiled kernels


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "weights"), [("local-f2", "heavy"), ("local-gqa-up", "none"), ("full", "heavy")])
def test_triton_matches_float64_on_awkward_shapes(shape, weights):
    case = _case(shape, weights, device="cuda")  # chunk_rows 256: every shape compiles to the same 256-row panel
    got = fused_moments(*case, 256, backend="triton")
    _assert_matches_float64(got, _materialized(*case), stats_tol=1e-8, w_tol=1e-7)
    emulated = fused_moments(*case, 256, backend="emulate")
    for name in ("xx", "xy"):
        assert _relative(getattr(got, name), getattr(emulated, name)) < 1e-9, name
    _assert_bitwise(got, fused_moments(*case, 256))  # auto picks triton on CUDA


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("levels", [4, 6])
def test_triton_other_levels(levels):
    case = _case("local-f2", "heavy", device="cuda")
    got = fused_moments(*case, 256, backend="triton", levels=levels)
    emulated = fused_moments(*case, 256, backend="emulate", levels=levels)
    assert max(_relative(got.xx, emulated.xx), _relative(got.xy, emulated.xy)) < 1e-9
    _assert_matches_float64(got, _materialized(*case), stats_tol=1e-7, w_tol=1e-6)


@gpu
@pytest.mark.gpu
def test_triton_bitwise_repeatable_and_independent_of_tiles():
    case = _case("local-f2", "heavy", device="cuda")
    first = fused_moments(*case, 256, backend="triton", config=GRAM_CONFIGS[0])
    _assert_bitwise(first, fused_moments(*case, 256, backend="triton", config=GRAM_CONFIGS[0]))
    _assert_bitwise(first, fused_moments(*case, 256, backend="triton", config=GramConfig(128, 64, 64, 8, 3)))


@gpu
@pytest.mark.gpu
def test_triton_paper_like_shape_meets_the_artifact_bound():
    """Head-Local, k = 8 of 10 bf16 source layers, 8 heads, d = 128 (p = 1024), 20,000 rows in 2 chunks."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, dim = 20_000, 8, 128
    rows_x = torch.randn(10, heads, rows, dim, generator=generator, device="cuda").to(torch.bfloat16)
    rows_y = torch.randn(heads, rows, dim, generator=generator, device="cuda").to(torch.bfloat16)
    raw = torch.exp(1.5 * torch.randn(heads, rows, generator=generator, device="cuda", dtype=torch.float64))
    w = raw / raw.mean(-1, keepdim=True)
    layers, head_index = torch.tensor([0, 2, 3, 4, 5, 7, 8, 9]), head_assignment("local", heads, heads)
    got = fused_moments(rows_x, rows_y, w, layers, head_index, 16384, backend="triton")
    _assert_matches_float64(got, _materialized(rows_x, rows_y, w, layers, head_index), stats_tol=1e-8)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_the_gathers_offset_hint_is_the_plans_multiple_unless_the_pass_config_turns_it_off(monkeypatch):
    """Both passes launch with the schedule's offset multiple (16-byte gathers, tests/test_kernels_stores.py), or 1
    with `PassConfig(offset_hint=False)` — the loads of before, for an A/B on one GPU (bench_fused_fit.py hint=0)."""
    import kernels.fused_fit as fused_fit

    seen = []

    class Launch:  # a kernel's `kernel[grid](...)`, recording the hint it is given
        def __getitem__(self, grid):
            return lambda *args, **constants: seen.append(constants["OFFSET_MULTIPLE"])

    monkeypatch.setattr(fused_fit, "_stats_kernel", Launch())
    monkeypatch.setattr(fused_fit, "_panel_kernel", Launch())
    rows_x, rows_y = torch.zeros(3, 2, 40, 16), torch.zeros(2, 40, 8)
    plan = make_plan(rows_x, rows_y, torch.tensor([0, 2]), torch.tensor([[0], [1]]), 64)
    source = (rows_x, plan.x_offsets, rows_x.stride(2), rows_x.stride(3), 16, 0, plan.x_multiple)
    for passes in (PassConfig(), PassConfig(offset_hint=False)):
        fused_fit._launch_stats(source, None, None, None, (None,) * 3, plan, 1, passes)
        fused_fit._launch_panel(source, None, None, None, None, slice(0, 40), plan, passes)
    assert seen == [16, 16, 1, 1]


def test_the_fit_bench_times_a_variant_without_the_hint_and_refuses_more_layers_than_the_target(tmp_path):
    """scripts/bench_fused_fit.py --quick (CPU): a hint=0 variant beside the default runs and is recorded; asking a
    variant for more layers than the target has is a usage error, not an IndexError mid-run."""
    script, out = ROOT / "scripts" / "bench_fused_fit.py", tmp_path / "ff.json"
    common = [sys.executable, str(script), "--quick", "--paths", "fused", "--out", str(out)]
    done = subprocess.run([*common, "--variant", "unhinted:hint=0", "--variant-layers", "2"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "variant:unhinted" in json.loads(out.read_text())["paths"]
    refused = subprocess.run([*common, "--variant", "unhinted:hint=0"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--variant-layers 8: 1 to the 3 target layers" in refused.stderr
