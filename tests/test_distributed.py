"""Sharded construction (src/distributed.py): two gloo processes on CPU build the same artifact as the one-process
`fit_mapper` on the pooled rows (supports, weightings, token features, statistics paths, uneven shards whose means
differ), every rank returns the same mapper, and ranks that disagree on the method fail with a clear error. And the
cluster launchers (conf/hydra/launcher/): they compose, carry the GPU environment, and (slow) run a local sweep."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from hydra import compose, initialize_config_dir

from src.distributed import GPU_ENV, fit_mapper_sharded, init_distributed, shard_rows
from src.fit import fit_mapper
from src.models import describe_kv
from src.support import head_assignment
from src.synthetic import synthetic_traces
from tests.conftest import tiny

WORLD = 2
LAYERS = torch.tensor([[0, 2], [1, 2]])  # S_ℓ for the 2 target layers, from 3 source layers; 2 → 4 KV heads
FIT = dict(lam=0.01, lam_relative=False, chunk_rows=37)  # 37 ∤ the shards' rows
CASES = {  # name → fit_mapper keyword arguments
    "local+attn_repair": dict(support="local", weighting="attn_repair"),
    "full+uniform, generic": dict(support="full", weighting="uniform", statistics="generic"),
    "local+attn_repair+tokens, relative λ, α cap": dict(
        support="local", weighting="attn_repair", token_features=True, lam_relative=True, alpha_cap=0.5
    ),
    "cyclic+attn_repair, fused": dict(support="cyclic", weighting="attn_repair", statistics="fused"),
}
TOLERANCE = {"fused": 1e-6}  # int8-digit Grams (emulated on CPU), per-chunk scales differ by shard; else float64
COEFFICIENTS = ("weight_k", "bias_k", "weight_v", "bias_v")


def _traces():
    """5 sequences × 40 rows; 2 → 4 KV heads (GQA); K/V offsets that grow with the sequence, so the two shards'
    means differ from each other and from the pooled mean (a merge without the correction terms shows)."""
    source, target = (
        describe_kv(tiny("qwen3", head_dim=8)),
        describe_kv(tiny("llama", num_hidden_layers=2, num_key_value_heads=4)),
    )
    traces = synthetic_traces(source, target, 5, 40, "cpu", torch.float32, seed=3)
    shift = traces.sequence_index.float()[:, None]  # [n, 1]
    for name, scale in (("source_k", 3.0), ("source_v", 1.0), ("target_k", 2.0), ("target_v", 0.5)):
        setattr(traces, name, getattr(traces, name) + 20.0 + scale * shift)
    traces.attn_k, traces.attn_v = traces.attn_k**16, traces.attn_v**16  # heavy-tailed: CV² ≈ 7.8 → α* < 1
    return traces


def _arguments(case: dict, source_heads: int, target_heads: int) -> dict:
    arguments = dict(FIT, **case)
    arguments["head_index"] = head_assignment(arguments["support"], source_heads, target_heads, shift=1)
    return arguments


def _worker(rank: int, port: int, traces, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    init_distributed("cpu")
    try:
        shard = shard_rows(traces, rank, WORLD)
        heads = traces.source_k.shape[1], traces.target_k.shape[1]
        results = {}
        for name, case in CASES.items():
            mapper = fit_mapper_sharded(shard, LAYERS, **_arguments(case, *heads))
            results[name] = {**mapper.tensors(), "manifest": mapper.manifest}
        try:  # rank 1 asks for other source layers: every rank must refuse before any reduction
            layers = LAYERS if rank == 0 else LAYERS.flip(1)
            fit_mapper_sharded(shard, layers, **_arguments(CASES["local+attn_repair"], *heads))
        except ValueError as error:
            results["mismatch"] = str(error)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawn(traces, out, deadline_s: float = 120) -> None:
    """Two gloo processes, forked (the parent's imports are reused: seconds, not a fresh interpreter each); fail, and
    stop them, rather than hang on a collective that never completes."""
    context = mp.start_processes(
        _worker, args=(_free_port(), traces, str(out)), nprocs=WORLD, join=False, start_method="fork"
    )
    began = time.monotonic()
    while not context.join(timeout=1):
        if time.monotonic() - began > deadline_s:
            for process in context.processes:
                process.kill()
            pytest.fail(f"sharded construction did not finish within {deadline_s} s")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_two_gloo_ranks_build_the_one_process_artifact(tmp_path):
    traces = _traces()
    _spawn(traces, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    heads = traces.source_k.shape[1], traces.target_k.shape[1]
    for name, case in CASES.items():
        reference = fit_mapper(traces, LAYERS, **_arguments(case, *heads))
        got = ranks[0][name]
        for tensor in COEFFICIENTS:
            difference = _relative(got[tensor], getattr(reference, tensor))
            assert difference <= TOLERANCE.get(case.get("statistics"), 1e-9), (name, tensor, difference)
            assert torch.equal(got[tensor], ranks[1][name][tensor]), (name, tensor, "ranks differ")
        assert torch.equal(got["source_layers"], reference.source_layers)
        assert torch.equal(got["head_index"], reference.head_index)
        manifest, expected = dict(got["manifest"]), dict(reference.manifest)
        alpha, expected_alpha = manifest.pop("alpha"), expected.pop("alpha")
        assert manifest == expected, name
        if expected_alpha is None:
            assert alpha is None
        else:
            for component in "kv":
                torch.testing.assert_close(torch.tensor(alpha[component]), torch.tensor(expected_alpha[component]))
            assert min(min(row) for row in expected_alpha["k"]) < 1, "the case should exercise the Kish floor"
    assert all("ranks disagree" in rank["mismatch"] for rank in ranks)


def test_shards_are_whole_sequences_covering_every_row_once():
    traces = _traces()
    shards = [shard_rows(traces, rank, 3) for rank in range(3)]
    assert [int(s.sequence_index.unique().numel()) for s in shards] == [2, 2, 1]
    assert sum(s.rows for s in shards) == traces.rows
    assert torch.equal(torch.cat([s.source_k for s in shards], 2), traces.source_k)  # ascending, disjoint
    assert shards[2].meta["rows"] == shards[2].rows
    with pytest.raises(ValueError, match="5 calibration sequences cannot be split over 6 ranks"):
        shard_rows(traces, 0, 6)


def test_block_pca_and_bad_statistics_are_refused_before_any_collective():
    shard = _traces()
    head_index = head_assignment("full", 2, 2)
    with pytest.raises(ValueError, match="block-PCA"):
        fit_mapper_sharded(shard, LAYERS, head_index, "pca", "uniform", **FIT)
    with pytest.raises(ValueError, match="unknown statistics"):
        fit_mapper_sharded(shard, LAYERS, head_index, "local", "uniform", **FIT, statistics="float16")
    with pytest.raises(ValueError, match="token features"):
        fit_mapper_sharded(
            shard, LAYERS, head_index, "local", "uniform", **FIT, statistics="fused", token_features=True
        )


# --------------------------------------------------------------------------- cluster launchers (Hydra plugins)

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = REPO / "conf" / "hydra" / "launcher"


def _launcher(name: str):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("run", overrides=[f"hydra/launcher={name}"], return_hydra_config=True).hydra.launcher


def test_slurm_and_local_launchers_compose_with_the_gpu_environment():
    slurm, local = _launcher("slurm"), _launcher("local")
    assert slurm._target_.endswith("submitit_launcher.SlurmLauncher") and slurm.gpus_per_node == 1
    assert local._target_.endswith("submitit_launcher.LocalLauncher")
    assert list(slurm.setup) == [f"export {name}={value}" for name, value in GPU_ENV.items()]


def test_ray_launcher_extends_the_plugin_and_sets_the_gpu_environment():
    """Without hydra-ray-launcher installed (it pins cloudpickle < 3) only the file itself can be checked."""
    config = yaml.safe_load((LAUNCHERS / "ray_cluster.yaml").read_text())
    assert config["defaults"] == ["ray"]
    assert config["ray"]["init"]["runtime_env"]["env_vars"] == GPU_ENV
    assert config["ray"]["remote"]["num_gpus"] == 1


@pytest.mark.slow
def test_local_launcher_runs_a_sweep_in_separate_processes(tmp_path):
    """Two construction jobs (fit.k=1,2) through the submitit launcher, each in its own process (minutes on 2 cores)."""
    _launcher("local")
    records = tmp_path / "records"
    command = [
        sys.executable, "-m", "src.run", "-m", "hydra/launcher=local", "+experiment=construction",
        "budget=synthetic_paper", "pair.device=cpu", "budget.storage_dtype=float32", "budget.sequences=8",
        "budget.seq_len=64", "eval.construction.budgets=[4,8]", "eval.construction.repeats=1", "fit.k=1,2",
        "tracking.backend=json", f"tracking.json_dir={records}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]  # fmt: skip
    environment = dict(os.environ, KVRELAY_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    subprocess.run(command, cwd=REPO, env=environment, check=True, timeout=1200, capture_output=True)
    logs = sorted((tmp_path / "sweep" / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2 and all("Job completed successfully" in log.read_text() for log in logs)
    jobs = {json.loads(path.read_text())["params"]["fit.k"] for path in records.glob("*/record.json")}
    assert jobs == {"1", "2"}
