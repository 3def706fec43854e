"""scripts/device_bg.sh and `device_quality.sh frontier3-par`, on the CPU with a stand-in `python3` (the GPU stages are
what a lease runs; here only their plumbing): a job outlives the call that started it and leaves its exit status; a
frontier chain runs its steps one after another, each with its own lost shares (F3_RECOMPUTE); the test steps start
only after every chain ended, and read a still copy of the records."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAND_IN = """#!/bin/bash
# src.run: log its overrides and the time it ran; src.choose: one lever (the grid check is src.choose's own test);
# the signal stage's report: nothing
case "$1 $2" in
  "-m src.run") echo "$(date +%s.%N) $*" >> "$RUNS"; sleep 0.3 ;;
  "-m src.choose") echo "$*" >> "$CHOICES"; echo "policy.levers.recompute=0.1" ;;
  "-m src.report.error_signal") ;;
  *) exit 3 ;;
esac
"""


@pytest.fixture
def lease(tmp_path):
    """A fake GPU machine: HOME, a `python3` that records what it was asked to run, the tree copied."""
    home, bin_ = tmp_path / "home", tmp_path / "bin"
    (home / "data").mkdir(parents=True)
    bin_.mkdir()
    (bin_ / "python3").write_text(STAND_IN)
    (bin_ / "python3").chmod(0o755)
    env = os.environ | {
        "HOME": str(home), "PATH": f"{bin_}:{os.environ['PATH']}", "RUNS": str(tmp_path / "runs.txt"),
        "CHOICES": str(tmp_path / "choices.txt"),
    }  # fmt: skip
    return env, home, tmp_path


def _bash(env: dict, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_job_outlives_its_call_and_leaves_its_exit_status(lease):
    env, home, _ = lease
    started = _bash(
        env, "scripts/device_bg.sh", "start", "slow", "X=7", "--", "bash", "-c", "sleep 1; echo x=$X; exit 3"
    )
    assert started.returncode == 0 and "started slow" in started.stdout  # returned before the job ended
    assert not (home / "bg/slow.rc").exists()
    waited = _bash(env, "scripts/device_bg.sh", "wait", "30", "slow")
    assert waited.stdout == "slow: rc 3\n" and (home / "bg/slow.log").read_text() == "x=7\n"
    again = _bash(env, "scripts/device_bg.sh", "start", "slow", "--", "true")
    assert again.returncode == 2 and "already started" in again.stderr
    never = _bash(env, "scripts/device_bg.sh", "wait", "1", "other")
    assert never.returncode == 2 and "never started" in never.stderr


def test_frontier_chains_run_their_steps_and_the_test_steps_after_every_chain(lease):
    env, home, tmp_path = lease
    copied = _bash(env, "scripts/device_bg.sh", "tree")
    assert copied.returncode == 0 and (home / "tree/.git").exists() and not (home / "tree/.stage").exists()
    (home / "carried/run").mkdir(parents=True)
    env = env | {"F3_CHAINS": "6 3:0.165,4:0.165/0.265", "VALID_CARRIED": str(home / "carried")}
    assert _bash(env, "scripts/device_quality.sh", "frontier3-par", cwd=home / "tree").returncode == 0
    assert "frontier3-test: rc 0" in _bash(env, "scripts/device_bg.sh", "wait", "60", "frontier3-test").stdout
    runs = []  # (when, the overrides as Hydra reads them: a later key wins)
    for line in (tmp_path / "runs.txt").read_text().splitlines():
        at, *args = line.split()
        runs.append((float(at), dict(arg.split("=", 1) for arg in args if "=" in arg)))
    asked = lambda text: [
        at for at, args in runs if dict(p.split("=", 1) for p in text.split()).items() <= args.items()
    ]  # noqa: E731
    deviation = "policy.levers.recompute=0.015,0.065,0.115,0.165,0.265 policy.levers.recompute_rule=deviation"
    assert len(asked(f"pair=qwen25coder_1p5b_to_0p5b {deviation} fit.v_space=attention")) == 1  # step 6, every share
    up, down = (
        asked("pair=qwen25coder_0p5b_to_1p5b policy.levers.recompute=0.165 policy.levers.recompute_rule=turn"),
        asked("pair=qwen25coder_1p5b_to_0p5b policy.levers.recompute=0.165,0.265 policy.levers.recompute_rule=turn"),
    )  # steps 3 and 4: their lost shares only, one after the other in one chain
    assert len(up) == len(down) == 1 and up[0] < down[0]
    tests = asked("workload.split=test")
    assert len(tests) == 2 and min(tests) > max(at for at, args in runs if args["workload.split"] != "test")
    choices = (tmp_path / "choices.txt").read_text()
    assert choices.count("--expect 20") == 4 and f"{home}/valid-chosen " in choices  # both test steps, both directions
    assert (home / "valid-chosen/run").is_dir()  # the carried records joined before the choice


def test_any_queue_runs_as_chains(lease):
    """`par`: the signal queue's steps 1-8 as two chains, one mapper each; every step alone (FROM=TO), in its turn."""
    env, home, tmp_path = lease
    started = _bash(env | {"PAR_STAGE": "signal", "PAR_CHAINS": "1,2,3,4 5,6,7,8"}, "scripts/device_quality.sh", "par")
    assert started.returncode == 0 and started.stdout.count("started signal-") == 2
    waited = _bash(env, "scripts/device_bg.sh", "wait", "60", "signal-1-2-3-4", "signal-5-6-7-8")
    assert waited.stdout == "signal-1-2-3-4: rc 0\nsignal-5-6-7-8: rc 0\n"
    runs = [dict(a.split("=", 1) for a in line.split()[1:] if "=" in a) for line in open(tmp_path / "runs.txt")]
    spaces = [run["fit.v_space"] for run in runs if "eval.diagnose.read_error" in run]
    assert len(runs) == 8 and sorted(spaces) == ["attention"] * 4 + ["token"] * 4
    assert all((home / f"signal/s{n}/log.txt").is_file() for n in range(1, 9))


def test_par_names_its_stage_and_chains(lease):
    env, home, _ = lease
    for stage, extra, missing in (("par", {"PAR_CHAINS": "1"}, "PAR_STAGE"), ("par", {"PAR_STAGE": "signal"}, "PAR_CHAINS"),
                                  ("frontier3-par", {}, "F3_CHAINS")):  # fmt: skip
        done = _bash(env | extra, "scripts/device_quality.sh", stage)
        assert done.returncode != 0 and missing in done.stderr
    assert not (home / "bg").exists() or not any((home / "bg").iterdir())  # nothing started
