"""Load or build the two models, describe their KV interface, fingerprint them, check a pair.

Every other stage reads model differences from `KVInterface`, never from a model name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "architectures",
)


class IncompatiblePairError(ValueError):
    """The source and target models cannot exchange KV caches; the message names what differs."""


@dataclass(frozen=True)
class KVInterface:
    """What a KV cache of this model looks like, read from its config and modules."""

    family: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    rope_parameters: dict
    rope_dim: int  # leading dims of each head that RoPE rotates (partial rotary < head_dim)
    rope_layout: str  # "half" (rotate_half, HF Llama family) or "interleaved"
    attention_scaling: float  # factor folded into cos/sin by the rotary module (YaRN, longrope)
    attention_softmax_scale: float  # the `scaling` of q·k in the attention module
    qk_norm: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    kv_lora_rank: int | None  # MLA latent rank; None for ordinary GQA

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as configs and records spell it ("bfloat16"; `getattr(torch, name)` reads it back)."""
    return str(dtype).removeprefix("torch.")


def build_random_model(
    config: dict,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "eager",
) -> PreTrainedModel:
    """A random-weight model from a config dict (`model_type` + overrides), initialized on `device`.
    Timing, memory and plumbing only, never quality."""
    fields = dict(config)
    model_type = fields.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", attn_implementation: str = "eager"
) -> PreTrainedModel:
    """A pretrained model from a local directory (never the hub)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (expected config.json there); see scripts/fetch_models.py")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def describe_kv(model: PreTrainedModel) -> KVInterface:
    """Read the KV interface of a decoder-only RoPE model from its config and first attention module."""
    config = model.config.get_text_config(decoder=True)
    attention = model.model.layers[0].self_attn
    rotary = model.model.rotary_emb
    num_q_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    layer_types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    uniform_window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or (
        getattr(config, "layer_types", None) is not None and "sliding_attention" not in layer_types
    ):
        uniform_window = None
    # hybrid models (Gemma 3) keep one frequency table per layer type: describe the first layer's
    prefix = "" if hasattr(rotary, "inv_freq") else f"{layer_types[0]}_"
    inv_freq, attention_scaling = getattr(rotary, f"{prefix}inv_freq"), getattr(rotary, f"{prefix}attention_scaling")
    return KVInterface(
        family=config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        rope_parameters=dict(config.rope_parameters),
        rope_dim=int(inv_freq.numel() * 2),
        rope_layout="half",
        attention_scaling=float(attention_scaling),
        attention_softmax_scale=float(attention.scaling),
        qk_norm=hasattr(attention, "k_norm"),
        layer_types=layer_types,
        sliding_window=uniform_window,
        kv_lora_rank=getattr(config, "kv_lora_rank", None),
    )


def config_hash(model: PreTrainedModel) -> str:
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _tensor_digest(item: tuple[str, torch.Tensor]) -> bytes:
    name, tensor = item
    digest = hashlib.sha256(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.digest()


def tensors_hash(names: Iterable[str], tensor: Callable[[str], torch.Tensor], workers: int) -> str:
    """sha256 over the per-tensor sha256 (name, dtype, shape, bytes) of each named tensor, in name order; `tensor`
    gives one by name and is called in `workers` parallel threads (hashlib releases the GIL), so at most `workers`
    tensors it makes are alive at once."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = pool.map(lambda name: _tensor_digest((name, tensor(name))), sorted(names))
        return hashlib.sha256(b"".join(digests)).hexdigest()


def weight_hash(model: PreTrainedModel) -> str:
    """`tensors_hash` of every parameter and buffer of the state dict, so 30B-class models take seconds."""
    state = model.state_dict()
    return tensors_hash(state, state.__getitem__, min(16, os.cpu_count() or 1))


def identity_hash(config: str, weights: str) -> str:
    """A fingerprint from a config hash and a weight hash."""
    return hashlib.sha256((config + weights).encode()).hexdigest()


CHECKSUM_WORDS = 1 << 12  # int32 words per row of the checksum matrix


@functools.cache
def _odd_words(count: int, seed: int, device: torch.device) -> torch.Tensor:
    """`count` fixed pseudo-random odd int32 weights on `device` (odd: invertible mod 2³²)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32, generator=generator) | 1).to(device)


def _row_hash(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """words [R, C] int32 · weights [C] → [R], wrapping mod 2³². CPU: one int32 GEMV; elsewhere (no integer
    GEMV on CUDA) a product and a sum per block of 4,096 rows (64 MiB of temporaries at most)."""
    if words.device.type == "cpu":
        return words @ weights
    return torch.cat([(block * weights).sum(-1, dtype=torch.int32) for block in words.split(1 << 12)])


def content_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A random linear hash mod 2³² of the tensor's bytes, computed on its own device: Σᵢⱼ xᵢⱼ·rⱼ·sᵢ over its
    bytes read as int32 words x [R, C] (odd fixed weights r, s). Any change of one word always changes it; any
    other change is missed with probability ≈ 2⁻³². Returns a 0-dim int32 tensor (no device sync)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes]
    if data.storage_offset() % 4:
        data = data.clone()
    block = 4 * CHECKSUM_WORDS
    full = data.numel() // block * block
    rows = [data[:full].view(torch.int32).view(-1, CHECKSUM_WORDS)]  # [R, C]
    if full < data.numel():  # the tail, zero-padded to one row (the shape is part of the probe)
        tail = torch.zeros(block, dtype=torch.uint8, device=data.device)
        tail[: data.numel() - full] = data[full:]
        rows.append(tail.view(torch.int32)[None])
    words = _odd_words(CHECKSUM_WORDS, 0, data.device)
    per_row = torch.cat([_row_hash(r, words) for r in rows])  # [R]
    count = 1 << max(per_row.numel() - 1, 0).bit_length()  # row weights cached per power of two
    return _row_hash(per_row[None], _odd_words(count, 1, data.device)[: per_row.numel()])[0]


def _probe(model: PreTrainedModel) -> tuple:
    """What the cached fingerprint is valid for: the config hash and every state tensor's name, dtype, shape,
    device and content checksum (one device sync for all of them)."""
    state = model.state_dict()
    sums = torch.stack([content_checksum(t).cpu() for t in state.values()]).tolist() if state else []
    described = [(name, str(t.dtype), tuple(t.shape), str(t.device)) for name, t in state.items()]
    return config_hash(model), tuple(zip(described, sums, strict=True))


def fingerprint(model: PreTrainedModel) -> str:
    """Identity of a model = sha256(config hash + weight hash). The full hash is cached on the model and reused
    only while a content checksum of every tensor (`content_checksum`, read on each call, on the tensor's device)
    is unchanged, so weights replaced or edited in any way (`load_state_dict`, `p.data = …`, `p.data.copy_(…)`,
    writes through numpy views) are noticed."""
    probe = _probe(model)
    cached = getattr(model, "_kvrelay_fingerprint", None)
    if cached is None or cached[0] != probe:
        digest = identity_hash(probe[0], weight_hash(model))
        model._kvrelay_fingerprint = cached = (probe, digest)
    return cached[1]


def tokenizer_hash(tokenizer) -> str:
    """sha256 of what decides token ids: vocab, merges, added tokens, normalizer, pre-tokenizer."""
    if hasattr(tokenizer, "backend_tokenizer"):
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        identity = {key: spec.get(key) for key in ("model", "added_tokens", "normalizer", "pre_tokenizer")}
    else:
        identity = {"vocab": sorted(tokenizer.get_vocab().items())}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def vocabulary_hash(model: PreTrainedModel) -> str:
    """Stand-in for a tokenizer hash when a random-weight model has no tokenizer: the vocab size only."""
    return hashlib.sha256(f"vocab_size={model.config.get_text_config().vocab_size}".encode()).hexdigest()


def check_model(kv: KVInterface, role: str, allow_sliding_window: bool = False) -> None:
    """Refuse a model whose cache cannot be mapped token by token (family, MLA, hybrid layers, sliding window
    unless allowed, unknown RoPE layout); `role` ("source" / "target") names it in the message."""
    if kv.family not in SUPPORTED_FAMILIES:
        raise IncompatiblePairError(
            f"{role} model family {kv.family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    if kv.kv_lora_rank is not None:
        raise IncompatiblePairError(f"{role} model uses latent (MLA) attention; its cache is not per-head K/V")
    kinds = set(kv.layer_types)
    if len(kinds) > 1:
        raise IncompatiblePairError(
            f"{role} model is hybrid ({sorted(kinds)}): per-layer cache kinds differ; not supported"
        )
    if (kinds != {"full_attention"} or kv.sliding_window is not None) and not allow_sliding_window:
        raise IncompatiblePairError(
            f"{role} model uses sliding-window attention (window {kv.sliding_window}): refused by default; "
            "set allow_sliding_window=true to map it (the target cache then keeps only the window)"
        )
    if kv.rope_layout not in ("half", "interleaved"):
        raise IncompatiblePairError(f"{role} model RoPE layout {kv.rope_layout!r} is unknown")


def check_compatible(
    source: KVInterface,
    target: KVInterface,
    source_tokenizer_hash: str,
    target_tokenizer_hash: str,
    allow_sliding_window: bool = False,
) -> None:
    """Refuse, before anything runs, a pair whose caches cannot be mapped token by token."""
    if source_tokenizer_hash != target_tokenizer_hash:
        raise IncompatiblePairError(
            f"tokenizers differ (source {source_tokenizer_hash[:12]} vs target {target_tokenizer_hash[:12]}): "
            "cross-model transfer needs identical token ids for the shared prefix"
        )
    check_model(source, "source", allow_sliding_window)
    check_model(target, "target", allow_sliding_window)


@dataclass
class Pair:
    """A source → target pair ready for transfer: models, the shared tokenizer (None if random), its hash."""

    source: PreTrainedModel
    target: PreTrainedModel
    tokenizer: object | None
    tokenizer_hash: str
    weights: str  # "real" or "random" — random weights are for timing only


def load_pair(
    source: dict,
    target: dict,
    weights: str,
    dtype: torch.dtype,
    device: str,
    allow_sliding_window: bool = False,
    attn_implementation: str = "eager",
) -> Pair:
    """Both models of a pair (each spec: `path` for real weights, `config` + `seed` for random), checked."""
    if weights == "random":
        models = [
            build_random_model(spec["config"], spec["seed"], dtype, device, attn_implementation)
            for spec in (source, target)
        ]
        tokenizer, hashes = None, [vocabulary_hash(model) for model in models]
    elif weights == "real":
        models = [load_model(spec["path"], dtype, device, attn_implementation) for spec in (source, target)]
        tokenizers = [load_tokenizer(spec["path"]) for spec in (source, target)]
        tokenizer, hashes = tokenizers[1], [tokenizer_hash(tok) for tok in tokenizers]
    else:
        raise ValueError(f"weights must be 'real' or 'random', not {weights!r}")
    check_compatible(describe_kv(models[0]), describe_kv(models[1]), *hashes, allow_sliding_window)
    return Pair(source=models[0], target=models[1], tokenizer=tokenizer, tokenizer_hash=hashes[1], weights=weights)
