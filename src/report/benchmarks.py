"""The marked tables of BENCHMARKS.md and README.md: which record set each is built from, the rebuild, and the check.

A marked table sits between `<!-- table: NAME -->` and `<!-- /table -->`; NAME is a key of TABLES, which names its
record sets (folders under results/), any other committed record files it reads (JSON under results/), the function
that renders it and the page (PAGES) that holds it. Every registered table is marked exactly once, on its own page.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from src.report.engine_table import engine
from src.report.headline import decision_brief, headline
from src.report.quality_tables import quickstart
from src.report.reliability import coverage
from src.report.routed_tables import decision, routed, routed_paired, routed_switches, routed_tasks
from src.report.rows import joined, record_rows
from src.report.vllm_table import BenchRun, vllm_phases, vllm_ttft

ROOT = Path(__file__).resolve().parents[2]
RESULTS, BENCHMARKS, README = ROOT / "results", ROOT / "BENCHMARKS.md", ROOT / "README.md"
PAGES = (BENCHMARKS, README)  # the pages holding marked tables
MARKED = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)


@dataclass(frozen=True)
class Table:
    run_sets: tuple[str, ...]  # folders under results/ (none: a table of `files` only)
    render: Callable[..., str]  # render(rows, *documents): one (path, parsed JSON) per entry of `files`
    page: str = BENCHMARKS.name  # the page (a PAGES file name) that holds the table
    files: tuple[str, ...] = ()  # other committed records the table reads: JSON files under results/
    shared_gpu: tuple[str, ...] = ()  # run sets measured beside other jobs on the GPU: their latencies are not shown


ROUTED, LEVERS, FITS = "routed-h200-2026-12-03", "routed2-h200-2026-12-03", "routed3-h200-2026-12-04"
BF16 = "routed4-h200-2026-12-04"
ENGINE = "engine-h200-2026-12-05"
ENGINE_V2 = "engine-h100-2026-12-06"  # the engine with the receiver protocol and map_into, random weights, one H100
ENGINE_V2B = "engine-h100-2026-12-06b"  # the same pair job at 732d5f6: host reads cut, capture_all, timed attention
ENGINE_V2C = "engine-h100-2026-12-06c"  # the same pair job at a35c14b: the map replayed as a CUDA graph
ENGINE_V2D = "engine-h100-2026-12-06d"  # the same at e04778a: the map's launch order, samples and intervals kept
ENGINE_V2E = "engine-h100-2026-12-07"  # the same at 057902f: the map graph's token-major inputs, one stacking copy
ENGINE_V2F = "engine-h100-2026-12-07b"  # the same at 1b55fcc: the turn launched before the flags' read, one-dot map
GATE_FIRST = "gate-h100-2026-12-06"  # the first gate run: 8 shards, before its plan named 4 (unregistered)
GATE = "gate-h100-2026-12-06b"  # scripts/device_quality.sh gate as registered: 200-shot ARC, bf16, graph engine
FRONTIER_CPU = "frontier-cpu-2026-12-06"  # issue 34 item 2: the passage frontier on the CPU, fp32
FRONTIER_CPU_TEST = "frontier-cpu-test-2026-12-06"  # the levers chosen on its validation runs, on test items
FRONTIER3 = "frontier3-h100-2026-12-07"  # device_quality.sh frontier3, steps 1-2 of 8 (validation items, fp32, engine)
FRONTIER3B = "frontier3-h100-2026-12-07b"  # steps 3, 4, 5, 7, 8 side by side (frontier3-par), shares lost
FUSED = "fused-fit-h200-2026-12-03/bench_fused_fit.json"
COVERAGE = "gate-coverage-cpu-2026-12-06/coverage.json"  # scripts/gate_coverage.py
VLLM_FILE = "vllm-h100-2026-12-06/vllm_ttft_file.json"  # scripts/bench_vllm_ttft.py, one H100
VLLM_SHM = "vllm-h100-2026-12-06/vllm_ttft_file_dev_shm.json"  # the same bench, the export directory on tmpfs
# What the bench's JSON does not record, from the lease: the transport (its log, vllm-bench.txt: the connector's
# `transport` a directory), the dtype (the bench's GPU setting) and the commit (the same lease's engine record)
VLLM_DEVICE = "vllm-h100-2026-12-06/vllm_ttft_device.json"  # the sender's exports on its GPU (CUDA IPC)
VLLM_TRITON = "vllm-h100-2026-12-06/vllm_ttft_device_triton.json"  # the same, the receiver's map by the Triton kernel
# The device records name their export memory; the map kernel comes from the call (COMMANDS.md beside them)
VLLM_TIMED = "vllm-h100-2026-12-06b/vllm_ttft_device_timings.json"  # device exports, Triton map, per-phase host times
VLLM_REAL = "vllm-h100-2026-12-06b/vllm_ttft_real.json"  # the real pair and its bf16 mapper, real-text histories
VLLM_BACKEND = "vllm-h100-2026-12-06c/vllm_ttft_device_backend.json"  # e04778a: each layer's own block writer
VLLM_STACKED = "vllm-h100-2026-12-06c/vllm_ttft_device_stacked.json"  # "stacked" asked, fell back to per layer
VLLM_BACKEND_E = "vllm-h100-2026-12-06e/vllm_ttft_device_backend.json"  # 5566976: each layer's own block writer
VLLM_DIRECT = "vllm-h100-2026-12-06e/vllm_ttft_device_stacked.json"  # 5566976: the map's stores are the block writes
VLLM_SALT = "vllm-h100-2026-12-06f/vllm_ttft_device_stacked_cache_salt.json"  # 5e83a97: the direct writer, salted
VLLM_POOL = "vllm-h100-2026-12-06f/vllm_ttft_device_stacked_cache_salt_pool1536.json"  # 5e83a97: + the export pool
VLLM_VECTOR = "vllm-h100-2026-12-07b/vllm_ttft_device_stacked_cache_salt_pool1536.json"  # 7f7a215: vector stores again
VLLM_GEMM = "vllm-h100-2026-12-07b/vllm_ttft_device_stacked_cache_salt_pool1536_gemm.json"  # 7f7a215: the gemm map
VLLM_REAL_G = "vllm-h100-2026-12-07b/vllm_ttft_real.json"  # 7f7a215: the real pair, its bf16 mapper
VLLM_K24 = "vllm-h100-2026-12-07c/vllm_ttft_device_stacked_cache_salt_pool1536.json"  # 057902f: random k = 24, bf16
VLLM_REAL_H = "vllm-h100-2026-12-07c/vllm_ttft_real.json"  # 057902f: the real pair, the direct writer and the pool
VLLM_REAL_I = "vllm-h100-2026-12-07d/vllm_ttft_real.json"  # 38895ed: + the sender's export read in one launch
VLLM_RUNS = {
    VLLM_FILE: BenchRun("file, exports on the machine's disk (/tmp/vllm-bench/exports)", "bf16", "732d5f6"),
    VLLM_SHM: BenchRun("file, exports on /dev/shm (tmpfs)", "bf16", "732d5f6"),
    VLLM_DEVICE: BenchRun("device, the sender's GPU (CUDA IPC), map kernel torch", "bf16", "a55f847"),
    VLLM_TRITON: BenchRun(
        "device, the sender's GPU (CUDA IPC), map kernel Triton (apply_backend auto)", "bf16", "a55f847"
    ),  # fmt: skip
    VLLM_TIMED: BenchRun(
        "device, the sender's GPU (CUDA IPC), map kernel Triton (apply_backend auto)", "bf16", "a35c14b"
    ),  # fmt: skip
    VLLM_REAL: BenchRun(
        "device, the sender's GPU (CUDA IPC), map kernel Triton (apply_backend auto)",
        "bf16",
        "a35c14b + the sender's fitted dtypes (da7ff57's script change)",
    ),  # fmt: skip
    VLLM_BACKEND: BenchRun(
        "device (CUDA IPC), Triton map, paged_writer backend (each layer's writer)", "bf16", "e04778a"
    ),
    VLLM_STACKED: BenchRun(
        "device (CUDA IPC), Triton map, paged_writer stacked asked — not engaged: vLLM 0.26 allocates each layer's "
        "cache apart, so each layer's writer wrote (the connector's warning)",
        "bf16",
        "e04778a",
    ),  # fmt: skip
    VLLM_BACKEND_E: BenchRun(
        "device (CUDA IPC), Triton map, paged_writer backend (each layer's writer)", "bf16", "5566976"
    ),
    VLLM_DIRECT: BenchRun(
        "device (CUDA IPC), Triton map, paged_writer stacked — engaged: the map's stores into each layer's own "
        "allocation through its offset table, no separate block write",
        "bf16",
        "5566976",
    ),  # fmt: skip
    VLLM_SALT: BenchRun(
        "device (CUDA IPC), Triton map, paged_writer stacked (engaged), the handoff salted (cache_salt: no re-key), "
        "the check after the map alone, each export its own allocations",
        "bf16",
        "5e83a97",
    ),  # fmt: skip
    VLLM_POOL: BenchRun(
        "device (CUDA IPC), Triton map, paged_writer stacked (engaged), the handoff salted (cache_salt: no re-key), "
        "the check after the map alone, the exports in an export pool of 1,536 MiB (export_pool_mb)",
        "bf16",
        "5e83a97",
    ),  # fmt: skip
    VLLM_VECTOR: BenchRun(
        "device (CUDA IPC), Triton map (16-byte vector stores, 3999905), paged_writer stacked (engaged), the handoff "
        "salted (cache_salt), the exports in an export pool of 1,536 MiB",
        "bf16",
        "7f7a215",
    ),  # fmt: skip
    VLLM_GEMM: BenchRun(
        "device (CUDA IPC), gemm map (gather + two cuBLAS GEMMs + the compiled Triton epilogue, apply_backend gemm), "
        "paged_writer stacked (engaged), the handoff salted (cache_salt), the exports in an export pool of 1,536 MiB",
        "bf16",
        "7f7a215",
    ),  # fmt: skip
    VLLM_REAL_G: BenchRun(
        "device (CUDA IPC), Triton map (vector stores), paged_writer backend (each layer's writer), the handoff "
        "salted (cache_salt), each export its own allocations",
        "bf16",
        "7f7a215",
    ),  # fmt: skip
}
VLLM_RUNS[VLLM_K24] = VLLM_RUNS[VLLM_REAL_H] = BenchRun(  # one lease, both records run alike
    "device (CUDA IPC), Triton map (default tile), paged_writer stacked (engaged), the handoff salted (cache_salt), "
    "the exports in an export pool of 1,536 MiB",
    "bf16",
    "057902f",
)
VLLM_RUNS[VLLM_REAL_I] = BenchRun(
    "device (CUDA IPC), Triton map (one dot, 4 warps), paged_writer stacked (engaged), the handoff salted "
    "(cache_salt), the exports in an export pool of 1,536 MiB, the sender's export read in one launch "
    "(kernels/paged_read.py)",
    "bf16",
    "38895ed",
)


TABLES: dict[str, Table] = {
    "quickstart": Table(("quickstart-cpu",), quickstart),
    "routed": Table((ROUTED,), routed),
    "routed_tasks": Table((ROUTED,), routed_tasks),
    "routed_switches": Table((ROUTED,), routed_switches),
    "routed_levers": Table((LEVERS,), routed),
    "routed_levers_tasks": Table((LEVERS,), routed_tasks),
    "routed_levers_paired": Table((ROUTED, LEVERS), routed_paired),
    "routed_fits": Table((FITS,), routed),
    "routed_fits_tasks": Table((FITS,), routed_tasks),
    "routed_fits_paired": Table((ROUTED, FITS), partial(routed_paired, run_set=FITS)),
    "routed_bf16": Table((BF16,), routed),
    "routed_bf16_tasks": Table((BF16,), routed_tasks),
    "routed_bf16_paired": Table((ROUTED, LEVERS, FITS, BF16), partial(routed_paired, run_set=BF16)),
    "routed_frontier_cpu": Table((FRONTIER_CPU,), routed),
    "routed_frontier_cpu_tasks": Table((FRONTIER_CPU,), routed_tasks),
    "routed_frontier_cpu_paired": Table((FRONTIER_CPU,), routed_paired),  # the rules at equal prefill, same items
    "routed_frontier_cpu_test": Table((FRONTIER_CPU_TEST,), routed),
    "routed_frontier_cpu_test_tasks": Table((FRONTIER_CPU_TEST,), routed_tasks),
    "routed_frontier3": Table((FRONTIER3, FRONTIER3B), routed, shared_gpu=(FRONTIER3B,)),
    "routed_frontier3_tasks": Table((FRONTIER3, FRONTIER3B), routed_tasks),
    "routed_frontier3_paired": Table((FRONTIER3, FRONTIER3B), routed_paired),  # the rules at equal prefill, same items
    "engine": Table((ENGINE,), engine),
    "engine_v2": Table((ENGINE_V2,), engine),
    "engine_v2b": Table((ENGINE_V2B,), engine),
    "engine_v2c": Table((ENGINE_V2C,), engine),
    "engine_v2d": Table((ENGINE_V2D,), engine),
    "engine_v2e": Table((ENGINE_V2E,), engine),
    "engine_v2f": Table((ENGINE_V2F,), engine),
    "vllm_ttft": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_TRITON, VLLM_DEVICE)),
    "vllm_ttft_file": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_FILE, VLLM_SHM)),
    "vllm_ttft_b": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_TIMED, VLLM_REAL)),
    "vllm_phases": Table((), vllm_phases, files=(VLLM_TIMED, VLLM_REAL)),
    "vllm_ttft_c": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_BACKEND, VLLM_STACKED)),
    "vllm_phases_c": Table((), vllm_phases, files=(VLLM_BACKEND, VLLM_STACKED)),
    "vllm_ttft_d": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_BACKEND_E, VLLM_DIRECT)),
    "vllm_phases_d": Table((), vllm_phases, files=(VLLM_BACKEND_E, VLLM_DIRECT)),
    "vllm_ttft_f": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_SALT, VLLM_POOL)),
    "vllm_phases_f": Table((), vllm_phases, files=(VLLM_SALT, VLLM_POOL)),
    "vllm_ttft_g": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_VECTOR, VLLM_GEMM, VLLM_REAL_G)),
    "vllm_phases_g": Table((), vllm_phases, files=(VLLM_VECTOR, VLLM_GEMM, VLLM_REAL_G)),
    "vllm_ttft_h": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_K24, VLLM_REAL_H)),
    "vllm_phases_h": Table((), vllm_phases, files=(VLLM_K24, VLLM_REAL_H)),
    "vllm_ttft_i": Table((), partial(vllm_ttft, runs=VLLM_RUNS), files=(VLLM_REAL_H, VLLM_REAL_I)),
    "vllm_phases_i": Table((), vllm_phases, files=(VLLM_REAL_H, VLLM_REAL_I)),
    "routed_gate": Table((GATE,), lambda rows: routed(joined(rows))),
    "routed_gate_tasks": Table((GATE,), lambda rows: routed_tasks(joined(rows))),
    "routed_gate_first": Table((GATE_FIRST,), lambda rows: routed(joined(rows))),
    "decision": Table((ROUTED, LEVERS, FITS, BF16, GATE_FIRST, GATE), decision),
    "headline": Table(
        (ROUTED, LEVERS, FITS, BF16, ENGINE, GATE_FIRST, GATE),
        partial(headline, vllm_run=VLLM_RUNS[VLLM_REAL_I]),
        README.name,
        (FUSED, VLLM_REAL_I),
    ),
    "decision_brief": Table((ROUTED, LEVERS, FITS, BF16, GATE_FIRST, GATE), decision_brief, README.name),
    "gate_coverage": Table((), coverage, files=(COVERAGE,)),
}


def build(name: str, results: Path = RESULTS) -> str:
    """The table NAME rebuilt from its record set."""
    if name not in TABLES:
        raise ValueError(f"no table {name!r} in src/report/benchmarks.py TABLES (registered: {sorted(TABLES)})")
    table = TABLES[name]
    rows = [
        row | {"shared_gpu": run_set in table.shared_gpu}
        for run_set in table.run_sets
        for row in record_rows(results / run_set)
    ]
    if not rows and table.run_sets:  # a table of other records only (`files`) reads no record set
        raise ValueError(
            f"table {name!r}: {[str(results / s) for s in table.run_sets]}: none holds a FINISHED record.json"
        )
    documents = [(name, json.loads((results / name).read_text())) for name in table.files]
    return table.render(sorted(rows, key=lambda row: (row["start_time"], row["name"])), *documents)


def marked(text: str) -> dict[str, str]:
    """NAME → the table text between its markers (without the trailing newline)."""
    found: dict[str, str] = {}
    for match in MARKED.finditer(text):
        if match.group(2) in found:
            raise ValueError(f"table {match.group(2)!r} is marked twice")
        found[match.group(2)] = match.group(3).rstrip("\n")
    return found


def _page(page: str | Path) -> str:
    name = Path(page).name
    if name not in {path.name for path in PAGES}:
        raise ValueError(
            f"no page {name!r} holds marked tables (src/report/benchmarks.py PAGES: {[p.name for p in PAGES]})"
        )
    return name


def rebuild(text: str, results: Path = RESULTS, page: str | Path = BENCHMARKS) -> str:
    """`text` (the page `page`) with every marked table replaced by its rebuild; a table registered for this page
    without a marker, a marker of a table registered for another page, or of no registered table, is an error."""
    name = _page(page)
    here = {table for table, spec in TABLES.items() if spec.page == name}
    found = marked(text)
    if missing := sorted(here - set(found)):
        raise ValueError(f"registered tables without a `<!-- table: NAME -->` marker in {name}: {missing}")
    if elsewhere := {table: TABLES[table].page for table in sorted(found) if table in TABLES and table not in here}:
        raise ValueError(f"{name} marks tables of other pages: {elsewhere}")
    return MARKED.sub(lambda m: f"{m.group(1)}{build(m.group(2), results)}\n{m.group(4)}", text)


def stale(text: str, results: Path = RESULTS, page: str | Path = BENCHMARKS) -> list[str]:
    """Names of the marked tables of the page `page` whose text differs from their rebuild."""
    fresh = marked(rebuild(text, results, page))
    return [name for name, table in marked(text).items() if table != fresh[name]]
