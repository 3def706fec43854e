"""scripts/sdpa_first_call.py (the probe that names a per-length attention cost on a GPU lease) runs on this host:
every backend set timed or named as unable to run, and bad arguments refused before any call."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sdpa_first_call.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True)


def test_the_probe_times_every_backend_set_on_the_host():
    done = _run("--lengths", "40", "56", "--heads", "4", "2", "16")
    assert done.returncode == 0, done.stderr
    for name in ("torch's choice", "flash alone", "timed set"):
        assert f"  {name}: first call on a new length " in done.stdout
    assert "  cuDNN alone: cannot run" in done.stdout  # no cuDNN on a CPU
    assert "sdpa priority after the calls:" in done.stdout


def test_the_probe_refuses_heads_that_do_not_group():
    done = _run("--heads", "3", "2", "16")
    assert done.returncode != 0 and "query heads a multiple of the KV heads" in done.stderr
