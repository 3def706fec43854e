"""The README's 27-line example runs as written (from the repo root, like a reader would), saving its mapper in a
temporary directory of its own."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(monkeypatch, capsys):
    if not (ROOT.parent / "shared/data").is_dir():
        pytest.skip("shared/data is not beside the repo")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The library in 27 lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), namespace)
    generated = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(eval(generated)) == 8
    assert os.path.isfile(os.path.join(namespace["directory"], "manifest.json"))
