"""The README's 20-line example runs as written (from the repo root, like a reader would)."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(monkeypatch, capsys):
    if not (ROOT.parent / "shared/data").is_dir():
        pytest.skip("shared/data is not beside the repo")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The library in 20 lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    generated = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(eval(generated)) == 8
    assert os.path.isfile("/tmp/kvrelay-mapper/manifest.json")
