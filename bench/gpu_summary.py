"""``python -m bench.gpu_summary WORK``: the one JSON of ``bench/gpu_check.sh`` (issue 35), from
the parts' outputs in ``WORK``: each part's exit status and time, the pytest summary line, every
ckptbench report as it was written, and issue 35's targets, each as ``{"value", "limit", "met"}``
(``met`` None where the part that measures it did not report)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPORTS = ("save", "first", "reserved", "restore", "loop", "recover", "recover_dcp")


def _parts(work: Path) -> dict[str, dict[str, int]]:
    parts: dict[str, dict[str, int]] = {}
    listing = work / "parts.txt"
    for line in listing.read_text().splitlines() if listing.exists() else []:
        name, rc, seconds = line.split()
        parts[name] = {"rc": int(rc), "seconds": int(seconds)}
    return parts


def _report(work: Path, name: str) -> dict[str, Any] | None:
    path = work / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dig(report: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(report, dict):
            return None
        report = report.get(key)
    return report


def _target(value: Any, limit: float) -> dict[str, Any]:
    met = None if not isinstance(value, (int, float)) else value <= limit
    return {"value": value, "limit": limit, "met": met}


def _at_least(value: Any, floor: float) -> dict[str, Any]:
    met = None if not isinstance(value, (int, float)) else value >= floor
    return {"value": value, "at_least": floor, "met": met}


def targets(reports: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Issue 35's targets from the reports (each one run on one device), and issue 36's
    tiered restore of a wiped node (the ``recover`` parts, on the machine's cores)."""
    save, first, reserved, restore, loop, recover, recover_dcp = (reports.get(n) for n in REPORTS)
    return {
        "recover_dcp_over_tiers": _at_least(_dig(recover, "restore", "dcp_over_tiers"), 1.0),
        "recover_peer_restore_over_p2p": _at_least(
            _dig(recover, "restore", "tiers", "peer_restore_over_p2p"), 0.5
        ),
        "recover_dcp_frontend_dcp_over_tiers": _at_least(
            _dig(recover_dcp, "restore", "dcp_over_tiers"), 1.0
        ),
        "stall_vs_device_memcpy": _target(_dig(save, "ratios", "stall_vs_memcpy"), 2.0),
        "blocked_s": _target(_dig(save, "ckptstore", "blocked_s"), 0.010),
        "first_stall_vs_later": _target(_dig(first, "ratios", "first_stall_vs_stall"), 2.0),
        "first_blocked_vs_later": _target(_dig(first, "ratios", "first_blocked_vs_blocked"), 2.0),
        "reserved_first_stall_vs_later": _target(
            _dig(reserved, "ratios", "first_stall_vs_stall"), 2.0
        ),
        "reserved_first_blocked_vs_later": _target(
            _dig(reserved, "ratios", "first_blocked_vs_blocked"), 2.0
        ),
        "device_restore_vs_host_restore": _target(
            _dig(restore, "ratios", "ckptstore_vs_ckptstore_host"), 1.2
        ),
        "device_restore_vs_dcp": _target(_dig(restore, "ratios", "ckptstore_vs_dcp"), 0.3),
        "loop_step_rate_loss": _target(_dig(loop, "methods", "ckptstore", "loss_fraction"), 0.03),
    }


def summarize(work: Path) -> dict[str, Any]:
    reports = {name: _report(work, name) for name in REPORTS}
    test_out = work / "test.json"
    lines = test_out.read_text().strip().splitlines() if test_out.exists() else []
    return {
        "parts": _parts(work),
        "pytest": lines[-1] if lines else None,
        "device": next(
            (d for r in reports.values() if (d := _dig(r, "config", "device")) is not None), None
        ),
        "targets": targets(reports),
        "dcp_async_loop_step_rate_loss": _dig(
            reports.get("loop"), "methods", "dcp_async", "loss_fraction"
        ),
        "reports": reports,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.gpu_summary WORK_DIR", file=sys.stderr)
        return 2
    json.dump(summarize(Path(args[0])), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
