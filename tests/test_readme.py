"""The README's library example runs as written, from any working folder (here a temporary one), and its heading
counts its lines."""

import os
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def example() -> tuple[int, str]:
    """(the line count the heading claims, the code) of the README's library example."""
    claimed, section = re.search(
        r"^## The library in (\d+) lines\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M
    ).groups()
    return int(claimed), re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_heading_counts_the_example():
    claimed, code = example()
    assert claimed == len(code.splitlines())


def test_readme_example_runs_from_any_folder(monkeypatch, capsys, tmp_path):
    data = os.environ.get("KVRELAY_DATA", ROOT.parent / "shared/data")
    if not Path(data).is_dir():
        pytest.skip("no shared data beside the repo (nor KVRELAY_DATA)")
    monkeypatch.chdir(tmp_path)  # not the repo root: the example finds conf/ and the data through the package
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its mkdtemp: under this test's own folder
    exec(compile(example()[1], "README.md", "exec"), {"__name__": "readme"})
    generated = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(eval(generated)) == 8
    (manifest,) = tmp_path.glob("kvrelay-mapper-*/manifest.json")
    assert manifest.is_file()
