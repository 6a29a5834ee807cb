"""Text for people, shared by the ``ckptstore`` command and ``ckptbench``: byte sizes, rates,
durations, ratios and aligned tables."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any


def human_bytes(n: float, *, si: bool = False, figures: int | None = None) -> str:
    """``n`` bytes in binary units with one decimal (``1.5 KiB``, ``12.0 MiB``); ``figures``:
    that many significant figures instead (``1.5 MiB``, ``100 MiB``); ``si``: decimal units
    (``2 TB``). Plain bytes are whole (``512 B``)."""
    n = float(n)
    base, units = (1000, ("B", "kB", "MB", "GB", "TB", "PB")) if si else (
        1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))  # fmt: skip
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            if unit == "B":
                return f"{n:.0f} {unit}"
            return f"{significant(n, figures)} {unit}" if figures else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float, *, si: bool = False) -> str:
    """``1.5 GiB/s`` (three significant figures)."""
    return f"{human_bytes(bytes_per_s, si=si, figures=3)}/s"


def format_seconds(s: float) -> str:
    """``850 us``, ``12.3 ms``, ``4.56 s``, ``12.5 min``, ``3.09 h``."""
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{significant(s * 1e3)} ms"
    if s < 120:
        return f"{significant(s)} s"
    if s < 2 * 3600:
        return f"{significant(s / 60)} min"
    if s < 3 * 86400:
        return f"{significant(s / 3600)} h"
    return f"{significant(s / 86400)} d"


def significant(x: float, figures: int = 3) -> str:
    """``x`` to ``figures`` significant figures, whole once it has more digits than that
    (``1023``, never ``1.02e+03``)."""
    if abs(x) >= 10**figures - 0.5:
        return f"{x:.0f}"
    return f"{x:.{figures}g}"


def format_ratio(value: float | None) -> str:
    """``1.21x``, or ``-`` when there is none."""
    return f"{value:.2f}x" if value else "-"


def printable(text: str) -> str:
    """``text`` with each character a terminal would act on (escapes, newlines, a lone
    surrogate) written as its Python escape: a name read from a step prints as itself."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def table(
    header: Sequence[Any],
    rows: Iterable[Sequence[Any]],
    *,
    right: Collection[int] | None = None,
    rule: bool = False,
) -> str:
    """An aligned text table. Columns in ``right`` are right-aligned (default: every column
    but the first); ``rule`` adds a line of dashes under the header."""
    cells = [[printable(str(c)) for c in header]] + [
        [printable(str(c)) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    if right is None:
        right = range(1, len(header))

    def line(row: list[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()

    lines = [line(cells[0])]
    if rule:
        lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(row) for row in cells[1:])
    return "\n".join(lines)


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as spans: ``0-3,6,8-9``."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
