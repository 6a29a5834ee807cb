"""Whether the process that left something behind is gone: a lease's holder, a put's or a
restore's temporary, a loader's report directory. Only a process on this machine (this host,
boot and pid namespace) can be known gone; any other is judged by age by the caller."""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from typing import Any


@functools.cache
def _boot_and_pid_namespace() -> tuple[str, int]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "", 0


def process_identity() -> dict[str, Any]:
    """This process as a lease records it."""
    boot, pidns = _boot_and_pid_namespace()
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": boot, "pidns": pidns}


def pid_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs in this pid namespace (one of another user's runs); a
    process killed whose parent has not reaped it yet (a zombie) is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # another user's; or no pid at all (a forged name)
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether every thread of ``pid`` has exited (a process whose main thread alone has
    exited shows as a zombie too, and lives on in its other threads)."""
    ended = (b"Z", b"X")
    try:
        if _state(f"/proc/{pid}/stat") not in ended:  # a live process: its threads unread
            return False
        threads = os.listdir(f"/proc/{pid}/task")
        return all(_state(f"/proc/{pid}/task/{tid}/stat") in ended for tid in threads)
    except OSError:  # no /proc (not Linux), or it ended meanwhile
        return False


def _state(path: str) -> bytes:
    with open(path, "rb") as f:
        stat = f.read()
    fields = stat.rsplit(b")", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[0] if fields else b""


def holder_gone(identity: dict[str, Any]) -> bool:
    """True when ``identity`` (``process_identity()`` of another process) ran on this machine,
    in this boot and pid namespace, and its process is gone."""
    pid = identity.get("pid")
    return _here(identity) and isinstance(pid, int) and pid_gone(pid)


def holder_alive(identity: dict[str, Any]) -> bool:
    """True when ``identity`` is a process of this machine (boot, pid namespace) that runs."""
    pid = identity.get("pid")
    return _here(identity) and isinstance(pid, int) and pid > 0 and not pid_gone(pid)


def _here(identity: dict[str, Any]) -> bool:
    boot, pidns = _boot_and_pid_namespace()
    return bool(
        boot
        and identity.get("boot_id") == boot
        and identity.get("pidns") == pidns
        and identity.get("host") == socket.gethostname()
    )


@functools.cache
def machine_tag() -> str:
    """8 hex digits naming this machine's host, boot and pid namespace (empty where they cannot
    be read): written into a temporary's name beside the writer's pid."""
    boot, pidns = _boot_and_pid_namespace()
    if not boot:
        return ""
    seen = f"{socket.gethostname()}|{boot}|{pidns}".encode()
    return hashlib.blake2b(seen, digest_size=4).hexdigest()
