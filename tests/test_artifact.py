"""Mapper artifact: save/load round trips, the manifest's contents, and every refusal on load."""

import hashlib
import json
import shutil

import pytest
import safetensors
import torch
import transformers
from conftest import calibration_ids, tiny
from safetensors.torch import load_file, save

from src.apply import KVTransfer
from src.artifact import SCHEMA_VERSION, ArtifactError, Mapper, load_mapper, save_mapper
from src.artifact_store import MANIFEST_FILE, POINTER, TENSOR_FILE, VERSION_MANIFEST, artifact_exists, publish
from src.fit import fit_transfer
from src.forward import prefill
from src.maps import TransferError
from src.models import describe_kv, fingerprint, vocabulary_hash
from src.traces import collect_traces, corpus_hash

NAMES = ("source_layers", "head_index", "weight_k", "bias_k", "weight_v", "bias_v")


@pytest.fixture(scope="module")
def pair():
    """qwen2 → qwen2 (different seeds), a mapper fitted on 8 × 32 calibration tokens, saved once in fp32."""
    source, target = tiny("qwen2", seed=0), tiny("qwen2", seed=1)
    ids = calibration_ids(8, 32)
    traces = collect_traces(source, target, ids, stride=2, batch_size=4)
    token_hash = vocabulary_hash(target)
    mapper = fit_transfer(source, target, traces, token_hash, support="local", k=2, lam=0.01)
    originals = {name: t.clone() for name, t in mapper.tensors().items()}
    return dict(source=source, target=target, ids=ids, hash=token_hash, mapper=mapper, originals=originals)


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    return save_mapper(pair["mapper"], tmp_path_factory.mktemp("mapper_fp32"))


@pytest.fixture
def artifact(saved, tmp_path):
    """A private copy of the saved artifact that a test may damage."""
    return shutil.copytree(saved, tmp_path / "artifact", symlinks=True)


def _manifest(directory) -> dict:
    return json.loads((directory / MANIFEST_FILE).read_text())


def _write_manifest(directory, manifest: dict | bytes) -> None:
    """Save these manifest contents beside the artifact's tensor bytes as a consistent version (its id the sha256 of
    the bytes): what the load's content checks then read."""
    data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    publish(directory, data, (directory / TENSOR_FILE).read_bytes())


def _edit_in_place(directory, manifest: dict) -> None:
    """Overwrite the manifest file where `manifest.json` leads (through the pointer, into the version directory)."""
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def _load(directory, pair, **overrides) -> Mapper:
    checks = dict(
        source_fingerprint=fingerprint(pair["source"]),
        target_fingerprint=fingerprint(pair["target"]),
        tokenizer_hash=pair["hash"],
    )
    return load_mapper(directory, **dict(checks, **overrides))


# ---------------------------------------------------------------- round trips


def test_fitted_mapper_shapes(pair):
    mapper, kv = pair["mapper"], describe_kv(pair["target"])
    assert mapper.source_layers.shape == (kv.num_layers, 2)
    assert mapper.head_index.tolist() == [[0], [1]]  # local support, equal KV-head counts
    width = 2 * 1 * describe_kv(pair["source"]).head_dim  # k · f · d_s
    assert mapper.weight_k.shape == mapper.weight_v.shape == (kv.num_layers, kv.num_kv_heads, width, kv.head_dim)
    assert mapper.bias_k.shape == mapper.bias_v.shape == (kv.num_layers, kv.num_kv_heads, kv.head_dim)
    assert all(torch.isfinite(t).all() for t in mapper.tensors().values())


def test_round_trip_float32_is_exact(pair, saved):
    loaded = _load(saved, pair)
    for name in NAMES:
        original = pair["originals"][name]
        assert getattr(loaded, name).dtype == (torch.int64 if name in NAMES[:2] else torch.float32)
        assert torch.equal(getattr(loaded, name), original), name
    assert loaded.manifest == _manifest(saved)
    assert loaded.manifest["coefficient_dtype"] == "float32"
    assert load_mapper(saved).manifest == loaded.manifest  # identity checks are optional


def test_round_trip_bfloat16_within_rounding(pair, tmp_path):
    mapper = Mapper(**pair["originals"], manifest=dict(pair["mapper"].manifest))
    save_mapper(mapper, tmp_path, coefficient_dtype="bfloat16")
    loaded = _load(tmp_path, pair)
    assert loaded.manifest["coefficient_dtype"] == "bfloat16"
    for name in NAMES[:2]:
        assert torch.equal(getattr(loaded, name), pair["originals"][name])
    for name in NAMES[2:]:
        value, original = getattr(loaded, name), pair["originals"][name]
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value.float(), original, rtol=2**-8, atol=1e-30)
        assert torch.equal(value, original.to(torch.bfloat16))


def test_bfloat16_file_is_half_the_coefficient_bytes(pair, saved, tmp_path):
    mapper = Mapper(**pair["originals"], manifest=dict(pair["mapper"].manifest))
    save_mapper(mapper, tmp_path, coefficient_dtype="bfloat16")
    coefficient_bytes = sum(pair["originals"][name].numel() * 4 for name in NAMES[2:])
    saving = (saved / TENSOR_FILE).stat().st_size - (tmp_path / TENSOR_FILE).stat().st_size
    assert saving == coefficient_bytes // 2


def test_unknown_coefficient_dtype(pair, tmp_path):
    with pytest.raises(ValueError, match="coefficient_dtype"):
        save_mapper(Mapper(**pair["originals"], manifest={}), tmp_path, coefficient_dtype="float16")


def test_manifest_contents(pair, saved):
    manifest, mapper = _manifest(saved), pair["mapper"]
    source, target = pair["source"], pair["target"]
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["method"] == "local+uniform"
    assert manifest["support"] == "local"
    assert manifest["weighting"] == "uniform"
    assert manifest["k"] == 2
    assert manifest["source_layers"] == pair["originals"]["source_layers"].tolist()
    assert manifest["head_index"] == pair["originals"]["head_index"].tolist()
    assert manifest["lambda"] == 0.01
    calibration = manifest["calibration"]
    assert calibration["corpus_hash"] == corpus_hash(pair["ids"])
    assert (calibration["sequences"], calibration["seq_len"], calibration["stride"]) == (8, 32, 2)
    assert calibration["rows"] == 8 * 16
    assert manifest["source_fingerprint"] == fingerprint(source)
    assert manifest["target_fingerprint"] == fingerprint(target)
    assert manifest["source_fingerprint"] != manifest["target_fingerprint"]
    assert manifest["tokenizer_hash"] == pair["hash"]
    for role, model in (("source_kv", source), ("target_kv", target)):
        kv = describe_kv(model)
        assert manifest[role]["rope_parameters"] == kv.rope_parameters
        assert manifest[role]["num_kv_heads"] == kv.num_kv_heads
        assert manifest[role]["head_dim"] == kv.head_dim
    libraries = manifest["libraries"]
    assert libraries["torch"] == torch.__version__
    assert libraries["transformers"] == transformers.__version__
    assert libraries["safetensors"] == safetensors.__version__
    assert {"python", "cuda"} <= set(libraries)
    tensor_bytes = (saved / TENSOR_FILE).read_bytes()
    assert manifest["tensor_sha256"] == hashlib.sha256(tensor_bytes).hexdigest()
    assert manifest["tensor_bytes"] == len(tensor_bytes)
    assert manifest["coefficient_count"] == mapper.weight_k.numel() + mapper.weight_v.numel()
    kv_s, kv_t = describe_kv(source), describe_kv(target)
    assert (
        manifest["coefficient_count"] == 2 * kv_t.num_layers * kv_t.num_kv_heads * (2 * kv_s.head_dim) * kv_t.head_dim
    )
    assert manifest["shapes"] == {name: list(t.shape) for name, t in pair["originals"].items()}
    # save_mapper leaves the manifest it wrote on the mapper (tuples there, lists in JSON)
    assert json.loads(json.dumps(mapper.manifest, default=str)) == manifest


# ---------------------------------------------------------------- refusals


def _truncate(directory):
    path = directory / TENSOR_FILE
    path.write_bytes(path.read_bytes()[:-17])


def _flip_byte(directory):
    path = directory / TENSOR_FILE
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(**changes):
    def edit(directory):
        _write_manifest(directory, dict(_manifest(directory), **changes))

    return edit


def _edit_shape(directory):
    manifest = _manifest(directory)
    manifest["shapes"]["weight_k"][2] += 1
    _write_manifest(directory, manifest)


CORRUPTIONS = {
    "missing manifest": (lambda d: (d / POINTER / VERSION_MANIFEST).unlink(), "incomplete: .*mapper.json is missing"),
    "missing tensors": (lambda d: (d / POINTER / TENSOR_FILE).unlink(), "incomplete: .*mapper.safetensors is missing"),
    "manifest not json": (lambda d: _write_manifest(d, b'{"schema_version": 1,'), "not valid JSON"),
    "wrong schema": (_edit_manifest(schema_version=SCHEMA_VERSION + 1), f"schema_version {SCHEMA_VERSION + 1}"),
    "no schema": (_edit_manifest(schema_version=None), "schema_version None"),
    "truncated tensors": (_truncate, "corrupt or was replaced: sha256"),
    "empty tensors": (lambda d: (d / TENSOR_FILE).write_bytes(b""), "corrupt or was replaced"),
    "flipped byte": (_flip_byte, "corrupt or was replaced: sha256"),
    "edited shape": (_edit_shape, r"tensor 'weight_k' missing or of the wrong shape"),
    "unknown tensor": (
        lambda d: _edit_manifest(shapes=dict(_manifest(d)["shapes"], weight_q=[1]))(d),
        r"unexpected \['weight_q'\]",
    ),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_damaged_artifact_refused(pair, artifact, corruption):
    damage, message = CORRUPTIONS[corruption]
    damage(artifact)
    with pytest.raises(ArtifactError, match=message):
        _load(artifact, pair)
    with pytest.raises(ArtifactError, match=message):
        load_mapper(artifact)


def test_flipped_coefficient_is_not_silently_loaded(pair, artifact):
    """The flipped byte lies in the coefficients: without the sha256 check it would load as a different value."""
    _flip_byte(artifact)
    tensors = load_file(artifact / TENSOR_FILE)
    assert any(not torch.equal(tensors[name], pair["originals"][name]) for name in NAMES)
    with pytest.raises(ArtifactError):
        _load(artifact, pair)


@pytest.mark.parametrize(
    "field, message",
    [
        ("source_fingerprint", "source fingerprint"),
        ("target_fingerprint", "target fingerprint"),
        ("tokenizer_hash", "tokenizer hash"),
    ],
)
def test_other_pair_refused(pair, saved, field, message):
    wrong = "0" * 64
    with pytest.raises(ArtifactError, match=f"fitted for another model pair: {message} .* this pair's {wrong[:12]}"):
        _load(saved, pair, **{field: wrong})


def test_swapped_models_refused(pair, saved):
    with pytest.raises(ArtifactError, match="source fingerprint"):
        load_mapper(saved, source_fingerprint=fingerprint(pair["target"]))
    with pytest.raises(ArtifactError, match="target fingerprint"):
        load_mapper(saved, target_fingerprint=fingerprint(pair["source"]))


def test_manifest_missing_a_shape_refused(pair, artifact):
    manifest = _manifest(artifact)
    del manifest["shapes"]["bias_v"]
    _write_manifest(artifact, manifest)
    with pytest.raises(ArtifactError, match="bias_v"):
        _load(artifact, pair)


def test_manifest_not_an_object_refused(pair, artifact):
    _write_manifest(artifact, b"[1, 2, 3]")
    with pytest.raises(ArtifactError, match="holds a JSON list, not a manifest object"):
        _load(artifact, pair)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: dict(m, calibration=dict(m["calibration"], seq_len=10**6)),  # past the length guard's reach
        lambda m: dict(m, source_fingerprint="0" * 64),
        lambda m: m,  # the same contents re-serialized: other bytes, another sha256
    ],
    ids=["calibration-length", "fingerprint", "reformatted"],
)
def test_a_manifest_edited_after_its_save_is_refused(pair, artifact, edit):
    """The version id is the sha256 of the manifest bytes: an edit in place (which would still load: every field is
    consistent with the tensors) is refused, naming the version directory and both digests."""
    version = (artifact / POINTER).resolve()
    manifest = edit(_manifest(artifact))
    _edit_in_place(artifact, manifest)
    edited = hashlib.sha256((version / VERSION_MANIFEST).read_bytes()).hexdigest()
    assert edited != version.name
    for load in (lambda: _load(artifact, pair, source_fingerprint=None), lambda: load_mapper(artifact)):
        with pytest.raises(ArtifactError, match=f"{version}: the manifest was changed after it was saved") as caught:
            load()
        assert f"sha256 {edited} ≠ the version id {version.name}" in str(caught.value)


# ---------------------------------------------------------------- binding to models


def test_transfer_binds_only_its_pair(pair, saved):
    loaded = _load(saved, pair)
    source, target, token_hash = pair["source"], pair["target"], pair["hash"]
    transfer = KVTransfer(loaded, source, target, token_hash)
    other = tiny("qwen2", seed=2)
    with pytest.raises(TransferError, match="source fingerprint"):
        KVTransfer(loaded, other, target, token_hash)
    with pytest.raises(TransferError, match="target fingerprint"):
        KVTransfer(loaded, source, other, token_hash)
    with pytest.raises(TransferError, match="source fingerprint"):
        KVTransfer(loaded, target, source, token_hash)
    with pytest.raises(TransferError, match="tokenizer hash"):
        KVTransfer(loaded, source, target, "f" * 64)
    # the reloaded artifact maps a cache exactly like the in-memory mapper it was saved from
    cache = prefill(source, pair["ids"][:1, :12])
    fresh = KVTransfer(Mapper(**pair["originals"], manifest=pair["mapper"].manifest), source, target, token_hash)
    mapped, reference = transfer(cache), fresh(cache)
    assert len(mapped.layers) == describe_kv(target).num_layers
    for layer, expected in zip(mapped.layers, reference.layers, strict=True):
        assert layer.keys.shape == (1, 2, 12, 16)
        assert torch.equal(layer.keys, expected.keys) and torch.equal(layer.values, expected.values)


# ---------------------------------------------------------------- layout (issue 11)


def _rewrite_version(directory, manifest: dict, tensor_bytes: bytes) -> None:
    """A consistent artifact of other contents (the manifest records the new bytes' sha256)."""
    manifest = dict(manifest, tensor_sha256=hashlib.sha256(tensor_bytes).hexdigest(), tensor_bytes=len(tensor_bytes))
    publish(directory, json.dumps(manifest).encode(), tensor_bytes)


def test_flat_layout_of_older_artifacts_still_loads(pair, saved, tmp_path):
    for name in (MANIFEST_FILE, TENSOR_FILE):
        shutil.copyfile(saved / name, tmp_path / name)  # the two files only, no pointer
    assert artifact_exists(tmp_path) and not (tmp_path / POINTER).exists()
    loaded = _load(tmp_path, pair)
    assert all(torch.equal(getattr(loaded, name), pair["originals"][name]) for name in NAMES)
    save_mapper(loaded, tmp_path)  # a re-save converts it in place
    assert (tmp_path / POINTER).is_symlink() and (tmp_path / MANIFEST_FILE).is_symlink()
    assert _load(tmp_path, pair).manifest == loaded.manifest


def test_copied_artifact_loads(pair, saved, tmp_path):
    """shutil.copytree follows the symlinks by default: the copy is plain files and still loads."""
    copy = shutil.copytree(saved, tmp_path / "copy")
    assert not (copy / POINTER).is_symlink() and not (copy / MANIFEST_FILE).is_symlink()
    assert _load(copy, pair).manifest == _manifest(saved)
    _edit_in_place(copy, dict(_manifest(copy), source_fingerprint="0" * 64))  # what a load reads is what is shown
    with pytest.raises(ArtifactError, match="source fingerprint 000000000000"):
        _load(copy, pair)
    mapper = _load(saved, pair)
    save_mapper(mapper, copy)  # and a save over the copy restores the layout
    assert (copy / POINTER).is_symlink() and _load(copy, pair).manifest == mapper.manifest


def test_same_content_saved_again_and_a_damaged_version_replaced(pair, artifact):
    version = (artifact / POINTER).resolve()
    mapper = _load(artifact, pair)
    _flip_byte(artifact)
    with pytest.raises(ArtifactError, match="corrupt or was replaced"):
        _load(artifact, pair)
    manifest = mapper.manifest
    save_mapper(mapper, artifact)  # same bytes → same version id: the damaged copy is replaced
    assert (artifact / POINTER).resolve() == version and mapper.manifest == manifest
    assert torch.equal(_load(artifact, pair).weight_v, pair["originals"]["weight_v"])


def test_tensor_dtype_other_than_the_manifest_says_refused(pair, artifact):
    tensors = {name: t.contiguous() for name, t in pair["originals"].items()}
    tensors["head_index"] = tensors["head_index"].to(torch.int32)
    _rewrite_version(artifact, _manifest(artifact), save(tensors))
    with pytest.raises(ArtifactError, match=r"tensor 'head_index' is torch\.int32, the manifest implies torch\.int64"):
        _load(artifact, pair)


def test_unknown_coefficient_dtype_in_manifest_refused(pair, artifact):
    _rewrite_version(
        artifact, dict(_manifest(artifact), coefficient_dtype="float16"), (artifact / TENSOR_FILE).read_bytes()
    )
    with pytest.raises(ArtifactError, match="coefficient_dtype 'float16' is not one of"):
        _load(artifact, pair)


def test_bytes_that_are_not_safetensors_refused(pair, artifact):
    _rewrite_version(artifact, _manifest(artifact), b"\xff" * 64)  # hash matches, contents unreadable
    with pytest.raises(ArtifactError, match="is not a readable safetensors file"):
        _load(artifact, pair)
