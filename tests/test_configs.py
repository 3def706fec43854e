"""Hydra configs: every experiment and every group option composes and resolves, and the invariants
the paper's protocols rely on hold (sweeps, the linear map, the quickstart pair, one home per default)."""

import functools
import itertools
import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError

from src.corpus import CORPORA
from src.run import JOBS
from src.runtime.plan import Levers
from src.runtime.routing import Policy, policy_from

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
ADDED = ("experiment", "method", "workload")  # groups outside the defaults list, chosen with +group=option
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in (*ADDED, "hydra"))
OPTIONS = [(group, p.stem) for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))]
PAPER_ROWS = 128_000  # 500 sequences × 1,024 tokens, every 4th token


@pytest.fixture(autouse=True)
def _environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVRELAY_DATA", raising=False)


@functools.cache
def composed(*overrides: str, hydra: bool = False):
    """The composed (unresolved, read-only) config; resolution happens later, under the test's environment."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("run", overrides=list(overrides), return_hydra_config=hydra)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def resolved(*overrides: str) -> dict:
    return OmegaConf.to_container(composed(*overrides), resolve=True)


def sweep_params(experiment: str) -> dict[str, list[str]]:
    params = composed(f"+experiment={experiment}", hydra=True).hydra.sweeper.params or {}
    return {key: str(value).split(",") for key, value in params.items()}


def leaves(node, prefix: str = "") -> dict[str, object]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out = {}
    for key, value in node.items():
        out |= leaves(value, f"{prefix}{key}.")
    return out


def file_keys(path: Path) -> dict[str, object]:
    """Fully qualified leaf keys a config file sets (its package applied; `defaults` and `hydra` left out)."""
    text = path.read_text()
    body = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k not in ("defaults", "hydra")}
    relative = path.relative_to(CONF)
    is_global = "# @package _global_" in text or relative.parent == Path(".")
    return leaves(body if is_global else {relative.parent.name: body})


def option_keys(path: Path) -> dict[str, object]:
    """`file_keys` of a group option, over those of the options of its group that its defaults list composes."""
    keys = {}
    for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            keys |= option_keys(path.parent / f"{entry}.yaml")
    return keys | file_keys(path)


def default_choices() -> dict[str, str]:
    defaults = yaml.safe_load((CONF / "run.yaml").read_text())["defaults"]
    return {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}


# --- composition ------------------------------------------------------------------------------------------------


def test_found_the_configs():
    assert {"quickstart", "table1", "attribution", "budget_sweep", "latency", "construction", "gate", "optuna"} <= set(
        EXPERIMENTS
    )
    assert {"pair", "support", "weighting", "budget", "fit", "eval", "tracking", "gate", "sweep"} <= set(GROUPS)
    assert {"fit_eval", "probe", "latency", "construction", "handoff", "gate", "optuna"} <= set(JOBS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_resolves(experiment):
    cfg = resolved(f"+experiment={experiment}")
    assert cfg["job"] in JOBS
    assert cfg["paths"]["home"].endswith("home")
    assert cfg["tracking"]["uri"].startswith("sqlite:///"), "MLflow ≥ 3.13 refuses the plain file store"
    if experiment != "gate":
        assert cfg["tracking"]["experiment"] != "kvrelay", "each experiment tracks into its own MLflow experiment"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_resolves(group, option):
    cfg = resolved(f"{group}={option}")
    assert group in cfg
    for experiment in ("quickstart", "table1"):  # also under an experiment that overrides groups
        assert group in resolved(f"+experiment={experiment}", f"{group}={option}")


@pytest.mark.parametrize("method", sorted(p.stem for p in (CONF / "method").glob("*.yaml")))
def test_every_method_composes_and_sets_support_weighting_and_k(method):
    cfg = resolved(f"+method={method}")
    choices = yaml.safe_load((CONF / "method" / f"{method}.yaml").read_text())
    chosen = {key.removeprefix("override /"): value for entry in choices["defaults"] for key, value in entry.items()}
    assert cfg["support"] == resolved(f"support={chosen['support']}")["support"]
    assert cfg["weighting"] == resolved(f"weighting={chosen['weighting']}")["weighting"]
    assert cfg["fit"] == {**resolved()["fit"], "k": choices["fit"]["k"]}
    assert resolved(f"+method={method}", "budget=paper_mix")["budget"]["corpus"].count("+") == 2


WORKLOAD_FILES = sorted(p.stem for p in (CONF / "workload").glob("*.yaml") if p.stem != "default")  # default: shared


@pytest.mark.parametrize("workload", WORKLOAD_FILES)
def test_every_workload_composes_with_the_routed_experiment(workload):
    cfg = resolved("+experiment=routed", f"+workload={workload}")
    assert cfg["job"] == "routed" and cfg["workload"]["name"] == workload
    assert set(cfg["workload"]) == set(resolved("+experiment=routed", "+workload=fewshot")["workload"])


SHARED = {
    "limit": 100,
    "split": "test",
    "shots": {},
    "base": None,
    "switch_counts": [],
    "turns": 0,
    "escalation": {"policy": "none", "every": 0, "threshold": 0.0},
    "engine_capacity": None,
    "shards": 1,
    "shard": 0,
    "warmup": 1,
    "same_work_every": 8,
    "rollback_items": 2,
    "rollback_tokens": 8,
}  # fmt: skip (policy, max_length_factor, guard_max_abs: moved to conf/policy/default.yaml, 2026-12-05)
WORKLOADS_COMPOSED = {  # cfg.workload of each workload as it composed when every file restated every key
    "fewshot": {"name": "fewshot", "tasks": ["arc_easy", "arc_challenge", "hellaswag", "mmlu", "winogrande", "piqa"]}
    | SHARED
    | {"shots": {"arc_easy": 25, "arc_challenge": 25, "hellaswag": 10, "mmlu": 5, "winogrande": 5, "piqa": 5}},
    "multiturn": {"name": "multiturn", "tasks": ["arc_easy", "mmlu", "boolq", "piqa"]}
    | SHARED
    | {"limit": 96, "turns": 8, "escalation": {"policy": "schedule", "every": 2, "threshold": 0.6}},
    "fewshot_long": {"name": "fewshot_long", "tasks": ["arc_easy", "hellaswag"]}
    | SHARED
    | {"shots": {"arc_easy": [20, 45, 90, 180, 360, 800], "hellaswag": [8, 18, 38, 75, 150, 330]}},
    "passage": {"name": "passage", "tasks": ["boolq", "lambada"]} | SHARED,
    "switches": {"name": "switches", "tasks": ["boolq", "lambada"]}
    | SHARED
    | {"base": "passage", "switch_counts": [1, 2, 4, 8]},
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS_COMPOSED))
def test_a_workload_composed_from_the_defaults_is_the_workload_it_was(workload):
    """conf/workload/default.yaml + the workload's changed keys compose to the very values (in the same key order)
    each workload had when its file listed all of them: runs and records see the same `workload.*` (but the policy's
    keys, now under `policy.*`)."""
    composed_workload = resolved("+experiment=routed", f"+workload={workload}")["workload"]
    assert composed_workload == WORKLOADS_COMPOSED[workload]
    assert list(composed_workload) == list(WORKLOADS_COMPOSED[workload])


@pytest.mark.parametrize("workload", WORKLOAD_FILES)
def test_a_workload_file_lists_only_what_differs_from_the_defaults(workload):
    """Each default of a workload lives in conf/workload/default.yaml; a workload file composes it first and sets
    only keys it has, to other values."""
    text = yaml.safe_load((CONF / "workload" / f"{workload}.yaml").read_text())
    assert text["defaults"] == ["default", "_self_"]
    shared = yaml.safe_load((CONF / "workload" / "default.yaml").read_text())
    for key, value in text.items():
        if key != "defaults":
            assert key in shared, f"{workload} sets {key}, which conf/workload/default.yaml does not have"
            assert shared[key] != value, f"{workload} repeats the default {key}={value}"


def test_every_workload_file_has_its_registry_entry():
    """One YAML ↔ one entry of src/routed_workloads.py WORKLOADS: a file the job cannot run, or an entry no file
    configures, fails here."""
    from src.routed_workloads import WORKLOADS

    assert sorted(WORKLOADS) == WORKLOAD_FILES


def test_options_of_a_group_set_the_same_keys():
    """Swapping an option never leaves a key of another option behind (or missing); keys every pair shares
    (conf/run.yaml `pair:`) may be overridden by some pair files only."""
    shared = {f"pair.{k}" for k in yaml.safe_load((CONF / "run.yaml").read_text())["pair"]}
    for group in GROUPS:
        shapes = {}
        for path in sorted((CONF / group).glob("*.yaml")):
            keys = {k for k in option_keys(path) if k.startswith(f"{group}.") and k not in shared}
            depth = 2 if group == "pair" else None  # real pairs have a path, random pairs a seed + config
            shapes[path.stem] = {".".join(k.split(".")[:depth]) for k in keys}
        assert len({frozenset(v) for v in shapes.values()}) == 1, (group, shapes)


# --- defaults list and single source of each default -------------------------------------------------------------


def test_run_defaults_have_no_experiment_entry():
    defaults = yaml.safe_load((CONF / "run.yaml").read_text())["defaults"]
    names = [entry if isinstance(entry, str) else next(iter(entry)) for entry in defaults]
    assert not any("experiment" in name for name in names), names
    assert "_self_" in names
    assert set(default_choices()) == set(GROUPS)
    for group, option in default_choices().items():
        assert (CONF / group / f"{option}.yaml").is_file()


def test_each_default_lives_in_one_file():
    """run.yaml plus the default option of each group: no leaf key is defined twice (a pair file may override
    what every pair shares, conf/run.yaml `pair:`)."""
    files = [CONF / "run.yaml"] + [CONF / group / f"{option}.yaml" for group, option in default_choices().items()]
    owners: dict[str, list[str]] = {}
    for path in files:
        for key in file_keys(path):
            owners.setdefault(key, []).append(str(path.relative_to(CONF)))
    shared = {f"pair.{k}" for k in yaml.safe_load((CONF / "run.yaml").read_text())["pair"]}
    overridden = lambda key, where: (
        key in shared and where[0] == "run.yaml" and all(w.startswith("pair/") for w in where[1:])
    )
    duplicated = {key: where for key, where in owners.items() if len(where) > 1 and not overridden(key, where)}
    assert not duplicated
    composed_keys = set(leaves(OmegaConf.to_container(composed(), resolve=False)))
    assert set(owners) == composed_keys


def test_fit_defaults_are_only_in_fit_default():
    for key in ("fit.lam", "fit.lam_relative", "fit.chunk_rows", "fit.coefficient_dtype"):
        where = [str(p.relative_to(CONF)) for p in CONF.rglob("*.yaml") if key in file_keys(p)]
        assert where == ["fit/default.yaml"], (key, where)
    lam = [str(p.relative_to(CONF)) for p in CONF.rglob("*.yaml") if re.search(r"^\s*lam:", p.read_text(), re.M)]
    assert sorted(lam) == ["fit/default.yaml", "sweep/k_lambda.yaml"]  # sweep.lam is the search range


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_only_change_existing_keys(experiment):
    """`# @package _global_`, and every key an experiment sets exists in the base config and differs from it."""
    path = CONF / "experiment" / f"{experiment}.yaml"
    assert path.read_text().splitlines()[0].strip() == "# @package _global_"
    base = leaves(OmegaConf.to_container(composed(), resolve=False))
    for key, value in file_keys(path).items():
        assert key in base, f"{experiment} sets unknown key {key}"
        assert base[key] != value, f"{experiment} repeats the default {key}={value}"


# --- the handoff policy: one group, read by every job ------------------------------------------------------------

OLD_POLICY_KEYS = ("eval.levers", "workload.policy", "workload.max_length_factor", "workload.guard_max_abs")


def test_the_policy_is_one_group_whose_defaults_are_the_api_defaults():
    """conf/policy/default.yaml is in the defaults list and holds the mode, every Levers field (a field without its
    YAML line has its default outside the one file) and the guards; composed, it is the Python API's Policy()."""
    assert default_choices()["policy"] == "default"
    policy = resolved()["policy"]
    assert list(policy) == list(Policy.__dataclass_fields__)  # mode, levers, the guards: in the API's order
    assert set(policy["levers"]) == set(Levers.__dataclass_fields__)
    assert policy_from(composed().policy) == Policy()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_no_lever_or_guard_outside_the_policy_group(experiment):
    """A job that reads a lever, the mode or a guard anywhere but `cfg.policy` fails: the old homes are gone from
    every experiment's config (and from every workload's), so reading them is a missing-key error."""
    cfg = composed(f"+experiment={experiment}")
    assert "levers" not in cfg.eval and set(cfg.policy) == set(Policy.__dataclass_fields__)
    with pytest.raises(ConfigAttributeError):
        cfg.eval.levers  # noqa: B018
    for workload in WORKLOAD_FILES if experiment == "routed" else ():
        composed_workload = composed(f"+experiment={experiment}", f"+workload={workload}").workload
        assert not {"policy", *Policy.__dataclass_fields__} & set(composed_workload) - {"levers"}, workload
        with pytest.raises(ConfigAttributeError):
            composed_workload.max_length_factor  # noqa: B018


def test_the_command_line_sets_the_policy():
    cfg = composed("+experiment=routed", "+workload=passage", "policy.mode=auto", "policy.levers.recompute=0.25",
                   "policy.levers.native_sink=4", "policy.max_length_factor=4", "policy.guard_max_abs=100")  # fmt: skip
    assert policy_from(cfg.policy) == Policy("auto", Levers(native_sink=4, recompute=0.25), 4.0, 100.0)


def test_code_reads_the_policy_only_through_policy_from():
    """The job config becomes Levers in one place (`Levers(**` only in src/runtime/routing.py `policy_from`; the
    lm-eval adapter builds them from its own model_args), and no job, script or config names the policy's old keys
    (only the record readers' translation, src/records.py, and the policy file's note on old records do)."""
    files = [p for folder in ("src", "scripts", "conf") for p in sorted((REPO / folder).rglob("*")) if p.is_file()]
    files = [p for p in files if p.suffix in (".py", ".sh", ".yaml")]
    built = [str(p.relative_to(REPO)) for p in files if p.suffix == ".py" and "Levers(**" in p.read_text()]
    assert built == ["src/eval/harness.py", "src/runtime/routing.py"]
    naming = {str(p.relative_to(REPO)) for p in files if any(key in p.read_text() for key in OLD_POLICY_KEYS)}
    assert naming == {"src/records.py", "conf/policy/default.yaml"}


# --- paths, hydra, tracking ---------------------------------------------------------------------------------------


def test_paths_follow_the_environment(monkeypatch, tmp_path):
    assert resolved()["paths"]["home"] == str(tmp_path / "home")
    monkeypatch.delenv("KVRELAY_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("KVRELAY_DATA", "/somewhere/data")
    paths = resolved()["paths"]
    assert paths["home"] == str(tmp_path / "user/.cache/kvrelay")
    assert paths["data"] == "/somewhere/data"
    monkeypatch.delenv("KVRELAY_DATA")
    data = resolved()["paths"]["data"]
    assert (REPO / data).resolve() == (REPO.parent / "shared/data").resolve()  # relative to the repo root (the cwd)
    assert resolved("paths.home=/x")["pair"] == resolved()["pair"]  # tiny pair: no path under home


def test_real_pairs_live_under_home():
    cfg = resolved("pair=qwen25coder_0p5b_to_1p5b", "paths.home=/models_home")
    assert cfg["pair"]["source"]["path"] == "/models_home/models/qwen25coder_0p5b"
    assert cfg["pair"]["target"]["path"] == "/models_home/models/qwen25coder_1p5b"


def test_hydra_settings():
    cfg = composed(hydra=True)
    assert cfg.hydra.job.chdir is False
    assert "${now:" in OmegaConf.to_container(cfg.hydra.run)["dir"]
    target = cfg.hydra.callbacks.mlflow_parent._target_
    assert target == "src.tracking.MLflowParentRun"
    assert issubclass(get_class(target), Callback)
    assert cfg.hydra.mode in (None, RunMode.RUN)


def test_tracking_and_sweep_stores_are_sqlite():
    cfg = resolved()
    assert cfg["tracking"]["uri"].startswith("sqlite:///")
    assert cfg["sweep"]["storage"].startswith("sqlite:///")


# --- the experiments ----------------------------------------------------------------------------------------------


def test_table1_sweeps_support_and_weighting_on_paper_budget():
    cfg = composed("+experiment=table1", hydra=True)
    assert cfg.hydra.mode == RunMode.MULTIRUN
    assert sweep_params("table1") == {"support": ["full", "local"], "weighting": ["uniform", "attn_repair"]}
    assert fit_sequences(cfg) * cfg.budget.seq_len // cfg.budget.stride == PAPER_ROWS
    assert cfg.tracking.experiment == "table1"


def test_attribution_sweeps_the_controls():
    cfg = composed("+experiment=attribution", hydra=True)
    assert cfg.hydra.mode == RunMode.MULTIRUN
    assert sweep_params("attribution") == {
        "support": ["pca", "cyclic", "local"],
        "weighting": ["uniform", "attn_repair"],
    }
    assert fit_sequences(cfg) * cfg.budget.seq_len // cfg.budget.stride == PAPER_ROWS
    assert resolved("support=cyclic")["support"]["shift"] != 0, "a cyclic control with shift 0 is Head-Local"


def fit_sequences(cfg) -> int:
    """Calibration sequences left for fitting after the held-out split (as Traces.split_heldout)."""
    return cfg.budget.sequences - max(1, round(cfg.budget.sequences * cfg.budget.heldout_fraction))


def test_budget_sweep_is_nested_prefixes_of_the_paper_budget():
    cfg = composed("+experiment=budget_sweep", hydra=True)
    assert cfg.hydra.mode == RunMode.MULTIRUN
    sizes = [int(v) for v in sweep_params("budget_sweep")["fit.sequences"]]
    assert sizes == [50, 100, 200, 500] == sorted(sizes)
    assert max(sizes) == fit_sequences(cfg) == 500
    assert cfg.weighting.kind == "attn_repair"
    assert list(cfg.eval.construction.budgets) == sizes  # the construction job times the same prefixes


@pytest.mark.parametrize("experiment", ["table1", "attribution", "budget_sweep"])
def test_every_sweep_point_composes_on_the_same_pair_and_corpus(experiment):
    """Paired comparisons: the swept points share the pair, the calibration corpus and the evaluation."""
    params = sweep_params(experiment)
    points = [dict(zip(params, values, strict=True)) for values in itertools.product(*params.values())]
    configs = [resolved(f"+experiment={experiment}", *(f"{k}={v}" for k, v in point.items())) for point in points]
    for point, cfg in zip(points, configs, strict=True):
        for key, value in point.items():
            if "." in key:
                group, field = key.split(".")
                assert str(cfg[group][field]) == value
            else:
                assert cfg[key] == resolved(f"{key}={value}")[key]
    for shared in ("pair", "eval", "budget"):
        assert all(cfg[shared] == configs[0][shared] for cfg in configs), shared
    fits = [{k: v for k, v in cfg["fit"].items() if k != "sequences"} for cfg in configs]
    assert all(f == fits[0] for f in fits)
    assert len({str(cfg["support"]) + str(cfg["weighting"]) + str(cfg["fit"]) for cfg in configs}) == len(points)


def test_support_linear_is_depth_selection_with_k1():
    for overrides in ((), ("+experiment=quickstart",), ("+experiment=table1",)):
        cfg = resolved(*overrides, "support=linear")
        assert cfg["support"] == {"kind": "local", "shift": 0, "selection": "depth"}
        assert cfg["fit"]["k"] == 1
        assert cfg["fit"]["lam"] == resolved()["fit"]["lam"]  # the rest of fit untouched
    assert resolved("support=linear", "fit.k=3")["fit"]["k"] == 3  # the command line still wins
    assert resolved("support=local")["fit"]["k"] == resolved()["fit"]["k"] > 1


def test_quickstart_is_the_tiny_random_pair_on_cpu():
    cfg = composed("+experiment=quickstart", hydra=True)
    assert cfg.hydra.mode in (None, RunMode.RUN)
    cfg = resolved("+experiment=quickstart")
    assert cfg["pair"] == resolved("pair=tiny_random")["pair"]
    assert cfg["pair"]["weights"] == "random"
    assert cfg["pair"]["device"] == "cpu"
    assert cfg["pair"]["source"]["seed"] != cfg["pair"]["target"]["seed"]
    assert (cfg["job"], cfg["support"]["kind"], cfg["weighting"]["kind"]) == ("fit_eval", "local", "attn_repair")
    assert cfg["budget"] == resolved("budget=tiny")["budget"]
    assert cfg["tracking"]["experiment"] == "quickstart"  # the gate judges routed-workload runs (conf/gate)


@pytest.mark.parametrize(
    ("experiment", "job"),
    [("latency", "latency"), ("construction", "construction"), ("gate", "gate"), ("optuna", "optuna")],
)
def test_job_experiments_select_their_job(experiment, job):
    assert resolved(f"+experiment={experiment}")["job"] == job


# --- group contents -----------------------------------------------------------------------------------------------


def test_pairs():
    pairs = [resolved(f"pair={option}", "paths.home=/h")["pair"] for group, option in OPTIONS if group == "pair"]
    assert len({p["direction"] for p in pairs}) == len(pairs)
    assert len({p["name"] for p in pairs}) == len(pairs)
    for pair in pairs:
        assert pair["weights"] in ("real", "random")
        if pair["weights"] == "random":
            assert pair["source"]["seed"] != pair["target"]["seed"]
            assert {"config", "seed"} <= set(pair["source"]) and {"config", "seed"} <= set(pair["target"])
        elif not pair["name"].endswith("_self"):  # a self-transfer pair reads one model twice
            assert pair["source"]["path"] != pair["target"]["path"]


def test_budgets_and_evaluation():
    for option in ("tiny", "paper"):
        budget = resolved(f"budget={option}")["budget"]
        assert 0 < budget["heldout_fraction"] < 1
        assert budget["seq_len"] % budget["stride"] == 0
        assert round(budget["sequences"] * budget["heldout_fraction"]) >= 1
        assert budget["corpus"] in CORPORA
    cfg = resolved()
    assert cfg["eval"]["nll"]["corpus"] in CORPORA
    assert cfg["eval"]["nll"]["corpus"] != cfg["budget"]["corpus"], "evaluation text must be disjoint from calibration"
    latency = cfg["eval"]["latency"]
    assert latency["prefix_len"] <= cfg["eval"]["nll"]["prefix_len"] + cfg["eval"]["nll"]["horizon"]
    assert latency["prefix_lens"] == sorted(latency["prefix_lens"])


@pytest.mark.parametrize(("option", "seq_len"), [("paper_2k", 2048), ("paper_4k", 4096), ("paper_8k", 8192)])
def test_long_calibration_budgets_change_only_the_sequence_length(option, seq_len):
    """paper_2k / 4k / 8k compose paper_mix and list only what differs: longer sequences, fewer of them — the same
    calibration tokens and fit rows (within 1 %), at most 8,192 tokens per batch."""
    base, budget = resolved("budget=paper_mix")["budget"], resolved(f"budget={option}")["budget"]
    text = yaml.safe_load((CONF / "budget" / f"{option}.yaml").read_text())
    assert text["defaults"] == ["paper_mix", "_self_"] and set(text) == {
        "defaults",
        "sequences",
        "seq_len",
        "batch_size",
    }
    assert {key for key in budget if budget[key] != base[key]} == {"sequences", "seq_len", "batch_size"}
    fit_rows = lambda b: (b["sequences"] - round(b["sequences"] * b["heldout_fraction"])) * b["seq_len"] // b["stride"]
    tokens = lambda b: b["sequences"] * b["seq_len"]
    assert budget["seq_len"] == seq_len and budget["batch_size"] * seq_len <= 8192
    assert abs(fit_rows(budget) / fit_rows(base) - 1) < 0.01 and abs(tokens(budget) / tokens(base) - 1) < 0.01


def test_sweep_and_gate_defaults():
    cfg = resolved()
    sweep = cfg["sweep"]
    assert 1 <= sweep["k"]["low"] <= sweep["k"]["high"]
    assert 0 < sweep["lam"]["low"] < cfg["fit"]["lam"] < sweep["lam"]["high"]
    assert sweep["direction"] == "maximize" and cfg["objective"] == "valid.nll_gap_recovered"
    assert cfg["gate"] == {
        "experiment": "routed",
        "run": None,
        "parent": None,
        "min_speedup": 2.0,
        "max_loss_points": 1.0,
        "min_task_units": 30,
        "min_timed_units": 20,
        "planned_loss_points": 0.0,
        "power": 0.8,
        "n_boot": 2000,
        "seed": 0,
        "plans": "results/gate_plans.yaml",
        "max_harness_skew": 1.25,
        "max_prefill_fraction": 0.5,
        "length_edges": [1024, 2048, 4096, 8192, 16384, 32768],
        "min_length_items": 300,
    }
