"""Calibration traces: the same token ids through both models → content-space K/V rows per layer/head.

Rows are every `stride`-th position of each calibration sequence (paper: 500 × 1,024 tokens, s = 4 →
128,000 rows). Only sampled rows are kept, one batch of sequences is in flight at a time, and the
target's Attn-Repair sensitivities (Eqs. 14–16) are reduced to one scalar per row while the batch's
queries are still at hand.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from src.models import KVInterface, check_model, describe_kv
from src.rope import apply_rope, remove_rope, rope_cos_sin


@dataclass
class Traces:
    """Aligned content-space K/V rows of both models. n = sequences × rows per sequence."""

    source_k: torch.Tensor  # [L_s, H_s, n, d_s]
    source_v: torch.Tensor  # [L_s, H_s, n, d_s]
    target_k: torch.Tensor  # [L_t, H_t, n, d_t]
    target_v: torch.Tensor  # [L_t, H_t, n, d_t]
    sequence_index: torch.Tensor  # [n] which calibration sequence each row came from
    position: torch.Tensor  # [n] token position of each row inside its sequence
    attn_k: torch.Tensor | None = None  # [L_t, H_t, n] raw r^K (Eq. 16), boundary-normalized and summed
    attn_v: torch.Tensor | None = None  # [L_t, H_t, n] raw r^V (Eq. 15)
    mix: torch.Tensor | None = None  # [L_t, H_t, S, t, t] the target's attention between each sequence's t rows
    meta: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.source_k.shape[2]

    def select_rows(self, index: torch.Tensor) -> Traces:
        take = lambda t: None if t is None else t.index_select(-2 if t.dim() == 4 else -1, index.to(t.device))
        mix = None
        if self.mix is not None:  # rows are sequence-major, t per sequence: only whole sequences keep their mixing
            t = self.mix.shape[-1]
            sequences = torch.unique_consecutive(index // t)
            if not torch.equal(index, (sequences[:, None] * t + torch.arange(t, device=index.device)).flatten()):
                raise ValueError("traces with attention mixing can only be cut into whole sequences")
            mix = self.mix.index_select(2, sequences.to(self.mix.device))
        return Traces(
            source_k=take(self.source_k),
            source_v=take(self.source_v),
            target_k=take(self.target_k),
            target_v=take(self.target_v),
            sequence_index=self.sequence_index[index],
            position=self.position[index],
            attn_k=take(self.attn_k),
            attn_v=take(self.attn_v),
            mix=mix,
            meta=dict(self.meta, rows=int(index.numel())),
        )

    def to(self, device: str | torch.device) -> Traces:
        move = lambda t: None if t is None else t.to(device)
        fields = ("source_k", "source_v", "target_k", "target_v", "attn_k", "attn_v", "mix")
        return Traces(
            **{name: move(getattr(self, name)) for name in fields},
            sequence_index=self.sequence_index,
            position=self.position,
            meta=self.meta,
        )

    def split_heldout(self, fraction: float) -> tuple[Traces, Traces]:
        """Fit rows / held-out rows, split by whole sequences (the last `fraction` of them)."""
        sequences = int(self.sequence_index.max()) + 1
        first_heldout = sequences - max(1, round(sequences * fraction))
        if first_heldout < 1:
            raise ValueError(f"need ≥ 2 calibration sequences to hold some out, have {sequences}")
        heldout = self.sequence_index >= first_heldout
        return self.select_rows(torch.nonzero(~heldout)[:, 0]), self.select_rows(torch.nonzero(heldout)[:, 0])


_TENSORS = ("source_k", "source_v", "target_k", "target_v", "sequence_index", "position", "attn_k", "attn_v", "mix")


def save_traces(traces: Traces, path: str | Path) -> None:
    """traces → <path>.safetensors + <path>.json (meta), for reuse across k, λ and support changes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(traces, name).contiguous() for name in _TENSORS if getattr(traces, name) is not None}
    save_file(tensors, path.with_suffix(".safetensors"))
    path.with_suffix(".json").write_text(json.dumps(traces.meta, indent=2))


def load_traces(path: str | Path) -> Traces | None:
    """Traces saved by `save_traces`, or None when there are none at this path."""
    path = Path(path)
    if not (path.with_suffix(".safetensors").is_file() and path.with_suffix(".json").is_file()):
        return None
    tensors = load_file(path.with_suffix(".safetensors"))
    return Traces(
        **{name: tensors.get(name) for name in _TENSORS}, meta=json.loads(path.with_suffix(".json").read_text())
    )


def corpus_hash(sequences: torch.Tensor) -> str:
    """sha256 of the calibration token ids [N, T] (int64), the identity of a calibration set."""
    return hashlib.sha256(sequences.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


def log_boundaries(seq_len: int, count: int, first: int) -> list[int]:
    """Attn-Repair boundaries: `count` log-spaced positions from `first` to T−1 (paper: 32 from 12)."""
    if seq_len - 1 <= first:
        return [seq_len - 1]
    return sorted({int(round(c)) for c in np.geomspace(first, seq_len - 1, count)})


def content_kv(model: PreTrainedModel, kv: KVInterface, cache, positions: torch.Tensor):
    """Per layer (content keys, values), each [B, H, T, d]: cached keys with the model's RoPE removed."""
    cos, sin = rope_cos_sin(model.model.rotary_emb, positions)
    return [(remove_rope(layer.keys, cos, sin, kv.rope_layout), layer.values) for layer in cache.layers]


class QueryCapture:
    """Forward hooks that keep each layer's pre-RoPE query states [B, H_q, T, d] for one forward pass."""

    def __init__(self, model: PreTrainedModel, kv: KVInterface):
        self.kv, self.queries, self.handles = kv, {}, []
        for layer_idx, layer in enumerate(model.model.layers):
            attention = layer.self_attn
            module = attention.q_norm if kv.qk_norm else attention.q_proj
            self.handles.append(module.register_forward_hook(self._hook(layer_idx)))

    def _hook(self, layer_idx: int):
        def keep(module, inputs, output):
            batch, seq = output.shape[0], output.shape[1]
            self.queries[layer_idx] = output.reshape(batch, seq, self.kv.num_q_heads, self.kv.head_dim).transpose(1, 2)

        return keep

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def attention_sensitivity(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    boundaries: list[int],
    eligible: torch.Tensor,
    softmax_scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Attn-Repair weights for one target layer, r^K and r^V: [B, H_kv, T].

    query [B, H_q, T, d] and key [B, H_kv, T, d] carry RoPE; value [B, H_kv, T, d]; eligible [T] bool
    marks sampled positions. At each boundary c the first future query (position c) attends causally
    to 0..c (to c−window+1..c with a sliding `window`, as the model does); sensitivities of eligible prefix
    positions i < c get unit mass per (head, component, boundary), and boundaries are summed with equal mass.
    """
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    c = torch.tensor(boundaries, device=query.device)
    q = query[:, :, c].float()  # [B, H_q, C, d]
    k = key.float().repeat_interleave(group, dim=1)  # [B, H_q, T, d]
    v = value.float().repeat_interleave(group, dim=1)  # [B, H_q, T, d]
    positions = torch.arange(key.shape[2], device=query.device)
    causal = positions[None, :] <= c[:, None]  # [C, T]
    if window is not None:
        causal &= positions[None, :] > c[:, None] - window
    scores = (q @ k.transpose(-1, -2)) * softmax_scale  # [B, H_q, C, T]
    a = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [B, H_q, C, T]
    o = a @ v  # [B, H_q, C, d]
    v_minus_o = (v * v).sum(-1)[:, :, None, :] - 2 * (o @ v.transpose(-1, -2)) + (o * o).sum(-1)[..., None]
    q_norm = (q * q).sum(-1, keepdim=True) * softmax_scale**2  # [B, H_q, C, 1]  ‖q_u‖²/d
    r_v = (a * a).unflatten(1, (kv_heads, group)).sum(2)  # [B, H_kv, C, T]  Eq. 15
    r_k = (a * a * v_minus_o.clamp_min(0) * q_norm).unflatten(1, (kv_heads, group)).sum(2)  # Eq. 16
    mask = (eligible[None, :] & (positions[None, :] < c[:, None])).float()  # [C, T] eligible prefix
    per_boundary = lambda r: r * mask / (r * mask).sum(-1, keepdim=True).clamp_min(torch.finfo(r.dtype).tiny)
    return per_boundary(r_k).sum(2), per_boundary(r_v).sum(2)  # [B, H_kv, T]


def attention_mixing(
    query: torch.Tensor,
    key: torch.Tensor,
    stride: int,
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """How the target mixes the sampled rows' values: [B, H_kv, t, t], t = ⌈T / stride⌉ (fit.v_space=attention).

    query [B, H_q, T, d] and key [B, H_kv, T, d] carry RoPE. Each sampled query row (positions 0, s, 2s, …) attends
    causally as the model does (the window too); a key position's weight goes to the sampled row that opens its
    block of `stride` positions, and the query heads of a KV head are averaged. Rows sum to 1, lower-triangular:
    Σ_s M_ts·v_s is the attention output at row t with each block's value represented by its sampled row."""
    batch, q_heads, length, _ = query.shape
    kv_heads = key.shape[1]
    sampled = torch.arange(0, length, stride, device=query.device)  # [t]
    positions = torch.arange(length, device=query.device)
    causal = positions[None, :] <= sampled[:, None]  # [t, T]
    if window is not None:
        causal &= positions[None, :] > sampled[:, None] - window
    k = key.float().repeat_interleave(q_heads // kv_heads, dim=1)  # [B, H_q, T, d]
    scores = (query[:, :, sampled].float() @ k.transpose(-1, -2)) * softmax_scale  # [B, H_q, t, T]
    a = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    pooled = a.new_zeros(batch, q_heads, sampled.numel(), sampled.numel()).index_add_(-1, positions // stride, a)
    return pooled.unflatten(1, (kv_heads, -1)).mean(2)  # [B, H_kv, t, t]


@torch.no_grad()
def collect_traces(
    source: PreTrainedModel,
    target: PreTrainedModel,
    sequences: torch.Tensor,
    stride: int,
    batch_size: int,
    storage_dtype: torch.dtype = torch.float32,
    attention_boundaries: int = 0,
    first_boundary: int = 12,
    storage_device: str = "cpu",
    mixing: bool = False,
) -> Traces:
    """Run calibration ids [N, T] through both models and keep every `stride`-th position's K/V.

    attention_boundaries > 0 also computes the target's raw Attn-Repair sensitivities; mixing=True the target's
    attention between the sampled rows of each sequence (`attention_mixing`, for fit.v_space=attention). Sliding-window models (the
    `allow_sliding_window` opt-in) work at any length: the forward keeps every position's K/V (a full cache; the
    attention mask stays the model's own) and the sensitivities use the window. Models no map can serve (hybrid
    layers, MLA, per-layer-type RoPE, unsupported families) are refused up front (IncompatiblePairError).
    """
    source_kv, target_kv = describe_kv(source), describe_kv(target)
    check_model(source_kv, "source", allow_sliding_window=True)
    check_model(target_kv, "target", allow_sliding_window=True)
    num_sequences, seq_len = sequences.shape
    sampled = torch.arange(0, seq_len, stride)
    eligible = torch.zeros(seq_len, dtype=torch.bool)
    eligible[sampled] = True
    boundaries = log_boundaries(seq_len, attention_boundaries, first_boundary) if attention_boundaries else []
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in ("sk", "sv", "tk", "tv", "ak", "av", "mix")}
    capture = QueryCapture(target, target_kv) if boundaries or mixing else None
    try:
        for start in tqdm(range(0, num_sequences, batch_size), desc="calibration traces", unit="batch"):
            ids = sequences[start : start + batch_size]
            positions = torch.arange(seq_len)
            roles = ((source, source_kv, ("sk", "sv"), False), (target, target_kv, ("tk", "tv"), True))
            for model, kv, keys, is_target in roles:  # source and target may be one model (self-transfer)
                device = next(model.parameters()).device
                # a cache of full layers keeps all T positions even for a sliding-window model (its own cache
                # would keep the last window − 1 only); the attention itself is unchanged
                cache = model(
                    ids.to(device), use_cache=True, past_key_values=DynamicCache(), logits_to_keep=1
                ).past_key_values  # K/V only: no logits over the whole vocabulary per position
                layers = content_kv(model, kv, cache, positions.to(device))
                for name, index in zip(keys, (0, 1), strict=True):
                    rows = torch.stack([layer[index][:, :, sampled.to(device)] for layer in layers])  # [L, B, H, t, d]
                    parts[name].append(rows.permute(0, 2, 1, 3, 4).flatten(2, 3).to(storage_device, storage_dtype))
                if capture is not None and is_target:
                    cos, sin = rope_cos_sin(target.model.rotary_emb, positions.to(device))
                    queries = [apply_rope(capture.queries[i], cos, sin, kv.rope_layout) for i in range(len(layers))]
                    scale, window = kv.attention_softmax_scale, kv.sliding_window
                    if mixing:
                        mixes = [
                            attention_mixing(q, layer.keys, stride, scale, window)
                            for q, layer in zip(queries, cache.layers, strict=True)
                        ]
                        parts["mix"].append(torch.stack(mixes).to(storage_device, storage_dtype))  # [L_t, B, H_t, t, t]
                if boundaries and is_target:
                    per_layer = [
                        attention_sensitivity(
                            q, layer.keys, layer.values, boundaries, eligible.to(device), scale, window
                        )
                        for q, layer in zip(queries, cache.layers, strict=True)
                    ]
                    for name, index in (("ak", 0), ("av", 1)):
                        r = torch.stack(
                            [pair[index][:, :, sampled.to(device)] for pair in per_layer]
                        )  # [L_t, B, H_t, t]
                        parts[name].append(r.transpose(1, 2).flatten(2).cpu())  # [L_t, H_t, B·t]
    finally:
        if capture is not None:
            capture.close()
    rows_per_sequence = sampled.numel()
    return Traces(
        source_k=torch.cat(parts["sk"], dim=2),
        source_v=torch.cat(parts["sv"], dim=2),
        target_k=torch.cat(parts["tk"], dim=2),
        target_v=torch.cat(parts["tv"], dim=2),
        sequence_index=torch.arange(num_sequences).repeat_interleave(rows_per_sequence),
        position=sampled.repeat(num_sequences),
        attn_k=torch.cat(parts["ak"], dim=2).double() if boundaries else None,
        attn_v=torch.cat(parts["av"], dim=2).double() if boundaries else None,
        mix=torch.cat(parts["mix"], dim=1).transpose(1, 2).contiguous() if mixing else None,  # [L_t, H_t, N, t, t]
        meta={
            "sequences": num_sequences,
            "seq_len": seq_len,
            "stride": stride,
            "rows": num_sequences * rows_per_sequence,
            "corpus_hash": corpus_hash(sequences),
            "attention_boundaries": boundaries,
            "mixing": mixing,
        },
    )
