"""Fault injection on mapper persistence (issue 11): two processes saving to one path at once, a load racing a
save, and SIGKILL during a save — at every publishing step and at random times, repeated. Every load must return a
complete artifact whose manifest and tensors come from one and the same save, or refuse clearly; a killed re-save
must leave the previous good artifact loadable; leftovers of killed saves are swept by the next good save.

Each writer's tensors are a deterministic function of its tag, and its manifest names the tag, so a mix of two
saves shows as a tag whose tensors differ. Children are forked (torch stays imported, one thread each)."""

import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import src.artifact_store
from src.artifact import ArtifactError, Mapper, load_mapper, save_mapper
from src.artifact_store import LOAD_ATTEMPTS, POINTER, STAGING, VERSIONS, artifact_exists

FORK = multiprocessing.get_context("fork")
SHAPE = (4, 2, 128, 64)  # [L_t, H_t, p, d_t]: 256 KiB per weight tensor in float32


def _tensors(tag: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(tag)
    layers, heads, _, d = SHAPE
    return {
        "source_layers": torch.full((layers, 1), tag % layers, dtype=torch.int64),
        "head_index": torch.arange(heads)[:, None],
        "weight_k": torch.randn(SHAPE, generator=generator),
        "bias_k": torch.randn(layers, heads, d, generator=generator),
        "weight_v": torch.randn(SHAPE, generator=generator),
        "bias_v": torch.randn(layers, heads, d, generator=generator),
    }


def _mapper(tag: int, round_: int = 0) -> Mapper:
    return Mapper(**_tensors(tag), manifest={"writer": tag, "round": round_})


def _assert_whole(mapper: Mapper, tags) -> int:
    """The loaded artifact is one save of a writer in `tags`: its tensors are that writer's. Returns the tag."""
    tag = mapper.manifest["writer"]
    assert tag in tags, mapper.manifest
    for name, expected in _tensors(tag).items():
        assert torch.equal(getattr(mapper, name), expected), f"{name} of writer {tag} mixed with another save"
    return tag


def _load_or_contention(directory: Path) -> Mapper | None:
    """A load; None when it was refused only because saves kept replacing the artifact (a clear refusal)."""
    try:
        return load_mapper(directory)
    except ArtifactError as refusal:
        assert f"replaced {LOAD_ATTEMPTS} times" in str(refusal), refusal  # never corrupt, never incomplete
        return None


def _assert_swept(directory: Path) -> None:
    """After a good save: one version, no staging entries anywhere."""
    assert len(list((directory / VERSIONS).iterdir())) == 1, sorted(os.listdir(directory / VERSIONS))
    assert not [entry for entry in os.listdir(directory) if entry.startswith(STAGING)]


def _save_loop(directory: str, tag: int, rounds: int) -> None:
    torch.set_num_threads(1)
    for round_ in range(rounds):
        save_mapper(_mapper(tag, round_), directory)


# ---------------------------------------------------------------- concurrent writers, racing readers


def _race(directory: Path, rounds: int) -> tuple[int, set]:
    save_mapper(_mapper(0), directory)
    writers = [FORK.Process(target=_save_loop, args=(str(directory), tag, rounds)) for tag in (1, 2)]
    for writer in writers:
        writer.start()
    loads, seen = 0, set()
    while any(writer.is_alive() for writer in writers):
        mapper = _load_or_contention(directory)
        if mapper is not None:
            seen.add(_assert_whole(mapper, (0, 1, 2)))
        loads += 1
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    assert _assert_whole(load_mapper(directory), (1, 2)) in (1, 2)  # the last writer won, whole
    _assert_swept(directory)
    return loads, seen


def test_two_processes_saving_concurrently_never_mix(tmp_path):
    loads, seen = _race(tmp_path / "artifact", rounds=12)
    assert loads > 0 and seen


@pytest.mark.slow
def test_two_processes_saving_concurrently_never_mix_long(tmp_path):
    loads, seen = _race(tmp_path / "artifact", rounds=200)
    assert seen >= {1, 2}, (loads, seen)


def test_a_save_between_a_loads_reads_never_mixes(tmp_path, monkeypatch):
    """Deterministic interleaving: a save (of the other writer) lands right after each of the first reads a load
    makes; the load returns one whole save, never one save's manifest with another's tensors."""
    directory = tmp_path / "artifact"
    save_mapper(_mapper(1), directory)
    read_bytes, saves = Path.read_bytes, []

    def read_then_save(path: Path) -> bytes:
        data = read_bytes(path)
        names = (src.artifact_store.MANIFEST_FILE, src.artifact_store.VERSION_MANIFEST, src.artifact_store.TENSOR_FILE)
        if path.name in names and len(saves) < 3:
            saves.append(path.name)
            save_mapper(_mapper(1 + len(saves) % 2, len(saves)), directory)  # writers 2, 1, 2
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_save)
    loaded = load_mapper(directory)
    monkeypatch.undo()
    assert len(saves) == 3 and _assert_whole(loaded, (1, 2))
    assert loaded.manifest == load_mapper(directory).manifest  # the load returned the newest save


# ---------------------------------------------------------------- SIGKILL during a save

STEPS = ("fsync", "rename", "replace", "symlink")  # os functions a save calls between its publishing steps


def _count_steps(directory: Path, monkeypatch) -> int:
    """Publishing calls of a re-save (the stable names already exist)."""
    save_mapper(_mapper(1), directory)
    calls = []
    for name in STEPS:
        original = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    save_mapper(_mapper(2, 99), directory)
    monkeypatch.undo()
    return len(calls)


def _save_killed_at(directory: str, step: int) -> None:
    """Save writer 2, SIGKILLed right before its `step`-th publishing call (0: right away, mid-serialization)."""
    torch.set_num_threads(1)
    calls = []

    def kill_at(original):
        def call(*args, **kwargs):
            calls.append(1)
            if len(calls) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return call

    for name in STEPS:
        setattr(os, name, kill_at(getattr(os, name)))
    save_mapper(_mapper(2, step), directory)


def test_sigkill_at_every_publishing_step_keeps_an_artifact_loadable(tmp_path, monkeypatch):
    steps = _count_steps(tmp_path / "probe", monkeypatch)
    assert steps >= 6  # 2 file fsyncs, staging fsync, rename, versions fsync, pointer symlink + replace, ...
    directory = tmp_path / "artifact"
    save_mapper(_mapper(1), directory)
    outcomes = []
    for step in range(1, steps + 1):
        child = FORK.Process(target=_save_killed_at, args=(str(directory), step))
        child.start()
        child.join()
        assert child.exitcode == -signal.SIGKILL, (step, child.exitcode)
        outcomes.append(_assert_whole(load_mapper(directory), (1, 2)))  # the old save or the new one, whole
        assert artifact_exists(directory)
    assert outcomes[0] == 1 and 2 in outcomes  # killed before publishing: the old one; late enough: the new one
    save_mapper(_mapper(1, 1000), directory)  # a good save sweeps what the killed ones left
    _assert_swept(directory)
    assert _assert_whole(load_mapper(directory), (1,)) == 1


def _kill_at_random_times(tmp_path: Path, rounds: int, seed: int) -> None:
    directory = tmp_path / "artifact"
    save_mapper(_mapper(1), directory)
    began = time.perf_counter()
    save_mapper(_mapper(1, 1), tmp_path / "timing")
    duration = time.perf_counter() - began
    shutil.rmtree(tmp_path / "timing")
    chooser = random.Random(seed)
    for round_ in range(rounds):
        child = FORK.Process(target=_save_loop, args=(str(directory), 2, 1_000_000))
        child.start()
        time.sleep(chooser.uniform(0, 3 * duration))
        child.kill()
        child.join()
        assert child.exitcode == -signal.SIGKILL, round_
        _assert_whole(load_mapper(directory), (1, 2))
    save_mapper(_mapper(1, 2000), directory)
    _assert_swept(directory)


def test_sigkill_at_random_times_repeated(tmp_path):
    _kill_at_random_times(tmp_path, rounds=6, seed=0)


@pytest.mark.slow
def test_sigkill_at_random_times_repeated_long(tmp_path):
    _kill_at_random_times(tmp_path, rounds=100, seed=1)


# ---------------------------------------------------------------- layout


def test_layout_pointer_and_stable_names(tmp_path):
    directory = tmp_path / "artifact"
    assert not artifact_exists(directory)
    for round_ in range(3):
        save_mapper(_mapper(3, round_), directory)
    assert (directory / POINTER).is_symlink() and os.readlink(directory / POINTER).startswith(f"{VERSIONS}/")
    for name in (src.artifact_store.MANIFEST_FILE, src.artifact_store.TENSOR_FILE):
        assert (directory / name).is_symlink() and (directory / name).is_file()
    assert artifact_exists(directory)
    _assert_swept(directory)
    assert load_mapper(directory).manifest["round"] == 2
