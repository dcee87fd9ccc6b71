"""Each ```python block of these pages runs by itself, as a reader copies it: every name it uses is
imported or defined in the block (tests/test_docs.py runs the blocks of a page in order, in one
process, so a block leaning on an earlier one passes there). Skipped blocks are checked too. Every page but
the two walkthroughs (CONTINUED_PAGES).

A static check (names, not state): the blocks of these pages also ran one by one, each in a fresh
process, when this was written. Add a page once its blocks stand alone."""

from __future__ import annotations

import ast
import builtins

import pytest
from test_docs import ROOT, extract_blocks

# robots.md and vla.md are walkthroughs: each block goes on with the objects the one before built.
CONTINUED_PAGES = {"docs/robots.md", "docs/vla.md"}
STANDALONE_PAGES = [
    "README.md",
    *sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "docs").glob("*.md")
        if str(p.relative_to(ROOT)) not in CONTINUED_PAGES
    ),
]


def free_names(code: str) -> set[str]:
    """Names ``code`` reads that it never imports, assigns or defines (builtins aside)."""
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return used - defined


def test_free_names_finds_what_a_block_leans_on():
    assert free_names("import numpy as np\nx = np.zeros(3)\nprint(envs, x)\n") == {"envs"}


@pytest.mark.parametrize("page", STANDALONE_PAGES)
def test_every_python_block_stands_alone(page):
    blocks = [b for b in extract_blocks(page, (ROOT / page).read_text()) if b.language == "python"]
    leaning = {f"{page}:{b.line}": sorted(free_names(b.code)) for b in blocks if free_names(b.code)}
    assert not leaning, f"blocks using names they do not import or define: {leaning}"
