"""The receiver engine's forwards replayed as CUDA graphs, one per token-count bucket (src/runtime/engine.py).

    graphs = ForwardGraphs(device, scratch, pool)     # one engine's graphs
    logits = graphs.run(layers, ids, positions)       # [1, V]: one replay of the bucket's graph (captured on first use)
    captured = graphs.capture_all(layers)             # every bucket now (a server's start-up)

`layers(ids, positions, slots, rows)` → logits [R, V] is the engine's forward over its layers (`Engine._layers`, on the
turn-attention kernel): handed in per call, so the graphs hold no reference to the engine. A forward of T ≤
`GRAPH_BUCKETS[-1]` tokens is padded to its bucket: padded queries sit at position 0 — they read one slot — and write
the scratch slot, which no query reads, so the cache outside the forward is untouched. The attention kernel
(kernels/turn_attention.py) reads the positions from device memory, so one graph serves every history length up to the
capacity. Manual `torch.cuda.graph` capture rather than `torch.compile(mode="reduce-overhead")`: no compile step on a
bare lease, the same kernels eager and replayed (their equality is a test), and the bucket logic is ours to read. The
graphs share the engine's memory pool with its span maps' (src/runtime/map_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)  # token counts
# captured as CUDA graphs (on first use, or all at once: capture_all; ≤ 1.5× padding above 128); longer forwards eager

Layers = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # ids, positions, slots,
# rows [T] (device) → logits [R, V]: the engine's forward, each layer's K/V written into `slots`


class ForwardGraphs:
    """One engine's forward graphs: a CUDA graph per token-count bucket and its static inputs. scratch: the slot no
    query reads; pool: the engine's graph memory pool."""

    def __init__(self, device: torch.device, scratch: int, pool):
        self.device, self.scratch, self.pool = device, scratch, pool
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def _capture(self, layers: Layers, bucket: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        """Capture the forward of `bucket` tokens on static inputs; warm-up and capture write only the scratch slot."""
        static = {
            "ids": torch.zeros(bucket, dtype=torch.long, device=self.device),
            "positions": torch.zeros(bucket, dtype=torch.long, device=self.device),
            "slots": torch.full((bucket,), self.scratch, dtype=torch.long, device=self.device),
            "rows": torch.zeros(1, dtype=torch.long, device=self.device),
        }
        run = lambda: layers(static["ids"], static["positions"], static["slots"], static["rows"])
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compile the kernels and warm the allocator outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static["logits"] = run()  # [1, V]
        return graph, static

    def capture_all(self, layers: Layers) -> int:
        """Capture every bucket's graph not captured yet; returns how many."""
        missing = [b for b in GRAPH_BUCKETS if b not in self._graphs]
        with torch.inference_mode():
            for bucket in missing:
                self._graphs[bucket] = self._capture(layers, bucket)
        return len(missing)

    def run(self, layers: Layers, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward of ids, positions [T ≤ GRAPH_BUCKETS[-1]] (copied into the graph's inputs from wherever they
        are) by one replay of its bucket's graph: the last row's logits [1, V]."""
        count = ids.numel()
        bucket = next(b for b in GRAPH_BUCKETS if b >= count)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(layers, bucket)
        graph, static = self._graphs[bucket]
        pad = bucket - count
        # non_blocking: host inputs cross without waiting for the stream (a blocking copy drains it — a map queued
        # before this forward would then finish before the replay is launched); each source is a new tensor
        static["ids"].copy_(torch.cat([ids.reshape(-1), ids.reshape(-1)[-1:].expand(pad)]), non_blocking=True)
        static["positions"].copy_(torch.cat([positions, positions.new_zeros(pad)]), non_blocking=True)  # pads: slot 0
        slots = torch.cat([positions, torch.full((pad,), self.scratch, dtype=positions.dtype, device=positions.device)])
        static["slots"].copy_(slots, non_blocking=True)  # pads write only the scratch slot
        static["rows"].fill_(count - 1)
        graph.replay()
        return static["logits"].clone()  # [1, V]
