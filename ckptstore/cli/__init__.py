"""The ``ckptstore`` command: list, inspect, verify, restore and garbage-collect checkpoints.

Exit status: 0 success; 1 a checkpoint (or an object of one) is corrupt, missing or unreadable,
or the store does not exist; 2 a usage error (bad arguments, unknown URI scheme). Errors are one
line on stderr (``ckptstore verify: error: ...``); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ckptstore.cli.common import PROG, Failed, UsageError, flush_stdout, open_store, stdout_gone
from ckptstore.cli.parser import UsageParser, build_parser, common_options_after_command
from ckptstore.cli.signals import terminate_unwinds
from ckptstore.errors import CheckpointError
from ckptstore.store import Store

__all__ = ["main", "build_parser", "UsageParser", "UsageError", "flush_stdout", "stdout_gone"]


def _setup_logging(args: argparse.Namespace) -> tuple[logging.Handler, int]:
    """Warnings (e.g. storage retries) on stderr; ``-v`` adds ckptstore's INFO, ``--debug``
    everything."""
    debug, verbose = getattr(args, "debug", False), getattr(args, "verbose", False)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(name)s: %(message)s"))
    handler.setLevel(logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING)
    if not debug:
        handler.addFilter(
            lambda r: r.levelno >= logging.WARNING or r.name.split(".")[0] == "ckptstore"
        )
    if not (debug or verbose):
        # Each failed attempt of a retried request: the command's error, if it comes to that,
        # says how many were made (one line), and a request that succeeded needs no warning.
        handler.addFilter(lambda r: not getattr(r, "ckptstore_retry", False))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(min(handler.level, old_level or logging.WARNING))
    return handler, old_level


def _teardown_logging(handler: logging.Handler, old_level: int, *, exiting: bool) -> None:
    """``exiting``: the process ends with the command (run as ``ckptstore``): a request still
    in flight after its error (a store that never answered) logs into a sink, not bare on
    stderr through ``logging.lastResort`` after the command's one-line error."""
    root = logging.getLogger()
    root.removeHandler(handler)
    if exiting:
        root.addHandler(logging.NullHandler())
    root.setLevel(old_level)
    flush_stdout()


def _command(name: str) -> Callable[[argparse.Namespace, Store], int]:
    """The function of subcommand ``name``, imported only now: ``--help`` and usage errors
    answer without importing what the commands need (torch, for restore and verify)."""
    import importlib

    return getattr(importlib.import_module(f"ckptstore.cli.cmd_{name}"), f"cmd_{name}")


def _json_error(message: str, status: int) -> None:
    """With ``--json``, an error is also one JSON object on stdout."""
    import json

    try:
        print(json.dumps({"error": message, "code": status}))
    except BrokenPipeError:
        stdout_gone()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 checkpoint problem, 2 usage)."""
    parser = build_parser()
    exiting = argv is None  # the command line's own process, not a caller's
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = common_options_after_command(argv, set(parser.commands))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        status = int(exc.code or 0) if not isinstance(exc.code, str) else 2
        if status and "--json" in argv:
            _json_error(UsageParser.last_error or "usage error", status)
        return status
    prog = f"{PROG} {args.command}"
    handler, old_level = _setup_logging(args)

    def fail(status: int, message: str, *, reported: bool = False) -> int:
        """``reported``: the command printed its own document (``verify``'s problems)."""
        first = message.strip().splitlines()[0] if message.strip() else "failed"
        print(f"{prog}: error: {first}", file=sys.stderr)
        if getattr(args, "json", False) and not reported:
            _json_error(first, status)
        return status

    try:
        func = _command(args.func)  # imports torch: seconds, in which Ctrl-C is a clean stop
    except KeyboardInterrupt:
        _teardown_logging(handler, old_level, exiting=exiting)
        return fail(130, "interrupted")
    with terminate_unwinds():  # SIGTERM, SIGHUP: a restore's partial output is removed
        return _run(
            func, args, fail, lambda: _teardown_logging(handler, old_level, exiting=exiting)
        )


def _run(
    func: Callable, args: argparse.Namespace, fail: Callable, teardown: Callable[[], None]
) -> int:
    """The command, each error one line and its exit status."""
    if args.debug:  # tracebacks for developers
        try:
            return func(args, open_store(args))
        except Failed as exc:
            return fail(1, str(exc), reported=True)
        except BrokenPipeError:  # `ckptstore ls URI | head`: the reader went away
            stdout_gone()
            return 0
        finally:
            teardown()
    try:
        return func(args, open_store(args))
    except Failed as exc:
        return fail(1, str(exc), reported=True)
    except UsageError as exc:
        return fail(2, str(exc))
    except CheckpointError as exc:  # before ValueError: corrupt / version errors are ValueErrors
        return fail(1, str(exc))
    except BrokenPipeError:  # `ckptstore ls URI | head`: the reader went away; a normal end
        stdout_gone()
        return 0
    except FileNotFoundError as exc:
        return fail(1, f"not found: {exc}")
    except OSError as exc:
        return fail(1, str(exc) or type(exc).__name__)
    except ValueError as exc:
        return fail(1, str(exc))
    except KeyboardInterrupt:
        return fail(130, "interrupted")
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, --debug shows the traceback
        return fail(1, f"unexpected {type(exc).__name__}: {exc} (rerun with --debug for details)")
    finally:
        teardown()
