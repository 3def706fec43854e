"""A span's map padded to its bucket (src/runtime/map_graph.py), the body a CUDA graph replays, run eagerly here: on
the exact non-identity pair it writes exactly what the unpadded map writes into the engine's cache — the span's slots
bit for bit, every other slot unchanged but the scratch slot — with the same device flags, and reads no device value
on the host; every span takes the smallest bucket ≥ it, within the padding bound, on the fused map's tile; the route
(graph or eager, and why) is data. The graph replay itself: tests/test_engine.py (GPU)."""

import bisect

import pytest
import torch

from kernels.apply_map import HAVE_TRITON, default_config
from src.apply import KVTransfer
from src.eval.ttft import handoff_ttft
from src.forward import prefill
from src.maps import TransferError, cache_layers, layer_flags, stacked_flags
from src.runtime.engine import Engine
from src.runtime.map_graph import SPAN_BUCKETS, MapGraphs, fill, padding, span_bucket, span_route
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair
from tests.host_syncs import DeviceReads
from tests.test_kernels_apply import interpreted  # noqa: F401  (the fixture)
from tests.test_session import _overflowing

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"))]
CAPACITY = 80  # slots 0..79, the scratch slot 80; a span's largest bucket: 80


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each apply path; Triton through its CPU interpreter (skipped where it cannot run)."""
    if request.param == "triton":
        request.getfixturevalue("interpreted")
    return request.param


def test_every_span_takes_the_smallest_bucket_within_the_padding_bound():
    """n ≤ 16 pads to 16; above, the smallest bucket ≥ n is < 1.25 n; above the largest, None (eager)."""
    assert SPAN_BUCKETS[:9] == (16, 20, 24, 28, 32, 40, 48, 56, 64) and SPAN_BUCKETS[-1] == 65536
    assert list(SPAN_BUCKETS) == sorted(set(SPAN_BUCKETS))
    for count in range(1, SPAN_BUCKETS[-1] + 1):
        bucket = span_bucket(count)
        assert bucket == SPAN_BUCKETS[bisect.bisect_left(SPAN_BUCKETS, count)], count  # the smallest ≥ n
        assert bucket >= count and (bucket < 1.25 * count or bucket == SPAN_BUCKETS[0]), count
    assert span_bucket(SPAN_BUCKETS[-1] + 1) is None
    assert sum(1024 <= b <= 16384 for b in SPAN_BUCKETS) == 17  # the 1K–16K histories' graphs per mapper
    with pytest.raises(ValueError, match="≥ 1 token"):
        span_bucket(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_span_keeps_the_fused_maps_tile(dtype):
    """The fused map's tile depends on the span length (64 rows up to 64 tokens, else 128): every span and its bucket
    take the same one, so each real row is computed by the same instructions padded or not."""
    for count in range(1, 4097):
        assert default_config(span_bucket(count), dtype) == default_config(count, dtype), count


def test_the_route_is_data_with_its_reason():
    assert span_route(1000, True, False) == (1024, "one replay of the 1024-row graph")
    assert span_route(1000, False, False) == (None, "the engine runs without CUDA graphs")
    assert span_route(1000, True, True).bucket is None and "token-feature" in span_route(1000, True, True).reason
    too_long = span_route(SPAN_BUCKETS[-1] + 1, True, False)
    assert too_long.bucket is None and "longer than the largest bucket 65536" in too_long.reason


def test_padding_repeats_the_last_token_into_the_scratch_slot():
    positions, slots = padding(5, 8, 5, 99)  # 3 tokens at 5..7, bucket 5, scratch slot 99
    assert positions.tolist() == [5, 6, 7, 7, 7] and slots.tolist() == [5, 6, 7, 99, 99]
    assert padding(5, 10, 5, 99)[1].tolist() == [5, 6, 7, 8, 9]  # the bucket's own size: no pad row


@pytest.mark.parametrize("count", [1, 5, 8])
def test_fill_holds_the_span_then_its_last_row_in_a_token_major_view(count):
    """`fill` = the span's layers stacked, its last row repeated to the bucket; the view's rows are one prefix."""
    generator = torch.Generator().manual_seed(count)
    layers = [torch.randn(1, 2, 11, 4, generator=generator)[:, :, 3 : 3 + count] for _ in range(3)]  # [1, H_s, n, d]
    flat = torch.full((8 * 3 * 2 * 4,), float("nan"))
    static = flat.view(8, 3, 2, 4).permute(1, 2, 0, 3)  # [L_s, H_s, b, d_s], token-major as MapGraphs keeps it
    fill(static, layers)
    rows = torch.arange(8).clamp(max=count - 1)  # [b]
    assert torch.equal(static, torch.cat(layers)[:, :, rows])


def _engine(pair) -> Engine:
    """An engine whose every slot, the scratch slot too, holds random values (so any stray write shows)."""
    engine = Engine(pair.target, CAPACITY)
    generator = torch.Generator().manual_seed(3)
    engine.keys.copy_(torch.randn(engine.keys.shape, generator=generator))
    engine.values.copy_(torch.randn(engine.values.shape, generator=generator))
    return engine


def _span(pair, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The source's cache of positions start..end − 1, [(K, V) [1, H_s, n, d_s]] (slices of a longer prefill)."""
    layers = cache_layers(prefill(pair.source, calibration_ids(1, end + 3, seed=31)))
    return [(k[:, :, start:end], v[:, :, start:end]) for k, v in layers]


def _padded(engine: Engine, transfer, layers, start: int, end: int, bucket: int, bound=None):
    """The bucketed map run eagerly: what the captured graph replays."""
    graphs = MapGraphs(engine.blocks(), engine.scratch, span_bucket(CAPACITY), None, replay=False)
    return graphs.run(transfer, layers, start, end, bucket, bound)


@pytest.mark.parametrize("start, end", [(4, 20), (4, 17), (9, 33), (30, 79)])  # buckets 16, 16, 24, 64: own, padded
def test_the_padded_map_writes_what_the_eager_map_writes(pair, backend, start, end):
    """The same slots bit for bit, the same flags, every other slot unchanged — but the scratch slot, which the pad
    rows (if any) write; the wrong (non-identity) mapper, so a pad row that landed in a real slot would show."""
    transfer = KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash, backend=backend)
    layers, bucket = _span(pair, start, end), span_bucket(end - start)
    padded, eager = _engine(pair), _engine(pair)
    before = eager.keys.clone(), eager.values.clone()
    bound = 1.0  # some mapped layers exceed it, some not: the magnitude flags are compared too
    got = _padded(padded, transfer, layers, start, end, bucket, bound)
    want = eager.map_span(transfer, layers, start, end, bound=bound)  # graphs off (CPU): `into`, unpadded
    for name, a, b in zip(("source", "target", "beyond"), got, want, strict=False):
        assert torch.equal(a, b), name
    assert want.beyond.any() and not want.beyond.all()
    scratch = eager.scratch
    for component, (a, b, old) in enumerate(zip(padded.blocks(), eager.blocks(), before, strict=True)):
        assert torch.equal(a[:, 0, :, :scratch], b[:, 0, :, :scratch]), component  # every real slot
        assert torch.equal(b[:, 0, :, :start], old[:, :, :start]) and torch.equal(b[:, 0, :, end:], old[:, :, end:])
        assert not torch.equal(b[:, 0, :, start:end], old[:, :, start:end])  # the span was written
        if bucket > end - start:  # the pad rows: the last token's map again, into the scratch slot alone
            assert torch.equal(a[:, 0, :, scratch], b[:, 0, :, end - 1]), component
        else:
            assert torch.equal(a[:, 0, :, scratch], old[:, :, scratch]), component


def test_the_padded_maps_flags_see_what_the_span_holds(pair):
    """Non-finite source values, an overflowing mapper: the padded map's flags are the eager map's."""
    start, end = 4, 17  # padded to 16
    layers = _span(pair, start, end)
    poisoned = [(k, v.clone()) for k, v in layers]
    poisoned[1][1][0, 0, 12, 2] = float("nan")  # the span's last token: the pad rows repeat it
    for mapper, source in ((pair.wrong, poisoned), (_overflowing(pair.exact), layers)):
        transfer = KVTransfer(mapper, pair.source, pair.target, pair.tokenizer_hash)
        got = _padded(_engine(pair), transfer, source, start, end, 16)
        want = _engine(pair).map_span(transfer, source, start, end)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)) and bool(want.target.any())


def test_a_span_that_does_not_fit_its_bucket_is_refused_before_anything_is_written(pair):
    transfer = KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash)
    engine = _engine(pair)
    before = engine.keys.clone()
    layers = _span(pair, 4, 21)  # 17 tokens
    for args, match in [
        ((layers, 4, 21, 16), "bucket 16"),  # a bucket below the span
        ((layers, 4, 22, 20), "18 tokens"),  # a span of other length than its layers
        ((layers, 4, 21, 128), "bucket 128"),  # past the engine's largest bucket
        ((layers[:-1], 4, 21, 20), "layers"),  # a source cache of another shape
    ]:
        with pytest.raises(TransferError, match=match):
            MapGraphs(engine.blocks(), engine.scratch, span_bucket(CAPACITY), None, replay=False).run(transfer, *args)
    assert torch.equal(engine.keys, before)
    with pytest.raises(ValueError, match="outside the engine's capacity"):
        engine.map_span(transfer, layers, 70, 87)


def test_the_padded_map_reads_no_device_value_on_the_host(pair):
    """Its positions, slots and gather rows are built on the host from ints and copied once to the device."""
    transfer = KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash)
    engine, layers = _engine(pair), _span(pair, 4, 17)
    device = [t for m in (pair.source, pair.target) for t in (*m.parameters(), *m.buffers())]
    device += [*transfer.mapper.tensors().values(), engine.keys, engine.values, *(t for p in layers for t in p)]
    with DeviceReads(*device, devices=(engine.device, transfer.device)) as reads:
        _padded(engine, transfer, layers, 4, 17, 16)
    assert reads.sites == []


def test_the_engine_maps_eagerly_without_graphs(pair):
    """On the CPU the engine's route is eager, `capture_all` captures no map."""
    transfer = KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash)
    engine = _engine(pair)
    assert engine.span_route(transfer, 17) == (None, "the engine runs without CUDA graphs")
    engine.map_span(transfer, _span(pair, 4, 21), 4, 21)
    assert engine.capture_all((transfer,)) == 0 and engine.map_graphs.replays == 0


def test_the_ttft_record_says_the_maps_ran_eagerly_on_the_cpu(pair):
    """`handoff_ttft` records how each engine's timed maps ran: here (no CUDA) eagerly on both engines."""
    transfer = KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash)
    ids = calibration_ids(1, 24, seed=8)
    metrics = handoff_ttft(transfer, ids[:, :20], ids[:, 20:], 1, 1, 0, ("static", "graph"))
    ran = [metrics[f"{name}.{what}"] for name in ("static", "graph") for what in ("map_graph", "map_bucket")]
    assert ran == [0, 0, 0, 0]


def test_stacked_flags_equal_each_layers_flags_on_a_token_major_stack():
    """The map graph's source flags come from its token-major static views (not dense per layer): one reduction per
    component must flag what the per-layer norms flag — NaN, Inf, and each layer's largest finite |entry|."""
    flat = torch.randn(6 * 3 * 2 * 4, generator=torch.Generator().manual_seed(0))
    keys = flat.view(6, 3, 2, 4).permute(1, 2, 0, 3)  # [L, H, b, d], token-major
    values = (flat * 3).view(6, 3, 2, 4).permute(1, 2, 0, 3)
    keys[1, 0, 4, 2], values[2, 1, 5, 0], keys[0, 1, 0, 3] = float("nan"), float("inf"), -40.0
    bad, peak = stacked_flags(keys, values)
    assert bad.tolist() == [[False, False], [True, False], [False, True]]
    assert torch.equal(bad, layer_flags(list(zip(keys, values, strict=True)))[0])
    assert torch.equal(peak, layer_flags(list(zip(keys, values, strict=True)))[1]) and float(peak[0]) == 40.0
