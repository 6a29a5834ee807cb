"""Shared helpers of ``ckptbench`` workloads: parsing sizes and rates, printing tables and JSON
(the text itself is ``ckptstore.render``'s, shared with the ``ckptstore`` command).

Sizes accept SI (``kB``, ``MB``, ``GB``, ``TB``: powers of 1000) and binary (``KiB``, ``MiB``,
``GiB``, ``TiB``: powers of 1024) units; rates are sizes followed by ``/s``. Bad input raises
``ValueError`` naming the text, which ``ckptbench`` prints as one line.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from ckptstore import render
from ckptstore.cli.signals import raise_if_stopped
from ckptstore.render import format_rate, format_seconds, human_bytes

__all__ = [
    "check_directory",
    "check_output_file",
    "format_bytes",
    "format_rate",
    "format_seconds",
    "load_json_object",
    "parse_bytes",
    "parse_count",
    "parse_rate",
    "print_json",
    "table",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float, *, what: str = "size") -> int:
    """``"4KiB"`` -> 4096, ``"1.5GB"`` -> 1500000000, ``"512"`` -> 512. Must be positive."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _NUMBER.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"bad {what} {text!r}: expected a number with an optional unit "
                "such as 4096, 4KiB, 16MiB, 1.5GB"
            )
        value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"bad {what} {text!r}: must be at least 1 byte")
    return int(round(value))


def parse_rate(text: str | int | float, *, what: str = "bandwidth") -> float:
    """``"2TB/s"`` -> 2e12 bytes per second; a bare number is bytes per second."""
    raw = str(text).strip()
    if raw.lower().endswith("/s"):
        raw = raw[:-2]
    return float(parse_bytes(raw, what=what))


def parse_count(text: str | int | float, *, what: str = "count") -> float:
    """``"405B"`` -> 405e9, ``"70b"`` -> 70e9, ``"1.3T"`` -> 1.3e12, ``"7e9"`` -> 7e9."""
    match = _NUMBER.match(str(text))
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    unit = match.group(2).lower() if match else None
    if match is None or unit not in scale:
        raise ValueError(f"bad {what} {text!r}: expected a number such as 7e9, 70B or 1.3T")
    value = float(match.group(1)) * scale[unit]
    if value <= 0:
        raise ValueError(f"bad {what} {text!r}: must be positive")
    return value


def format_bytes(n: float, *, si: bool = False) -> str:
    """Three significant figures, binary units (``1.5 MiB``) or with ``si`` decimal (``2 TB``)."""
    return human_bytes(n, si=si, figures=3)


def rounds(n: int) -> str:
    """``"1 round"``, ``"3 rounds"``."""
    return f"{n} round" if n == 1 else f"{n} rounds"


def table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], *, out: TextIO | None = None
) -> None:
    """Print an aligned text table under a rule; the first column left-aligned, the others
    right-aligned."""
    raise_if_stopped()  # a signal whose exception was dropped: no results
    print(render.table(header, rows, rule=True), file=out or sys.stdout)


def ratio_line(ratios: dict[str, float | None], lead: str = "ratios") -> str:
    """The ratios a run ends with, each ``A_vs_B`` read as A / B (below 1x: A takes less time,
    or stores fewer bytes, than B)."""
    shown = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v)
    return f"{lead} (A_vs_B = A / B; below 1x, A takes less): {shown}"


def print_json(obj: Any, *, out: TextIO | None = None) -> None:
    """One JSON object on one line, keys in insertion order."""
    raise_if_stopped()  # a signal whose exception was dropped: no results
    print(json.dumps(obj, allow_nan=False), file=out or sys.stdout)


def check_output_file(path: str, *, flag: str) -> None:
    """Fail now, before a run, with one line, unless a file can be written at ``path`` (its
    directory exists and is writable; it is not a directory itself)."""
    target = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (
        os.path.exists(target) and not os.access(target, os.W_OK)
    ):
        raise ValueError(f"{flag} {path}: permission denied")


def check_directory(path: str, *, flag: str) -> None:
    """Fail now, with one line naming it, unless ``path`` is an existing writable directory."""
    target = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(target):
        raise ValueError(f"{flag} {path}: no such directory")
    if not os.path.isdir(target):
        raise ValueError(f"{flag} {path}: not a directory")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: permission denied (cannot write there)")


def load_json_object(path: str, *, what: str) -> dict[str, Any]:
    """Read a JSON object written by ``ckptbench ... --json``; one-line errors for bad files."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from exc
    # The object may be preceded by other output (a table); take the last line that parses.
    for candidate in [text, *reversed(text.strip().splitlines())]:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise ValueError(f"{what} {path!r} holds no JSON object")
