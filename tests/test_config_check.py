"""The composed config checked before a job starts (src/config_check.py, called first by src/run.py `main`): a bad
policy mode, a lever the receiver cannot run (the turn rule without the engine, the attention rule on it), a misspelt
policy key (named with the closest valid one) are each one clear line and a non-zero exit, before any model loads or
MLflow run opens; every shipped experiment and workload passes (issue 32 item 5)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import src.pipeline
import src.routed
import src.run
import src.tracking
from src.config_check import ConfigError, check_config
from src.run import JOBS

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))
WORKLOADS = sorted(p.stem for p in (REPO / "conf/workload").glob("*.yaml") if p.stem != "default")
TURN = ("policy.levers.recompute=0.25", "policy.levers.recompute_rule=turn")
ATTENTION = ("policy.levers.recompute=0.25", "policy.levers.recompute_rule=attention")
PASSAGE = ("+experiment=routed", "+workload=passage")


def composed(*overrides: str, data: Path = REPO / "tests"):
    """The job config; `paths.data` a folder that exists (the check asks no more of it) unless `data` says else."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("run", overrides=[f"paths.data={data}", *overrides])


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        check_config(composed(*overrides), JOBS)
    message = str(refused.value)
    assert "\n" not in message  # one line
    return message


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_passes(experiment):
    workload = ("+workload=passage",) if experiment == "routed" else ()  # routed names its workload
    check_config(composed(f"+experiment={experiment}", *workload), JOBS)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload_passes_with_the_routed_job(workload):
    check_config(composed("+experiment=routed", f"+workload={workload}"), JOBS)


def test_a_bad_policy_mode_is_refused():
    assert refusal("policy.mode=mapp") == "policy: policy mode must be one of ('map', 'reprefill', 'auto'), not 'mapp'"
    assert "length_guard must be one of" in refusal("policy.length_guard=sometimes")
    assert "recompute is a share of the prefix in [0, 1], not 1.5" in refusal("policy.levers.recompute=1.5")


def test_a_misspelt_policy_key_is_named_with_the_closest_valid_one():
    assert refusal("+policy.levers.hold_bak=2") == (
        "policy.levers.hold_bak is not a key of the policy: did you mean policy.levers.hold_back?"
    )
    assert refusal("+policy.mdoe=map") == "policy.mdoe is not a key of the policy: did you mean policy.mode?"
    assert refusal("+policy.levers.zzz=1").startswith("policy.levers.zzz is not a key of the policy (valid: policy.")


def test_the_turn_rule_without_the_engine_is_refused():
    assert "the turn rule are built on the static engine" in refusal(*TURN)  # fit_eval: DynamicCache only
    message = refusal(*PASSAGE, *TURN)
    assert message.startswith("policy.levers on Hugging Face's DynamicCache (workload.engine_capacity: null): ")
    check_config(composed(*PASSAGE, *TURN, "workload.engine_capacity=4096"), JOBS)  # on the engine it runs
    check_config(composed(*PASSAGE, *TURN, "policy.mode=reprefill"), JOBS)  # never splices: the levers are unused


def test_the_attention_rule_on_the_engine_is_refused():
    message = refusal(*PASSAGE, *ATTENTION, "workload.engine_capacity=4096")
    assert message == (
        "policy.levers on the static engine (workload.engine_capacity is set): the attention rule is not built on the "
        "static engine (its selection pass): use deviation"
    )
    check_config(composed(*PASSAGE, *ATTENTION), JOBS)  # on Hugging Face's cache it runs


def test_the_jobs_own_checks_are_called():
    """The deviation rule's depth with token features (check_splice), the workload's checks (src/routed.py
    check_workload), a job that does not exist, a routed job without a workload."""
    assert "recompute_layers ≥ 2" in refusal("fit.token_features=true", "policy.levers.recompute=0.25")
    assert "not sharded" in refusal("+experiment=routed", "+workload=multiturn", "workload.shards=2")
    assert "does not run on the engine" in refusal(
        "+experiment=routed", "+workload=switches", "workload.engine_capacity=64"
    )
    assert refusal("job=fiteval") == "job 'fiteval' is not a job: did you mean fit_eval?"
    assert refusal("+experiment=routed").startswith("the routed job needs a workload: +workload=NAME")


def test_a_data_folder_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"paths.data '\S+/nowhere' is not a folder \(from .*\): the fit_eval job "):
        check_config(composed(data=tmp_path / "nowhere"), JOBS)
    check_config(composed("+experiment=gate", data=tmp_path / "nowhere"), JOBS)  # the gate reads records only


class Loaded(AssertionError):
    pass


def test_the_job_refuses_before_any_model_loads_or_run_opens(monkeypatch):
    """src/run.py main checks first: with loading and tracking forbidden, each class exits with its one line."""

    def forbidden(*args, **kwargs):
        raise Loaded("a model loaded or a run opened before the config was checked")

    for module in (src.run, src.routed, src.pipeline):
        monkeypatch.setattr(module, "load", forbidden)
    monkeypatch.setattr(src.tracking, "job_run", forbidden)
    for overrides in (("policy.mode=mapp",), ("+policy.levers.hold_bak=2",), TURN,
                      (*PASSAGE, *ATTENTION, "workload.engine_capacity=4096")):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            src.run.main.__wrapped__(composed(*overrides))
        assert str(exited.value).startswith("config: "), overrides


def test_the_command_prints_one_line_and_exits_non_zero(tmp_path):
    """`python -m src.run` with a misspelt lever: exit code ≠ 0, one line on stderr, no traceback, nothing tracked."""
    env = dict(os.environ, KVRELAY_HOME=str(tmp_path / "home"), KVRELAY_DATA=str(REPO / "tests"))
    command = [sys.executable, "-m", "src.run", "+policy.levers.hold_bak=2", f"tracking.uri=sqlite:///{tmp_path}/m.db",
               f"hydra.run.dir={tmp_path / 'out'}"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    assert (
        done.stderr
        == "config: policy.levers.hold_bak is not a key of the policy: did you mean policy.levers.hold_back?\n"
    )
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "home").exists()
