"""Calibration traces (`src.traces`): rows are every stride-th position of every sequence, in sequence order and
independent of the batch size; the stored content K equals each model's own key projection before RoPE (k_norm
output where the model has one) and V its value projection, at the sampled positions; save/load round-trips;
`split_heldout` holds out whole sequences; a long sequence read in chunks gives the statistics of one read (every
field, sensitivities and attention mixing included). The Attn-Repair sensitivities' unit mass per boundary
(Eqs. 14–16) is checked in tests/test_weighting.py, at the kernel and at the `collect_traces` level.
"""

import pytest
import torch

import src.traces
from src.models import describe_kv
from src.traces import collect_traces, corpus_hash, load_traces, save_traces
from tests.conftest import calibration_ids, tiny

SEQUENCES, LENGTH, STRIDE = 5, 23, 3  # 23 is not a multiple of 3: positions 0, 3, …, 21 (8 rows per sequence)


@torch.no_grad()
def _projections(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the model's own pre-RoPE K (after k_norm if any) and V, each [B, H_kv, T, d], from hooks."""
    kv = describe_kv(model)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for name, module in (("k", attention.k_norm if kv.qk_norm else attention.k_proj), ("v", attention.v_proj)):
            keep = lambda _m, _i, output, key=(index, name): captured.__setitem__(key, output)
            hooks.append(module.register_forward_hook(keep))
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    heads = lambda t: t.reshape(*ids.shape, kv.num_kv_heads, kv.head_dim).transpose(1, 2)  # [B, H_kv, T, d]
    return [(heads(captured[(i, "k")]), heads(captured[(i, "v")])) for i in range(kv.num_layers)]


@pytest.fixture(scope="module")
def traced():
    source, target = tiny("llama", seed=3), tiny("qwen3", seed=4)  # qwen3: k_norm before RoPE
    ids = calibration_ids(SEQUENCES, LENGTH, seed=9)
    return source, target, ids, collect_traces(source, target, ids, stride=STRIDE, batch_size=2)


def test_rows_are_the_stride_positions_in_sequence_order(traced):
    *_, ids, traces = traced
    positions = torch.arange(0, LENGTH, STRIDE)
    assert traces.rows == SEQUENCES * positions.numel() == traces.meta["rows"]
    assert torch.equal(traces.position, positions.repeat(SEQUENCES))
    assert torch.equal(traces.sequence_index, torch.arange(SEQUENCES).repeat_interleave(positions.numel()))
    assert (traces.meta["sequences"], traces.meta["seq_len"], traces.meta["stride"]) == (SEQUENCES, LENGTH, STRIDE)
    assert traces.meta["corpus_hash"] == corpus_hash(ids) != corpus_hash(ids.flip(0))
    assert traces.attn_k is None and traces.attn_v is None


def test_content_rows_equal_each_models_own_projections(traced):
    source, target, ids, traces = traced
    for model, keys, values in ((source, traces.source_k, traces.source_v), (target, traces.target_k, traces.target_v)):
        own = _projections(model, ids)
        for layer, (k, v) in enumerate(own):  # [B, H, T, d] → rows [H, B·t, d] at the sampled positions
            rows = lambda t: t[:, :, traces.position[: traces.rows // SEQUENCES]].transpose(0, 1).flatten(1, 2)
            torch.testing.assert_close(keys[layer], rows(k), rtol=1e-4, atol=1e-5)  # RoPE removed exactly
            torch.testing.assert_close(values[layer], rows(v), rtol=0, atol=0)


def test_batch_size_does_not_change_the_rows(traced):
    source, target, ids, traces = traced
    one_by_one = collect_traces(source, target, ids, stride=STRIDE, batch_size=1)
    for name in ("source_k", "source_v", "target_k", "target_v", "sequence_index", "position"):
        torch.testing.assert_close(getattr(one_by_one, name), getattr(traces, name), rtol=1e-5, atol=1e-6)


def test_save_load_round_trip(tmp_path):
    model = tiny("llama")
    traces = collect_traces(model, model, calibration_ids(2, 16), stride=2, batch_size=2, attention_boundaries=2)
    assert load_traces(tmp_path / "traces") is None  # nothing saved yet
    save_traces(traces, tmp_path / "cache" / "traces")
    loaded = load_traces(tmp_path / "cache" / "traces")
    assert loaded.meta == traces.meta
    for name in ("source_k", "source_v", "target_k", "target_v", "sequence_index", "position", "attn_k", "attn_v"):
        assert torch.equal(getattr(loaded, name), getattr(traces, name)), name
    (tmp_path / "cache" / "traces.json").unlink()
    assert load_traces(tmp_path / "cache" / "traces") is None  # half an entry is no entry


@pytest.mark.parametrize(("fraction", "held"), [(0.2, 1), (0.4, 2), (0.01, 1), (0.5, 2)])  # of 5 sequences
def test_split_heldout_holds_out_whole_sequences(traced, fraction, held):
    *_, traces = traced
    fit, heldout = traces.split_heldout(fraction)
    assert set(heldout.sequence_index.tolist()) == set(range(SEQUENCES - held, SEQUENCES))
    assert set(fit.sequence_index.tolist()) == set(range(SEQUENCES - held))
    assert fit.rows + heldout.rows == traces.rows and heldout.meta["rows"] == heldout.rows
    rows_per_sequence = traces.rows // SEQUENCES
    assert heldout.rows == held * rows_per_sequence  # every row of a held-out sequence, none of the others
    torch.testing.assert_close(heldout.target_v, traces.target_v[:, :, -heldout.rows :], rtol=0, atol=0)
    torch.testing.assert_close(fit.source_k, traces.source_k[:, :, : fit.rows], rtol=0, atol=0)


def test_split_heldout_needs_two_sequences():
    model = tiny("llama")
    single = collect_traces(model, model, calibration_ids(1, 8), stride=2, batch_size=1)
    with pytest.raises(ValueError, match="≥ 2 calibration sequences"):
        single.split_heldout(0.5)


def test_split_heldout_keeps_sensitivities_aligned():
    model = tiny("llama")
    traces = collect_traces(model, model, calibration_ids(4, 20), stride=2, batch_size=4, attention_boundaries=2)
    fit, heldout = traces.split_heldout(0.25)
    torch.testing.assert_close(torch.cat([fit.attn_k, heldout.attn_k], -1), traces.attn_k, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([fit.attn_v, heldout.attn_v], -1), traces.attn_v, rtol=0, atol=0)


@pytest.mark.parametrize("self_transfer", [False, True], ids=["pair", "self-transfer"])
def test_a_sequence_read_in_chunks_gives_the_statistics_of_one_read(self_transfer, monkeypatch):
    """The streamed forward (src/traces.py: chunks of ⌊ATTENTION_TILE / T⌋ tokens, the mixing's query rows in blocks
    of as many) keeps the statistics of reading each sequence at once: K/V rows, Attn-Repair sensitivities and the
    target's attention mixing — with chunks that do not divide the length (7 of 41; the tile's 2) and boundaries
    inside chunks."""
    source, target = tiny("llama", seed=5), tiny("qwen3", seed=6)
    source = target if self_transfer else source
    ids = calibration_ids(2, 41, seed=11)
    read = lambda chunk: collect_traces(
        source, target, ids, stride=3, batch_size=2, attention_boundaries=5, first_boundary=4, mixing=True,
        chunk_tokens=chunk,
    )  # fmt: skip
    whole, chunked = read(None), read(7)  # None: one chunk at this length
    monkeypatch.setattr(src.traces, "ATTENTION_TILE", 100)  # ⌊100 / 41⌋ = 2 tokens a chunk, 2 query rows a block
    tiled = read(None)
    for name in ("source_k", "source_v", "target_k", "target_v", "attn_k", "attn_v", "mix"):
        for streamed in (chunked, tiled):
            torch.testing.assert_close(getattr(streamed, name), getattr(whole, name), rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(chunked.position, whole.position) and chunked.meta == tiled.meta == whole.meta
    with pytest.raises(ValueError, match="chunk_tokens must be a token count ≥ 1"):
        read(0)
