"""The house stays readable (issue #45): a module's header says what it is, its invariant and where to read
more in at most 12 lines (theory, history and measurements live in docs/); no module passes 500 lines (a
longer one holds two ideas: split it); the README is a guide of at most 150 lines; no docs page passes
420 lines, and each opens with what it answers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rstar2_core", "rstar2_cli", "tasks", "flows", "bench")
MAX_HEADER_LINES, MAX_MODULE_LINES, MAX_README_LINES, MAX_DOC_LINES = 12, 500, 150, 420


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _header_lines(source: str) -> int:
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno or 0
    return 0


def test_module_headers_are_short_and_modules_hold_one_idea():
    sources = _sources()
    assert len(sources) > 100                                         # the scan sees the packages
    long_headers = {str(p.relative_to(ROOT)): n for p in sources if (n := _header_lines(p.read_text())) > MAX_HEADER_LINES}
    assert not long_headers, (f"module headers over {MAX_HEADER_LINES} lines (what it is, its invariant, a "
                              f"pointer into docs/; move the rest to the doc): {long_headers}")
    long_modules = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines (split by idea): {long_modules}"


def test_readme_is_a_short_guide_and_docs_pages_say_what_they_answer():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    too_long = {p.name: n for p in pages if (n := len(p.read_text().splitlines())) > MAX_DOC_LINES}
    assert not too_long, f"docs pages over {MAX_DOC_LINES} lines (split by topic): {too_long}"
    unframed = [p.name for p in pages if "What this page answers" not in "\n".join(p.read_text().splitlines()[:6])]
    assert not unframed, f"docs pages that do not open with 'What this page answers': {unframed}"
