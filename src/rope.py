"""RoPE codec: take a model's rotation off cached keys (content space) and put another model's on.

cos/sin always come from the model's own rotary module, so every scaling type (linear, dynamic,
llama3, YaRN, longrope) and the `attention_scaling` factor that YaRN/longrope fold into cos/sin are
exact. Only the leading `rope_dim` channels of each head rotate (partial rotary); the rest pass through.
"""

from __future__ import annotations

import torch


def rope_cos_sin(rotary_emb: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [B, 1, T, rope_dim] in float32 for positions [B, T] (or [T]), attention_scaling included."""
    inv_freq = getattr(rotary_emb, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):  # Gemma 3: `{layer_type}_inv_freq`, forward(x, positions, layer_type)
        raise ValueError(
            f"{type(rotary_emb).__name__} has no single `inv_freq` table (one per layer type, Gemma-3 style): "
            "per-layer-type RoPE is not supported (load_pair, KVTransfer and collect_traces refuse such models)"
        )
    if positions.dim() == 1:
        positions = positions[None]
    anchor = torch.empty(0, dtype=torch.float32, device=inv_freq.device)
    cos, sin = rotary_emb(anchor, positions.to(anchor.device))  # [B, T, rope_dim]
    return cos[:, None].float(), sin[:, None].float()


DYNAMIC_ROPE = ("dynamic", "longrope")  # rope types whose tables depend on the longest position a call holds


class RopeTable:
    """A rotary module's cos, sin for positions start..start+n−1 as views of one table of positions 0..N−1, grown
    (doubling, on the module's device) when a span reaches past it — a handoff's per-call RoPE without a rotary
    forward: the same values, since every entry is one product inv_freq · position and its cos / sin. Rope types whose
    tables depend on the call's longest position (`DYNAMIC_ROPE`) compute per call, as `rope_cos_sin`. Its memory:
    2 · N · rope_dim float32 (N the longest position mapped, rounded up by doubling; 32 MiB at 32K for rope_dim 128)."""

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary = rotary_emb
        self.static = getattr(rotary_emb, "rope_type", "default") not in DYNAMIC_ROPE
        self._cos = self._sin = None  # [1, 1, N, rope_dim] float32

    def at(self, start: int, count: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, count, rope_dim] float32 of positions start..start+count−1 (`rope_cos_sin`'s)."""
        if not self.static:
            return rope_cos_sin(self.rotary, torch.arange(start, start + count, device=device))
        end = start + count
        if self._cos is None or self._cos.shape[2] < end:
            size = max(end, 2 * (0 if self._cos is None else self._cos.shape[2]), 1024)
            self._cos, self._sin = rope_cos_sin(self.rotary, torch.arange(size, device=device))
        return self._cos[:, :, start:end], self._sin[:, :, start:end]


def rotate(x: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """The 90° partner of each rotated pair: rotate_half for "half", (-x2, x1) per pair for "interleaved"."""
    if layout == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))  # [..., rope_dim/2, 2]
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def _interleave(cos: torch.Tensor, layout: str) -> torch.Tensor:
    """HF builds cos as cat(freqs, freqs); the interleaved layout repeats each frequency in place."""
    if layout == "half":
        return cos
    half = cos[..., : cos.shape[-1] // 2]
    return half.repeat_interleave(2, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """x: [B, H, T, head_dim] content keys → rotated keys, computed in float32, returned in x.dtype."""
    rope_dim = cos.shape[-1]
    cos, sin = _interleave(cos, layout), _interleave(sin, layout)
    rotated, passthrough = x[..., :rope_dim].float(), x[..., rope_dim:]
    out = rotated * cos + rotate(rotated, layout) * sin  # RoFormer rotation, scaled by attention_scaling
    return torch.cat((out.to(x.dtype), passthrough), dim=-1)


def remove_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Exact inverse of `apply_rope`: R(θ)ᵀ / (cos² + sin²), which also divides out attention_scaling²."""
    rope_dim = cos.shape[-1]
    cos, sin = _interleave(cos, layout), _interleave(sin, layout)
    rotated, passthrough = x[..., :rope_dim].float(), x[..., rope_dim:]
    out = (rotated * cos - rotate(rotated, layout) * sin) / (cos * cos + sin * sin)
    return torch.cat((out.to(x.dtype), passthrough), dim=-1)
