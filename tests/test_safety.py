"""Safe to fail (issue 11), as properties: over generated cache types, shapes, dtypes, devices, layouts, lengths,
positions, token ids and mapper fields, every input is either refused (TransferError at construction or call,
ArtifactError on load) — and then rolled back bit-identically by `src.runtime.splice.handoff` — or mapped to exactly what
an independent float64 reference map computes. Nothing else: no other exception, no refusal from the apply path's
catch-all (`UNEXPECTED`), no valid input refused, no invalid input mapped.

Pairs: the exact llama pair (target ≠ source, known closed-form map; fp32 and bf16), a sliding-window mistral
self-map (window 6, calibrated on sequences longer than the window) and a token-feature qwen2 self-map.
The default profile is short and derandomized (CI); `-m slow` runs the long random profile."""

import functools
import json
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import FAMILIES, calibration_ids, tiny
from exact_pair import exact_pair
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, EncoderDecoderCache, StaticCache

from src.apply import UNEXPECTED, KVTransfer
from src.artifact import ArtifactError, Mapper, load_mapper, save_mapper
from src.artifact_store import publish
from src.fit import fit_transfer
from src.forward import prefill, prefill_layers
from src.maps import TransferError, cache_layers
from src.models import IncompatiblePairError, build_random_model, vocabulary_hash
from src.rope import rope_cos_sin
from src.runtime.splice import handoff
from src.traces import collect_traces

COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SHORT = settings(max_examples=20, derandomize=True, **COMMON)
LONG = settings(max_examples=1500, **COMMON)


@dataclass(frozen=True)
class Pair:
    source: torch.nn.Module
    target: torch.nn.Module
    token_hash: str
    mapper: Mapper
    window: int | None = None


@functools.cache
def _pair(name: str) -> Pair:
    if name in ("exact", "exact_bf16"):
        source, target, token_hash, exact, _ = exact_pair(
            "llama", dtype=torch.bfloat16 if name == "exact_bf16" else torch.float32
        )
        return Pair(source, target, token_hash, exact)
    family, overrides, options = {
        "window": ("mistral", {"sliding_window": 6}, {}),
        "tokens": ("qwen2", {}, {"token_features": True}),
    }[name]
    model = tiny(family, **overrides)
    token_hash = vocabulary_hash(model)
    traces = collect_traces(model, model, calibration_ids(4, 24, seed=1), stride=1, batch_size=4)
    mapper = fit_transfer(
        model, model, traces, token_hash, support="local", k=1, selection="identity", lam=1e-6, **options
    )
    return Pair(model, model, token_hash, mapper, overrides.get("sliding_window"))


PAIRS = ("exact", "exact_bf16", "window", "tokens")


# ---------------------------------------------------------------- the reference map


def _rotate(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, rotary, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [B, H, T, d] (float64) rotated ("half" layout) by the module's own cos/sin at positions, or un-rotated."""
    cos, sin = (t.double() for t in rope_cos_sin(rotary, positions))  # [1, 1, T, r]
    r = cos.shape[-1]
    head, tail = x[..., :r], x[..., r:]
    out = (head * cos - _rotate(head) * sin) / (cos * cos + sin * sin) if inverse else head * cos + _rotate(head) * sin
    return torch.cat((out, tail), dim=-1)


def _reference(pair: Pair, mapper: Mapper, layers, positions: torch.Tensor, input_ids) -> DynamicCache:
    """Per target layer ℓ and head h, in float64: features = content rows of the source layers S_ℓ (heads a_h) in
    (layer, head, channel) order [⊕ the target's layer-0 content K, V of the token, all heads] · W[ℓ, h] + b[ℓ, h];
    keys re-rotated at the positions; a token-feature mapper's layer 0 is the target's own."""
    source_rope, target_rope = pair.source.model.rotary_emb, pair.target.model.rotary_emb
    content = [(_rope(k.double(), source_rope, positions, True), v.double()) for k, v in layers]
    arange = torch.arange(layers[0][0].shape[2])
    own0 = None
    if mapper.token_features:
        layer = prefill_layers(pair.target, input_ids, 1).layers[0]
        own0 = _rope(layer.keys.double(), target_rope, arange, True), layer.values.double()  # [B, H_t, T, d_t]
    dtype = next(pair.target.parameters()).dtype
    cache = DynamicCache(config=pair.target.config)
    for layer in range(mapper.weight_k.shape[0]):
        mapped = []
        for component, (weight, bias) in enumerate(
            ((mapper.weight_k, mapper.bias_k), (mapper.weight_v, mapper.bias_v))
        ):
            heads = []
            for h in range(weight.shape[1]):
                parts = [
                    content[int(s)][component][:, int(a)]  # [B, T, d_s]
                    for s in mapper.source_layers[layer]
                    for a in mapper.head_index[h]
                ]
                if own0 is not None:
                    parts += [own0[0][:, g] for g in range(own0[0].shape[1])] + [
                        own0[1][:, g] for g in range(own0[1].shape[1])
                    ]
                features = torch.cat(parts, -1)  # [B, T, p]
                heads.append(features @ weight[layer, h].double() + bias[layer, h].double())  # [B, T, d_t]
            mapped.append(torch.stack(heads, 1))  # [B, H_t, T, d_t]
        if own0 is not None and layer == 0:
            mapped = list(own0)
        keys = _rope(mapped[0], target_rope, positions, False)
        cache.update(keys.to(dtype), mapped[1].to(dtype), layer)
    return cache


def _assert_maps_like(out, reference, dtype: torch.dtype) -> None:
    assert isinstance(out, DynamicCache) and len(out.layers) == len(reference.layers)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for index, (a, b) in enumerate(zip(out.layers, reference.layers, strict=True)):
        assert a.keys.dtype == b.keys.dtype == dtype and a.keys.shape == b.keys.shape, index
        scale = 1 + float(b.keys.abs().max().max(b.values.abs().max()))
        torch.testing.assert_close(a.keys.double(), b.keys.double(), rtol=tol, atol=tol * scale, msg=f"layer {index}")
        torch.testing.assert_close(a.values.double(), b.values.double(), rtol=tol, atol=tol * scale)


def _assert_rolled_back(pair: Pair, transfer: KVTransfer, cache, ids: torch.Tensor, mapper: Mapper) -> None:
    """`handoff` on the same cache and the prompt's ids: a transfer equal to the reference, or the target's own
    prefill bit for bit, with a named reason."""
    result = handoff(transfer, cache, ids)
    if result.mode == "transfer":
        layers = cache_layers(cache)
        _assert_maps_like(
            result.cache, _reference(pair, mapper, layers, torch.arange(ids.shape[1]), ids), transfer.dtype
        )
        return
    assert result.mode == "prefill" and not result.reason.startswith(UNEXPECTED), result.reason
    own = prefill(pair.target, ids)
    for a, b in zip(result.cache.layers, own.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# ---------------------------------------------------------------- generated inputs

MAPPER_EDITS = {  # name → (edit, valid)
    "none": (lambda m: m, True),
    "int32_indices": (lambda m: replace(m, source_layers=m.source_layers.int(), head_index=m.head_index.short()), True),
    "float64_coefficients": (lambda m: replace(m, weight_k=m.weight_k.double(), bias_v=m.bias_v.double()), True),
    "negative_layer": (lambda m: replace(m, source_layers=m.source_layers - 1), False),
    "layer_out_of_range": (lambda m: replace(m, source_layers=m.source_layers + 3), False),
    "negative_head": (lambda m: replace(m, head_index=-1 - m.head_index), False),
    "head_out_of_range": (lambda m: replace(m, head_index=m.head_index + 2), False),
    "float_indices": (lambda m: replace(m, head_index=m.head_index.float()), False),
    "nan_weight": (
        lambda m: replace(m, weight_v=m.weight_v.clone().index_fill_(2, torch.tensor([0]), float("nan"))),
        False,
    ),
    "inf_bias": (lambda m: replace(m, bias_k=m.bias_k.clone().fill_(float("inf"))), False),
    "int_coefficients": (lambda m: replace(m, bias_v=m.bias_v.long()), False),
    "narrow_weight": (lambda m: replace(m, weight_k=m.weight_k[:, :, :-1]), False),
    "sparse_weight": (lambda m: replace(m, weight_v=m.weight_v.to_sparse()), False),
    "token_flag_flipped": (lambda m: replace(m, manifest=dict(m.manifest, token_features=not m.token_features)), False),
}


def _split(edits: dict) -> tuple[list, list]:
    """(valid names, invalid names) of an edit table."""
    return sorted(k for k, (_, ok) in edits.items() if ok), sorted(k for k, (_, ok) in edits.items() if not ok)


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]  # stride 2 over the channels
    return wide.copy_(t)


def _head_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _other_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16 if t.dtype != torch.float16 else torch.float32)


def _corrupt(value: float):
    def corrupt(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if t.numel():
            t.view(-1)[t.numel() // 2] = value
        return t

    return corrupt


TENSOR_EDITS = {  # name → (edit of one layer's keys, valid)
    "none": (lambda t: t, True),
    "strided_channels": (_non_contiguous, True),
    "head_major_storage": (_head_major, True),
    "other_dtype": (_other_dtype, False),
    "meta": (lambda t: t.to("meta"), False),
    "sparse": (lambda t: t.to_sparse(), False),
    "nan": (_corrupt(float("nan")), False),
    "inf": (_corrupt(float("-inf")), False),
    "fewer_heads": (lambda t: t[:, :1], False),
    "narrow_head_dim": (lambda t: t[..., :8], False),
    "shorter": (lambda t: t[:, :, :-1] if t.shape[2] else t[:, :, :0, :0], False),
    "other_batch": (lambda t: torch.cat([t, t]), False),
}
KINDS = ("dynamic", "list", "tuple", "static", "encoder_decoder", "none", "stacked_tensor", "partial")
POSITIONS = ("none", "arange", "wrong_length", "float", "negative", "2d", "list")
IDS = ("none", "valid", "wrong_shape", "out_of_vocab", "float", "wrong_batch")


@dataclass(frozen=True)
class Case:
    """One generated input: a pair and backend, a mapper edit, a cache (kind, shape, tensor / layer edit),
    positions and token ids. The defaults are a valid handoff on the exact pair."""

    pair: str = "exact"
    backend: str = "torch"
    mapper: str = "none"
    batch: int = 1
    seq: int = 9
    seed: int = 0
    kind: str = "dynamic"
    tensors: str = "none"
    layers: str = "none"
    edited_layer: int = 0
    positions: str = "none"
    offset: int = 0
    ids: str = "valid"


def _mostly(valid, invalid) -> st.SearchStrategy:
    """Three draws in four from the valid options, so that whole valid inputs are common."""
    return st.integers(0, 3).flatmap(lambda pick: st.sampled_from(invalid if pick == 3 else valid))


CASES = st.builds(
    Case,
    pair=st.sampled_from(PAIRS),
    backend=st.sampled_from(["torch", "auto"]),
    mapper=_mostly(*_split(MAPPER_EDITS)),
    batch=_mostly([1, 2], [0]),
    seq=st.integers(0, 3).flatmap(lambda pick: st.just(0) if pick == 3 else st.integers(1, 12)),
    seed=st.integers(0, 2**16),
    kind=_mostly(KINDS[:3], KINDS[3:]),
    tensors=_mostly(*_split(TENSOR_EDITS)),
    layers=_mostly(["none"], ["drop", "extra"]),
    edited_layer=st.integers(0, 2),
    positions=_mostly(POSITIONS[:2], POSITIONS[2:]),
    offset=st.integers(0, 40),
    ids=_mostly(IDS[:2], IDS[2:]),
)
EXPLICIT = [  # every option once, the rest valid (the random profile combines them)
    *(Case(pair=name, backend=backend) for name in PAIRS for backend in ("torch", "auto")),
    *(Case(mapper=name) for name in MAPPER_EDITS),
    *(
        Case(pair="tokens", mapper=name)
        for name in ("none", "int32_indices", "float64_coefficients", "token_flag_flipped")
    ),
    *(Case(kind=name) for name in KINDS),
    *(Case(tensors=name, edited_layer=1) for name in TENSOR_EDITS),
    *(Case(layers=name) for name in ("drop", "extra")),
    *(Case(batch=batch, seq=seq) for batch, seq in ((0, 9), (1, 0), (2, 1))),
    *(Case(positions=name, offset=17) for name in POSITIONS),
    *(Case(ids=name) for name in IDS),
    Case(pair="tokens", ids="none"),
    Case(pair="tokens", ids="out_of_vocab"),
    Case(pair="window", seq=12),  # dropped tokens, no positions: refused
    Case(pair="window", seq=12, positions="arange", offset=7),  # dropped tokens at their positions
    Case(pair="window", seq=12, kind="list"),  # a list carries no window: mapped at 0..4
    Case(pair="window", seq=4),  # inside the window
]


def _transfer(case: Case, pair: Pair, mapper: Mapper) -> KVTransfer | None:
    """The bound transfer, or None when construction refused an invalid mapper (a valid one must bind)."""
    backend = "torch" if case.pair == "tokens" else case.backend
    valid = MAPPER_EDITS[case.mapper][1]
    try:
        transfer = KVTransfer(mapper, pair.source, pair.target, pair.token_hash, backend=backend)
    except TransferError as refusal:
        assert not valid, f"valid mapper ({case.mapper}) refused: {refusal}"
        event("mapper refused")
        return None
    assert valid, f"mapper with {case.mapper} accepted"
    return transfer


def _cache(case: Case, pair: Pair, transfer: KVTransfer, ids: torch.Tensor) -> tuple[object, int, int, bool]:
    """(source cache, tokens it holds, tokens a window dropped before them, whether it is a valid input)."""
    kv, nonempty = transfer.source_kv, case.batch > 0 and case.seq > 0
    if nonempty:
        native = prefill(pair.source, ids)
    else:
        native = DynamicCache()
        zeros = torch.zeros(case.batch, kv.num_kv_heads, case.seq, kv.head_dim, dtype=transfer.dtype)
        for layer in range(kv.num_layers):
            native.update(zeros, zeros, layer)
    held = native.layers[0].keys.shape[2]
    dropped = case.seq - held
    layers = [(layer.keys, layer.values) for layer in native.layers]
    edit, tensors_valid = TENSOR_EDITS[case.tensors]
    layers[case.edited_layer] = (edit(layers[case.edited_layer][0]), layers[case.edited_layer][1])
    layers = {"none": layers, "drop": layers[:-1], "extra": layers + layers[:1]}[case.layers]
    valid = tensors_valid and case.layers == "none" and nonempty
    if case.kind == "dynamic":
        if case.layers == "drop":
            native.layers.pop()
        elif case.layers == "extra":
            native.layers.append(DynamicCache((layers[-1],)).layers[0])
        for layer, (k, v) in zip(native.layers, layers, strict=True):
            layer.keys, layer.values = k, v
        return native, held, dropped, valid
    if case.kind in ("list", "tuple"):  # a plain list carries no window: its positions are the caller's
        return (layers if case.kind == "list" else tuple(layers)), held, 0, valid
    if case.kind == "static" and nonempty:
        cache = StaticCache(config=pair.source.config, max_cache_len=case.seq + 2)
        pair.source(ids, past_key_values=cache, use_cache=True)
    elif case.kind == "encoder_decoder":
        cache = EncoderDecoderCache(native, DynamicCache())
    elif case.kind == "partial" and nonempty:
        cache = prefill_layers(pair.source, ids, 1)
    elif case.kind == "stacked_tensor" and tensors_valid and case.layers == "none":
        cache = torch.stack([torch.stack(layer) for layer in layers])
    else:
        cache = None
    return cache, held, dropped, False


@torch.no_grad()
def _example(case: Case) -> None:
    pair = _pair(case.pair)
    mapper = MAPPER_EDITS[case.mapper][0](pair.mapper)
    transfer = _transfer(case, pair, mapper)
    if transfer is None:
        return
    vocab = transfer.vocab_size
    ids = torch.randint(0, vocab, (case.batch, case.seq), generator=torch.Generator().manual_seed(case.seed))
    cache, held, dropped, valid = _cache(case, pair, transfer, ids)
    positions = {
        "none": None,
        "arange": torch.arange(case.offset, case.offset + held),
        "wrong_length": torch.arange(held + 1),
        "float": torch.arange(held, dtype=torch.float32),
        "negative": torch.arange(-1, held - 1),
        "2d": torch.arange(held)[None],
        "list": list(range(held)),
    }[case.positions]
    valid &= case.positions == "arange" or (case.positions == "none" and dropped == 0)
    held_ids = ids[:, case.seq - held :]
    input_ids = {
        "none": None,
        "valid": held_ids,
        "wrong_shape": torch.cat([held_ids, held_ids], 1),
        "out_of_vocab": held_ids + vocab,
        "float": held_ids.float(),
        "wrong_batch": torch.cat([held_ids, held_ids]),
    }[case.ids]
    valid &= case.ids == "valid" or (case.ids == "none" and not transfer.token_features)
    try:
        out = transfer(cache, positions=positions, input_ids=input_ids)
    except TransferError as refusal:
        assert not str(refusal).startswith(UNEXPECTED), refusal
        assert not valid, f"valid input refused: {refusal}"
        event("call refused")
    else:
        assert valid, "invalid input mapped"
        event(f"mapped: {case.pair}, {case.kind}")
        at = torch.arange(held) if positions is None else positions
        _assert_maps_like(out, _reference(pair, mapper, cache_layers(cache), at, input_ids), transfer.dtype)
    if case.batch and case.seq:
        _assert_rolled_back(pair, transfer, cache, ids, mapper)


def _explicit(test):
    for case in reversed(EXPLICIT):
        test = example(case)(test)
    return test


@_explicit
@SHORT
@given(CASES)
def test_every_input_is_refused_and_rolled_back_or_mapped_exactly(case):
    _example(case)


@pytest.mark.slow
@LONG
@given(CASES)
def test_every_input_is_refused_and_rolled_back_or_mapped_exactly_long(case):
    _example(case)


# ---------------------------------------------------------------- artifacts

MANIFEST_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.text(max_size=8),
    st.lists(st.integers(0, 4), max_size=4),
    st.just({}),
)
MANIFEST_KEYS = (
    "schema_version",
    "shapes",
    "tensor_sha256",
    "coefficient_dtype",
    "source_fingerprint",
    "target_fingerprint",
    "tokenizer_hash",
    "token_features",
    "k",
)


def _artifact_example(data, directory) -> None:
    pair = _pair("exact")
    save_mapper(replace(pair.mapper), directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    tensors = (directory / "mapper.safetensors").read_bytes()
    key = data.draw(st.sampled_from(MANIFEST_KEYS), label="key")
    if data.draw(st.booleans(), label="delete"):
        manifest.pop(key)
    else:
        manifest[key] = data.draw(MANIFEST_VALUES, label="value")
    if data.draw(st.booleans(), label="flip a tensor byte"):
        position = data.draw(st.integers(0, len(tensors) - 1), label="byte")
        tensors = tensors[:position] + bytes([tensors[position] ^ 0x10]) + tensors[position + 1 :]
    publish(directory, json.dumps(manifest).encode(), tensors)
    try:
        loaded = load_mapper(directory)
        transfer = KVTransfer(loaded, pair.source, pair.target, pair.token_hash)
    except (ArtifactError, TransferError):
        return
    ids = calibration_ids(1, 9, seed=3)
    _assert_maps_like(
        transfer(prefill(pair.source, ids)),
        _reference(pair, pair.mapper, cache_layers(prefill(pair.source, ids)), torch.arange(9), None),
        transfer.dtype,
    )


@settings(max_examples=15, derandomize=True, **COMMON)
@given(data=st.data())
def test_every_edited_artifact_is_refused_or_maps_exactly(data, tmp_path_factory):
    _artifact_example(data, tmp_path_factory.mktemp("artifact"))


# ---------------------------------------------------------------- opt-ins that must work or refuse up front


def test_sliding_window_traces_longer_than_the_window():
    """allow_sliding_window: calibration longer than the window keeps every position's exact K/V, and the
    Attn-Repair sensitivities follow the window (no mass outside c − W + 1 … c)."""
    window, length = 6, 24
    model = tiny("mistral", sliding_window=window)
    ids = calibration_ids(2, length, seed=2)
    traces = collect_traces(model, model, ids, stride=1, batch_size=2, attention_boundaries=4, first_boundary=8)
    full = model(ids, use_cache=True, past_key_values=DynamicCache()).past_key_values  # every position
    for layer, own in enumerate(full.layers):
        content = _rope(own.keys.double(), model.model.rotary_emb, torch.arange(length), True)  # [B, H, T, d]
        rows = content.transpose(1, 2).flatten(0, 1).transpose(0, 1)  # [H, B·T, d]
        torch.testing.assert_close(traces.target_k[layer].double(), rows, rtol=0, atol=1e-5)
    boundaries = traces.meta["attention_boundaries"]
    position = traces.position.view(2, length)[0]
    sensitivity = traces.attn_v[:, :, :length]  # [L, H, T] of the first sequence
    outside = torch.stack([position <= c - window for c in boundaries]).all(0)  # before every boundary's window
    assert outside.any() and float(sensitivity[..., outside].abs().max()) == 0.0
    assert float(sensitivity[..., ~outside].sum()) > 0


def test_per_layer_type_rotary_refused_clearly():
    """A Gemma-3-style model (one RoPE table per layer type, no `inv_freq`) reached without load_pair: the codec
    and trace collection refuse it with a message instead of an AttributeError."""
    gemma = build_random_model(
        dict(
            FAMILIES["llama"],
            model_type="gemma3_text",
            sliding_window=4,
            layer_types=["sliding_attention"] * 2 + ["full_attention"],
        ),
        seed=0,
    )
    assert not hasattr(gemma.model.rotary_emb, "inv_freq")
    with pytest.raises(ValueError, match="no single `inv_freq` table"):
        rope_cos_sin(gemma.model.rotary_emb, torch.arange(4))
    with pytest.raises(IncompatiblePairError, match="source model family 'gemma3_text' is not supported"):
        collect_traces(gemma, gemma, calibration_ids(1, 8), stride=1, batch_size=1)
