"""The receiver engine (src/runtime/engine.py) and the splice on it: the static-cache path equals the DynamicCache path
(cache and logits) on every family and on the exact non-identity pair (where a leak of the receiver's native state
shows); fused recompute of every token equals a native prefill, of none pure transfer, and the three-forward path on
the same selection; graph replay equals eager (GPU)."""

import pytest
import torch

import src.runtime.engine as engine_module
from src.apply import KVTransfer
from src.forward import prefill
from src.runtime.engine import GRAPH_BUCKETS, Engine
from src.runtime.plan import Levers
from src.runtime.splice import engine_handoff, spliced_cache
from tests.conftest import calibration_ids, tiny
from tests.exact_pair import exact_pair

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture(scope="module")
def transfers(pair):
    return (
        KVTransfer(pair.exact, pair.source, pair.target, pair.tokenizer_hash),
        KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash),
    )


def _engine_cache(engine: Engine, length: int) -> torch.Tensor:
    return torch.stack([engine.keys[:, :, :length], engine.values[:, :, :length]])  # [2, L, H, T, d]


def _hf_cache(cache) -> torch.Tensor:
    return torch.stack(
        [
            torch.stack([layer.keys[0] for layer in cache.layers]),
            torch.stack([layer.values[0] for layer in cache.layers]),
        ]
    )  # [2, L, H, T, d]


@pytest.mark.parametrize("flash", [False, True])
def test_engine_equals_the_dynamic_cache_path(family, flash, monkeypatch):
    monkeypatch.setattr(engine_module, "FLASH_MIN_TOKENS", 8 if flash else 10**9)
    model = tiny(family)
    ids = calibration_ids(1, 40, seed=1)[0]
    native = model(ids[None], use_cache=True)
    engine = Engine(model, 64)
    prefix_logits = engine.forward(ids[:30], torch.arange(30))
    turn_logits = engine.forward(ids[30:], torch.arange(30, 40))
    assert (prefix_logits - model(ids[None, :30]).logits[0, -1:]).abs().max() < 1e-5
    assert (turn_logits - native.logits[0, -1:]).abs().max() < 1e-5
    assert (_engine_cache(engine, 40) - _hf_cache(native.past_key_values)).abs().max() < 1e-5
    assert engine.length == 40


def test_engine_decode_steps_and_rows(pair):
    model = pair.target
    ids = calibration_ids(1, 24, seed=2)[0]
    native = model(ids[None]).logits[0]  # [24, V]
    engine = Engine(model, 32)
    rows = engine.forward(ids[:20], torch.arange(20), rows=torch.arange(20))
    assert (rows - native[:20]).abs().max() < 1e-5
    for position in range(20, 24):
        assert (
            engine.forward(ids[position : position + 1], torch.tensor([position])) - native[position]
        ).abs().max() < 1e-5


def test_engine_refuses_what_it_cannot_read(pair):
    engine = Engine(pair.target, 16)
    with pytest.raises(ValueError, match="capacity"):
        engine.forward(torch.zeros(4, dtype=torch.long), torch.arange(14, 18))
    engine.forward(torch.zeros(4, dtype=torch.long), torch.arange(4))
    with pytest.raises(ValueError, match="in order"):  # a gap would read stale slots
        engine.forward(torch.zeros(2, dtype=torch.long), torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="capacity"):
        Engine(pair.target, 0)
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(tiny("mistral", sliding_window=8, use_sliding_window=True), 16)


LEVERS = {
    "pure": Levers(),
    "sink+hold": Levers(native_sink=3, hold_back=4),
    "native layers": Levers(native_sink=2, native_layers=2),
    "deviation": Levers(native_sink=2, hold_back=2, recompute=0.3, recompute_layers=2),
    "recency": Levers(native_sink=1, recompute=0.25, recompute_rule="recency"),
    "everything held back": Levers(hold_back=30),
}


@pytest.mark.parametrize("name", sorted(LEVERS))
def test_engine_handoff_equals_the_three_forward_splice(pair, transfers, name):
    """Same levers, same selection: the static engine's fused forward gives the turn's logits of the DynamicCache
    splice followed by the turn; with the wrong mapper both differ from native (no leak of the native cache)."""
    ids = calibration_ids(1, 36, seed=5)
    prefix, turn = ids[:, :30], ids[:, 30:]
    source_cache = prefill(pair.source, prefix)
    native = pair.target(ids).logits[0, -1:]
    engine = Engine(pair.target, 48)
    for transfer in transfers:
        cache = spliced_cache(transfer, source_cache, prefix, LEVERS[name], query_ids=turn)
        reference = pair.target(turn, past_key_values=cache).logits[0, -1:]
        got = engine_handoff(transfer, engine, source_cache, prefix, LEVERS[name], turn)
        assert (got - reference).abs().max() < 1e-4
        assert (_engine_cache(engine, 36) - _hf_cache(cache)).abs().max() < 1e-4
    exact = engine_handoff(transfers[0], engine, source_cache, prefix, LEVERS[name], turn)
    assert (exact - native).abs().max() < 1e-4  # the exact map: native, through the map
    wrong = engine_handoff(transfers[1], engine, source_cache, prefix, LEVERS[name], turn)
    if name != "everything held back":
        assert (wrong - native).abs().max() > 1e-3  # the wrong map shows: nothing native leaked in


def test_fused_recompute_of_every_token_is_a_native_prefill_of_none_pure_transfer(pair, transfers):
    wrong = transfers[1]
    ids = calibration_ids(1, 34, seed=6)
    prefix, turn = ids[:, :30], ids[:, 30:]
    source_cache = prefill(pair.source, prefix)
    engine = Engine(pair.target, 40)
    native = pair.target(ids).logits[0, -1:]
    every = engine_handoff(wrong, engine, source_cache, prefix, Levers(recompute=1.0, recompute_rule="recency"), turn)
    assert (every - native).abs().max() < 1e-4
    assert (_engine_cache(engine, 34) - _hf_cache(prefill(pair.target, ids))).abs().max() < 1e-4
    none = engine_handoff(wrong, engine, source_cache, prefix, Levers(), turn)
    pure = spliced_cache(wrong, source_cache, prefix, Levers())
    assert (none - pair.target(turn, past_key_values=pure).logits[0, -1:]).abs().max() < 1e-4


def test_the_attention_rule_is_refused_on_the_engine_before_it_is_touched(pair, transfers):
    ids = calibration_ids(1, 34, seed=6)
    engine = Engine(pair.target, 40)
    engine.forward(ids[0, :5], torch.arange(5))
    before = _engine_cache(engine, 40).clone()
    with pytest.raises(ValueError, match="attention rule"):
        engine_handoff(transfers[0], engine, prefill(pair.source, ids[:, :30]), ids[:, :30],
                       Levers(recompute=0.2, recompute_rule="attention"), ids[:, 30:])  # fmt: skip
    assert engine.length == 5 and torch.equal(_engine_cache(engine, 40), before)


@cuda
@pytest.mark.gpu
def test_capture_all_captures_every_bucket_and_leaves_the_cache_as_it_was():
    """A server's start-up: every bucket captured before any timed forward, the held slots untouched (capture writes
    only the scratch slot), and a forward afterwards captures nothing more."""
    model = tiny("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to("cuda", torch.bfloat16)
    ids = calibration_ids(1, 40, seed=7)[0]
    engine = Engine(model, 4200, graphs=True)
    engine.forward(ids[:30], torch.arange(30))
    before = _engine_cache(engine, 30).clone()
    assert engine.capture_all() == len(GRAPH_BUCKETS) - 1  # the 30-token forward captured bucket 32 already
    assert torch.equal(_engine_cache(engine, 30), before) and engine.capture_all() == 0
    engine.forward(ids[30:33], torch.arange(30, 33))
    assert len(engine._graphs) == len(GRAPH_BUCKETS)


def test_capture_all_is_a_no_op_without_graphs():
    engine = Engine(tiny("qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 64, graphs=False)
    assert engine.capture_all() == 0 and engine._graphs == {}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(dtype):
    model = tiny("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to("cuda", dtype)
    ids = calibration_ids(1, 300, seed=7)[0]
    eager, graphed = Engine(model, 512, graphs=False), Engine(model, 512, graphs=True)
    for engine in (eager, graphed):
        engine.forward(ids[:270], torch.arange(270))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # a padded bucket runs other GEMM shapes than eager
    for start, count in ((270, 5), (275, 16), (291, 1), (292, 8)):  # buckets 8, 16, 1, 8: one graph, two lengths
        chunk, positions = ids[start : start + count], torch.arange(start, start + count)
        own = count in (16, 1, 8)  # the bucket's own size: the same kernels on the same shapes
        if own:  # ... on the same cache: the padded bucket before wrote K/V of other GEMM shapes, so in fp32 its slots
            # differ in the last bit and every later read shows it (H100, 2026-12-06: 1.5e-7 at (275, 16); GEMMs alone
            # are bit-equal captured and eager, results/gate-h100-2026-12-06/graph-probe.txt)
            graphed.keys.copy_(eager.keys), graphed.values.copy_(eager.values)
        a, b = eager.forward(chunk, positions), graphed.forward(chunk, positions)
        if own:
            assert torch.equal(a, b), (start, count, float((a - b).abs().max()))
        assert (a.float() - b.float()).abs().max() < tolerance, (start, count)
    assert (_engine_cache(eager, 300).float() - _engine_cache(graphed, 300).float()).abs().max() < tolerance
    assert float(graphed.keys[:, :, graphed.scratch].abs().max()) >= 0  # the scratch slot exists; nothing reads it
    hf = model(ids[None].to("cuda")).logits[0, -1:].float()
    tolerance = 1e-3 if dtype == torch.float32 else 0.1
    long = graphed.forward(
        ids[:300], torch.arange(300), graph=True
    ).float()  # a 300-token prefill replayed (bucket 512)
    assert (long - hf).abs().max() < tolerance
    assert (graphed.forward(ids[299:300], torch.tensor([299])).float() - hf).abs().max() < tolerance
