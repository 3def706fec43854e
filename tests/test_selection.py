"""Selection that needs less recompute, on the static engine (src/runtime/splice.py on `EngineReceiver`,
src/runtime/plan.py `Recompute`): progressive selection (the set shrinks with depth, CacheBlend-style) and the turn
rule (the new turn's attention at the last native layer picks the set, which is recomputed from there on, with the
turn, in one forward). On the exact non-identity pair with its perturbed (wrong) map, 5 layers: progressive 1 is
today's fused forward bit for bit; a plain layer-by-layer torch reference equals the engine (every cache layer and
the turn's logits); the turn rule recomputing every token is a native prefill, none pure transfer; the rows each
layer runs are what `Levers.prefill_fraction` charges; the DynamicCache path and bad settings are refused."""

from dataclasses import replace

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from src.apply import KVTransfer
from src.forward import prefill
from src.maps import cache_layers
from src.runtime.engine import Engine, Recompute
from src.runtime.plan import Levers, check_splice
from src.runtime.receivers import EngineReceiver
from src.runtime.splice import engine_handoff, spliced_cache
from tests.conftest import calibration_ids
from tests.exact_pair import exact_pair

LAYERS, PREFIX, TURN, SINK, HOLD, DEPTH = 5, 30, 6, 2, 2, 2
END = PREFIX - HOLD  # the mapped span is SINK..END − 1, the tail END..PREFIX + TURN − 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def wrong(pair):
    return KVTransfer(pair.wrong, pair.source, pair.target, pair.tokenizer_hash)


@pytest.fixture(scope="module")
def conversation():
    ids = calibration_ids(1, PREFIX + TURN, seed=21)
    return ids[:, :PREFIX], ids[:, PREFIX:]  # prefix [1, 30], turn [1, 6]


def _levers(rule: str, progressive: float) -> Levers:
    return Levers(SINK, HOLD, recompute=0.5, recompute_rule=rule, recompute_layers=DEPTH, progressive=progressive)


def _stacked(cache) -> tuple[torch.Tensor, torch.Tensor]:
    layers = cache_layers(cache)
    return torch.stack([k[0] for k, _ in layers]), torch.stack([v[0] for _, v in layers])  # [L, H_kv, T, d] each


def _handoff(wrong, prefix, turn, levers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    engine = Engine(wrong.target, 48)
    logits = engine_handoff(wrong, engine, prefill(wrong.source, prefix), prefix, levers, turn)  # [1, V]
    total = PREFIX + TURN
    return logits, engine.keys[:, :, :total].clone(), engine.values[:, :, :total].clone()


# --- (a) progressive 1 is today's fused forward ------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["deviation", "recency"])
def test_progressive_one_is_todays_fused_forward_bit_for_bit(wrong, conversation, rule, monkeypatch):
    """At progressive 1 the tail's forward is the plain fused one (the set's positions first, every row through every
    layer from the embeddings, replayable): each call is checked against `Engine.forward` without the plan, run on a
    copy of the same cache, bit for bit — logits and every slot."""
    prefix, turn = conversation
    checked, forward = [], Engine.forward

    def twice(engine, ids, positions, rows=None, graph=None, recompute=None):
        if recompute is None:
            return forward(engine, ids, positions, rows, graph)
        saved = engine.keys.clone(), engine.values.clone(), engine.length
        today = forward(engine, ids, positions, rows, graph)  # the fused forward before progressive selection
        keys, values = engine.keys.clone(), engine.values.clone()
        engine.keys.copy_(saved[0]), engine.values.copy_(saved[1])
        engine.length = saved[2]
        got = forward(engine, ids, positions, rows, graph, recompute)
        checked.append(
            torch.equal(got, today) and torch.equal(engine.keys, keys) and torch.equal(engine.values, values)
        )
        return got

    monkeypatch.setattr(Engine, "forward", twice)
    default = _handoff(wrong, prefix, turn, Levers(SINK, HOLD, recompute=0.5, recompute_rule=rule, recompute_layers=2))
    assert checked == [True]
    explicit = _handoff(wrong, prefix, turn, _levers(rule, 1.0))
    assert checked == [True, True] and all(torch.equal(a, b) for a, b in zip(default, explicit, strict=True))


# --- (b) a plain layer-by-layer reference ------------------------------------------------------------------------


def _deviation(fresh: torch.Tensor, mapped: torch.Tensor) -> torch.Tensor:
    """fresh, mapped [H_kv, S, d] → [S]: ‖fresh − mapped‖² over the mean ‖fresh‖² of the S tokens."""
    return (fresh - mapped).pow(2).sum((0, 2)) / fresh.pow(2).sum((0, 2)).mean()


@torch.no_grad()
def _reference(model, keys, values, hidden, positions, size, start, keep):
    """The fused forward written plainly, layer by layer: rows [T] at `positions` (the set's `size` first, then the
    tail) enter layer `start` with `hidden` [T, hidden]; each layer writes their K/V into keys / values [L, H_kv, n, d]
    (in place) and every row attends over the slots ≤ its position; after each layer ℓ ≥ DEPTH the set keeps its
    round(keep · |S|) rows whose fresh K/V deviate most from the slots' K/V before the write. → last row's logits."""
    decoder = model.model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    d = keys.shape[-1]
    cos, sin = decoder.rotary_emb(hidden[None], torch.arange(keys.shape[2])[None])  # [1, n, d]
    for index in range(start, LAYERS):
        layer, count = decoder.layers[index], hidden.shape[0]
        attention = layer.self_attn
        x = layer.input_layernorm(hidden)  # [T, hidden]
        q = attention.q_proj(x).view(count, heads, d).transpose(0, 1)  # [H_q, T, d]
        k = attention.k_proj(x).view(count, kv_heads, d).transpose(0, 1)  # [H_kv, T, d]
        v = attention.v_proj(x).view(count, kv_heads, d).transpose(0, 1)  # [H_kv, T, d]
        q, k = apply_rotary_pos_emb(q[None], k[None], cos[:, positions], sin[:, positions])  # [1, H, T, d]
        before = keys[index][:, positions[:size]].clone(), values[index][:, positions[:size]].clone()
        keys[index][:, positions], values[index][:, positions] = k[0], v  # [H_kv, T, d]
        group = heads // kv_heads
        scores = q[0] @ keys[index].repeat_interleave(group, 0).transpose(1, 2) * attention.scaling  # [H_q, T, n]
        unseen = torch.arange(keys.shape[2])[None, :] > positions[:, None]  # [T, n]
        weights = scores.masked_fill(unseen, float("-inf")).softmax(-1)  # [H_q, T, n]
        out = weights @ values[index].repeat_interleave(group, 0)  # [H_q, T, d]
        hidden = hidden + attention.o_proj(out.transpose(0, 1).reshape(count, heads * d))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        kept = int(keep * size + 0.5)
        if index >= DEPTH and index < LAYERS - 1 and kept < size:
            slots = positions[:size]
            score = _deviation(keys[index][:, slots], before[0]) + _deviation(values[index][:, slots], before[1])
            rows = torch.cat([score.topk(kept).indices.sort().values, torch.arange(size, count)])
            hidden, positions, size = hidden[rows], positions[rows], kept
    return model.lm_head(decoder.norm(hidden[-1:]))  # [1, V]


@torch.no_grad()
def _reference_handoff(pair, wrong, prefix, turn, rule, keep):
    """The receiver's cache before the tail's forward, built on the DynamicCache path (sink native, span mapped, the
    first DEPTH layers native over the prefix — or prefix + tail, turn rule), the set chosen plainly, then
    `_reference`. → (logits [1, V], keys, values [L, H_kv, n, d])."""
    target, ids = pair.target, torch.cat([prefix, turn], 1)  # [1, n]
    mapped = _stacked(spliced_cache(wrong, prefill(pair.source, prefix[:, :END]), prefix[:, :END], Levers(SINK)))
    assert target.config._attn_implementation == "eager"  # the attention probabilities
    native = target(ids, output_attentions=True, output_hidden_states=True, use_cache=True)
    own = _stacked(native.past_key_values)  # [L, H_kv, n, d] each
    keys, values = (torch.zeros_like(x) for x in own)
    keys[:, :, :END], values[:, :, :END] = mapped
    high = ids.shape[1] if rule == "turn" else END
    keys[:DEPTH, :, SINK:high], values[:DEPTH, :, SINK:high] = (
        own[0][:DEPTH, :, SINK:high],
        own[1][:DEPTH, :, SINK:high],
    )
    count = Levers(recompute=0.5).recomputed(PREFIX)
    if rule == "turn":  # the tail's attention at the last native layer, onto the span
        scores = native.attentions[DEPTH - 1][0, :, END:, SINK:END].sum((0, 1))  # [S]
    else:  # the mapped span's deviation from native in the first DEPTH layers
        scores = sum(
            _deviation(own[c][i, :, SINK:END], mapped[c][i, :, SINK:END]) for i in range(DEPTH) for c in (0, 1)
        )
    chosen = SINK + scores.topk(count).indices.sort().values  # [R]
    positions = torch.cat([chosen, torch.arange(END, ids.shape[1])])  # [R + n]
    if rule == "turn":
        start, hidden = DEPTH, native.hidden_states[DEPTH][0, positions]  # entering layer DEPTH
    else:
        start, hidden = 0, target.model.embed_tokens(ids[0, positions])
    logits = _reference(target, keys, values, hidden, positions, count, start, keep)
    return logits, keys, values


@pytest.mark.parametrize("rule", ["deviation", "turn"])
@pytest.mark.parametrize("keep", [0.5, 0.3])
def test_progressive_selection_equals_a_plain_layer_by_layer_reference(pair, wrong, conversation, rule, keep):
    prefix, turn = conversation
    logits, keys, values = _handoff(wrong, prefix, turn, _levers(rule, keep))
    want_logits, want_keys, want_values = _reference_handoff(pair, wrong, prefix, turn, rule, keep)
    assert (keys - want_keys).abs().max() < 1e-4 and (values - want_values).abs().max() < 1e-4
    assert (logits - want_logits).abs().max() < 1e-4
    full, _, _ = _handoff(wrong, prefix, turn, _levers(rule, 1.0))
    assert (logits - full).abs().max() > 1e-4  # the shrinking shows


# --- (c) the turn rule's ends -----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 3])
def test_the_turn_rule_recomputing_every_token_is_a_native_prefill_and_none_pure_transfer(
    pair, wrong, conversation, depth
):
    prefix, turn = conversation
    ids = torch.cat([prefix, turn], 1)
    every = Levers(SINK, HOLD, recompute=1.0, recompute_rule="turn", recompute_layers=depth)
    logits, keys, values = _handoff(wrong, prefix, turn, every)
    native = pair.target(ids, use_cache=True)
    own = _stacked(native.past_key_values)
    assert (logits - native.logits[0, -1:]).abs().max() < 1e-4
    assert (keys - own[0]).abs().max() < 1e-4 and (values - own[1]).abs().max() < 1e-4
    assert every.prefill_fraction(PREFIX, LAYERS) == 1.0  # no layer redone: exactly one prefill
    pure = _handoff(wrong, prefix, turn, Levers(SINK, HOLD))
    for none in (0.0, 0.01):  # 1 % of 30 tokens rounds to none
        got = _handoff(wrong, prefix, turn, replace(every, recompute=none))
        assert all(torch.equal(a, b) for a, b in zip(got, pure, strict=True))
    assert (pure[0] - native.logits[0, -1:]).abs().max() > 1e-3  # the wrong map shows


# --- (d) the work charged is the work run ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "levers",
    [
        _levers("deviation", 0.5),
        _levers("turn", 0.5),
        _levers("turn", 1.0),
        Levers(hold_back=HOLD, native_layers=1, recompute=0.4, recompute_rule="recency", progressive=0.6),
    ],
)
def test_prefill_fraction_counts_the_rows_each_layer_ran(pair, wrong, conversation, levers):
    """Rows each decoder layer's projections ran during the handoff (forward hooks): the stopped native prefill over
    the prefix (turn rule: prefix + tail) in the first layers, then the fused forward's set (`layer_sizes`) and tail;
    what `prefill_fraction` charges is the sink and hold-back in full, the span's native layers and those set rows."""
    prefix, turn = conversation
    ran: list[tuple[int, int]] = []
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda _, args, __, i=i: ran.append((i, args[0].shape[0])))
        for i, layer in enumerate(pair.target.model.layers)
    ]
    try:
        _handoff(wrong, prefix, turn, levers)
    finally:
        for hook in hooks:
            hook.remove()
    sink, tail = levers.native_sink, HOLD + TURN
    turn_rule = levers.recompute_rule == "turn"
    depth = levers.native_depth(PREFIX)
    over = END + tail if turn_rule else END
    forward = ran[(LAYERS if sink else 0) + depth :]  # after the sink's forward and the stopped prefill
    assert ran[(LAYERS if sink else 0) :][:depth] == [(i, over) for i in range(depth)]
    first = depth if turn_rule else 0
    assert [i for i, _ in forward] == list(range(first, LAYERS))
    sizes = [0] * first + [rows - tail for _, rows in forward]  # the set's rows in each layer
    assert tuple(sizes) == levers.layer_sizes(PREFIX, LAYERS)
    mapped = END - sink
    spent = (sink + HOLD) * LAYERS + mapped * depth + sum(sizes)
    assert levers.prefill_fraction(PREFIX, LAYERS) == pytest.approx(spent / (LAYERS * PREFIX))
    if levers.progressive < 1:
        assert sizes[-1] < sizes[first]  # it did shrink


# --- (e) refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("levers", [_levers("deviation", 0.5), _levers("turn", 1.0)])
def test_the_dynamic_cache_path_refuses_the_engine_only_selection(pair, wrong, conversation, levers):
    prefix, turn = conversation
    with pytest.raises(ValueError, match="progressive selection / the turn rule are built on the static engine"):
        spliced_cache(wrong, prefill(pair.source, prefix), prefix, levers, query_ids=turn)
    assert spliced_cache(wrong, prefill(pair.source, prefix), prefix, replace(levers, recompute=0.0))  # no set: runs


def test_the_turn_rule_and_progressive_selection_need_a_tail(wrong):
    with pytest.raises(ValueError, match="the turn rule needs the new turn"):
        check_splice(Levers(recompute=0.5, recompute_rule="turn"), False, 20, 0, EngineReceiver.capabilities)
    with pytest.raises(ValueError, match="progressive selection reads the turn"):
        check_splice(Levers(recompute=0.5, progressive=0.5), False, 20, 0, EngineReceiver.capabilities)
    check_splice(
        Levers(recompute=0.5, recompute_rule="turn", progressive=0.5), False, 20, 1, EngineReceiver.capabilities
    )


def test_the_engine_refuses_a_recompute_it_cannot_run_before_writing(pair):
    engine = Engine(pair.target, 48)
    engine.forward(calibration_ids(1, 20, seed=22)[0], torch.arange(20))
    before = engine.keys.clone(), engine.values.clone()
    ids, positions = calibration_ids(1, 5, seed=23)[0], torch.tensor([3, 7, 20, 21, 22])
    keep = lambda mapped, fresh, size: torch.arange(size)
    hidden = torch.zeros(5, pair.target.config.hidden_size)
    for plan, match in [
        (Recompute(torch.tensor([3, 7]), sizes=(2, 1, 1, 1, 1)), "shrinking needs `keep`"),
        (Recompute(torch.tensor([3, 7]), sizes=(2, 1, 2, 1, 1), keep=keep), "must not grow"),
        (Recompute(torch.tensor([3, 7]), sizes=(2, 1), keep=keep), "layers 0..4"),
        (Recompute(torch.tensor([3, 8]), sizes=(2, 2, 1, 1, 1), keep=keep), "first positions"),
        (Recompute(torch.tensor([3, 7]), start=2, sizes=(2, 1, 1), keep=keep), "hidden states"),
        (Recompute(torch.tensor([3, 7]), start=0, hidden=hidden, sizes=(2, 2, 1, 1, 1), keep=keep), "hidden states"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.forward(ids, positions, recompute=plan)
        assert engine.length == 20 and torch.equal(engine.keys, before[0]) and torch.equal(engine.values, before[1])
    with pytest.raises(ValueError, match="a tail must follow"):
        engine.forward(ids[:2], positions[:2], recompute=Recompute(torch.tensor([3, 7]), start=1, hidden=hidden[:2]))
