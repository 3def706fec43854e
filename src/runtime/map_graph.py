"""A span's map replayed as one CUDA graph on the static engine (issue 33: the map's ≈ 94 launches from the host — per
layer gathers, GEMMs, RoPE, writes — become one replay and a few copies into the graph's inputs).

    route = span_route(n, graphs, transfer.token_features)   # the decision, as data: a bucket, or eager and why
    graphs = MapGraphs(blocks, scratch, largest, pool, True)   # one engine's graphs (src/runtime/engine.py map_span)
    flags = graphs.run(transfer, layers, start, end, route.bucket)

A span of n tokens is padded to its bucket b = `span_bucket(n)`: SPAN_BUCKETS holds four sizes per octave from 16 —
16, 20, 24, 28, 32, 40, … 65,536 — so b < 1.25 n for every n > 16 (b ≤ 16 below), and the 1K–16K histories take 17
graphs per mapper. Padding costs map work (≤ 25 % more rows); fewer buckets would pad more (two per octave: ≤ 1.5×),
more buckets capture more graphs for little (the map is ≈ linear in its rows). Spans above 65,536 map eagerly. The
bucket 64 is kept: the fused map's tile is 64 rows at ≤ 64 tokens, else 128 (kernels/apply_map.py `default_config`),
and every n shares its bucket's side of 64, so a padded map computes each real row with the same tile as the unpadded
one — bit for bit the same values (the torch backend's GEMMs on a GPU may pick another algorithm for more rows: equal
there to rounding).

The pad rows repeat the span's last token — its source K/V and its position — and write the engine's scratch slot,
which no query reads: the cache outside the span is untouched, and the flags (non-finite values, the largest |value|)
are the unpadded map's, as a repeated row holds no value the span does not. The inputs are copied into the graph's
static buffers (per transfer, sized to the largest bucket it has used, viewed by every bucket — the span's source
K/V once more, ≈ 200 MB at 16K tokens of a 0.5B source in bf16; kept while the engine is): token-major, so that a
span's rows are one contiguous prefix of every bucket's view — the source K/V by one stacking copy per component into
that prefix and one small copy of the last row into the pad rows (the map reads the view's strides: no further
copy), the positions and slots by one host → device copy (built on the host from ints: no device read). The graph
writes the engine's cache in place and its flags into one static tensor, copied out per run (a later replay of the
same graph — another piece, another handoff — must not change flags already returned).

The graphs share the engine's memory pool with its forward graphs: every graph of an engine runs on one stream,
never concurrently, and none reads another's pool memory (each graph's outputs are tensors held here or by the
engine, which no later capture can reuse) — the case PyTorch documents as safe in any replay order
(pytorch/pytorch#166975, as vLLM does). Without replay (`replay=False`: the CPU tests) `run` is the same padded map,
eagerly.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from src.apply import KVTransfer
from src.maps import MapFlags, TransferError


def span_buckets(low: int = 16, high: int = 65536, per_octave: int = 4) -> tuple[int, ...]:
    """Sizes low·2^k · (1 + j / per_octave), j < per_octave, up to `high`: consecutive ratios ≤ 1 + 1 / per_octave."""
    sizes, octave = [], low
    while octave < high:
        sizes += [octave + octave * j // per_octave for j in range(per_octave)]
        octave *= 2
    return (*sizes, high)


SPAN_BUCKETS = span_buckets()  # span lengths a map graph is captured for (module docstring)


def span_bucket(count: int, buckets: tuple[int, ...] = SPAN_BUCKETS) -> int | None:
    """The smallest bucket ≥ count ≥ 1, or None above the largest (the map runs eagerly)."""
    if count < 1:
        raise ValueError(f"a span maps ≥ 1 token, not {count}")
    return next((bucket for bucket in buckets if bucket >= count), None)


class SpanRoute(NamedTuple):
    """How one span's map runs on an engine, decided once (`span_route`): one replay of the graph of `bucket` rows,
    or eagerly (bucket None) for `reason`."""

    bucket: int | None
    reason: str


def span_route(count: int, graphs: bool, token_features: bool) -> SpanRoute:
    """The route of a span of `count` tokens: its bucket where the engine replays graphs and the map reads no ids (a
    token-feature mapper prefills target layer 0 from them: eager), else eager."""
    bucket = span_bucket(count)
    if not graphs:
        return SpanRoute(None, "the engine runs without CUDA graphs")
    if token_features:
        return SpanRoute(None, "a token-feature mapper prefills target layer 0 from the ids")
    if bucket is None:
        return SpanRoute(None, f"a span of {count} tokens is longer than the largest bucket {SPAN_BUCKETS[-1]}")
    return SpanRoute(bucket, f"one replay of the {bucket}-row graph")


class Static(NamedTuple):
    """A bucket's view of a transfer's static inputs (b rows): what the captured map reads."""

    keys: torch.Tensor  # [L_s, H_s, b, d_s] the span's source keys (RoPE'd), pad rows = its last row; token-major
    values: torch.Tensor  # [L_s, H_s, b, d_s]  (strides H_s·d_s, d_s, L_s·H_s·d_s, 1)
    index: torch.Tensor  # [2, b] long: positions, slots (pads: the scratch slot)


def padding(start: int, end: int, bucket: int, scratch: int) -> torch.Tensor:
    """[2, bucket] on the host: positions start..end − 1 then end − 1 repeated; slots the same then `scratch`."""
    count = end - start
    rows = torch.arange(bucket).clamp_(max=count - 1)  # [b]: the span row each row holds (pads: the last)
    slots = torch.where(torch.arange(bucket) < count, rows + start, scratch)  # [b]
    return torch.stack([rows + start, slots])


def fill(static: torch.Tensor, layers: list[torch.Tensor]) -> None:
    """Source layers [1, H_s, n, d_s] (n ≤ b) into a bucket's token-major view [L_s, H_s, b, d_s]: rows 0..n − 1 by
    one stacking copy into their contiguous prefix, rows n..b − 1 a copy of row n − 1."""
    rows = static.permute(2, 0, 1, 3)  # [b, L_s, H_s, d_s], contiguous
    count = layers[0].shape[2]
    torch.stack([layer[0].to(static.device).transpose(0, 1) for layer in layers], 1, out=rows[:count])  # [n, L_s, …]
    rows[count:].copy_(rows[count - 1 : count].expand_as(rows[count:]))  # the pad rows repeat the last


class MapGraphs:
    """One engine's span maps: a CUDA graph per (transfer, bucket, bound), captured on first use (`run`) or at
    start-up (`capture`), and each transfer's static inputs. blocks: the engine's cache as [L_t, 1, H_t, N + 1, d_t]
    views (`Engine.blocks`); scratch: the slot no query reads; largest: the largest bucket a span of the engine can
    take; pool: the engine's graph memory pool; replay: False maps the padded span eagerly instead (the CPU)."""

    def __init__(self, blocks: tuple[torch.Tensor, torch.Tensor], scratch: int, largest: int, pool, replay: bool):
        self.blocks, self.scratch, self.largest, self.pool, self.replay = blocks, scratch, largest, pool, replay
        self._inputs: weakref.WeakKeyDictionary[KVTransfer, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()
        self._graphs: weakref.WeakKeyDictionary[KVTransfer, dict] = weakref.WeakKeyDictionary()
        self.replays = 0  # graph replays so far (a record says whether the timed maps replayed)

    def buckets(self) -> tuple[int, ...]:
        """The buckets a span of this engine can take."""
        return tuple(bucket for bucket in SPAN_BUCKETS if bucket <= self.largest)

    def transfers(self) -> list[KVTransfer]:
        """The transfers mapped here so far (held weakly)."""
        return list(self._graphs)

    def _static(self, transfer: KVTransfer, bucket: int) -> Static:
        """The bucket's views of the transfer's static inputs, sized to the largest bucket asked for so far: a larger
        one reallocates them and drops the graphs that read the old ones (captured again on use; `capture` asks for
        the largest first)."""
        kv = transfer.source_kv
        shape = (bucket, kv.num_layers, kv.num_kv_heads, kv.head_dim)  # token-major: a span is a prefix of rows
        count = bucket * shape[1] * shape[2] * shape[3]
        if transfer not in self._inputs or self._inputs[transfer][0].numel() < count:
            self._graphs.pop(transfer, None)
            dtype = next(transfer.source.parameters()).dtype
            flat = [torch.zeros(count, dtype=dtype, device=transfer.device) for _ in range(2)]  # K, V
            self._inputs[transfer] = (*flat, torch.zeros(2 * bucket, dtype=torch.long, device=transfer.device))
        keys, values, index = self._inputs[transfer]
        view = lambda flat: flat[:count].view(shape).permute(1, 2, 0, 3)  # [L_s, H_s, b, d_s]
        return Static(view(keys), view(values), index[: 2 * bucket].view(2, bucket))

    def _map(self, transfer: KVTransfer, static: Static, bound: float | None) -> torch.Tensor:
        """The map of the static span into the engine's cache: its flags packed [2·L_s + 2·L_t] bool (source, target,
        beyond) in one tensor (what the graph captures)."""
        positions, slots = static.index
        flags = transfer.map_into(static.keys, static.values, positions, slots, *self.blocks, bound)
        return torch.cat([flags.source.reshape(-1), flags.target, flags.beyond])  # [2·L_s + 2·L_t]

    def _capture(self, transfer: KVTransfer, bucket: int, bound: float | None) -> tuple:
        """The graph of the bucket's map; its warm-up and capture write only the scratch slot."""
        static = self._static(transfer, bucket)
        static.index.fill_(self.scratch)  # positions (any ≥ 0) and slots: the scratch slot
        stream = torch.cuda.Stream(transfer.device)
        stream.wait_stream(torch.cuda.current_stream(transfer.device))
        with torch.cuda.stream(stream):  # compile the kernels and warm the allocator outside the capture
            for _ in range(2):
                self._map(transfer, static, bound)
        torch.cuda.current_stream(transfer.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            packed = self._map(transfer, static, bound)  # [2·L_s + 2·L_t]
        return graph, packed

    def capture(self, transfer: KVTransfer, bound: float | None = None) -> int:
        """Capture every bucket's graph of this transfer not captured yet (a server's start-up: no timed map pays a
        capture); returns how many (0 without graphs, or for a token-feature mapper, which maps eagerly)."""
        if not self.replay or transfer.token_features:
            return 0
        captured = 0
        with torch.inference_mode():
            for bucket in reversed(self.buckets()):  # the largest first: its static inputs serve every bucket
                if (bucket, bound) not in self._graphs.get(transfer, {}):
                    self._keep(transfer, bucket, bound)
                    captured += 1
        return captured

    def _keep(self, transfer: KVTransfer, bucket: int, bound: float | None) -> None:
        """Capture the bucket's graph and keep it (after `_static` may have dropped the transfer's older ones)."""
        captured = self._capture(transfer, bucket, bound)
        self._graphs.setdefault(transfer, {})[(bucket, bound)] = captured

    @torch.inference_mode()
    def run(
        self, transfer: KVTransfer, layers: list, start: int, end: int, bucket: int, bound: float | None = None
    ) -> MapFlags:
        """The map of source layers [(K, V) [1, H_s, n, d_s]] (n = end − start) into slots start..end − 1, padded to
        `bucket` rows: one replay of its graph (captured now on first use), or eagerly without graphs. Shapes, dtypes
        and devices are checked first (TransferError, nothing written); the values are not read."""
        batch, count = transfer.check_cache(layers)
        if batch != 1 or count != end - start or not count <= bucket <= self.largest:
            raise TransferError(f"a span map reads one conversation's {end - start} tokens into a bucket of ≤ "
                                f"{self.largest} rows: got batch {batch}, {count} tokens, bucket {bucket}")  # fmt: skip
        if self.replay and (bucket, bound) not in self._graphs.get(transfer, {}):
            self._keep(transfer, bucket, bound)
        static = self._static(transfer, bucket)
        static.index.copy_(padding(start, end, bucket, self.scratch), non_blocking=True)  # [2, b] from the host
        for component, target in enumerate((static.keys, static.values)):
            fill(target, [pair[component] for pair in layers])  # [L_s, H_s, b, d_s]
        if not self.replay:
            packed = self._map(transfer, static, bound)
        else:
            graph, packed = self._graphs[transfer][(bucket, bound)]
            graph.replay()
            self.replays += 1
        layers_t = transfer.target_kv.num_layers
        source, target, beyond = packed.clone().split([2 * transfer.source_kv.num_layers, layers_t, layers_t])
        return MapFlags(source.view(-1, 2), target, beyond, bound)
