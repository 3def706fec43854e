"""scripts/tables.py, run as a reader runs it: `--check` passes on the committed BENCHMARKS.md and results/, a table
prints by name, `--records DIR` prints the quality tables of a record folder (the tables themselves:
tests/test_report.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tables(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/tables.py"), *args], capture_output=True, text=True, cwd=cwd
    )


def test_check_passes_on_the_committed_tables(tmp_path):
    done = tables("--check", cwd=tmp_path)  # from anywhere: the script finds this checkout's src/ and BENCHMARKS.md
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("marked table(s) equal their rebuild from results/")
    assert "in BENCHMARKS.md" in done.stdout and "2 in README.md" in done.stdout  # both pages are checked


def test_a_table_prints_by_name_and_a_record_folder_prints_its_quality_tables(tmp_path):
    done = tables("quickstart")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| metric | value |\n|---|---|\n| recorded | ")
    shutil.copytree(ROOT / "results/quickstart-cpu", tmp_path / "records")
    done = tables("--records", str(tmp_path / "records"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| run | prefix tokens | prefill frac |")


def test_an_unknown_table_is_named():
    done = tables("no_such_table")
    assert done.returncode != 0 and "no table 'no_such_table'" in done.stderr
