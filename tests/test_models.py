"""KV interface description, model/tokenizer identity, and the pair-compatibility refusals."""

import dataclasses
import math

import pytest
import torch
from conftest import TINY, tiny
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from src.models import (
    SUPPORTED_FAMILIES,
    IncompatiblePairError,
    KVInterface,
    build_random_model,
    check_compatible,
    config_hash,
    describe_kv,
    dtype_name,
    fingerprint,
    load_model,
    tokenizer_hash,
    vocabulary_hash,
    weight_hash,
)

HASH = "a" * 64
GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def _gemma3():
    return build_random_model(
        dict(TINY, model_type="gemma3_text", head_dim=16, sliding_window=16, layer_types=GEMMA3_LAYER_TYPES), seed=0
    )


@pytest.fixture(scope="module")
def llama_kv() -> KVInterface:
    return describe_kv(tiny("llama"))


# ---------------------------------------------------------------- describe_kv


def test_describe_kv(family):
    model = tiny(family)
    kv = describe_kv(model)
    assert kv.family == family
    assert kv.num_layers == 3 == len(kv.layer_types)
    assert kv.num_kv_heads == 2
    assert kv.num_q_heads == 4
    assert kv.q_per_kv == 2
    assert kv.head_dim == 16
    assert kv.qk_norm is (family == "qwen3")
    assert kv.rope_dim == 16
    assert kv.rope_layout == "half"
    assert kv.attention_scaling == 1.0
    assert kv.attention_softmax_scale == pytest.approx(16**-0.5)
    assert kv.rope_parameters["rope_type"] == "default"
    assert kv.layer_types == ("full_attention",) * 3
    assert kv.sliding_window is None
    assert kv.kv_lora_rank is None
    # the description matches the module shapes the cache is built from
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.out_features == kv.num_kv_heads * kv.head_dim
    assert attention.q_proj.out_features == kv.num_q_heads * kv.head_dim
    assert kv.to_dict()["num_kv_heads"] == 2


def test_describe_kv_yarn_scaling_and_other_shapes():
    kv = describe_kv(tiny("llama", rope_parameters=dict(YARN), num_key_value_heads=1, num_hidden_layers=2))
    assert kv.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert kv.rope_parameters["rope_type"] == "yarn"
    assert (kv.num_layers, kv.num_kv_heads, kv.q_per_kv) == (2, 1, 4)
    qwen2 = describe_kv(tiny("qwen2", hidden_size=96))  # head_dim from hidden_size / heads
    assert qwen2.head_dim == 24 == qwen2.rope_dim


def test_describe_kv_sliding_and_hybrid():
    mistral = describe_kv(tiny("mistral", sliding_window=32))
    assert mistral.sliding_window == 32
    hybrid = describe_kv(tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert hybrid.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert hybrid.sliding_window == 16


# ---------------------------------------------------------------- fingerprints


def test_fingerprint_stable_and_deterministic():
    model = tiny("llama")
    first = fingerprint(model)
    assert len(first) == 64
    assert fingerprint(model) == first
    assert fingerprint(tiny("llama")) == first  # same config + seed → same weights → same identity
    assert fingerprint(tiny("llama", seed=1)) != first


def test_fingerprint_changes_with_one_weight():
    base, edited = tiny("llama"), tiny("llama")
    with torch.no_grad():
        edited.model.layers[2].self_attn.v_proj.weight[3, 5] += 1e-3
    assert config_hash(base) == config_hash(edited)
    assert weight_hash(base) != weight_hash(edited)
    assert fingerprint(base) != fingerprint(edited)


def test_fingerprint_changes_with_dtype():
    assert weight_hash(tiny("llama")) != weight_hash(tiny("llama").to(torch.bfloat16))


def test_fingerprint_tracks_in_place_weight_edit():
    model = tiny("llama")
    before = fingerprint(model)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
    assert fingerprint(model) != before


def test_fingerprint_changes_with_config():
    base = tiny("llama")
    assert config_hash(tiny("llama", rms_norm_eps=1e-5)) != config_hash(base)
    linear = tiny("llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    assert weight_hash(linear) == weight_hash(base)  # same seed, same weights: only the config differs
    assert fingerprint(linear) != fingerprint(base)


def test_config_hash_ignores_volatile_keys():
    model = tiny("llama")
    before = config_hash(model)
    model.config._name_or_path = "/somewhere/else"
    assert config_hash(model) == before
    model.config.rms_norm_eps = 1e-3
    assert config_hash(model) != before


# ---------------------------------------------------------------- tokenizer hash


def _fast_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, **{word: index for index, word in enumerate(words, start=1)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_tokenizer_hash():
    words = ["the", "cache", "moves", "between", "models"]
    first, same = _fast_tokenizer(words), _fast_tokenizer(list(words))
    assert first("the cache moves")["input_ids"] == [1, 2, 3]
    assert tokenizer_hash(first) == tokenizer_hash(same)
    assert len(tokenizer_hash(first)) == 64
    changed = _fast_tokenizer([*words[:-1], "model"])
    assert tokenizer_hash(changed) != tokenizer_hash(first)
    swapped = _fast_tokenizer([words[1], words[0], *words[2:]])  # same tokens, different ids
    assert tokenizer_hash(swapped) != tokenizer_hash(first)


def test_vocabulary_hash_is_vocab_size_only():
    assert vocabulary_hash(tiny("llama")) == vocabulary_hash(tiny("qwen2", seed=3))
    assert vocabulary_hash(tiny("llama", vocab_size=97)) != vocabulary_hash(tiny("llama"))


# ---------------------------------------------------------------- check_compatible


def test_compatible_pairs_pass(family, llama_kv):
    check_compatible(llama_kv, describe_kv(tiny(family, seed=1)), HASH, HASH)
    check_compatible(describe_kv(tiny(family)), llama_kv, HASH, HASH)


def test_refuses_different_tokenizers(llama_kv):
    other = "b" * 64
    with pytest.raises(IncompatiblePairError, match="tokenizers differ") as error:
        check_compatible(llama_kv, llama_kv, HASH, other)
    assert HASH[:12] in str(error.value) and other[:12] in str(error.value)


def test_sliding_window_target_refused_by_default(llama_kv):
    target = describe_kv(tiny("mistral", sliding_window=32))
    with pytest.raises(IncompatiblePairError, match=r"target model uses sliding-window attention \(window 32\)"):
        check_compatible(llama_kv, target, HASH, HASH)
    with pytest.raises(IncompatiblePairError, match="source model uses sliding-window"):
        check_compatible(target, llama_kv, HASH, HASH)
    check_compatible(llama_kv, target, HASH, HASH, allow_sliding_window=True)


def test_hybrid_model_refused_even_with_sliding_allowed(llama_kv):
    hybrid = describe_kv(tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1))
    for allow in (False, True):
        with pytest.raises(IncompatiblePairError, match="target model is hybrid") as error:
            check_compatible(llama_kv, hybrid, HASH, HASH, allow_sliding_window=allow)
        assert "sliding_attention" in str(error.value) and "full_attention" in str(error.value)


def test_gemma3_layer_types_refused(llama_kv):
    """A gemma3-style interface (supported shapes, mixed layer kinds) is refused as hybrid."""
    config = _gemma3().config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    hybrid = dataclasses.replace(llama_kv, layer_types=tuple(config.layer_types), sliding_window=config.sliding_window)
    with pytest.raises(IncompatiblePairError, match="source model is hybrid"):
        check_compatible(hybrid, llama_kv, HASH, HASH, allow_sliding_window=True)
    with pytest.raises(IncompatiblePairError, match="'gemma3_text' is not supported"):
        check_compatible(llama_kv, dataclasses.replace(hybrid, family="gemma3_text"), HASH, HASH)


def test_gemma3_model_refused_not_crashed(llama_kv):
    with pytest.raises(IncompatiblePairError, match="gemma3_text|hybrid"):
        check_compatible(llama_kv, describe_kv(_gemma3()), HASH, HASH)


def test_qwen2_without_sliding_layers_is_not_sliding(llama_kv):
    model = tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=3)
    assert all(layer.self_attn.sliding_window is None for layer in model.model.layers)
    check_compatible(llama_kv, describe_kv(model), HASH, HASH)


def test_mla_refused(llama_kv):
    mla = dataclasses.replace(llama_kv, kv_lora_rank=64)
    with pytest.raises(IncompatiblePairError, match="latent \\(MLA\\) attention"):
        check_compatible(llama_kv, mla, HASH, HASH)
    with pytest.raises(IncompatiblePairError, match="source model uses latent"):
        check_compatible(mla, llama_kv, HASH, HASH)


def test_unsupported_family_refused(llama_kv):
    assert set(SUPPORTED_FAMILIES) == {"llama", "mistral", "qwen2", "qwen3"}
    other = dataclasses.replace(llama_kv, family="gpt_neox")
    with pytest.raises(IncompatiblePairError, match="target model family 'gpt_neox' is not supported"):
        check_compatible(llama_kv, other, HASH, HASH)


def test_unknown_rope_layout_refused(llama_kv):
    with pytest.raises(IncompatiblePairError, match="RoPE layout 'spiral' is unknown"):
        check_compatible(llama_kv, dataclasses.replace(llama_kv, rope_layout="spiral"), HASH, HASH)
    check_compatible(llama_kv, dataclasses.replace(llama_kv, rope_layout="interleaved"), HASH, HASH)


# ---------------------------------------------------------------- load_model


def test_load_model_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/fetch_models.py"):
        load_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


@pytest.fixture(scope="module")
def saved_qwen3(tmp_path_factory):
    model = tiny("qwen3", seed=4)
    directory = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(directory)
    return model, directory


def test_load_model_round_trip_same_fingerprint(saved_qwen3):
    model, directory = saved_qwen3
    loaded = load_model(directory)
    assert not loaded.training
    assert weight_hash(loaded) == weight_hash(model)
    assert config_hash(loaded) == config_hash(model)
    assert fingerprint(loaded) == fingerprint(model)
    assert describe_kv(loaded) == describe_kv(model)
    assert fingerprint(load_model(directory, dtype=torch.bfloat16)) != fingerprint(model)


def test_fingerprint_before_save_matches_reloaded_model(tmp_path):
    model = tiny("llama", seed=5)
    recorded = fingerprint(model)
    model.save_pretrained(tmp_path)
    assert fingerprint(load_model(tmp_path)) == recorded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_dtype_name_reads_back_as_its_dtype(dtype):
    """What transports and records write (`dtype_name`) is what their readers parse (`getattr(torch, name)`)."""
    assert getattr(torch, dtype_name(dtype)) is dtype and "." not in dtype_name(dtype)
