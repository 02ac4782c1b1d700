"""The pages read as Markdown (on GitHub, in an editor) as they do on the site.

Their code samples are copies of docs/samples (which tests/docs runs), kept in step by
scripts/docs-samples; their code fits the width the site shows; their relative links lead
somewhere.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import unicodedata
from pathlib import Path
from types import ModuleType

import markdown
import pytest
from pymdownx.snippets import SnippetExtension, SnippetPreprocessor

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
WIDTH = 80
"""Characters a code block shows without scrolling: the Material theme at a 1280 px window
(its content column is 688 px; code is Roboto Mono at 13.6 px, 8.2 px a character)."""
FENCE = re.compile(r"^([ \t]*)(`{3,})([^`\n]*)\n(.*?)^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)[ \t]*$", re.MULTILINE)
OBJECT = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)
"""An API reference's mkdocstrings line: on the site, the anchors of the object and its members."""


def load_script() -> ModuleType:
    """scripts/docs-samples, which has no .py suffix, as a module."""
    path = ROOT / "scripts" / "docs-samples"
    loader = importlib.machinery.SourceFileLoader("docs_samples", str(path))
    spec = importlib.util.spec_from_loader("docs_samples", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


SCRIPT = load_script()
PAGES = SCRIPT.pages(ROOT)


def name(page: Path) -> str:
    """The page's path from the repository root."""
    return page.relative_to(ROOT).as_posix()


def copies() -> list[tuple[Path, str, list[str]]]:
    """Every copied block: (page, target, its lines)."""
    return [
        (page, target, lines)
        for page in PAGES
        for target, lines in SCRIPT.copies(page.read_text(encoding="utf-8"))
    ]


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_the_copied_code_is_the_code_of_its_source(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    rendered = SCRIPT.render(text)
    stale = [
        target
        for (target, shown), (_, current) in zip(
            SCRIPT.copies(text), SCRIPT.copies(rendered), strict=False
        )
        if shown != current
    ]
    assert rendered == text, (
        f"{name(page)}: the code copied from {', '.join(stale) or 'docs/samples'} is not "
        "the code there (or an include line waits to be copied): run `make docs-samples`"
    )


def included_by_snippets(target: str) -> list[str]:
    """What pymdownx.snippets, as the site configured it, includes for `--8<-- "target"`."""
    config = SnippetExtension(
        base_path=[str(ROOT)], check_paths=True, dedent_subsections=True
    ).getConfigs()
    lines = SnippetPreprocessor(config, markdown.Markdown()).run([f'--8<-- "{target}"'])
    while lines and not lines[-1].strip():
        lines.pop()
    return [line if line.strip() else "" for line in lines]


@pytest.mark.parametrize(
    "page, target, lines", copies(), ids=[f"{name(p)}:{t}" for p, t, _ in copies()]
)
def test_a_copy_is_what_a_snippets_include_of_its_target_shows(
    page: Path, target: str, lines: list[str]
) -> None:
    assert lines == included_by_snippets(target), f"{name(page)} shows {target} otherwise"


@pytest.mark.parametrize(
    "page, target", [(p, t) for p, t, _ in copies()], ids=[f"{name(p)}:{t}" for p, t, _ in copies()]
)
def test_a_copy_comes_from_tested_code(page: Path, target: str) -> None:
    path = target.partition(":")[0]
    assert path.startswith(
        (
            "docs/samples/",
            "examples/fastapi_orders/",
            "examples/shop/",
            "tests/examples/",
            "tests/mersal_sqlalchemy/alembic_project/",
        )
    ), (
        f"{name(page)} shows {path}: samples live in docs/samples (run by tests/docs), "
        "the examples (run by tests/examples) or the Alembic project of tests/mersal_sqlalchemy"
    )


def python_lines() -> list[tuple[str, str]]:
    """Every line of the samples' modules and of the pages' python blocks: (where, line)."""
    found = [
        (f"{name(path)}:{number}", line)
        for path in sorted((DOCS / "samples").glob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
    ]
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            indent, _, info, body = block.groups()
            if info.strip() != "python":
                continue
            first = text.count("\n", 0, block.start(4)) + 1
            for number, line in enumerate(body.splitlines(), first):
                found.append((f"{name(page)}:{number}", line.removeprefix(indent)))
    return found


def test_no_python_line_is_wider_than_the_site_shows() -> None:
    wide = [f"{where} ({len(line)})" for where, line in python_lines() if len(line) > WIDTH]
    assert not wide, (
        f"lines over {WIDTH} characters scroll on the site; wrap them, then run "
        f"`make docs-samples`: {', '.join(wide)}"
    )


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading (the site's toc makes the same ones for ours)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, outside code blocks, and its `::: module` lines."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(heading) for heading in HEADING.findall(text)} | set(OBJECT.findall(text))


def has_anchor(page: Path, anchor: str) -> bool:
    """Whether `anchor` is a heading of the page, or an object its API reference documents."""
    found = anchors(page)
    return anchor in found or any(anchor.startswith(f"{name}.") for name in found)


def links() -> list[tuple[Path, str]]:
    """Every relative link of README.md and the pages, outside code: (page, target)."""
    found = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        text = re.sub(r"`[^`\n]*`", "", text)
        found += [(page, target) for target in LINK.findall(text)]
    return [(page, target) for page, target in found if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page, target", links(), ids=[f"{name(p)}->{t}" for p, t in links()])
def test_a_relative_link_leads_to_a_file_and_heading(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{name(page)} links to {target}, which does not exist"
    assert ROOT in linked.parents, f"{name(page)} links to {target}, outside the repository"
    if anchor and linked.suffix == ".md":
        assert has_anchor(linked, anchor), f"{name(page)} links to {target}: no such heading"
