"""The rooms' imports (docs/ARCHITECTURE.md, "Rooms"): the core never imports the DCP front-end,
``ckptstore.dcp``, which builds on it; what the core reads of a DCP step (its metadata, item
keys, pickled values, the whole step in one process) lives in the core."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore.dcp import StoreWriter
from tests.helpers import ROOT

PACKAGE = ROOT / "ckptstore"
FRONT_END = "ckptstore.dcp"
ABOVE_IT = ("ckptstore.integrations",)  # adapters built on the DCP front-end (torchtitan)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imported(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in it (function bodies too)."""
    return _imports(path.read_text(), _module(path), path.name == "__init__.py")


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module ``source`` (module ``module``) imports, as absolute names with their line:
    ``from ckptstore import dcp`` names ``ckptstore`` and ``ckptstore.dcp``, relative imports
    resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            found += [(node.lineno, module)]
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _core_files() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(_in(_module(path), room) for room in (FRONT_END, *ABOVE_IT))
    ]


def test_no_core_module_imports_the_dcp_front_end():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _core_files()
        for line, name in _imported(path)
        if _in(name, FRONT_END)
    ]
    assert not offenders, offenders
    assert len(_core_files()) > 40  # the walk sees the package


def test_the_dcp_front_end_imports_nothing_built_on_it():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((PACKAGE / "dcp").rglob("*.py"))
        for line, name in _imported(path)
        if any(_in(name, room) for room in ABOVE_IT)
    ]
    assert not offenders, offenders


def test_the_scan_resolves_every_spelling_of_an_import():
    source = (
        "from ckptstore import dcp\nfrom ..dcp.ids import x\nimport ckptstore.dcp.reader\n"
        "def f():\n    from . import dcp\n"
    )
    names = [name for _, name in _imports(source, "ckptstore.cli.example", False)]
    assert sorted(n for n in names if _in(n, FRONT_END)) == [
        "ckptstore.dcp",
        "ckptstore.dcp.ids",
        "ckptstore.dcp.ids.x",
        "ckptstore.dcp.reader",
    ]
    assert "ckptstore.cli.dcp" in names  # ``from . import dcp`` in cli/ is cli's own


CORE_RUN = """
import importlib, json, sys
from ckptstore.cli import main

uri, out, *core = sys.argv[1:]
for name in core:
    importlib.import_module(name)
codes = [main(["verify", uri]), main(["restore", uri, "--to", out])]
print(json.dumps({"codes": codes, "dcp": sorted(m for m in sys.modules if m.startswith("ckptstore.dcp"))}))
"""


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dcp_step_is_verified_and_restored_without_the_dcp_front_end(tmp_path):
    """Every core module imported, then ``verify`` (DCP metadata, pickled values) and
    ``restore`` (the whole step through DCP's planner) of a DCP step: ``ckptstore.dcp`` is
    never imported."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}
    uri = str(tmp_path / "store")
    dcp.save(state, storage_writer=StoreWriter(uri, step=1), no_dist=True)
    out = tmp_path / "restored.pt"
    core = [_module(path) for path in _core_files() if path.name != "__main__.py"]
    proc = subprocess.run(
        [sys.executable, "-c", CORE_RUN, uri, str(out), *core],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc == {"codes": [0, 0], "dcp": []}, doc
    restored = torch.load(out, weights_only=True)
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 3


def _rooms() -> dict[str, str]:
    """docs/ARCHITECTURE.md's rooms of the package (``format``, ``tiers``...) -> the text of
    their "may import" column."""
    rows = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        m = re.match(r"^\| `ckptstore/([^`/]+?)(?:\.py|/)?` \|.*\| ([^|]*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_room_imports_only_what_architecture_md_says_it_may():
    rooms = _rooms()
    assert {"store", "format", "tiers", "dcp", "checkpointer"} <= set(rooms)
    offenders = []
    for room, column in sorted(rooms.items()):
        may = set(re.findall(r"[A-Za-z_]+", column)) | {"errors", room}
        path = PACKAGE / room
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
        for file in files:
            for line, name in _imported(file):
                parts = name.split(".")
                if parts[0] == "ckptstore" and len(parts) > 1 and parts[1] in rooms:
                    if parts[1] not in may:
                        offenders.append(f"{file.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, offenders
