"""``ckptbench``: storage and checkpoint benchmarks. Each workload lives in its own module with
``add_parser(subparsers)`` registering a subcommand whose ``func(args) -> int`` runs it.

Exit status: 0 success (also when the reader of stdout goes away: ``ckptbench plan | head -1``);
1 the run failed; 2 a usage error (bad flags, a missing --dir, an unwritable --plot). Errors are
one line on stderr (``ckptbench plan: error: ...``), usage errors as ``ckptstore``'s.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys

from ckptstore.cli import UsageParser, flush_stdout, stdout_gone
from ckptstore.cli.signals import stopped_by_signal, terminate_unwinds
from ckptstore.errors import CheckpointError

# Modules of bench/ that define a subcommand, in the order --help lists them.
WORKLOADS = (
    "save",
    "restore",
    "export",
    "interference",
    "loader",
    "storage",
    "scale",
    "recover",
    "plan",
)


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="ckptbench",
        description="Stress and benchmark checkpoint storage. Timings are medians and "
        "percentiles; comparisons are ratios measured side by side in one run.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in WORKLOADS:
        importlib.import_module(f"bench.{name}").add_parser(sub)
    for command in sub.choices.values():
        _say_defaults(command)
        # "--size -5MiB" is a bad size, said as such; not argparse's "expected one argument"
        command._negative_number_matcher = _NEGATIVE_VALUE
    return parser


# A minus and a digit begin a value, not an option (argparse's own pattern: plain numbers only).
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help names its default where the text does not already."""
    for action in parser._actions:
        default = action.default
        if (
            action.help in (None, argparse.SUPPRESS)
            or default in (None, False, argparse.SUPPRESS, [], ())
            or "default" in action.help.lower()
            or not action.option_strings
        ):
            continue
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        action.help = f"{action.help} (default {str(shown).replace('%', '%%')})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with terminate_unwinds():  # SIGTERM removes the run's files too, as Ctrl-C does
            status = int(args.func(args) or 0)
        flush_stdout()
        return status
    except BrokenPipeError:  # `ckptbench plan | head -1`: the reader went away; a normal end
        stdout_gone()
        return 0
    except (ValueError, OSError, CheckpointError) as exc:
        _say(args, exc)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        print(f"ckptbench {args.command}: interrupted", file=sys.stderr)
        return 130
    except BaseException as exc:
        status = stopped_by_signal()  # wrapped on its way up (DCP's CheckpointException)
        if status is not None:
            return status
        cause = _storage_or_memory_cause(exc)
        if cause is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _say(args, cause)  # torch.save's error after a full disk, DCP's wrapper, an allocation
        return 1


def _say(args: argparse.Namespace, exc: BaseException) -> None:
    """The error in one line; an OS error that names no file, with where the run wrote."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    where = getattr(args, "uri", None) or getattr(args, "dir", None)
    if isinstance(exc, OSError) and not exc.filename and where:
        first += f" (writing under {where})"
    print(f"ckptbench {args.command}: error: {first}", file=sys.stderr)


def _storage_or_memory_cause(exc: BaseException) -> BaseException | None:
    """The storage or memory error under ``exc`` (its causes and contexts, and the failures
    DCP's ``CheckpointException`` holds per rank); None where there is none (a bug)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (OSError, CheckpointError, MemoryError)):
            return e
        if isinstance(e, RuntimeError) and "can't allocate memory" in str(e):
            return MemoryError(f"out of memory: {str(e).splitlines()[-1].strip()}")
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


if __name__ == "__main__":
    sys.exit(main())
