"""torch's private names reach ckptstore through ckptstore/_torch_private.py alone, so that a
torch release that moves one breaks one file."""

from __future__ import annotations

import ast
from pathlib import Path

import ckptstore
from ckptstore import _torch_private

PACKAGE = Path(ckptstore.__file__).parent


def _private_torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    return found


def test_only_the_private_module_imports_torch_private_names():
    own = Path(_torch_private.__file__)
    outside = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != own
        for line in _private_torch_imports(path)
    ]
    assert outside == []
    assert _private_torch_imports(own)  # the scan sees a private import where there is one
