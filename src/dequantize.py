"""A GGUF checkpoint de-quantized to a float32 safetensors HF directory through transformers, checked by greedy decoding
(src/fetch.py drives it).

Two gaps in transformers' GGUF tokenizer conversion are closed on the way: the GGUF's ``add_bos_token`` /
``add_eos_token`` flags are applied, and the saved tokenizer is pinned to load its ``tokenizer.json`` verbatim.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

PROMPT = "def fibonacci(n):"
GREEDY_TOKENS = 8


def dequantize(source: Path, out_dir: Path, name: str) -> dict[str, Any]:
    """Load the GGUF ``source``, save it float32 to ``out_dir``, reload it and check that greedy decoding of
    :data:`PROMPT` gives the same token ids; returns what was checked (dtype, tokenizer flags, library versions,
    greedy ids, load seconds). ``name`` labels the progress lines and errors."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.models import dtype_name

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    apply_gguf_bos_eos(tokenizer, source)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    gguf_load_s = time.perf_counter() - t0
    tqdm.write(f"{name}: loaded GGUF in {gguf_load_s:.1f} s ({model.num_parameters():,} params)")
    gguf_ids = greedy_ids(model, tokenizer)

    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    pin_tokenizer_json(out_dir)
    del model

    t0 = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
    reload_s = time.perf_counter() - t0
    reloaded_ids = greedy_ids(reloaded, AutoTokenizer.from_pretrained(out_dir))
    tqdm.write(
        f"{name}: reloaded safetensors in {reload_s:.1f} s; greedy ids gguf={gguf_ids} "
        f"reloaded={reloaded_ids} text={tokenizer.decode(reloaded_ids)!r}"
    )
    if gguf_ids != reloaded_ids:
        raise RuntimeError(f"{name}: greedy ids changed by save/reload: {gguf_ids} != {reloaded_ids}")
    return {
        "dtype": dtype_name(reloaded.dtype),
        "tokenizer": {
            "converted_as": type(tokenizer).__name__,
            "add_bos_token": tokenizer.add_bos_token,
            "add_eos_token": tokenizer.add_eos_token,
        },
        "versions": {pkg: importlib.metadata.version(pkg) for pkg in ("transformers", "torch", "gguf")},
        "greedy_check": {"prompt": PROMPT, "ids": reloaded_ids},
        "load_seconds": {"gguf": round(gguf_load_s, 1), "safetensors": round(reload_s, 1)},
    }


def apply_gguf_bos_eos(tokenizer: Any, source: Path) -> None:
    """Honour ``tokenizer.ggml.add_{bos,eos}_token``, which transformers' GGUF converter ignores.

    Gemma 3 sets ``add_bos_token``; without the ``<bos>`` it was trained with, it generates noise.
    """
    from gguf import GGUFReader

    fields = GGUFReader(source).fields
    for flag in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{flag}")
        if field is not None and bool(field.contents()) != getattr(tokenizer, flag):
            setattr(tokenizer, flag, bool(field.contents()))  # the setter rebuilds the post-processor


def pin_tokenizer_json(directory: Path) -> None:
    """Make ``AutoTokenizer.from_pretrained(directory)`` load the saved ``tokenizer.json`` verbatim.

    A model-specific class (``GemmaTokenizer``, ...) rebuilds its backend from the vocabulary as a BPE; the
    Unigram vocabulary converted from a Gemma GGUF has no merges, so it would tokenize per character.
    """
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "TokenizersBackend"
    path.write_text(json.dumps(config, indent=2) + "\n")


def greedy_ids(model: Any, tokenizer: Any) -> list[int]:
    """Prompt ids followed by a greedy continuation of exactly :data:`GREEDY_TOKENS` tokens."""
    import torch

    inputs = tokenizer(PROMPT, return_tensors="pt")
    pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=pad_id
        )
    return out[0].tolist()
