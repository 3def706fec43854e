"""vLLM's paged KV blocks: where a token's K/V live, how kvrelay reads them (the sender's export) and writes them (the
receiver's mapped span).

Every attention layer holds one tensor, logically `[num_blocks, num_kv_heads, block_size, 2·head_size]` in vLLM
0.26 and 0.32 (its physical stride order may differ: FlashAttention's NHD). A token at position p of a request sits
in slot `block_ids[p // block_size] · block_size + p % block_size`. Inside a (block, head) the backends differ:

    flash   FlashAttention (GPU): the last dim splits per token, K = [..., :d], V = [..., d:]
            (`kv.transpose(1, 2).split(d, -1)` in `FlashAttentionImpl.do_kv_cache_update`)
    cpu     vLLM's CPU backend (ISA vec / vec16): the (block, head) is 2·block_size·d contiguous elements; the first
            half holds K channel-major, [d, block_size]; the second V token-major, [block_size, d]
            (read off `ops.cpu_attn_reshape_and_cache` on x86 for fp32 / bf16 / fp16 and d = 32, 64, 128: the
            "all K rows, then all V rows" reading of the view `[2·block_size, d]` holds for V only)

`write_mapped` is the one function that puts mapped K/V into a receiver's blocks: it hands them to each layer's own
cache writer (`layer.impl.do_kv_cache_update`, what vLLM calls for freshly computed tokens), so the layout, the
ISA variant and an FP8 cache's scales are the backend's by construction. `read_slots` / `write_slots_ref` are the
pure-torch layouts: the sender reads its export through the first, the tests compare the backend's writer with the
second, and `check_layout` verifies a reader against the live backend once per engine (an unknown layout is refused
before serving, never misread).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = {"FLASH_ATTN": "flash", "CPU_ATTN": "cpu"}  # vLLM attention backend name → the layout kvrelay reads


def layout_of(layer: torch.nn.Module) -> str:
    """The layout of an attention layer's paged cache, from its backend; a ValueError for a backend kvrelay does
    not read."""
    name = layer.attn_backend.get_name()
    if name not in LAYOUTS:
        raise ValueError(
            f"attention backend {name} has a paged layout kvrelay does not read (known: {sorted(LAYOUTS)})"
        )
    return LAYOUTS[name]


def slots_for(
    block_ids: Sequence[int], block_size: int, start: int, end: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Slots [end − start] (int64, on `device`) of positions start..end−1 of a request whose blocks are `block_ids`
    (computed there: one id per block crosses from the host, not one slot per token)."""
    positions = torch.arange(start, end, device=device)  # [n]
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)[positions // block_size]  # [n]
    return blocks * block_size + positions % block_size


def _cpu_halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU layout's K [B, H, d, N] and V [B, H, N, d] views of kv [B, H, N, 2d] (B blocks of N slots)."""
    blocks, heads, size, width = kv.shape
    d = width // 2
    region = kv.view(blocks, heads, 2 * size * d)  # [B, H, 2·N·d]
    return region[..., : size * d].view(blocks, heads, d, size), region[..., size * d :].view(blocks, heads, size, d)


def read_slots(kv: torch.Tensor, slots: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [n, H, d] of one layer's paged cache kv [B, H, N, 2d] at slots [n]."""
    size, d = kv.shape[2], kv.shape[3] // 2
    slots = slots.to(kv.device)
    block, offset = slots // size, slots % size  # [n]
    if layout == "flash":
        rows = kv[block, :, offset]  # [n, H, 2d]
        return rows[..., :d], rows[..., d:]
    keys, values = _cpu_halves(kv)
    return keys[block, :, :, offset], values[block, :, offset]  # [n, H, d] each


def write_slots_ref(
    kv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, layout: str
) -> None:
    """Pure-torch write of keys / values [n, H, d] into kv [B, H, N, 2d] at slots [n] — what the backend's own
    cache writer does (the reference `write_mapped` is tested against)."""
    size, d = kv.shape[2], kv.shape[3] // 2
    slots = slots.to(kv.device)
    block, offset = slots // size, slots % size  # [n]
    if layout == "flash":
        kv[block, :, offset, :d] = keys.to(kv.dtype)
        kv[block, :, offset, d:] = values.to(kv.dtype)
        return
    key_half, value_half = _cpu_halves(kv)
    key_half[block, :, :, offset] = keys.to(kv.dtype)
    value_half[block, :, offset] = values.to(kv.dtype)


def write_mapped(
    layers: Sequence[torch.nn.Module], keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write mapped keys / values [L, n, H, d] (one entry per layer of `layers`, this worker's heads) into the paged
    blocks at slots [n] through each layer's own cache writer (module docstring). No host sync."""
    slots = slots.to(keys.device)
    for layer, k, v in zip(layers, keys, values, strict=True):
        cache = layer.kv_cache
        layer.impl.do_kv_cache_update(
            layer, k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous(), cache, slots
        )


def check_layout(layer: torch.nn.Module) -> str:
    """The layer's layout, verified: random K/V written into a one-block copy of its cache by the backend's own
    writer must read back bit for bit through `read_slots`. A ValueError otherwise (a backend or ISA whose layout
    kvrelay would misread: refused before serving)."""
    layout = layout_of(layer)
    cache = layer.kv_cache
    scratch = cache[:1].clone()  # [1, H, N, 2d], the cache's strides
    heads, size, d = cache.shape[1], cache.shape[2], cache.shape[3] // 2
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(size, heads, d, generator=generator).to(cache.device, cache.dtype) for _ in range(2))
    slots = torch.arange(size, device=cache.device)
    layer.impl.do_kv_cache_update(layer, keys, values, scratch, slots)
    read = read_slots(scratch, slots, layout)
    if not (torch.equal(read[0], keys) and torch.equal(read[1], values)):
        isa = getattr(layer, "isa", getattr(layer.impl, "isa", "?"))
        raise ValueError(
            f"the {layer.attn_backend.get_name()} backend (isa {isa}, {cache.dtype}) stores K/V in a layout kvrelay "
            f"does not read ({layout!r} expected): refusing to serve handoffs on it"
        )
    return layout
