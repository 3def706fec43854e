"""End-to-end handoff TTFT: from "switch to T" to T's first token, given S's cache — on three engines, side by side.

Paths (the vocabulary of the session, the routed workloads and the gate):
  map        map S's prefix cache into T's cache → T reads the new turn on top → first token
  reprefill  T reads prefix + new turn from scratch → first token                     (what a router does today)
  hit        T already holds its own prefix cache → reads the new turn → first token  (same-model prefix hit)
  recompute_<r>  map, then r of the prefix recomputed in the turn's own forward (deviation rule: T's first layer over
                 the prefix picks the tokens; src/runtime/splice.py) → first token
  recompute_<r>_<rule>[_p<p>]  the same with another rule (`turn`: the turn's attention in the first-layer prefill
                 picks them) or progressive selection p < 1 (the set shrinks with depth; `recompute_path`)
  reprefill_graph  the re-prefill replayed as one graph bucket (graph engine, ≤ 4,096 tokens): the baseline is the
                 engine's faster re-prefill (`reprefill_best`), so no launch overhead of the baseline flatters the map
Engines: `hf` (Hugging Face eager forwards on a DynamicCache: the reference), `static` (src/runtime/engine.py, every
forward eager) and `graph` (the same engine, forwards of ≤ 4,096 tokens but long prefills replayed as CUDA graphs, the
map as one graph per span bucket — src/runtime/map_graph.py: what a server runs). Each ratio is formed inside one
engine. Beside TTFT: the map alone, the largest logit difference of each engine's paths from the hf re-prefill (a
check that the fast paths compute the same thing), GPU peak memory of the hf paths, and the source cache's transport
cost when S and T live apart — bytes, host staging (device → pinned host → device)
and device-to-device copies (to a second GPU when there is one, else within the one GPU, labelled by `d2d_peer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from src.apply import KVTransfer
from src.eval.intervals import median_ratio_interval
from src.eval.latency import percentiles, time_ms
from src.forward import prefill
from src.maps import cache_layers
from src.runtime.engine import Engine
from src.runtime.forward_graph import GRAPH_BUCKETS
from src.runtime.plan import NO_LEVERS, Levers
from src.runtime.splice import engine_handoff

ENGINES = ("hf", "static", "graph")


def _peak_mb(fn, device: torch.device) -> float:
    """GPU peak memory (MB) of one call of fn (0 on CPU)."""
    if device.type != "cuda":
        fn()
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def transport(source_cache, repeats: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Bytes of S's cache and the ms / GB/s to move it: device → pinned host, host → device, device → device."""
    tensors = [t for pair in cache_layers(source_cache) for t in pair]  # K, V per layer: [B, H_s, P, d_s]
    total = sum(t.numel() * t.element_size() for t in tensors)
    metrics: dict[str, float] = {"cache_bytes": float(total)}
    if device.type != "cuda":
        return metrics
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    others = [i for i in range(torch.cuda.device_count()) if i != (device.index or 0)]
    peer = torch.device("cuda", others[0]) if others else device
    to_peer = (lambda t: t.to(peer, non_blocking=True)) if others else torch.clone
    moves = {
        "d2h": lambda: [h.copy_(t, non_blocking=True) for h, t in zip(host, tensors, strict=True)],
        "h2d": lambda: [h.to(device, non_blocking=True) for h in host],
        "d2d": lambda: [to_peer(t) for t in tensors],
    }
    for name, move in moves.items():
        metrics |= percentiles(time_ms(move, repeats, warmup, device), name)
        metrics[f"{name}_gbps"] = total / metrics[f"{name}_ms_p50"] / 1e6
    metrics["host_staging_ms_p50"] = metrics["d2h_ms_p50"] + metrics["h2d_ms_p50"]
    metrics["d2d_peer"] = float(bool(others))  # 1: a second GPU; 0: a copy within the one GPU
    return metrics


def _rounded_ms(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> list[float]:
    """`time_ms`'s per-call ms rounded to 4 decimals (0.1 µs): what the artifact keeps, and every figure is computed
    from these, so the samples give each one back."""
    return [round(ms, 4) for ms in time_ms(fn, repeats, warmup, device)]


def _ratio(name: str, numerators: list[list[float]], denominator: list[float]) -> dict[str, float]:
    """`name` (the least numerator median / the denominator's) with `name_lo` / `name_hi`: the 95 % interval for a
    ratio of medians timed in separate loops (`median_ratio_interval`: each median's order-statistic interval at
    97.5 % or above, Bonferroni — holds at any n, NaN where a sample is too small for one: below 7, so at 5 repeats)."""
    point, low, high = median_ratio_interval(numerators, denominator)
    return {name: point, f"{name}_lo": low, f"{name}_hi": high}


def handoff_paths(
    transfer: KVTransfer, source_cache, prefix: torch.Tensor, turn: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """The hf engine's paths for prefix ids [1, P] (S's cache of them given) and new-turn ids [1, N], each a call that
    returns T's next-token logits [1, V]; T's own prefix cache (hit) is built here, untimed."""
    target = transfer.target
    own_cache = prefill(target, prefix)
    last_logits = lambda cache, ids: target(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]

    def via_hit() -> torch.Tensor:
        logits = last_logits(own_cache, turn)
        own_cache.crop(-turn.shape[1])  # back to the prefix for the next repetition
        return logits

    return {
        "map": lambda: last_logits(transfer(source_cache, input_ids=prefix), turn),  # the map is timed
        "reprefill": lambda: target(torch.cat([prefix, turn], dim=1), logits_to_keep=1).logits[:, -1],
        "hit": via_hit,
    }


def recompute_path(share: float, rule: str, progressive: float) -> str:
    """recompute_<r>, or recompute_<r>_<rule>[_p<p>] for another rule or progressive selection p < 1 (the names the
    deviation rule at p = 1 had before either existed; src/report/engine_table.py reads them back)."""
    if rule == "deviation" and progressive == 1:
        return f"recompute_{share:g}"
    return f"recompute_{share:g}_{rule}" + (f"_p{progressive:g}" if progressive < 1 else "")


def engine_paths(
    transfer: KVTransfer,
    source_cache,
    prefix: torch.Tensor,
    turn: torch.Tensor,
    shares: tuple[float, ...] = (),
    rules: tuple[str, ...] = ("deviation",),
    progressive: float = 1.0,
) -> tuple[dict[str, Callable[[], torch.Tensor]], tuple[Engine, Engine]]:
    """The static engine's paths (as `handoff_paths`, plus a recompute path for each share r and rule, at
    `progressive`: `recompute_path`), on two engines sized to prefix + turn: one holds T's own prefix (hit, prefilled
    here, untimed), the other is rebuilt by every call. Returns the paths and the engines (set `graphs_enabled` on
    both to choose eager or graph-replayed forwards)."""
    count, turn_count = prefix.shape[1], turn.shape[1]
    capacity = count + turn_count
    own, work = Engine(transfer.target, capacity), Engine(transfer.target, capacity)
    own.forward(prefix[0].cpu(), torch.arange(count))
    conversation = torch.cat([prefix, turn], 1)[0].cpu()  # [P + N]
    turn_positions = torch.arange(count, capacity)

    def via_hit() -> torch.Tensor:
        own.truncate(count)
        return own.forward(conversation[count:], turn_positions)

    def via_reprefill() -> torch.Tensor:
        work.truncate(0)
        return work.forward(conversation, torch.arange(capacity))

    def via_reprefill_graph() -> torch.Tensor:  # the whole conversation replayed in one bucket (≤ 4,096 tokens)
        work.truncate(0)
        return work.forward(conversation, torch.arange(capacity), graph=True)

    # [1, P], [1, N]: a tokenizer's ids on the host, as the hit's (device ids cost `engine_handoff` one copy)
    host_prefix, host_turn = conversation[None, :count], conversation[None, count:]
    handoff = lambda levers: lambda: engine_handoff(transfer, work, source_cache, host_prefix, levers, host_turn)
    paths = {"map": handoff(NO_LEVERS), "reprefill": via_reprefill, "hit": via_hit}
    if capacity <= GRAPH_BUCKETS[-1]:
        paths["reprefill_graph"] = via_reprefill_graph
    for share in shares:
        for rule in rules:
            levers = Levers(recompute=share, recompute_rule=rule, progressive=progressive)
            paths[recompute_path(share, rule, progressive)] = handoff(levers)
    return paths, (own, work)


def profile_table(fn: Callable[[], object], device: torch.device, rows: int = 25) -> str:
    """torch.profiler's tables of one call of fn (after one warm call): by host time, then (CUDA) by device time."""
    fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = profiler.key_averages()
    host = table.table(sort_by="cpu_time_total", row_limit=rows)
    return host if device.type != "cuda" else host + "\n" + table.table(sort_by="self_cuda_time_total", row_limit=rows)


@torch.inference_mode()
def handoff_ttft(
    transfer: KVTransfer,
    prefix: torch.Tensor,
    turn: torch.Tensor,
    repeats: int,
    prefill_repeats: int,
    warmup: int,
    engines: tuple[str, ...] = ENGINES,
    shares: tuple[float, ...] = (),
    profiles: dict[str, str] | None = None,
    rules: tuple[str, ...] = ("deviation",),
    progressive: float = 1.0,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """TTFT p50/p95 (ms) of every path on every engine for prefix ids [1, P] and new-turn ids [1, N]:
    `ttft.<engine>.<path>_ms_p50`, the speedups `speedup.<engine>.<path>` (that engine's best re-prefill median / the
    path's) and `<engine>.map_over_hit` (routed TTFT / prefix hit), each with its 95 % interval `…_lo` / `…_hi`
    (`_ratio`; NaN below 7 repeats of a side), how each engine's timed maps ran (`<engine>.map_graph`: graph
    replays per call, 1 or 0; `<engine>.map_bucket`: the span's graph rows, 0: eager), the map alone (`map_ms_p50`),
    the checks `check.<engine>.<path>_logit_diff` (largest |Δ logit| from the hf re-prefill), hf peak memory and
    transport.
    profiles: filled with a profiler table (`profile_table`) of the map alone and of every path of the last engine.
    samples: filled with every timed call's ms (4 decimals), `<engine>.<path>` and `map` (the map alone).
    shares × rules at `progressive`: the recompute paths (`engine_paths`)."""
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}: choose from {ENGINES}")
    device = transfer.device
    prefix, turn = prefix.to(device), turn.to(device)
    source_cache = prefill(transfer.source, prefix)  # S's cache exists before the switch: not timed
    hf = handoff_paths(transfer, source_cache, prefix, turn) if "hf" in engines else {}  # its hit cache is T's own
    reference = transfer.target(torch.cat([prefix, turn], 1), use_cache=False, logits_to_keep=1).logits[:, -1].float()
    timed = {"map": _rounded_ms(lambda: transfer(source_cache, input_ids=prefix), repeats, warmup, device)}  # ms
    metrics = percentiles(timed["map"], "map")
    static = [name for name in engines if name != "hf"]
    built = engine_paths(transfer, source_cache, prefix, turn, shares, rules, progressive) if static else None
    for name in engines:
        if name == "hf":
            paths = dict(hf)
        else:
            paths = dict(built[0])
            for engine in built[1]:
                engine.graphs_enabled = name == "graph" and device.type == "cuda"
            if name == "static":  # graphs off: recompute and the replayed re-prefill belong to the graph engine
                paths = {
                    p: run for p, run in paths.items() if not p.startswith("recompute_") and p != "reprefill_graph"
                }
        first_token = {path: (lambda run=run: run().argmax(-1)) for path, run in paths.items()}  # [1] each
        work = built[1][1] if name != "hf" else None  # the engine the handoffs rebuild
        for path, run in paths.items():
            slow = path.startswith(("reprefill", "recompute"))
            calls = (prefill_repeats, min(warmup, 1)) if slow else (repeats, warmup)
            replays = work.map_graphs.replays if work is not None else 0
            timed[f"{name}.{path}"] = _rounded_ms(first_token[path], *calls, device)
            metrics |= percentiles(timed[f"{name}.{path}"], f"ttft.{name}.{path}")
            if work is not None and path == "map":  # how the timed maps ran: 1 each one graph replay, 0 eager
                metrics[f"{name}.map_graph"] = (work.map_graphs.replays - replays) / sum(calls)
                metrics[f"{name}.map_bucket"] = float(work.span_route(transfer, prefix.shape[1]).bucket or 0)
            metrics[f"check.{name}.{path}_logit_diff"] = float((run().float() - reference).abs().max())
        best = min(metrics[f"ttft.{name}.{path}_ms_p50"] for path in paths if path.startswith("reprefill"))
        metrics[f"ttft.{name}.reprefill_best_ms_p50"] = best  # the engine's fastest re-prefill: every speedup's base
        bases = [timed[f"{name}.{path}"] for path in paths if path.startswith("reprefill")]
        for path in paths:
            metrics |= _ratio(f"speedup.{name}.{path}", bases, timed[f"{name}.{path}"])
        if profiles is not None and name == engines[-1]:
            profiles["map"] = profile_table(lambda: transfer(source_cache, input_ids=prefix), device)
            profiles |= {f"{name}.{path}": profile_table(run, device) for path, run in paths.items()}
        metrics |= _ratio(f"{name}.map_over_hit", [timed[f"{name}.map"]], timed[f"{name}.hit"])
    if "hf" in engines:
        for path, run in hf.items():
            metrics[f"gpu_peak_mb_{path}"] = _peak_mb(run, device)
    if samples is not None:
        samples |= timed
    return metrics | transport(source_cache, repeats, warmup, device)
