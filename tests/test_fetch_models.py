"""scripts/fetch_models.py, the command line of src/fetch.py: --list prints each model's status and path, names and
flags reach fetch_model, an unknown name is refused (the fetching itself: tests/test_fetch.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from src.fetch import MARKER, RECIPES, model_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_models.py"
_spec = importlib.util.spec_from_file_location("fetch_models", SCRIPT)
script = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def test_list_reports_status_and_paths(tmp_path, capsys):
    ready = model_dir(RECIPES["smollm2_135m"], tmp_path)
    ready.mkdir(parents=True)
    (ready / MARKER).write_text("{}")
    assert script.main(["--list", "--home", str(tmp_path)]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert lines["smollm2_135m"] == ["ready", str(ready)]
    assert lines["qwen25coder_0p5b"][0] == "missing"


def test_names_and_flags_reach_fetch_model(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(script, "fetch_model", lambda recipe, home, **flags: calls.append((recipe.name, home, flags)))
    assert script.main(["qwen25coder_0p5b", "qwen25coder_1p5b", "--gguf-only", "--home", str(tmp_path)]) == 0
    flags = {"keep_gguf": False, "gguf_only": True}
    assert calls == [("qwen25coder_0p5b", tmp_path, flags), ("qwen25coder_1p5b", tmp_path, flags)]


def test_an_unknown_model_is_refused(capsys):
    with pytest.raises(SystemExit):
        script.main(["qwen25coder_0p5b", "no_such_model"])
    assert "unknown model(s) no_such_model; known: qwen25coder_0p5b" in capsys.readouterr().err
