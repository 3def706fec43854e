"""The receiver engine: one model's static KV cache and its forwards over explicit positions, short ones replayed as
CUDA graphs — the serving runtime a handoff is measured on (gpt-fast style, over the Hugging Face model's own modules:
weights shared, nothing copied).

    engine = Engine(model, capacity=16384)       # keys / values [L, H_kv, capacity + 1, d]: slot s holds position s
    logits = engine.forward(ids, positions)      # [R, V]: each query writes its K/V into its slot, then attends to
                                                 # every slot ≤ its own position
    engine.write(keys, values, start)            # mapped K/V straight into slots start.. (start = its length)
    keys, values = engine.blocks()               # [L, 1, H_kv, capacity + 1, d]: a map writes there at slots
    engine.commit(start, end)                    # (`engine.slot_mapping(start, end)`), then commits them
    flags = engine.map_span(transfer, layers, start, end)  # a span's map there: one graph replay (map_graph.py)

One forward covers every path a server runs: a prefill (positions 0..n−1), the new turn or a prefix hit (n..n+T−1),
a decode step (T = 1), and fused recompute — selected mapped positions + hold-back + turn in one forward: a recomputed
token's fresh K/V replace its mapped slot in each layer before that layer's attention, so every later query (and the
turn) reads them, as CacheBlend does. Forwards of ≤ `GRAPH_BUCKETS[-1]` tokens replay a CUDA graph captured once per
token-count bucket on the turn-attention kernel (src/runtime/forward_graph.py). Long contiguous prefills run eagerly on
sdpa's causal flash path (compute-bound, as a server's prefill), unless `forward(..., graph=True)` asks for the replayed
kernel path. A span's map (`map_span`) replays one CUDA graph per (mapper, span bucket) in the same memory pool
(src/runtime/map_graph.py).
On CPU everything is eager, with the kernel's torch reference.
A fused recompute (`Recompute`, src/runtime/plan.py) runs eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import PreTrainedModel

from kernels.rms_norm import rms_norm
from kernels.rope_write import rope_write
from kernels.turn_attention import turn_attention, turn_attention_weights
from src.apply import KVTransfer
from src.maps import MapFlags
from src.models import describe_kv
from src.rope import rope_cos_sin
from src.runtime.forward_graph import GRAPH_BUCKETS, ForwardGraphs
from src.runtime.map_graph import SPAN_BUCKETS, MapGraphs, SpanRoute, span_bucket, span_route
from src.runtime.plan import Recompute, check_recompute, picked

FLASH_MIN_TOKENS = 256  # a contiguous forward at least this long uses sdpa's causal flash path (eager)


class Native(NamedTuple):
    """A stopped native prefill (`Engine.native_prefix`) over n tokens."""

    keys: torch.Tensor  # [depth, H_kv, n, d]
    values: torch.Tensor  # [depth, H_kv, n, d]
    hidden: torch.Tensor  # [n, hidden] entering layer `depth`
    mass: torch.Tensor | None  # [n] the last queries' attention at layer depth − 1 (`attention_mass`), or None


def attention_mass(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities of queries q [H_q, Q, d] at positions [Q] over slots keys [H_kv, n, d]
    (`turn_attention_weights`, float32), summed over heads and queries: [n]."""
    return turn_attention_weights(q, keys, positions, scale).sum((0, 1))  # [n]


def engine_problem(model: PreTrainedModel) -> str | None:
    """Why the engine cannot run this model (its forward is written for full-attention RoPE decoders), or None."""
    kv = describe_kv(model)
    if kv.sliding_window is not None or set(kv.layer_types) != {"full_attention"}:
        return f"sliding-window attention (window {kv.sliding_window}) is not supported by the static engine"
    if kv.kv_lora_rank is not None:
        return "latent (MLA) attention is not supported by the static engine"
    if kv.rope_dim != kv.head_dim or kv.rope_layout != "half":
        return f"partial or interleaved RoPE (rope_dim {kv.rope_dim} of {kv.head_dim}) is not supported"
    if kv.rope_parameters.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"RoPE type {kv.rope_parameters['rope_type']!r} depends on the sequence length: not a static table"
    return None


class Engine:
    """A model's static KV cache (slot = position) and its forwards; see the module docstring."""

    def __init__(self, model: PreTrainedModel, capacity: int, graphs: bool | None = None, backend: str = "auto"):
        if problem := engine_problem(model):
            raise ValueError(problem)
        if capacity < 1:
            raise ValueError(f"engine capacity must be ≥ 1 token, not {capacity}")
        kv = describe_kv(model)
        parameter = next(model.parameters())
        self.model, self.device, self.dtype = model, parameter.device, parameter.dtype
        self.q_heads, self.kv_heads, self.head_dim = kv.num_q_heads, kv.num_kv_heads, kv.head_dim
        self.scale = kv.attention_softmax_scale
        self.capacity, self.scratch = capacity, capacity  # slot `capacity` is written by padded queries, never read
        shape = (kv.num_layers, kv.num_kv_heads, capacity + 1, kv.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, H_kv, N + 1, d]
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, H_kv, N + 1, d]
        cos, sin = rope_cos_sin(model.model.rotary_emb, torch.arange(capacity + 1))  # [1, 1, N + 1, d] float32
        self.cos, self.sin = cos[0, 0].to(self.device, self.dtype), sin[0, 0].to(self.device, self.dtype)  # [N + 1, d]
        self.length = 0  # slots 0..length − 1 hold the conversation
        self.vocab = model.get_input_embeddings().num_embeddings
        self._owner: weakref.ref | None = None  # the session whose conversation it holds (`claim`)
        self.backend = backend
        self.graphs_enabled = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs_enabled and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        cuda = self.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if cuda else None  # one pool for every graph, the maps' too
        self.forward_graphs = ForwardGraphs(self.device, self.scratch, self._pool)  # src/runtime/forward_graph.py
        largest = span_bucket(capacity) or SPAN_BUCKETS[-1]  # a span's map: src/runtime/map_graph.py
        self.map_graphs = MapGraphs(self.blocks(), self.scratch, largest, self._pool, replay=cuda)

    # --- the forward ---------------------------------------------------------------------------------------------

    def _attend(self, q: torch.Tensor, layer: int, positions: torch.Tensor, flash: int | None) -> torch.Tensor:
        """q [1, H_q, T, d] → [1, H_q, T, d]: each query over slots ≤ its position. flash: the contiguous forward's
        end slot (sdpa's causal flash path over slots 0..flash − 1), or None (the turn kernel)."""
        if flash is not None:
            keys, values = self.keys[layer, None, :, :flash], self.values[layer, None, :, :flash]  # [1, H_kv, n, d]
            start = flash - q.shape[2]
            mask = None if start == 0 else causal_lower_right(q.shape[2], flash)
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=start == 0, scale=self.scale, enable_gqa=True
            )
        out = turn_attention(q[0], self.keys[layer], self.values[layer], positions, self.scale, self.backend)
        return out[None]  # [1, H_q, T, d]

    def _norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm `module` on x in one launch (kernels/rms_norm.py; its torch reference on CPU)."""
        return rms_norm(x, module.weight, module.variance_epsilon, self.backend)

    def _layer(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One decoder layer on hidden [T, hidden]: its K/V written into keys / values [H_kv, N, d] at `slots` before
        attend(q [1, H_q, T, d]) → [1, H_q, T, d] reads them; returns the layer's output [T, hidden]."""
        attention, count = layer.self_attn, hidden.shape[0]
        x = self._norm(layer.input_layernorm, hidden)  # [T, hidden]
        q = attention.q_proj(x).view(count, self.q_heads, self.head_dim)  # [T, H_q, d]
        k = attention.k_proj(x).view(count, self.kv_heads, self.head_dim)  # [T, H_kv, d]
        v = attention.v_proj(x).view(count, self.kv_heads, self.head_dim)  # [T, H_kv, d]
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = self._norm(attention.q_norm, q), self._norm(attention.k_norm, k)
        q = rope_write(q, k, v, self.cos, self.sin, positions, slots, keys, values, self.backend)  # [T, H_q, d]
        out = attend(q.transpose(0, 1)[None])  # [1, H_q, T, d]
        hidden = hidden + attention.o_proj(out[0].transpose(0, 1).reshape(count, self.q_heads * self.head_dim))
        return hidden + layer.mlp(self._norm(layer.post_attention_layernorm, hidden))

    def _layers(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        flash: int | None = None,
        plan: Recompute | None = None,
    ) -> torch.Tensor:
        """ids, positions, slots [T] (device) → logits [R, V] at rows [R] of the last layer's rows; every layer's K/V
        written into `slots`. flash: `_attend`'s (None: the turn kernel, what a graph captures); plan: a recompute set
        that starts at a layer or shrinks with depth (`Recompute`)."""
        decoder = self.model.model
        start, size = (0, 0) if plan is None else (plan.start, plan.positions.numel())
        hidden = decoder.embed_tokens(ids) if plan is None or plan.hidden is None else plan.hidden  # [T, hidden]
        shrinks = plan is not None and plan.keep is not None
        if shrinks:  # the set's held slots as they were: put back if the forward fails (a pick `keep` got wrong)
            held = slots[:size]  # [R]
            backup = self.keys[start:, :, held], self.values[start:, :, held]  # [L − start, H_kv, R, d] copies
            wrong = torch.zeros((), dtype=torch.bool, device=self.device)  # a pick out of range, decided at the end
        try:
            for index in range(start, len(decoder.layers)):
                keys, values = self.keys[index], self.values[index]  # [H_kv, N + 1, d]
                after = index - start + 1
                kept = plan.sizes[after] if plan is not None and after < len(plan.sizes) else size
                if kept < size:  # the set's mapped K/V, read before the layer overwrites them
                    mapped = keys[:, slots[:size]], values[:, slots[:size]]  # [H_kv, s, d] copies
                attend = lambda q, index=index, positions=positions: self._attend(q, index, positions, flash)
                hidden = self._layer(decoder.layers[index], hidden, positions, slots, keys, values, attend)
                if kept < size:  # only the set rows `keep` picks, and the tail, go on
                    fresh = keys[:, slots[:size]], values[:, slots[:size]]  # [H_kv, s, d]
                    chosen, bad = picked(plan.keep(mapped, fresh, kept), kept, size, self.device)  # [kept], []
                    wrong |= bad
                    go_on = torch.cat([chosen, torch.arange(size, hidden.shape[0], device=self.device)])  # [T']
                    hidden, positions, slots, size = hidden[go_on], positions[go_on], slots[go_on], kept  # [T', …]
            if shrinks and bool(wrong):  # the one host read of the pick's range
                raise ValueError("a recompute's `keep` picked rows outside its set, or not distinct and ascending")
        except BaseException:
            if shrinks:
                self.keys[start:, :, held], self.values[start:, :, held] = backup
            raise
        return self.model.lm_head(self._norm(decoder.norm, hidden[rows]))  # [R, V]

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor | None = None,
        graph: bool | None = None,
        recompute: Recompute | None = None,
    ) -> torch.Tensor:
        """The model reads ids [T] at positions [T] (distinct, < capacity; a recompute set, hold-back and turn, in
        ascending order) on the cache: each writes its K/V into slot = position and attends to the slots ≤ its
        position. Returns the logits [R, V] at rows [R] of the forward (default: the last). `length` becomes
        max(length, last position + 1). graph: replay a captured graph (True: whenever the engine has graphs and the
        forward fits a bucket; None: unless it is a long contiguous prefill, which takes sdpa's flash path eagerly).
        recompute: the set the first rows are (`Recompute`); one that starts at a layer or shrinks runs eagerly and
        returns the last row's logits."""
        ids, positions, host = self._inputs(ids, positions)
        count = ids.numel()
        plan = None if recompute is None or recompute.plain else recompute
        if plan is not None:
            check_recompute(plan, host, rows, self.keys.shape[0])
        last = int(host[-1])
        single_row = rows is None
        last_row = -1 if plan is not None else count - 1  # a shrinking forward ends with fewer rows
        rows = torch.tensor([last_row]) if rows is None else torch.as_tensor(rows).reshape(-1)
        first = int(host[0])
        contiguous = last - first + 1 == count  # distinct and ascending: contiguous exactly when the span fits
        replay = single_row and self.graphs_enabled and count <= GRAPH_BUCKETS[-1] and graph is not False
        replay, long = replay and plan is None, contiguous and count >= FLASH_MIN_TOKENS and plan is None  # plan: eager
        flash = first + count if long and not (replay and graph) else None
        if replay and flash is None:
            logits = self.forward_graphs.run(self._layers, ids, positions)
        else:
            on = lambda t: t.to(self.device, torch.long)
            logits = self._layers(on(ids), on(positions), on(positions), on(rows), flash, plan)
        self.length = max(self.length, last + 1)
        return logits

    def _inputs(self, ids: object, positions: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, positions on the host) of a forward, or a ValueError before anything is written: ids a
        dense [T ≥ 1] integer tensor of one sequence, inside the vocabulary (values checked where they are on the host:
        ids from the device are the caller's, as reading them would wait for it); positions [T] integers, distinct and
        ascending, < capacity, those past the cache exactly length..last (a gap would read stale slots)."""
        ids, positions = torch.as_tensor(ids), torch.as_tensor(positions)
        for name, t in (("ids", ids), ("positions", positions)):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"engine forward {name} are {t.dtype}: integers only (nothing is truncated)")
            if t.is_nested or t.layout != torch.strided or t.device.type == "meta":
                raise ValueError(
                    f"engine forward {name} must be a dense tensor with data, not {t.layout} on {t.device}"
                )
            if t.dim() != 1:
                raise ValueError(f"engine forward reads one sequence: {name} [T], got shape {tuple(t.shape)}")
        count = ids.numel()
        if count == 0 or positions.numel() != count:
            raise ValueError(f"engine forward needs ≥ 1 id and one position per id, got {count} ids, "
                             f"{positions.numel()} positions")  # fmt: skip
        if ids.device.type == "cpu" and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise ValueError(f"engine forward ids {int(ids.min())}..{int(ids.max())} outside the vocabulary "
                             f"[0, {self.vocab})")  # fmt: skip
        host = positions.cpu()  # [T] (free for host positions, which every caller here passes)
        low, last = int(host.min()), int(host.max())
        if low < 0 or last >= self.capacity:
            raise ValueError(f"positions {low}..{last} outside the engine's capacity {self.capacity}")
        if count > 1 and not bool((host[1:] > host[:-1]).all()):
            raise ValueError(f"engine forward positions must be distinct and ascending, got {host.tolist()[:8]}…")
        fresh = host[host >= self.length]  # slots past the cache: they must be exactly length..last
        if not torch.equal(fresh, torch.arange(self.length, max(self.length, last + 1))):
            raise ValueError(
                f"positions past the {self.length} cached tokens must be {self.length}..{last} in order, "
                f"got {fresh.tolist()[:8]}…"
            )
        return ids, positions, host

    # --- CUDA graphs, one per token-count bucket (src/runtime/forward_graph.py) ------------------------------------

    def capture_all(self, transfers: tuple[KVTransfer, ...] = ()) -> int:
        """Capture every bucket's graph now (a server's start-up), so that no timed forward or map pays a capture: the
        forward's, and the span maps' (`map_span`) of `transfers` and of every transfer mapped here already; returns
        how many were captured (0 without graphs). Capture writes only the scratch slot: the cache is unchanged."""
        if not self.graphs_enabled:
            return 0
        captured = self.forward_graphs.capture_all(self._layers)
        mappers = dict.fromkeys((*transfers, *self.map_graphs.transfers()))  # once each, in order
        return captured + sum(self.map_graphs.capture(transfer) for transfer in mappers)

    # --- what the splice needs -------------------------------------------------------------------------------------

    def write(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Mapped K/V [L, H_kv, T, d] (or [L, 1, H_kv, T, d]) into slots start..start + T − 1, where start is the
        length it holds (a write past it would leave unwritten slots the conversation reads); a ValueError before any
        slot is written for other shapes, a gap or a write past the capacity."""
        shape = (self.keys.shape[0], self.kv_heads, self.head_dim)
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5) or (t.dim() == 5 and t.shape[1] != 1):
                raise ValueError(f"engine write {name}: expected [L, H_kv, T, d] or [L, 1, H_kv, T, d], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")  # fmt: skip
            if (t.shape[0], t.shape[-3], t.shape[-1]) != shape:
                raise ValueError(f"engine write {name} {tuple(t.shape)}: the engine holds {shape[0]} layers of "
                                 f"{shape[1]} KV heads × {shape[2]} channels")  # fmt: skip
        if keys.shape != values.shape:
            raise ValueError(f"engine write: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
        count = keys.shape[-2]
        if start != self.length:
            raise ValueError(f"engine write at slot {start}: it holds {self.length} tokens, a write continues there")
        if start + count > self.capacity:
            raise ValueError(f"slots {start}..{start + count - 1} outside the engine's capacity {self.capacity}")
        self.keys[:, :, start : start + count].copy_(keys.reshape(*shape[:2], count, shape[2]))
        self.values[:, :, start : start + count].copy_(values.reshape(*shape[:2], count, shape[2]))
        self.length = start + count

    def commit(self, start: int, end: int) -> None:
        """Slots start..end − 1, written in place through `blocks` (e.g. by the map), now hold the conversation;
        start must be the length it holds (no gap of unwritten slots)."""
        if start != self.length or not start <= end <= self.capacity:
            raise ValueError(f"cannot commit slots {start}..{end - 1}: the engine holds {self.length} of "
                             f"{self.capacity} (a commit continues at slot {self.length})")  # fmt: skip
        self.length = end

    def span_route(self, transfer: KVTransfer, count: int) -> SpanRoute:
        """How a span of `count` tokens maps here (`span_route`): one graph replay, or eagerly and why."""
        return span_route(count, self.graphs_enabled, transfer.token_features)

    def map_span(
        self,
        transfer: KVTransfer,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        end: int,
        input_ids: torch.Tensor | None = None,
        bound: float | None = None,
    ) -> MapFlags:
        """Source K/V of positions start..end − 1 ([(keys, values) [1, H_s, n, d_s]] per source layer) mapped into
        their slots with no host sync, by the route `span_route` decides: one replay of the span bucket's CUDA graph
        (src/runtime/map_graph.py), else `KVTransfer.into` eagerly (input_ids [1, n]: read by a token-feature mapper,
        checked otherwise). Returns the maps' device flags; a ValueError / TransferError before any slot is written
        for what the host sees. `commit` the slots (the splice does before the flags are decided: a refusal
        truncates)."""
        if start < 0 or end > self.capacity or end <= start:
            raise ValueError(f"slots {start}..{end - 1} outside the engine's capacity {self.capacity}")
        route = self.span_route(transfer, end - start)
        if route.bucket is not None:
            return self.map_graphs.run(transfer, layers, start, end, route.bucket, bound)
        return transfer.into(self.blocks(), layers, positions=torch.arange(start, end), input_ids=input_ids,
                             slots=self.slot_mapping(start, end), bound=bound)  # fmt: skip

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot as one block, [L, 1, H_kv, capacity + 1, d] views (a map's destination: `KVTransfer.into`)."""
        return self.keys[:, None], self.values[:, None]

    def slot_mapping(self, start: int, end: int) -> torch.Tensor:
        """The slots [end − start] of positions start..end − 1 (slot = position), made on the device (no copy)."""
        if start < 0 or end > self.capacity or end < start:
            raise ValueError(f"slots {start}..{end - 1} outside the engine's capacity {self.capacity}")
        return torch.arange(start, end, device=self.device)

    # --- who holds it ------------------------------------------------------------------------------------------

    @property
    def owner(self) -> object | None:
        """The session whose conversation the engine holds (None: free, or that session is gone)."""
        return None if self._owner is None else self._owner()

    def claim(self, owner: object) -> None:
        """`owner` takes the engine; a ValueError while another owner holds it (two sessions on one engine would each
        change the other's cache: `release` it first)."""
        held = self.owner
        if held is not None and held is not owner:
            raise ValueError("this engine already holds another session's conversation: close that session first")
        self._owner = weakref.ref(owner)

    def release(self, owner: object) -> None:
        """`owner` gives the engine back (nothing if it does not hold it)."""
        if self.owner is owner:
            self._owner = None

    @torch.inference_mode()
    def native_prefix(self, ids: torch.Tensor, depth: int, queries: int = 0) -> Native:
        """The model's own K/V of ids [n] at positions 0..n − 1 in its first `depth` ≥ 1 layers (a stopped prefill
        over fresh K/V, the cache untouched), the hidden states entering layer `depth`, and (queries > 0) the
        attention mass of the last `queries` tokens over every slot at layer depth − 1 (`Native`)."""
        decoder, count = self.model.model, ids.numel()
        positions = torch.arange(count, device=self.device)
        shape = (depth, self.kv_heads, count, self.head_dim)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)  # [depth, H_kv, n, d]
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        mass = []

        def attend(q: torch.Tensor, index: int) -> torch.Tensor:  # q [1, H_q, n, d]
            if queries and index == depth - 1:
                mass.append(attention_mass(q[0, :, -queries:], keys[index], positions[-queries:], self.scale))
            return F.scaled_dot_product_attention(
                q, keys[index, None], values[index, None], is_causal=True, scale=self.scale, enable_gqa=True
            )

        hidden = decoder.embed_tokens(ids.reshape(-1).to(self.device))  # [n, hidden]
        for index, layer in enumerate(decoder.layers[:depth]):
            read = lambda q, index=index: attend(q, index)
            hidden = self._layer(layer, hidden, positions, positions, keys[index], values[index], read)
        return Native(keys, values, hidden, mass[0] if mass else None)

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (their contents are overwritten before any query reads them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate an engine holding {self.length} tokens to {length}")
        self.length = length
