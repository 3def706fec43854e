"""The import contract of `src/` and `kernels/`: imports only point down the pipeline, and there is no cycle.

Floors, bottom to top (a module may import its own floor and the floors below it):
models and their streamed identity, rope, task data, records, the MLflow store and tracking, model fetching → corpus, traces, statistics, support, weighting, the artifact's store, artifact → selection, map
arithmetic, forward passes, Fused-Fit kernel → fit, a mapper's pair check, probe, synthetic, apply kernel → apply → runtime room (levers, recompute,
the splice plan → a span's map graph → the forward's graphs → the receiver engine → the receivers → the one splice → routing → a model's reader → generation, a handoff's pieces → a handoff's cover → router session) → serving (the vLLM connector, its router) → eval → pipeline (cfg → objects), workloads → jobs (bench, routed, sweep, gate,
distributed) → routed_merge (a run's item shards joined) → report (tables from records) → choose, length evidence → config check → run (dispatch). A new module must be given a floor here before it can land.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = [
    {
        "src.models",
        "src.model_identity",  # a model directory's fingerprint streamed from its files (imports src.models)
        "src.rope",
        "src.tasks",
        "src.records",  # committed run records read as data, a record folder's name
        "src.mlflow_store",  # the MLflow store; JSON records imported into it, its runs exported as records
        "src.tracking",  # a job's tracked run, and the command line (imports the two above)
        "kernels.jit",
        "src.fetch",
        "src.dequantize",
    },
    {
        "src.corpus",
        "src.traces",
        "src.stats",
        "src.support",
        "src.weighting",
        "src.artifact_store",  # the artifact's directory: versions, the pointer, the lock (imports nothing of ours)
        "src.artifact",
    },
    {"src.select", "src.maps", "src.forward", "kernels.fused_fit"},
    {
        "src.fit",
        "src.pair_check",  # a mapper checked against its pair (KVTransfer's and the vLLM routes' checks)
        "src.probe",
        "src.synthetic",
        "kernels.apply_map",
        "kernels.apply_map_gemm",  # the map as one GEMM per target head (map_cache's backend "gemm")
        "kernels.apply_map_epilogue",  # the gemm map finished in one Triton pass, stored into the target cache
        "kernels.turn_attention",
        "kernels.rms_norm",
        "kernels.rope_write",
        "kernels.paged_read",  # the sender's export read from every flash layer in one launch (serving/paged.py)
    },
    {"src.apply"},
    {"src.runtime.plan", "src.runtime.recompute"},
    {"src.runtime.plan"},  # the splice decided once per handoff (its receiver's capabilities, its recomputed set)
    {"src.runtime.map_graph"},  # a span's map replayed as one CUDA graph on the engine
    {"src.runtime.forward_graph"},  # the engine's forwards replayed as CUDA graphs, one per token-count bucket
    {"src.runtime.engine"},
    {"src.runtime.receivers"},  # the Receiver protocol: the DynamicCache reference, the static engine
    {"src.runtime.splice"},
    {"src.runtime.routing"},
    {"src.runtime.reader"},  # what one model of a session holds: cache or engine slots, provenance, logits
    {"src.runtime.generation", "src.runtime.pieces"},  # generate on a reader; the handoff's pieces and their map
    {"src.runtime.cover"},  # one handoff: re-prefill or plan, map and splice; its record
    {"src.runtime.session"},
    {"src.serving"},  # the package: adapters to serving engines (the vLLM connector, its router)
    {"src.eval"},  # the package: every src.eval.* module
    {"src.pipeline", "src.workloads"},
    {
        "src.bench",
        "src.routed",
        "src.routed_runs",
        "src.routed_multiturn",  # the conversations' runner (imports the Run of src.routed_runs)
        "src.routed_rollback",  # the rollback replay on a workload's own items
        "src.routed_workloads",
        "src.sweep",
        "src.gate",
        "src.gate_evidence",  # a run as the gate reads it, judged from its items
        "src.gate_plan",  # operating points and the pre-registered run of each
        "src.gate_criteria",  # the criteria on one run
        "src.distributed",
    },
    {"src.routed_merge"},  # joins a routed run's item shards (reads the routed job's metrics)
    {"src.report"},  # the package: every src.report.* module
    {"src.choose", "src.length_evidence"},  # validation records → a choice (levers; the mapper's verified length)
    {"src.config_check"},  # the composed config checked before any job starts (the jobs' own checks, called)
    {"src.run"},
]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def floor_of(name: str) -> int:
    for index, floor in enumerate(FLOORS):
        if name in floor or any(name.startswith(f"{member}.") for member in floor):
            return index
    raise KeyError(name)


def imports_of(path: Path) -> set[str]:
    """The project modules `path` imports (at any depth of the file: lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from src import bench`
    modules = {module_name(p) for p in MODULES}
    return {name for name in found if name in modules and name not in ("src", "kernels", "src.eval")}


MODULES = sorted(p for folder in ("src", "kernels") for p in (REPO / folder).rglob("*.py") if p.name != "__init__.py")
GRAPH = {module_name(p): imports_of(p) for p in MODULES}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_every_module_has_a_floor(module):
    floor_of(module)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    upward = {name for name in GRAPH[module] if floor_of(name) > floor_of(module)}
    assert not upward, f"{module} (floor {floor_of(module)}) imports from above: {sorted(upward)}"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(GRAPH[name]):
            if state.get(other) == 1:
                raise AssertionError("import cycle: " + " → ".join(path[path.index(other) :] + [other]))
            if other not in state:
                visit(other, path + [other])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_the_contract_sees_the_known_edges():
    """The graph is built from the real files (a contract that reads nothing passes vacuously)."""
    assert "kernels.apply_map" in GRAPH["src.apply"] and "src.maps" in GRAPH["kernels.apply_map"]
    assert "src.pipeline" in GRAPH["src.bench"] and "src.bench" in GRAPH["src.run"]


SPLICE_STEPS = {  # step → the modules that call it: the splice selects, the DynamicCache receiver carries out
    "deviation_scores": {"src.runtime.splice"},
    "select_tokens": {"src.runtime.splice"},
    "recompute_in_place": {"src.runtime.receivers"},
    "attention_scores": {"src.runtime.receivers"},
    "splice": {"src.runtime.splice", "src.runtime.cover"},  # a session's handoff and the offline entry points
}


def test_one_splice():
    """Each splice step is called from one place (src/runtime/splice.py selects; the DynamicCache receiver,
    src/runtime/receivers.py, recomputes and reads attention), and there is one splice body: a second copy of the
    splice — in the session, offline scoring, NLL or latency, or a second body per receiver — fails here."""
    callers, bodies = {}, []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in SPLICE_STEPS:
                    callers.setdefault(name, set()).add(module_name(path))
            elif isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith("splice"):
                bodies.append((module_name(path), node.name))
    assert callers == SPLICE_STEPS, callers
    assert sorted(bodies) == [("src.runtime.splice", "splice"), ("src.runtime.splice", "spliced_cache")], bodies
