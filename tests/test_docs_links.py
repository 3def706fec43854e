"""Every relative link in the docs a reader follows resolves: README.md, BENCHMARKS.md, CHANGELOG.md and docs/*.md —
the file (or folder) a link names exists, and its `#anchor` is a heading of that Markdown file (as GitHub derives
heading anchors) or an explicit `<a id=…>`. Links inside code blocks and inline code are text, not links."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target); text may span lines
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXPLICIT = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, every character but letters, marks, numbers,
    '_', '-' and spaces removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = (ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines: heading slugs (a repeated one gets -1, -2, … as on GitHub) and explicit
    `<a id=…>` / `<a name=…>`."""
    found, seen = set(EXPLICIT.findall(text)), {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken(page: Path, text: str | None = None) -> list[str]:
    """The links of `page` (its text, or `text` read as if it were the page) that do not resolve."""
    text = page.read_text() if text is None else text
    gone = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: — not checked here
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            gone.append(f"{target} (no file {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where})")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where.read_text()):
            gone.append(f"{target} (no heading #{anchor} in {where.relative_to(ROOT)})")
    return gone


def test_every_relative_link_and_anchor_resolves():
    assert all(page.exists() for page in PAGES[:3])
    links = sum(len(LINK.findall(prose(page.read_text()))) for page in PAGES)
    assert links > 60  # the check reads the pages' links (a pattern that finds none passes vacuously)
    assert {page.name: found for page in PAGES if (found := broken(page))} == {}


def test_a_broken_anchor_or_file_is_caught():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert "(BENCHMARKS.md#the-decision)" in text
    planted = text.replace("(BENCHMARKS.md#the-decision)", "(BENCHMARKS.md#the-decisions)", 1)
    assert broken(readme, planted) == ["BENCHMARKS.md#the-decisions (no heading #the-decisions in BENCHMARKS.md)"]
    assert broken(readme, "see [it](docs/runing.md) and [here](#nowhere)") == [
        "docs/runing.md (no file docs/runing.md)",
        "#nowhere (no heading #nowhere in README.md)",
    ]
    assert broken(readme, "`[not a link](#nowhere)` and\n```\n[nor this](#nowhere)\n```\n") == []


def test_anchors_follow_github():
    assert slug("Quality (real pair: Qwen2.5-Coder 0.5B → 1.5B)") == "quality-real-pair-qwen25-coder-05b--15b"
    assert slug("Optuna over k, relative λ and α cap (CPU, small budget)") == (
        "optuna-over-k-relative-λ-and-α-cap-cpu-small-budget"
    )
    assert anchors("# A\n## A\n```\n# A\n```\n### A") == {"a", "a-1", "a-2"}
