"""Writing a restored state to a local path: a torch.save file or a DCP directory, under a
temporary name first, so a crash never leaves a partial file under the target's name."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import uuid
from typing import Any

from ckptstore.cli.common import UsageError
from ckptstore.errors import UnsupportedStateError, one_line
from ckptstore.store.processes import machine_tag, pid_gone

logger = logging.getLogger(__name__)


def count_values(state: Any) -> dict[str, int]:
    import numpy as np
    import torch

    stats = {"tensors": 0, "bytes": 0, "numpy": 0, "other": 0}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            stats["tensors"] += 1
            stats["bytes"] += value.numel() * value.element_size()
        elif isinstance(value, np.ndarray):
            stats["tensors"] += 1
            stats["numpy"] += 1
            stats["bytes"] += value.nbytes
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif not (value is None or isinstance(value, (bool, int, float, str, bytes))):
            stats["other"] += 1  # e.g. an object DCP unpickled: weights_only may refuse it

    walk(state)
    return stats


def _special_kind(mode: int) -> str | None:
    for test, kind in (
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "named pipe"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return None


def check_target(target: str, fmt: str, force: bool) -> None:
    """Refuse a ``--to`` that cannot be written, or that holds something ``--force`` must not
    replace: for ``--format dcp`` a directory of other files (it would be replaced whole)."""
    if not os.path.lexists(target):
        ancestor = os.path.dirname(target)
        while not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise UsageError(f"--to {target}: {ancestor} is a file, not a directory")
        return
    # The restore is moved over the target: a link (to /proc/self/fd/1, to a checkpoint
    # directory) or a device would be replaced, not written through.
    if os.path.islink(target):
        raise UsageError(
            f"--to {target} is a symbolic link (to {os.readlink(target)}); give the path it "
            "names, or a new one"
        )
    kind = _special_kind(os.stat(target).st_mode)
    if kind:
        raise UsageError(f"--to {target} is a {kind}, not a file or directory; give a file name")
    if fmt == "torch" and os.path.isdir(target):
        raise UsageError(
            f"--to {target} is a directory; --format torch writes a file (give a file name)"
        )
    if fmt == "dcp" and not os.path.isdir(target):
        raise UsageError(f"--to {target} exists and is not a directory (--format dcp)")
    empty = not os.listdir(target) if os.path.isdir(target) else os.path.getsize(target) == 0
    if not empty and not force:
        raise UsageError(f"--to {target} exists and is not empty; pass --force to replace it")
    if not empty and fmt == "dcp" and not os.path.isfile(os.path.join(target, ".metadata")):
        raise UsageError(
            f"--to {target} holds files but no DCP checkpoint (no .metadata): not replaced, even "
            "with --force; choose a new or empty directory"
        )
    if not empty and fmt == "dcp":
        others = sorted(n for n in os.listdir(target) if not _dcp_file(n))
        if others:
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            raise UsageError(
                f"--to {target} holds {others[0]!r}{more} besides a DCP checkpoint: not replaced, "
                "even with --force (it is replaced whole); move them, or choose a new directory"
            )


def _dcp_file(name: str) -> bool:
    """What torch's ``FileSystemWriter`` writes in a checkpoint directory."""
    return name == ".metadata" or name.endswith(".distcp")


def remove_if_empty_dir(path: str) -> None:
    try:
        os.rmdir(path)  # fails unless it is an empty directory
    except OSError:
        pass


def write_atomically(target: str, fmt: str, force: bool, state: Any) -> None:
    """Write ``state`` to a temporary sibling of ``target``, then move it into place; a crash
    or error never leaves a partial file under the target's name. Missing parent directories
    are made (and removed again if the write fails). A failed write (a full disk) is an
    ``OSError`` naming the target."""
    parent = os.path.dirname(target)
    made = _make_dirs(parent)
    remove_killed_temporaries(target)
    tmp = os.path.join(parent, f"{_tmp_prefix(target)}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _write(target, tmp, fmt, force, state)
    except BaseException as exc:
        _remove(tmp)
        for path in reversed(made):
            remove_if_empty_dir(path)
        stop = _stopped(exc)
        if stop is not None and stop is not exc:  # torch's writer wraps it in a RuntimeError
            raise stop from exc
        failed = _write_failure(exc)
        refused = _dcp_refusal(exc) if failed is None else None
        if refused is not None:
            raise UnsupportedStateError(
                f"--format dcp cannot hold this state: {refused} (DCP joins nested keys with "
                "'.'; --format torch keeps the state as saved)"
            ) from exc
        if failed is None:
            raise
        raise OSError(f"cannot write {target}: {failed}") from exc
    _remove(tmp)


def _tmp_prefix(target: str) -> str:
    """``.<name>.tmp-<machine>-``: then the writer's pid and a random part (``<machine>``: this
    host, boot and pid namespace, ``store.processes.machine_tag``; ``host`` where unknown)."""
    return f".{os.path.basename(target)}.tmp-{machine_tag() or 'host'}-"


def remove_killed_temporaries(target: str) -> None:
    """Remove what restores to ``target`` killed on this host (``kill -9``, the OOM killer)
    left beside it: their process is gone. One killed while it swapped a DCP directory in
    (the old one moved aside to ``<tmp>.old``, the new one not yet in place) is left as it is,
    with a warning naming both."""
    parent = os.path.dirname(target) or "."
    prefix = _tmp_prefix(target)
    if not machine_tag():  # whose temporary it is cannot be told: another container's, maybe
        return
    try:
        names = os.listdir(parent)
    except OSError:
        return
    ours = re.compile(re.escape(prefix) + r"(\d+)-[0-9a-f]{8}")  # pid, random part; no .old
    for name in sorted(names):
        match = ours.fullmatch(name)
        if match is None or not pid_gone(int(match[1])):
            continue
        path = os.path.join(parent, name)
        if os.path.lexists(f"{path}.old"):
            logger.warning(
                "a restore killed while it replaced %s left the previous checkpoint at %s.old "
                "and the new one at %s; neither is removed",
                target,
                path,
                path,
            )
            continue
        _remove(path)
        logger.warning("removed %s, left by a restore that was killed", path)


def _stopped(exc: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM (``SystemExit``) behind ``exc``, if a signal stopped the write."""
    for _ in range(8):
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return exc
        # DCP's CheckpointException carries each rank's error, as (error, traceback) or error.
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                stop = _stopped(inner) if isinstance(inner, BaseException) else None
                if stop is not None:
                    return stop
        exc = exc.__cause__ or exc.__context__
        if exc is None:
            return None
    return None


def _make_dirs(path: str) -> list[str]:
    """``os.makedirs(path)``; the directories it made, outermost first."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory)
    return missing[::-1]


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _write_failure(exc: BaseException) -> str | None:
    """Why writing failed, in one line, if ``exc`` is a failed write: an ``OSError``, torch.save's
    ``RuntimeError``, or DCP's ``CheckpointException`` around either."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        inner = [_write_failure(c) for c in _causes(exc)]
        return next((why for why in inner if why), None)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, RuntimeError):  # torch.save's writer; the OSError it met is its context
        inner = exc.__context__
        return _write_failure(inner) if isinstance(inner, OSError) else " ".join(str(exc).split())
    return None


def _causes(exc: Any) -> list[BaseException]:
    """The errors inside DCP's ``CheckpointException`` (one per rank)."""
    causes = [e[0] if isinstance(e, tuple) else e for e in exc.failures.values()]
    return [c for c in causes if isinstance(c, BaseException)]


def _dcp_refusal(exc: BaseException) -> str | None:
    """Why DCP refused the state itself (a key two nested keys flatten to, say), in one line;
    None when ``exc`` is not DCP's."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return None
    causes = _causes(exc)
    return one_line(causes[0]) if causes else " ".join(str(exc).split())[:300]


def _write(target: str, tmp: str, fmt: str, force: bool, state: Any) -> None:
    import torch

    if fmt == "torch":
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if force or os.path.lexists(target):  # --force, or an empty file (checked)
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # fails if something appeared there meanwhile
            except FileExistsError:
                raise UsageError(
                    f"--to {target} appeared during the restore; pass --force to replace it"
                ) from None
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        if os.path.isdir(target) and not os.listdir(target):
            os.rmdir(target)
        elif os.path.isdir(target):
            assert force  # checked by check_target
            # Moved aside, not deleted, until the new one is in place: a crash in between
            # leaves the old checkpoint beside the target, never neither.
            old = f"{tmp}.old"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
            return
        os.rename(tmp, target)
