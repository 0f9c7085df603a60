"""The documentation: README.md, docs/*.md and benchmarks/NOTES.md. Every relative link resolves (the file exists, and
an anchor names a heading of the page it points to, as GitHub spells heading anchors), README links every docs page
and lists every subcommand, prose keeps to 120 columns outside tables, images and code, and README's Python
quickstart runs and passes the three principles."""
import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "NOTES.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
WIDTH = 120


def prose(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page outside code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of every heading of `page` (a repeated heading's second anchor ends in -1, and so on)."""
    seen: dict[str, int] = {}
    for _, line in prose(page):
        if found := re.match(r"#{1,6} (.+)", line):
            name = anchor(found.group(1))
            seen[name] = seen.get(name, -1) + 1
            if seen[name]:
                seen[f"{name}-{seen[name]}"] = 0
    return set(seen)


def relative_links(page: Path) -> list[tuple[int, str]]:
    return [(number, target) for number, line in prose(page) for target in LINK.findall(line)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for number, target in relative_links(page):
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{page.name}:{number}: {target} (no heading with anchor #{fragment} in {linked.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in relative_links(ROOT / "README.md")}
    unlinked = [page.name for page in PAGES if page.parent == ROOT / "docs" and page.resolve() not in linked]
    assert not unlinked, f"docs pages missing from README's Documentation list: {', '.join(unlinked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_prose_keeps_to_120_columns(page):
    long = [f"{page.name}:{number}: {len(line)} columns" for number, line in prose(page)
            if len(line) > WIDTH and not line.startswith(("|", "!["))]
    assert not long, f"lines over {WIDTH} columns outside tables, images and code (rewrap them):\n" + "\n".join(long)



def test_the_readme_lists_every_subcommand():
    from starscream_jax.cli.main import SUBCOMMANDS

    text = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", text.split("The `starscream` command", 1)[1].split("\n\n", 2)[1], re.M)
    assert listed == list(SUBCOMMANDS), f"README's subcommand table lists {listed}; the command has {list(SUBCOMMANDS)}"

def test_the_anchor_of_a_heading_is_githubs():
    assert anchor("Quick start (a fresh machine with Python 3.11+ and make)") == (
        "quick-start-a-fresh-machine-with-python-311-and-make")
    assert anchor("Any jitted step: `check`") == "any-jitted-step-check"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[there](missing.md) [here](#title) [gone](#nowhere)\n```\n[code](skipped.md)\n```\n")
    assert relative_links(page) == [(3, "missing.md"), (3, "#title"), (3, "#nowhere")]
    assert anchors(page) == {"title"}


def test_the_readme_quickstart_runs_and_passes_the_principles():
    text = (ROOT / "README.md").read_text()
    section = text.split("## The public API in a few lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md quickstart", "exec"), {"__name__": "quickstart"})
    verdicts = re.findall(r"^\s+\d (.+?)\s{2,}(\S+)", printed.getvalue(), re.M)
    assert [verdict for _, verdict in verdicts] == ["ok", "ok", "ok"], printed.getvalue()
    assert "P(('data', 'xcd'), 'gpu')" in printed.getvalue()
