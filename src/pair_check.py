"""A mapper checked against its pair before anything maps: who each model is (`ModelView`: fingerprint, KV interface,
rotary module — from a loaded model, or from its directory without the weights, src/serving/routes.py), the pair
checks that `KVTransfer` (src/apply.py) and the vLLM connector's routes share (`check_pair`), and the mapper as a
transfer applies it (`bound_mapper`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from src.artifact import Mapper
from src.maps import TransferError, check_mapper
from src.models import IncompatiblePairError, KVInterface, check_model, describe_kv, fingerprint
from src.rope import rope_cos_sin


@dataclass(frozen=True)
class ModelView:
    """What a mapper is checked against on one side of its pair: the model's fingerprint, KV interface and rotary
    module — from a loaded model (`of`), or from its directory without its weights (src/serving/routes.py)."""

    fingerprint: str
    kv: KVInterface
    rotary: torch.nn.Module

    @staticmethod
    def of(model: PreTrainedModel) -> ModelView:
        return ModelView(fingerprint(model), describe_kv(model), model.model.rotary_emb)


def check_pair(mapper: Mapper, source: ModelView, target: ModelView, tokenizer_hash: str) -> None:
    """Verify the artifact against both models: fingerprints and tokenizer hash against its manifest, each model's
    cache mappable (what load_pair checks, minus the sliding-window opt-in, decided there) with a usable rotary module,
    and everything the mapper carries (`check_mapper`). A refusal is a TransferError naming what differs."""
    if not isinstance(mapper, Mapper) or not isinstance(mapper.manifest, dict):
        raise TransferError(f"mapper is a {type(mapper).__name__} without a manifest dict, not a Mapper")
    manifest = mapper.manifest
    for what, recorded, actual in (
        ("source fingerprint", manifest.get("source_fingerprint"), source.fingerprint),
        ("target fingerprint", manifest.get("target_fingerprint"), target.fingerprint),
        ("tokenizer hash", manifest.get("tokenizer_hash"), tokenizer_hash),
    ):
        if recorded != actual:
            raise TransferError(f"mapper does not belong to this pair: {what} {str(recorded)[:12]} ≠ {actual[:12]}")
    for role, view in (("source", source), ("target", target)):
        try:
            check_model(view.kv, role, allow_sliding_window=True)
            rope_cos_sin(view.rotary, torch.arange(1))
        except (IncompatiblePairError, ValueError) as error:
            raise TransferError(f"{role} model cannot be mapped: {error}") from error
    check_mapper(mapper, source.kv, target.kv)


def bound_mapper(mapper: Mapper, device: torch.device | str, compute_dtype: torch.dtype) -> Mapper:
    """The mapper as a transfer applies it: coefficients in `compute_dtype`, int64 indices, on `device`."""
    bound = mapper.to(device, compute_dtype)
    bound.source_layers, bound.head_index = bound.source_layers.long(), bound.head_index.long()
    return bound
