"""docs/extending.md cites only what exists: every `src/…`, `conf/…`, `tests/…`, `scripts/…` path it mentions, and
every `tests/<file>.py::<test>` it tells a reader to copy."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs/extending.md"
PATH = re.compile(r"\b((?:src|conf|tests|scripts)/[\w./-]*\w)(?:::(\w+))?")  # a <placeholder> stops it at its folder


def cited(text: str) -> list[tuple[str, str | None]]:
    return sorted(set(PATH.findall(text)))


def missing(text: str) -> list[str]:
    """The cited paths that do not exist, and the cited tests their file does not define."""
    gone = []
    for path, test in cited(text):
        if not (REPO / path).exists():
            gone.append(path)
        elif test:
            names = {
                node.name
                for node in ast.walk(ast.parse((REPO / path).read_text()))
                if isinstance(node, ast.FunctionDef)
            }
            gone += [] if test in names else [f"{path}::{test}"]
    return gone


def test_every_cited_path_and_test_exists():
    text = DOC.read_text()
    assert len(cited(text)) > 30  # the check reads the doc's citations (a pattern that finds none passes vacuously)
    assert missing(text) == []


def test_a_wrong_path_or_test_name_is_caught():
    assert missing("see `src/suport.py` and `tests/test_gate.py::test_no_such_test`") == [
        "src/suport.py",
        "tests/test_gate.py::test_no_such_test",
    ]
    assert missing("a new `conf/pair/<name>.yaml`") == []  # a placeholder leaves its folder, which exists
