"""The documentation: README.md, docs/*.md and benchmarks/NOTES.md. Every relative link resolves (the file exists, and
an anchor names a heading of the page it points to, as GitHub spells heading anchors); README links every docs page
and states every subcommand and the pinned JAX and Flax range; every repository path and every name of the
package's code the pages give exists; prose keeps to 120 columns outside tables, images and code; and README's Python
quickstart runs and passes the three principles."""
import ast
import contextlib
import importlib
import io
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "NOTES.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
WIDTH = 120
REPO_PATH = re.compile(r"`((?:starscream_jax|scripts|tests|examples|meshes|models|benchmarks|docs|data)/[\w./-]*)`")
CODE_NAME = re.compile(r"`((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)`")
FILE_SUFFIXES = {"py", "json", "jsonl", "toml", "cfg", "md", "png", "log", "sh", "xml", "conf", "safetensors",
                 "damaged"}
"""A backticked `a.b` ending in one of these is a file name, not code."""
PACKAGE = ROOT / "starscream_jax"
MODULES = [".".join(path.relative_to(ROOT).parent.parts if path.name == "__init__.py"
                   else path.relative_to(ROOT).with_suffix("").parts) for path in PACKAGE.rglob("*.py")]
"""Every module and package of the package by dotted name, read from the files (nothing imported)."""


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


def source(module: str) -> str:
    path = ROOT / module.replace(".", "/")
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def owner(head: str) -> str | None:
    """The one module `head` names: a dotted path from `starscream_jax`, its last parts (`decoder`, `model.ops`), or
    a class defined at the top of exactly one module (`ModelConfig`); None when it names none or several."""
    modules = [module for module in MODULES if module == head or module.endswith("." + head)]
    if not modules and head.isidentifier() and head[0].isupper():
        modules = [module for module in MODULES
                   if re.search(rf"^class {head}\b", source(module), re.M)]
    return modules[0] if len(modules) == 1 else None


def resolve(name: str):
    """The package's object that `name` (`dense_cache.split_cache`, `ModelConfig.scan_unroll`) names, None when its head
    names no module or class of the package (another library's names, say); AttributeError when the rest is gone."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module = owner(".".join(parts[:split]))
        if module is None:
            continue
        found = importlib.import_module(module)
        rest = parts[split:] if module.endswith(".".join(parts[:split])) else parts
        for attribute in rest:
            found = getattr(found, attribute)
        return found
    return None


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


def subcommands() -> list[str]:
    """The keys of `cli/main.py`'s SUBCOMMANDS, read from its source (importing the command imports every stage)."""
    tree = ast.parse((PACKAGE / "cli" / "main.py").read_text())
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(getattr(target, "id", None) == "SUBCOMMANDS" for target in node.targets))
    return [key.value for key in table.keys]


def test_the_readme_lists_every_subcommand():
    text = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", text.split("The `starscream` command", 1)[1].split("\n\n", 2)[1], re.M)
    assert listed == subcommands(), f"README's subcommand table lists {listed}; the command has {subcommands()}"


def test_every_name_the_docs_give_the_code_exists():
    """Names in the docs that point into the package (`dense_cache.split_cache`, `hardware.backend.CUDA`) name
    what is there; benchmarks/NOTES.md is history and keeps the names of its day, as do the rendered tables' notes."""
    missing = []
    for page in PAGES[:-1]:
        text = re.sub(r"<!-- speed-tables:start (\w+) -->.*?<!-- speed-tables:end \1 -->", "", page.read_text(),
                      flags=re.S)
        for name in sorted(set(CODE_NAME.findall(text))):
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            try:
                resolve(name)
            except AttributeError as error:
                missing.append(f"{page.name}: `{name}` ({error})")
    assert not missing, "names the code no longer has:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda page: str(page.relative_to(ROOT)))
def test_every_path_in_the_repository_a_page_names_exists(page):
    """A backticked path from the repository's root (`scripts/bench_mfu.py`, `tests/fixtures/hf/`) is there;
    benchmarks/NOTES.md, the history, keeps the paths of its day."""
    missing = [path for path in sorted(set(REPO_PATH.findall(page.read_text()))) if not (ROOT / path).exists()]
    assert not missing, f"{page.name} names paths that are not in the repository: {', '.join(missing)}"


def test_the_readme_states_the_pinned_jax_and_flax_range():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    text = " ".join((ROOT / "README.md").read_text().split())
    for package, name in (("jax", "JAX"), ("flax", "Flax")):
        pinned = next(spec for spec in dependencies if re.match(rf"{package}[<>=]", spec))
        bounds = re.findall(r"(>=|<)\s*([\d.]+)", pinned)
        stated = f"{name} " + " and ".join(f"{operator} {version}" for operator, version in bounds)
        assert stated in text, f"README should state {stated!r}, as pyproject.toml pins {pinned!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_prose_keeps_to_120_columns(page):
    long = [f"{page.name}:{number}: {len(line)} columns" for number, line in prose(page)
            if len(line) > WIDTH and not line.startswith(("|", "!["))]
    assert not long, f"lines over {WIDTH} columns outside tables, images and code (rewrap them):\n" + "\n".join(long)


def test_the_anchor_of_a_heading_is_githubs():
    assert anchor("Quick start (a fresh machine with Python 3.11+ and make)") == (
        "quick-start-a-fresh-machine-with-python-311-and-make")
    assert anchor("Any jitted step: `check`") == "any-jitted-step-check"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[there](missing.md) [here](#title) [gone](#nowhere)\n```\n[code](skipped.md)\n```\n")
    assert relative_links(page) == [(3, "missing.md"), (3, "#title"), (3, "#nowhere")]
    assert anchors(page) == {"title"}


def test_a_name_is_resolved_in_the_package_or_left_alone():
    from starscream_jax.model import dense_cache

    assert resolve("dense_cache.split_cache") is dense_cache.split_cache
    assert resolve("model.dense_cache.split_cache") is dense_cache.split_cache
    assert resolve("ModelConfig.scan_unroll") is not None
    assert resolve("jax.shard_map") is None
    with pytest.raises(AttributeError):
        resolve("dense_cache.no_such_function")


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
