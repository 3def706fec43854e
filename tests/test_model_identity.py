"""A model directory's streamed identity (src/model_identity.py) is exactly the fingerprint of the model loaded from
it — tied and untied embeddings, float32 and bfloat16, one file or shards — changes with any tensor on disk, and is
refused (NotStreamable, never a guess) wherever the files do not match the model with certainty. Tiny random Qwen2
models saved with `save_pretrained` (correctness only, never quality)."""

import hashlib
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES
from safetensors.torch import load_file, save_file

from src.fetch import RECIPES, kvrelay_home, model_dir
from src.model_identity import INDEX, SINGLE, NotStreamable, streamed_identity
from src.models import _tensor_digest, build_random_model, fingerprint, load_model, weight_hash


def _saved(root: Path, tied: bool, sharded: bool = False, seed: int = 0) -> Path:
    model = build_random_model(dict(FAMILIES["qwen2"], tie_word_embeddings=tied), seed=seed)
    model.save_pretrained(root, **({"max_shard_size": "40KB"} if sharded else {}))
    assert (root / (INDEX if sharded else SINGLE)).is_file()
    return root


def _rewrite(directory: Path, edit) -> None:
    """The single file's tensors, edited by `edit(tensors)` in place, written back."""
    tensors = load_file(directory / SINGLE)
    edit(tensors)
    save_file(tensors, directory / SINGLE, metadata={"format": "pt"})


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "shards"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_streamed_identity_is_the_loaded_models_fingerprint(tmp_path, tied, dtype, sharded):
    directory = _saved(tmp_path, tied, sharded)
    if tied:
        assert "lm_head.weight" not in (load_file(directory / SINGLE) if not sharded else {})
    assert streamed_identity(directory, dtype) == fingerprint(load_model(directory, dtype))


def test_a_tensor_edited_on_disk_changes_the_identity_to_the_edited_models(tmp_path):
    directory = _saved(tmp_path, tied=True)
    before = streamed_identity(directory, torch.bfloat16)

    def edit(tensors):
        tensors["model.layers.1.self_attn.v_proj.weight"][0, 0] += 1.0

    _rewrite(directory, edit)
    after = streamed_identity(directory, torch.bfloat16)
    assert after != before
    assert after == fingerprint(load_model(directory, torch.bfloat16))


def test_both_tied_tensors_on_disk_and_different_hash_each_as_transformers_unties_them(tmp_path):
    directory = _saved(tmp_path, tied=True)

    def add_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 2

    _rewrite(directory, add_head)
    assert streamed_identity(directory, torch.float32) == fingerprint(load_model(directory, torch.float32))


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _add(name):
    return lambda tensors: tensors.update({name: torch.zeros(3)})


def _base_model_keys(tensors):  # a checkpoint of the base model: keys the loader prefixes with "model."
    for key in [key for key in tensors if key.startswith("model.")]:
        tensors[key.removeprefix("model.")] = tensors.pop(key)


def _reshape(tensors):
    tensors["model.norm.weight"] = torch.ones(7)


REFUSED = {  # edit → (tied, what the refusal names)
    "missing_tensor": (_drop("model.layers.0.mlp.up_proj.weight"), False, "lack model.layers.0.mlp.up_proj.weight"),
    "missing_tied_source": (_drop("model.embed_tokens.weight"), True, "lack model.embed_tokens.weight .tied"),
    "missing_untied_head": (_drop("lm_head.weight"), False, "lack lm_head.weight$"),
    "unexpected_tensor": (_add("model.extra.weight"), False, "not a tensor of the model"),
    "renamed_on_load": (_add("model.layers.0.LayerNorm.gamma"), False, "renamed or converted on load"),
    "base_model_keys": (_base_model_keys, False, "renamed or converted on load"),
    "other_shape": (_reshape, False, "has shape"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_files_that_do_not_match_the_model_are_refused_never_guessed(tmp_path, case):
    edit, tied, reason = REFUSED[case]
    directory = _saved(tmp_path, tied)
    _rewrite(directory, edit)
    with pytest.raises(NotStreamable, match=reason):
        streamed_identity(directory, torch.float32)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    directory = _saved(tmp_path, tied=False)
    (directory / SINGLE).unlink()
    with pytest.raises(NotStreamable, match="has no model.safetensors"):
        streamed_identity(directory, torch.float32)


def test_the_weight_hash_is_over_per_tensor_digests_in_name_order():
    """The recorded fingerprints (every mapper manifest) depend on the order: a reference written out by hand."""
    model = build_random_model(FAMILIES["qwen2"], seed=0)
    digests = [_tensor_digest(item) for item in sorted(model.state_dict().items())]
    assert weight_hash(model) == hashlib.sha256(b"".join(digests)).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen25coder_0p5b", "qwen25coder_1p5b"])
def test_the_streamed_identity_of_real_weights_is_their_loaded_fingerprint(name, dtype):
    """Slow: not in the default suite; skipped unless scripts/fetch_models.py has cached the model."""
    directory = model_dir(RECIPES[name], kvrelay_home())
    if not (directory / "config.json").is_file():
        pytest.skip(f"no cached model at {directory}")
    assert streamed_identity(directory, dtype) == fingerprint(load_model(directory, dtype))
