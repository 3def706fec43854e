"""A model directory's fingerprint without loading the model: its safetensors files read one tensor at a time.

`streamed_identity(path, dtype)` gives exactly `fingerprint(load_model(path, dtype))` (src/models.py) — the config
hash of a skeleton built from the config on the meta device, as `load_model` builds it before its weights arrive, and
`tensors_hash` over that skeleton's state-dict names, each tensor read from the files and cast as transformers casts
it on load (to the skeleton tensor's dtype) — holding only the tensors being hashed in memory. A tied name the files
lack (`lm_head.weight` under `tie_word_embeddings`) is the one tensor of its group the files hold, as transformers
ties it. Wherever the files do not match the skeleton with certainty — a missing or unexpected tensor, a key the model
renames or converts on load, a shape that differs, dtype rules kept per module, no safetensors — it raises
`NotStreamable` naming why, and the caller loads the model instead; it never guesses a fingerprint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from src.models import config_hash, identity_hash, tensors_hash

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"  # the order transformers looks for them


class NotStreamable(ValueError):
    """The files cannot be matched to the model with certainty; the message says why (load the model instead)."""


def skeleton(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model `load_model(path, dtype)` builds before its weights arrive, on the meta device (no memory), with its
    rotary module built for real on the CPU from the config (as the loaded model recomputes it)."""
    config = AutoConfig.from_pretrained(Path(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    rotary = model.model.rotary_emb
    with torch.device("cpu"):
        model.model.rotary_emb = type(rotary)(config=rotary.config)
    return model.eval()


def _files(path: Path) -> list[Path]:
    """The safetensors files `from_pretrained` reads: the single file, else every shard the index names."""
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    if (path / INDEX).is_file():
        shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    raise NotStreamable(f"{path} has no {SINGLE} or {INDEX}")


def _located(path: Path, model: PreTrainedModel) -> dict[str, tuple[Path, str]]:
    """State-dict name → (file, key in that file) for every tensor the files hold; every key must load under its own
    name (no renaming or conversion on load) and appear once."""
    expected = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    located = {}
    for file in _files(path):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                renamed, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
                if key in expected and renamed not in expected:
                    renamed, converter = key, None  # transformers keeps a key the model has (core_model_loading)
                if renamed != key or converter is not None:
                    raise NotStreamable(f"{file.name}: {key} is renamed or converted on load (→ {renamed})")
                if key not in expected:
                    raise NotStreamable(f"{file.name}: {key} is not a tensor of the model")
                if key in located:
                    raise NotStreamable(f"{key} is in both {located[key][0].name} and {file.name}")
                located[key] = (file, key)
    return located


def _sources(model: PreTrainedModel, located: dict[str, tuple[Path, str]]) -> dict[str, tuple[Path, str]]:
    """Every state-dict name → where its value comes from: its own file tensor, or — for a tied name the files lack —
    the one tensor of its tie group they hold (transformers ties symmetrically on load)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    sources = {}
    for names in groups.values():
        present = [name for name in names if name in located]
        for name in names:
            if name in located:
                sources[name] = located[name]
            elif len(present) == 1:
                sources[name] = located[present[0]]
            else:
                tied = f" (tied in {names}, of which they hold {present})" if len(names) > 1 else ""
                raise NotStreamable(f"the files lack {name}{tied}")
    return sources


def streamed_identity(path: Path, dtype: torch.dtype, model: PreTrainedModel | None = None) -> str:
    """`fingerprint(load_model(path, dtype))` from the files, one tensor at a time (module docstring); `model`: the
    directory's `skeleton` when the caller has built it. Raises NotStreamable."""
    path = Path(path)
    model = skeleton(path, dtype) if model is None else model
    if model._keep_in_fp32_modules or model._keep_in_fp32_modules_strict:
        raise NotStreamable(f"{type(model).__name__} keeps modules in float32 by its own dtype rules")
    expected = model.state_dict()
    sources = _sources(model, _located(path, model))

    def tensor(name: str) -> torch.Tensor:
        file, key = sources[name]
        with safe_open(file, framework="pt") as handle:
            value = handle.get_slice(key)
            if tuple(value.get_shape()) != tuple(expected[name].shape):
                raise NotStreamable(f"{key} has shape {value.get_shape()}, the model {tuple(expected[name].shape)}")
            return value[...].to(dtype=expected[name].dtype)

    return identity_hash(config_hash(model), tensors_hash(expected, tensor, min(4, os.cpu_count() or 1)))
