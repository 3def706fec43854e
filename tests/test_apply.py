"""Applying a mapper (`src.apply`): self-transfer exactness for every family, relocated positions, refusal
of unsafe caches with a named reason, deterministic rollback to prefill, and corrupt coefficients.

Self-transfer: S = T (the same tiny model object), Head-Local support, identity selection, k = 1,
λ = 1e-6. The fitted map is then the identity up to the ridge shrinkage W = (A + λI)⁻¹A ≈ I − λA⁻¹ and the
float32 round trip through remove/apply RoPE, which leaves ≲ 1e-6 absolute error on the cache (measured
~5e-7). We allow 1e-4 on cache entries and 1e-3 on logits: four orders of magnitude below the spread of
the random models' logits, so greedy tokens must agree exactly.
"""

import functools
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, StaticCache

from src.apply import KVTransfer
from src.fit import fit_transfer
from src.forward import prefill, prefill_layers
from src.maps import TransferError
from src.models import load_model, load_tokenizer, tokenizer_hash, vocabulary_hash
from src.runtime.plan import Levers, spent
from src.runtime.splice import handoff, spliced_cache
from src.traces import collect_traces
from tests.conftest import calibration_ids, tiny

CACHE_TOL = 1e-4
LOGIT_TOL = 1e-3
NEW_TOKENS = 8


@functools.cache
def _self_transfer(family: str) -> KVTransfer:
    model = tiny(family)
    token_hash = vocabulary_hash(model)
    traces = collect_traces(model, model, calibration_ids(4, 48, seed=1), stride=1, batch_size=4)
    mapper = fit_transfer(model, model, traces, token_hash, support="local", k=1, selection="identity", lam=1e-6)
    return KVTransfer(mapper, model, model, token_hash)


def _prompt(batch=1, length=20, seed=5):
    return calibration_ids(batch, length, seed=seed)


def _assert_cache_close(ours, theirs, tol=CACHE_TOL):
    assert len(ours.layers) == len(theirs.layers)
    for index, (a, b) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape, index
        assert a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype, index
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=tol, msg=f"layer {index} keys")
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=tol, msg=f"layer {index} values")


def _assert_cache_equal(ours, theirs):
    assert len(ours.layers) == len(theirs.layers)
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@torch.no_grad()
def _greedy(model, cache, last_ids, steps=NEW_TOKENS):
    """Manual decode loop from a cache that covers all but the last prompt token."""
    tokens, logits = [], []
    next_ids = last_ids
    for _ in range(steps):
        step = model(next_ids, past_key_values=cache, use_cache=True).logits[:, -1]
        logits.append(step)
        next_ids = step.argmax(-1, keepdim=True)
        tokens.append(next_ids)
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def _source_layers(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


# --------------------------------------------------------------------------- self-transfer, every family


def test_self_transfer_reproduces_prefill_cache(family):
    transfer = _self_transfer(family)
    model = transfer.target
    for batch in (1, 2):
        prompt = _prompt(batch=batch)
        mapped = transfer(prefill(model, prompt[:, :-1]))
        _assert_cache_close(mapped, prefill(model, prompt[:, :-1]))
        assert mapped.get_seq_length() == prompt.shape[1] - 1


def test_self_transfer_greedy_decode_matches_native(family):
    transfer = _self_transfer(family)
    model = transfer.target
    prompt = _prompt()
    native_tokens, native_logits = _greedy(model, prefill(model, prompt[:, :-1]), prompt[:, -1:])
    mapped_tokens, mapped_logits = _greedy(model, transfer(prefill(model, prompt[:, :-1])), prompt[:, -1:])
    assert mapped_tokens.tolist() == native_tokens.tolist()
    torch.testing.assert_close(mapped_logits, native_logits, rtol=0, atol=LOGIT_TOL)
    with torch.no_grad():  # the native loop itself agrees with one full forward over the prompt
        full = model(prompt).logits[:, -1]
    torch.testing.assert_close(native_logits[:, 0], full, rtol=0, atol=1e-5)
    # the tolerance is meaningful: logits spread far wider than LOGIT_TOL
    assert float(native_logits.std()) > 100 * LOGIT_TOL


def test_self_transfer_generate_matches_native(family):
    """`generate` with a prefix cache: pass the *whole* prompt as input_ids; generate feeds only the tokens the
    cache does not cover (here the last one). Passing only the uncovered token fails in transformers 5.17.
    eos_token_id=None keeps the random models from stopping early on token 2."""
    transfer = _self_transfer(family)
    model = transfer.target
    prompt = _prompt()
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        native = model.generate(input_ids=prompt, **options)
        mapped = model.generate(input_ids=prompt, past_key_values=transfer(prefill(model, prompt[:, :-1])), **options)
    assert native.shape == (1, prompt.shape[1] + NEW_TOKENS)
    assert mapped.tolist() == native.tolist()
    manual, _ = _greedy(model, transfer(prefill(model, prompt[:, :-1])), prompt[:, -1:])
    assert manual.tolist() == native[:, prompt.shape[1] :].tolist()


def test_relocated_positions_self_transfer(family):
    """A cache computed at positions 50..69, mapped with positions=50..69, equals the target's own there."""
    transfer = _self_transfer(family)
    model = transfer.target
    prompt = _prompt()
    positions = torch.arange(50, 70)
    with torch.no_grad():
        own = model(prompt, position_ids=positions[None], use_cache=True).past_key_values
    _assert_cache_close(transfer(_source_layers(own), positions=positions), own)


@functools.cache
def _twisted_transfer(family: str, **overrides) -> KVTransfer:
    """S → T where T is S with its last layer's content keys linearly mixed per head (k ↦ M_h k, M_h not a
    rotation, so it does not commute with RoPE): an exact affine pair whose map depends on positions."""
    source, target = tiny(family, **overrides), tiny(family, **overrides)
    generator = torch.Generator().manual_seed(4)
    attention = target.model.layers[-1].self_attn
    with torch.no_grad():
        if hasattr(attention, "k_norm"):  # k = k_norm(k_proj x): a channel scale is the linear handle
            attention.k_norm.weight.mul_(0.5 + torch.rand(attention.k_norm.weight.shape, generator=generator))
        else:
            heads = target.config.num_key_value_heads
            dim = attention.k_proj.weight.shape[0] // heads
            mix = torch.block_diag(
                *[torch.eye(dim) + 0.5 * torch.randn(dim, dim, generator=generator) / dim**0.5 for _ in range(heads)]
            )
            attention.k_proj.weight.copy_(mix @ attention.k_proj.weight)
            if attention.k_proj.bias is not None:
                attention.k_proj.bias.copy_(mix @ attention.k_proj.bias)
    token_hash = vocabulary_hash(target)
    traces = collect_traces(source, target, calibration_ids(4, 48, seed=1), stride=1, batch_size=4)
    mapper = fit_transfer(source, target, traces, token_hash, support="local", k=1, selection="identity", lam=1e-6)
    return KVTransfer(mapper, source, target, token_hash)


def test_relocated_positions_position_dependent_map(family):
    transfer = _twisted_transfer(family)
    prompt = _prompt()
    positions = torch.arange(50, 70)
    with torch.no_grad():
        source = transfer.source(prompt, position_ids=positions[None], use_cache=True).past_key_values
        own = transfer.target(prompt, position_ids=positions[None], use_cache=True).past_key_values
    last_source, last_own = source.layers[-1].keys, own.layers[-1].keys
    assert float((last_source - last_own).abs().max()) > 1e-2  # the pair really differs
    _assert_cache_close(transfer(_source_layers(source), positions=positions), own)
    # mapping as if the tokens sat at 0..19 is wrong on the twisted layer (values are position-free)
    shifted = transfer(_source_layers(source))
    torch.testing.assert_close(shifted.layers[-1].values, own.layers[-1].values, rtol=0, atol=CACHE_TOL)
    assert float((shifted.layers[-1].keys - last_own).abs().max()) > 1e-2


# --------------------------------------------------------------------------- token features (fit.token_features)


@functools.cache
def _token_transfer(family: str) -> KVTransfer:
    """The self-transfer, its maps also reading the target's layer-0 content K/V of each token."""
    model = tiny(family)
    token_hash = vocabulary_hash(model)
    traces = collect_traces(model, model, calibration_ids(4, 48, seed=1), stride=1, batch_size=4)
    mapper = fit_transfer(
        model, model, traces, token_hash, support="local", k=1, selection="identity", lam=1e-6, token_features=True
    )
    return KVTransfer(mapper, model, model, token_hash)


def test_token_feature_self_transfer_reproduces_prefill_cache(family):
    transfer = _token_transfer(family)
    heads, dim = transfer.target_kv.num_kv_heads, transfer.target_kv.head_dim
    assert transfer.mapper.weight_v.shape[2] == dim + 2 * heads * dim  # k·f·d_s + 2·H_t·d_t
    prompt = _prompt(batch=2)
    source = prefill(transfer.source, prompt)
    _assert_cache_close(transfer(_source_layers(source), input_ids=prompt), prefill(transfer.target, prompt))


def test_token_feature_transfer_at_relocated_positions(family):
    transfer = _token_transfer(family)
    prompt, positions = _prompt(), torch.arange(50, 70)
    with torch.no_grad():
        source = transfer.source(prompt, position_ids=positions[None], use_cache=True).past_key_values
        own = transfer.target(prompt, position_ids=positions[None], use_cache=True).past_key_values
    _assert_cache_close(transfer(_source_layers(source), positions=positions, input_ids=prompt), own)


def test_token_feature_mapper_needs_the_prefix_ids():
    transfer = _token_transfer("qwen2")
    prompt = _prompt()
    layers = _source_layers(prefill(transfer.source, prompt))
    with pytest.raises(TransferError, match="token features: pass the prefix's input_ids"):
        transfer(layers)
    with pytest.raises(TransferError, match=re.escape("input_ids shape (1, 19) ≠ the source cache's (1, 20)")):
        transfer(layers, input_ids=prompt[:, 1:])
    assert handoff(transfer, layers, prompt).mode == "transfer"
    assert spent(transfer, Levers()) == Levers(native_layers=1)  # layer 0 is prefilled for the features
    assert spent(transfer, Levers(4, 16, 7)) == Levers(4, 16, 7)


def test_token_feature_mapper_refuses_triton_and_a_narrow_artifact():
    transfer = _token_transfer("qwen2")
    model = transfer.target
    for backend in ("triton", "gemm"):
        with pytest.raises(ValueError, match=f"{backend} apply does not read token features"):
            KVTransfer(transfer.mapper, model, model, vocabulary_hash(model), backend=backend)
    plain = _self_transfer("qwen2").mapper
    claims_tokens = replace(plain, manifest=dict(plain.manifest, token_features=True))
    with pytest.raises(
        TransferError, match="mapper weight_k reads 16 features, its layers, heads and token features make 80"
    ):
        KVTransfer(claims_tokens, model, model, vocabulary_hash(model))


# --------------------------------------------------------------------------- refusal and rollback


def _bad_caches(cache):
    layers = _source_layers(cache)
    nan = [(k.clone(), v.clone()) for k, v in layers]
    nan[1][0][0, 1, 3, 5] = float("nan")
    inf = [(k.clone(), v.clone()) for k, v in layers]
    inf[2][1][0, 0, 0, 0] = float("inf")
    return {
        "nan_in_one_layer": (nan, r"layer 1 keys contains NaN"),
        "inf_in_values": (inf, r"layer 2 values contains NaN or Inf"),
        "too_few_layers": (layers[:2], r"source cache has 2 layers, the source model 3"),
        "too_many_layers": (layers + layers[:1], r"source cache has 4 layers, the source model 3"),
        "wrong_head_count": (
            [(k[:, :1], v[:, :1]) for k, v in layers],
            r"layer 0 keys has shape \(1, 1, 19, 16\), expected \[batch, 2, seq, 16\]",
        ),
        "wrong_head_dim": (
            [(k[..., :8], v[..., :8]) for k, v in layers],
            r"layer 0 keys has shape \(1, 2, 19, 8\), expected \[batch, 2, seq, 16\]",
        ),
        "three_dim_tensor": ([(k[0], v[0]) for k, v in layers], r"layer 0 keys has shape \(2, 19, 16\)"),
        "key_value_mismatch": ([(k, v[:, :, :-1]) for k, v in layers], r"layer 0 values shape"),
        "bf16_for_fp32_model": (
            [(k.bfloat16(), v.bfloat16()) for k, v in layers],
            r"layer 0 keys is torch\.bfloat16, the source model torch\.float32",
        ),
    }


BAD_CASES = [
    "nan_in_one_layer",
    "inf_in_values",
    "too_few_layers",
    "too_many_layers",
    "wrong_head_count",
    "wrong_head_dim",
    "three_dim_tensor",
    "key_value_mismatch",
    "bf16_for_fp32_model",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_source_cache_is_refused(case):
    transfer = _self_transfer("llama")
    prompt = _prompt()
    bad, message = _bad_caches(prefill(transfer.source, prompt[:, :-1]))[case]
    with pytest.raises(TransferError, match=message):
        transfer(bad)


@pytest.mark.parametrize("case", BAD_CASES)
def test_handoff_rolls_back_to_prefill(case):
    transfer = _self_transfer("llama")
    prompt = _prompt()
    prefix = prompt[:, :-1]
    bad, message = _bad_caches(prefill(transfer.source, prefix))[case]
    result = handoff(transfer, bad, prefix)
    assert result.mode == "prefill"
    assert isinstance(result.reason, str)
    assert re.search(message, result.reason), result.reason
    _assert_cache_equal(result.cache, prefill(transfer.target, prefix))  # deterministic rollback


def test_handoff_rollback_decodes_like_prefill():
    transfer = _self_transfer("llama")
    prompt = _prompt()
    prefix = prompt[:, :-1]
    bad, _ = _bad_caches(prefill(transfer.source, prefix))["nan_in_one_layer"]
    result = handoff(transfer, bad, prefix)
    assert result.mode == "prefill"
    tokens, logits = _greedy(transfer.target, result.cache, prompt[:, -1:], steps=4)
    native_tokens, native_logits = _greedy(transfer.target, prefill(transfer.target, prefix), prompt[:, -1:], steps=4)
    assert tokens.tolist() == native_tokens.tolist() and torch.equal(logits, native_logits)


def test_mismatched_positions_length_is_refused():
    transfer = _self_transfer("llama")
    cache = prefill(transfer.source, _prompt()[:, :-1])  # 19 tokens
    for positions in (torch.arange(20), torch.arange(18), torch.arange(50, 70)):
        with pytest.raises(TransferError, match=rf"{positions.numel()} positions given for a 19-token cache"):
            transfer(cache, positions=positions)


def test_handoff_transfers_a_good_cache():
    transfer = _self_transfer("llama")
    prefix = _prompt()[:, :-1]
    result = handoff(transfer, prefill(transfer.source, prefix), prefix)
    assert result.mode == "transfer" and result.reason is None
    _assert_cache_close(result.cache, prefill(transfer.target, prefix))
    # a list of (keys, values) is accepted like a DynamicCache
    result = handoff(transfer, _source_layers(prefill(transfer.source, prefix)), prefix)
    assert result.mode == "transfer"


# --------------------------------------------------------------------------- corrupt coefficients


def _corrupt(mapper, name, index, value):
    tensor = getattr(mapper, name).clone()
    tensor[index] = value
    return replace(mapper, **{name: tensor})


@pytest.mark.parametrize(
    "name,index,value",
    [
        ("weight_k", (1, 0, 3, 5), float("nan")),
        ("weight_v", (2, 1, 0, 0), float("nan")),
        ("bias_k", (0, 1, 7), float("nan")),
        ("bias_v", (1, 0, 2), float("inf")),
    ],
)
def test_corrupt_mapper_coefficient_is_refused_at_construction(name, index, value):
    good = _self_transfer("llama")
    model = good.target
    corrupt = _corrupt(good.mapper, name, index, value)
    assert torch.isfinite(getattr(good.mapper, name)).all()  # the shared mapper is untouched
    with pytest.raises(TransferError, match=re.escape(f"mapper {name} contains NaN or Inf (first at {index})")):
        KVTransfer(corrupt, model, model, vocabulary_hash(model))


def _overflowing(mapper):
    """Finite coefficients whose map overflows float32 in target layer 1 (caught per call, not at construction)."""
    return _corrupt(mapper, "weight_v", (1,), 3e38)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_non_finite_mapped_layer_is_refused_and_rolled_back(backend):
    good = _self_transfer("llama")
    model = good.target
    transfer = KVTransfer(_overflowing(good.mapper), model, model, vocabulary_hash(model), backend=backend)
    prefix = _prompt()[:, :-1]
    with pytest.raises(TransferError, match=r"mapped target layer 1 is not finite"):
        transfer(prefill(model, prefix))
    result = handoff(transfer, prefill(model, prefix), prefix)
    assert result.mode == "prefill" and "mapped target layer 1" in result.reason
    _assert_cache_equal(result.cache, prefill(model, prefix))


# --------------------------------------------------------------------------- binding to the pair


def test_transfer_refuses_another_pair():
    good = _self_transfer("llama")
    model = good.target
    token_hash = vocabulary_hash(model)
    with pytest.raises(TransferError, match="tokenizer hash"):
        KVTransfer(good.mapper, model, model, "0" * 64)
    other = tiny("llama", seed=3)  # same architecture, other weights
    with pytest.raises(TransferError, match="target fingerprint"):
        KVTransfer(good.mapper, model, other, token_hash)
    with pytest.raises(TransferError, match="source fingerprint"):
        KVTransfer(good.mapper, other, model, token_hash)
    wrong_shape = replace(good.mapper, weight_k=good.mapper.weight_k[:2])
    with pytest.raises(TransferError, match="does not fit the target"):
        KVTransfer(wrong_shape, model, model, token_hash)


@pytest.mark.parametrize("support", ["local", "full"])
def test_layer_groups_do_not_change_the_mapped_cache(monkeypatch, support):
    """Mapping target layers in groups (one gather + one batched GEMM per group) equals one layer at a time."""
    import src.maps

    source, target = tiny("qwen3", seed=0), tiny("qwen3", seed=1, num_hidden_layers=5)
    hashed = vocabulary_hash(target)
    traces = collect_traces(source, target, calibration_ids(4, 32), 2, 4)
    mapper = fit_transfer(source, target, traces, hashed, support=support, k=2, lam=1e-3)
    ids = calibration_ids(2, 12, seed=9)
    grouped = KVTransfer(mapper, source, target, hashed)(prefill(source, ids))
    monkeypatch.setattr(src.maps, "GROUP_BYTES", 1)  # every group a single layer
    assert len(src.maps.layer_groups(mapper.to("cpu", torch.float32), 24, support == "full")) == 5
    single = KVTransfer(mapper, source, target, hashed)(prefill(source, ids))
    for a, b in zip(grouped.layers, single.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, atol=1e-6) and torch.allclose(a.values, b.values, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fused_backend_matches_the_torch_path_or_refuses(backend):
    """`backend="auto"` runs kernels/apply_map.py (its torch reference on CPU) and equals the torch path;
    `backend="triton"` on CPU refuses rather than silently falling back."""
    torch_path = _self_transfer("qwen3")
    model = torch_path.target
    fused = KVTransfer(torch_path.mapper, model, model, vocabulary_hash(model), backend=backend)
    source = prefill(model, _prompt(batch=2))
    if backend == "triton" and fused.device.type == "cpu":
        with pytest.raises(TransferError, match="Triton path unavailable"):  # a refusal: handoff rolls back
            fused(source)
        return
    _assert_cache_close(fused(source), torch_path(source), tol=1e-6)
    _assert_cache_close(
        fused(source, positions=torch.arange(7, 27)), torch_path(source, positions=torch.arange(7, 27)), 1e-6
    )


def test_fused_backend_refuses_unknown_backends():
    torch_path = _self_transfer("llama")
    model = torch_path.target
    with pytest.raises(ValueError, match="apply backend must be one of"):
        KVTransfer(torch_path.mapper, model, model, vocabulary_hash(model), backend="cuda")


SMOLLM2 = Path(os.environ.get("KVRELAY_HOME", Path.home() / ".cache/kvrelay")) / "models/smollm2_135m"


@pytest.mark.skipif(not (SMOLLM2 / "kvrelay_fetch.json").is_file(), reason="run scripts/fetch_models.py smollm2_135m")
def test_real_smollm2_self_transfer_reproduces_greedy_decoding():
    """Real weights (SmolLM2-135M, llama, 3 KV heads): an identity self-map fitted on real text continues a
    real prompt exactly as the model's own cache does."""
    model, tokenizer = load_model(SMOLLM2), load_tokenizer(SMOLLM2)
    hashed = tokenizer_hash(tokenizer)
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = torch.tensor(tokenizer(text)["input_ids"][:64])[None]  # [1, 64]
    traces = collect_traces(model, model, ids.repeat(2, 1), stride=1, batch_size=2)
    mapper = fit_transfer(model, model, traces, hashed, support="local", k=1, selection="identity", lam=1e-6)
    transfer = KVTransfer(mapper, model, model, hashed)
    prompt = torch.tensor(tokenizer("def fibonacci(n):")["input_ids"])[None]  # [1, T]
    native_tokens, _ = _greedy(model, prefill(model, prompt[:, :-1]), prompt[:, -1:])
    mapped_tokens, _ = _greedy(model, transfer(prefill(model, prompt[:, :-1])), prompt[:, -1:])
    assert mapped_tokens.tolist() == native_tokens.tolist()


# --------------------------------------------------------------------------- inputs the map cannot read (issue 11)


def _refused_and_rolled_back(transfer: KVTransfer, cache, prefix: torch.Tensor, message: str, **kwargs) -> None:
    with pytest.raises(TransferError, match=message):
        transfer(cache, **kwargs)
    result = handoff(transfer, cache, prefix)
    assert result.mode == "prefill" and re.search(message, result.reason), result.reason
    _assert_cache_equal(result.cache, prefill(transfer.target, prefix))


def _foreign_caches(model, prefix):
    static = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(prefix, past_key_values=static, use_cache=True)
    native = prefill(model, prefix)
    layers = _source_layers(native)
    return {
        "static": (static, "source cache is a StaticCache"),
        "encoder_decoder": (EncoderDecoderCache(prefill(model, prefix), DynamicCache()), "is a EncoderDecoderCache"),
        "none": (None, "source cache is a NoneType"),
        "stacked_tensor": (torch.stack([torch.stack(pair) for pair in layers]), "source cache is a Tensor"),
        "not_a_pair": ([k for k, _ in layers], r"source cache layer 0 is a Tensor, not a \(keys, values\) pair"),
        "empty_later_layers": (prefill_layers(model, prefix, 1), "layer 1 keys is a NoneType, not a tensor"),
        "sparse": ([(k.to_sparse(), v) for k, v in layers], "layer 0 keys is torch.sparse_coo: only dense"),
        "empty": ([(k[:, :, :0], v[:, :, :0]) for k, v in layers], r"source cache is empty: shape \(1, 2, 0, 16\)"),
        "meta": ([(k.to("meta"), v.to("meta")) for k, v in layers], "layer 0 keys is on meta"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "static",
        "encoder_decoder",
        "none",
        "stacked_tensor",
        "not_a_pair",
        "empty_later_layers",
        "sparse",
        "empty",
        "meta",
    ],
)
def test_foreign_cache_types_and_layouts_are_refused(case):
    transfer = _self_transfer("llama")
    prefix = _prompt()[:, :-1]
    cache, message = _foreign_caches(transfer.source, prefix)[case]
    _refused_and_rolled_back(transfer, cache, prefix, message)


def test_odd_strides_map_like_contiguous_caches():
    """Non-contiguous views (head-major storage, a broadcast batch) are read, not refused, and map exactly
    like their contiguous copies."""
    transfer = _self_transfer("qwen2")
    layers = _source_layers(prefill(transfer.source, _prompt()))
    strided = [
        (k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2))
        for k, v in layers
    ]
    assert not strided[0][0].is_contiguous()
    _assert_cache_equal(transfer(strided), transfer(layers))
    broadcast = [(k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)) for k, v in layers]  # stride 0 over the batch
    mapped, single = transfer(broadcast), transfer(layers)
    for a, b in zip(mapped.layers, single.layers, strict=True):
        assert torch.equal(a.keys, b.keys.expand(3, -1, -1, -1)) and torch.equal(
            a.values, b.values.expand(3, -1, -1, -1)
        )


@pytest.mark.parametrize(
    "positions,message",
    [
        (torch.arange(19.0), r"positions are torch\.float32, expected integers"),
        (torch.arange(-1, 18), "positions must be ≥ 0, the smallest is -1"),
        (torch.arange(19)[None], r"positions have shape \(1, 19\), expected \[19\]"),
        (list(range(19)), "positions is a list"),
        (torch.arange(19) > 3, "positions are torch.bool"),
    ],
)
def test_bad_positions_are_refused(positions, message):
    transfer = _self_transfer("llama")
    with pytest.raises(TransferError, match=message):
        transfer(prefill(transfer.source, _prompt()[:, :-1]), positions=positions)


@pytest.mark.parametrize(
    "ids,message",
    [
        (lambda p: p.float(), r"input_ids are torch\.float32"),
        (lambda p: p + 96, r"input_ids hold ids \d+\.\.\d+, outside the vocabulary \[0, 96\)"),
        (lambda p: p - 200, "outside the vocabulary"),
        (lambda p: p[:, 1:], r"input_ids shape \(1, 18\) ≠ the source cache's \(1, 19\)"),
        (lambda p: p.repeat(2, 1), r"input_ids shape \(2, 19\)"),  # wrong batch
    ],
)
def test_bad_input_ids_are_refused(ids, message):
    transfer = _self_transfer("llama")
    prefix = _prompt()[:, :-1]
    with pytest.raises(TransferError, match=message):
        transfer(prefill(transfer.source, prefix), input_ids=ids(prefix))


def _with(mapper, **fields):
    return replace(mapper, **fields)


MAPPER_FIELDS = {
    "negative_layer": (
        lambda m: _with(m, source_layers=m.source_layers - 1),
        r"source_layers holds indices -1\.\.1, outside \[0, 3\)",
    ),
    "layer_out_of_range": (
        lambda m: _with(m, source_layers=m.source_layers + 1),
        r"source_layers holds indices 1\.\.3, outside \[0, 3\)",
    ),
    "negative_head": (
        lambda m: _with(m, head_index=m.head_index - 2),
        r"head_index holds indices -2\.\.-1, outside \[0, 2\)",
    ),
    "head_out_of_range": (
        lambda m: _with(m, head_index=m.head_index + 1),
        r"head_index holds indices 1\.\.2, outside \[0, 2\)",
    ),
    "float_layers": (
        lambda m: _with(m, source_layers=m.source_layers.float()),
        "source_layers is torch.float32: indices must be integers",
    ),
    "bool_heads": (
        lambda m: _with(m, head_index=m.head_index.bool()),
        "head_index is torch.bool: indices must be integers",
    ),
    "layer_rows": (
        lambda m: _with(m, source_layers=m.source_layers[:2]),
        r"source_layers has shape \(2, 1\), expected \[3, ≥ 1\]",
    ),
    "head_rows": (lambda m: _with(m, head_index=m.head_index[:, :0]), r"head_index has shape \(2, 0\)"),
    "int_weights": (
        lambda m: _with(m, weight_v=m.weight_v.long()),
        "weight_v is torch.int64: coefficients must be floating point",
    ),
    "bias_shape": (
        lambda m: _with(m, bias_k=m.bias_k[..., :8]),
        r"bias_k has shape \(3, 2, 8\), expected \(3, 2, 16\)",
    ),
    "sparse_weights": (lambda m: _with(m, weight_k=m.weight_k.to_sparse()), "weight_k is not a dense tensor"),
    "list_bias": (lambda m: _with(m, bias_v=m.bias_v.tolist()), "bias_v is a list, not a tensor"),
    "inf_bias": (
        lambda m: _with(m, bias_v=m.bias_v.clone().fill_(float("inf"))),
        r"bias_v contains NaN or Inf \(first at \(0, 0, 0\)\)",
    ),
}


@pytest.mark.parametrize("case", sorted(MAPPER_FIELDS))
def test_bad_mapper_fields_are_refused_at_construction(case):
    good = _self_transfer("llama")
    model = good.target
    edit, message = MAPPER_FIELDS[case]
    with pytest.raises(TransferError, match=message):
        KVTransfer(edit(good.mapper), model, model, vocabulary_hash(model))


def test_narrow_index_and_wide_coefficient_dtypes_map_like_the_originals():
    good = _self_transfer("llama")
    model = good.target
    other = replace(
        good.mapper, source_layers=good.mapper.source_layers.int(), head_index=good.mapper.head_index.to(torch.uint8)
    )
    cache = prefill(model, _prompt())
    _assert_cache_equal(KVTransfer(other, model, model, vocabulary_hash(model))(cache), good(cache))
    wide = replace(good.mapper, weight_k=good.mapper.weight_k.double(), weight_v=good.mapper.weight_v.double())
    _assert_cache_equal(KVTransfer(wide, model, model, vocabulary_hash(model))(cache), good(cache))


def test_sliding_window_opt_in_traces_and_window_positions():
    """A sliding-window pair (window 8) calibrated on 48-token sequences (longer than the window: the opt-in path
    of issue 11); a source cache that has dropped tokens is refused without its positions and mapped exactly at
    them; a prefix inside the window maps to the target's own (windowed) cache."""
    transfer = _twisted_transfer("mistral", sliding_window=8)
    prompt = _prompt()  # 20 tokens: the sliding cache keeps the last 7
    source = prefill(transfer.source, prompt)
    own = prefill(transfer.target, prompt)
    assert source.layers[0].keys.shape[2] == 7 and source.layers[0].cumulative_length == 20
    _refused_and_rolled_back(
        transfer, source, prompt, r"sliding window holding the last 7 of 20 tokens: pass .* \(13\.\.19\)"
    )
    mapped = transfer(source, positions=torch.arange(13, 20))
    for a, b in zip(mapped.layers, own.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=CACHE_TOL)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=CACHE_TOL)
    wrong = transfer(_source_layers(source))  # a plain list carries no window: positions 0..6 are assumed
    assert float((wrong.layers[-1].keys - own.layers[-1].keys).abs().max()) > 1e-2
    short = _prompt(length=6)
    _assert_cache_close(transfer(prefill(transfer.source, short)), prefill(transfer.target, short))


def test_splicing_refuses_a_source_cache_that_dropped_tokens():
    """Splicing slices the source cache by position (sink, middle, hold-back): a sliding-window cache that has
    dropped its first tokens holds position dropped + i at index i, so it is refused, not silently misplaced."""
    transfer = _twisted_transfer("mistral", sliding_window=8)
    prompt = _prompt()  # 20 tokens: the sliding cache keeps the last 7
    with pytest.raises(TransferError, match="dropped its first 13 tokens"):
        spliced_cache(transfer, prefill(transfer.source, prompt), prompt, Levers(native_sink=2))
    short = _prompt(length=6)  # inside the window: nothing dropped, splices as before
    spliced_cache(transfer, prefill(transfer.source, short), short, Levers(native_sink=2))


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (lambda p, vocab: p + vocab, r"outside the vocabulary \[0, "),
        (lambda p, vocab: p.float(), "expected integer token ids"),
        (lambda p, vocab: p[0], r"expected \[batch, tokens ≥ 1\]"),
        (lambda p, vocab: p[:, :0], r"expected \[batch, tokens ≥ 1\]"),
    ],
    ids=["out_of_vocab", "float", "1d", "empty"],
)
def test_ids_no_path_can_read_are_a_clear_error_not_a_fallback(ids, message):
    """handoff's rollback prefills the same ids: ids outside the target's vocabulary (or not token ids at all)
    cannot be served by any path, so handoff, spliced_cache and prefill name the problem up front."""
    transfer = _twisted_transfer("llama")
    prompt = _prompt()
    cache, bad = prefill(transfer.source, prompt), ids(prompt, transfer.vocab_size)
    for call in (
        lambda: handoff(transfer, cache, bad),
        lambda: spliced_cache(transfer, cache, bad, Levers(native_sink=2)),
        lambda: prefill(transfer.target, bad),
        lambda: prefill_layers(transfer.target, bad, 1),
    ):
        with pytest.raises(ValueError, match=message):
            call()


class _PerTypeRotary(torch.nn.Module):
    """A Gemma-3-style rotary module: one frequency table per layer type, no `inv_freq`."""

    def __init__(self, rotary):
        super().__init__()
        self.register_buffer("full_attention_inv_freq", rotary.inv_freq.clone(), persistent=False)
        self.full_attention_attention_scaling = rotary.attention_scaling

    def forward(self, x, position_ids, layer_type):
        raise AssertionError("never called: refused before")


def test_per_layer_type_rotary_refused_up_front():
    good = _self_transfer("qwen2")
    model = tiny("qwen2")  # same weights (fingerprint) as good's model, own modules
    model.model.rotary_emb = _PerTypeRotary(model.model.rotary_emb)
    with pytest.raises(TransferError, match="source model cannot be mapped: _PerTypeRotary has no single `inv_freq`"):
        KVTransfer(good.mapper, model, model, vocabulary_hash(model))


def test_a_failure_no_check_foresaw_is_still_a_refusal(monkeypatch):
    """Whatever raises inside the apply path surfaces as a TransferError (named as unexpected), so handoff rolls
    back instead of raising."""
    import src.apply

    transfer = _self_transfer("llama")
    prefix = _prompt()[:, :-1]

    def broken(*args, **kwargs):
        raise IndexError("index 7 is out of bounds")

    monkeypatch.setattr(src.apply, "map_layers", broken)
    with pytest.raises(TransferError, match=r"unexpected failure while mapping .*IndexError: index 7") as refusal:
        transfer(prefill(transfer.source, prefix))
    assert str(refusal.value).startswith(src.apply.UNEXPECTED)
    _refused_and_rolled_back(transfer, prefill(transfer.source, prefix), prefix, "IndexError")


@pytest.mark.parametrize("layers", [0, -1, 4])
def test_prefill_layers_refuses_a_depth_the_model_does_not_have(layers):
    model = _self_transfer("llama").target  # 3 layers
    with pytest.raises(ValueError, match=rf"1 ≤ layers ≤ 3, got {layers}"):
        prefill_layers(model, _prompt(), layers)
