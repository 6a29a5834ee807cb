"""The package's layout (issue 31): no function or method in ``ckptstore/`` runs over 80 lines,
first line to last, docstring included; the CLI's ``build_parser``, one long declaration of
arguments, is the one exception."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "ckptstore"
MOST_LINES = 80
EXEMPT = {("ckptstore/cli/parser.py", "build_parser")}


def _functions(path: Path) -> Iterator[tuple[str, int, int]]:
    """Every function and method of ``path``, nested ones too: qualified name, first line,
    line count."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text()), "")


def test_no_function_in_the_package_is_over_80_lines():
    files = sorted(PACKAGE.rglob("*.py"))
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name} ({lines} lines)"
        for path in files
        for name, line, lines in _functions(path)
        if lines > MOST_LINES and (path.relative_to(ROOT).as_posix(), name) not in EXEMPT
    ]
    assert not offenders, offenders
    assert len(files) > 40  # the walk sees the package
