"""Calibration traces: the same token ids through both models → content-space K/V rows per layer/head.

Rows are every `stride`-th position of each calibration sequence (paper: 500 × 1,024 tokens, s = 4 →
128,000 rows). Only sampled rows are kept, one batch of sequences is in flight at a time, and the
target's Attn-Repair sensitivities (Eqs. 14–16) are reduced to one scalar per row while the batch's
queries are still at hand.

Long calibration sequences (conf/budget/paper_2k|4k|8k) stream: each batch is read in chunks of ⌊ATTENTION_TILE / T⌋
tokens (one chunk up to T = 1,024), so an eager attention's scores [B, H, chunk, T] never exceed B·H·ATTENTION_TILE
elements whatever T; only the queries the statistics read are kept (at the boundaries, at the sampled rows for the
mixing), RoPE is removed at the sampled rows only, and the mixing's scores are taken in blocks of query rows of the
same size. What grows with T is the batch's KV cache, which the forward itself needs, and the statistics.
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

ATTENTION_TILE = 1 << 20  # query × key positions of one chunk's attention scores (module docstring)


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
    """Forward hooks that keep each layer's pre-RoPE query states [B, H_q, T, d] for one forward pass — or, with
    `keep` (ascending positions [K]), only those positions' [B, H_q, K, d], gathered over a sequence read in chunks
    (`offset`: the position of the chunk being read; clear `queries` before the next sequence)."""

    def __init__(self, model: PreTrainedModel, kv: KVInterface, keep: torch.Tensor | None = None):
        self.kv, self.keep, self.offset, self.queries, self.handles = kv, keep, 0, {}, []
        for layer_idx, layer in enumerate(model.model.layers):
            attention = layer.self_attn
            module = attention.q_norm if kv.qk_norm else attention.q_proj
            self.handles.append(module.register_forward_hook(self._hook(layer_idx)))

    def _hook(self, layer_idx: int):
        def keep(module, inputs, output):
            batch, seq = output.shape[0], output.shape[1]
            states = output.reshape(batch, seq, self.kv.num_q_heads, self.kv.head_dim).transpose(1, 2)  # [B, H_q, n, d]
            if self.keep is None:
                self.queries[layer_idx] = states
                return
            inside = self.keep[(self.keep >= self.offset) & (self.keep < self.offset + seq)] - self.offset
            kept = states[:, :, inside.to(states.device)]  # [B, H_q, k, d] a copy: the chunk's states are let go
            held = self.queries.get(layer_idx)
            self.queries[layer_idx] = kept if held is None else torch.cat([held, kept], dim=2)

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

    query [B, H_q, C, d] (the queries at the C boundaries) and key [B, H_kv, T, d] carry RoPE; value [B, H_kv, T, d]; eligible [T] bool
    marks sampled positions. At each boundary c the first future query (position c) attends causally
    to 0..c (to c−window+1..c with a sliding `window`, as the model does); sensitivities of eligible prefix
    positions i < c get unit mass per (head, component, boundary), and boundaries are summed with equal mass.
    """
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    c = torch.tensor(boundaries, device=query.device)
    q = query.float()  # [B, H_q, C, d]
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

    query [B, H_q, t, d] (the queries at the sampled rows 0, s, 2s, …) and key [B, H_kv, T, d] carry RoPE. Each
    sampled query row attends causally as the model does (the window too); a key position's weight goes to the
    sampled row that opens its block of `stride` positions, and the query heads of a KV head are averaged. Rows sum
    to 1, lower-triangular: Σ_s M_ts·v_s is the attention output at row t with each block's value represented by its
    sampled row. The scores are taken for ⌊ATTENTION_TILE / T⌋ query rows at a time."""
    batch, q_heads, rows, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    sampled = torch.arange(0, length, stride, device=query.device)  # [t]
    positions = torch.arange(length, device=query.device)
    k = key.float().repeat_interleave(q_heads // kv_heads, dim=1)  # [B, H_q, T, d]
    block = max(1, ATTENTION_TILE // length)
    pooled = []
    for start in range(0, rows, block):
        at = sampled[start : start + block]  # [r]
        causal = positions[None, :] <= at[:, None]  # [r, T]
        if window is not None:
            causal &= positions[None, :] > at[:, None] - window
        scores = (query[:, :, start : start + block].float() @ k.transpose(-1, -2)) * softmax_scale  # [B, H_q, r, T]
        a = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        part = a.new_zeros(batch, q_heads, at.numel(), rows).index_add_(-1, positions // stride, a)  # [B, H_q, r, t]
        pooled.append(part.unflatten(1, (kv_heads, -1)).mean(2))  # [B, H_kv, r, t]
    return torch.cat(pooled, dim=2)  # [B, H_kv, t, t]


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
    chunk_tokens: int | None = None,
) -> Traces:
    """Run calibration ids [N, T] through both models and keep every `stride`-th position's K/V.

    attention_boundaries > 0 also computes the target's raw Attn-Repair sensitivities; mixing=True the target's
    attention between the sampled rows of each sequence (`attention_mixing`, for fit.v_space=attention). Each batch is
    read `chunk_tokens` at a time (None: ⌊ATTENTION_TILE / T⌋, module docstring); the statistics do not depend on it
    beyond float rounding. Sliding-window models (the `allow_sliding_window` opt-in) work at any length: the forward
    keeps every position's K/V (a full cache; the attention mask stays the model's own) and the sensitivities use the
    window. Models no map can serve (hybrid layers, MLA, per-layer-type RoPE, unsupported families) are refused up
    front (IncompatiblePairError).
    """
    source_kv, target_kv = describe_kv(source), describe_kv(target)
    check_model(source_kv, "source", allow_sliding_window=True)
    check_model(target_kv, "target", allow_sliding_window=True)
    num_sequences, seq_len = sequences.shape
    chunk = max(1, ATTENTION_TILE // seq_len) if chunk_tokens is None else chunk_tokens
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_tokens must be a token count ≥ 1 or None, not {chunk_tokens!r}")
    sampled = torch.arange(0, seq_len, stride)
    eligible = torch.zeros(seq_len, dtype=torch.bool)
    eligible[sampled] = True
    boundaries = log_boundaries(seq_len, attention_boundaries, first_boundary) if attention_boundaries else []
    keep = torch.tensor(sorted(set(boundaries) | (set(sampled.tolist()) if mixing else set())), dtype=torch.long)
    at_boundaries = torch.searchsorted(keep, torch.tensor(boundaries, dtype=torch.long))  # their queries in `keep`
    at_sampled = torch.searchsorted(keep, sampled) if mixing else None
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in ("sk", "sv", "tk", "tv", "ak", "av", "mix")}
    capture = QueryCapture(target, target_kv, keep) if boundaries or mixing else None
    try:
        for start in tqdm(range(0, num_sequences, batch_size), desc="calibration traces", unit="batch"):
            ids = sequences[start : start + batch_size]
            roles = ((source, source_kv, ("sk", "sv"), False), (target, target_kv, ("tk", "tv"), True))
            for model, kv, keys, is_target in roles:  # source and target may be one model (self-transfer)
                device = next(model.parameters()).device
                if capture is not None:
                    capture.queries.clear()  # this batch's (a self-transfer's source read fired the hooks too)
                # a cache of full layers keeps all T positions even for a sliding-window model (its own cache
                # would keep the last window − 1 only); the attention itself is unchanged. K/V only: no logits over
                # the whole vocabulary per position
                cache = DynamicCache()
                for offset in range(0, seq_len, chunk):
                    if capture is not None:
                        capture.offset = offset
                    chunk_ids = ids[:, offset : offset + chunk].to(device)  # [B, chunk]
                    model(chunk_ids, use_cache=True, past_key_values=cache, logits_to_keep=1)
                at = sampled.to(device)
                cos, sin = rope_cos_sin(model.model.rotary_emb, at)  # RoPE removed at the sampled rows only
                content = (
                    torch.stack(
                        [remove_rope(layer.keys[:, :, at], cos, sin, kv.rope_layout) for layer in cache.layers]
                    ),
                    torch.stack([layer.values[:, :, at] for layer in cache.layers]),
                )  # K, V [L, B, H, t, d]
                for name, rows in zip(keys, content, strict=True):
                    parts[name].append(rows.permute(0, 2, 1, 3, 4).flatten(2, 3).to(storage_device, storage_dtype))
                if capture is not None and is_target:
                    cos, sin = rope_cos_sin(target.model.rotary_emb, keep.to(device))
                    queries = [
                        apply_rope(capture.queries[i], cos, sin, kv.rope_layout) for i in range(len(cache.layers))
                    ]
                    scale, window = kv.attention_softmax_scale, kv.sliding_window  # queries: [B, H_q, K, d] at `keep`
                    if mixing:
                        mixes = [
                            attention_mixing(q[:, :, at_sampled.to(device)], layer.keys, stride, scale, window)
                            for q, layer in zip(queries, cache.layers, strict=True)
                        ]
                        parts["mix"].append(torch.stack(mixes).to(storage_device, storage_dtype))  # [L_t, B, H_t, t, t]
                if boundaries and is_target:
                    per_layer = [
                        attention_sensitivity(
                            q[:, :, at_boundaries.to(device)],
                            layer.keys,
                            layer.values,
                            boundaries,
                            eligible.to(device),
                            scale,
                            window,
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
