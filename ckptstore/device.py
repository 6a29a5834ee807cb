"""The few device calls that staging and restore make, one code path for every device.

On an accelerator these are torch's device-generic streams and events (``torch.Stream``,
``torch.Event``, ``torch.accelerator``). The CPU has streams in name only and no events, so on
the CPU a copy enqueued on a stream has run when the call returns and an event recorded after
it is already complete (``_DoneEvent``). Everything above this module (which copy waits for
which, when a buffer may be reused, budgets, fallbacks) is the same code on both.

Host buffers are reserved in bounded slabs (``allocate_host``): the pages are touched one slab at
a time, then, for a CUDA device, the whole buffer is page-locked with one ``cudaHostRegister``. It
must be one: a copy whose host range spans two registrations fails ("invalid argument"; seen on an
H100, issue 35).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096
HOST_SLAB_BYTES = 256 * 2**20


class _DoneEvent:
    """The CPU's event: the work before it ran when it was recorded."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Device:
    """Streams, events and memory of one device (``cpu`` runs every call synchronously)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.is_accelerator = self.device.type != "cpu"
        if self.is_accelerator and self.device.index is None:
            self.device = torch.device(self.device.type, torch.accelerator.current_device_index())

    def __repr__(self) -> str:
        return f"Device({self.device})"

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Device | None:
        """The one accelerator the tensors live on (cpu if none does); None if several."""
        found = {t.device for t in tensors if t.device.type != "cpu"}
        if len(found) > 1:
            return None
        return cls(found.pop() if found else "cpu")

    def new_stream(self):
        return torch.Stream(device=self.device) if self.is_accelerator else None

    def current_stream(self):
        if not self.is_accelerator:
            return None
        return torch.accelerator.current_stream(self.device)

    @contextlib.contextmanager
    def on(self, stream) -> Iterator[None]:
        """Work enqueued inside goes on ``stream``."""
        if stream is None:
            yield
            return
        with stream:
            yield

    def record(self, stream=None):
        """An event that completes once the work enqueued on ``stream`` so far has run."""
        if not self.is_accelerator:
            return _DoneEvent()
        event = torch.Event(device=self.device)
        event.record(stream if stream is not None else self.current_stream())
        return event

    def wait(self, event, stream=None) -> None:
        """Make ``stream`` (the current one by default) wait on the device for ``event``; the
        host does not wait."""
        if self.is_accelerator:
            (stream if stream is not None else self.current_stream()).wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``'s memory is not reused before the work on ``stream`` so far has run."""
        if self.is_accelerator and tensor.device.type != "cpu":
            tensor.record_stream(stream)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def free_bytes(self) -> int:
        """Memory a new buffer could take without taking what the training loop needs: the
        device's free memory, less what torch's caching allocator gave back since its
        high-water mark (the loop's peak must fit again). The allocator's cached blocks are
        the loop's (its activations, between steps), not counted. On the CPU, the kernel's
        MemAvailable."""
        if not self.is_accelerator:
            return host_available_bytes()
        free, _total = torch.accelerator.get_memory_info(self.device)
        reserved = torch.accelerator.memory_reserved(self.device)
        peak = torch.accelerator.max_memory_reserved(self.device)
        return max(0, int(free - max(0, peak - reserved)))


def host_available_bytes() -> int:
    """Memory this process may still take: the kernel's MemAvailable, or less where its cgroup
    (a container's memory limit) leaves less, for the kernel kills a process at that limit
    however much the host has free."""
    available = torch.iinfo(torch.int64).max
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    left = cgroup_available_bytes()
    return available if left is None else min(available, left)


CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def cgroup_available_bytes() -> int | None:
    """What the tightest memory limit of this process's cgroup and its ancestors leaves: at
    each, the limit less the memory charged to it (its descendants' included), page cache not
    counted (the kernel drops clean file pages before it kills at the limit, as MemAvailable
    counts them). None where no limit is set or none can be read. A cgroup path that does not
    exist under ``CGROUP_ROOT`` (a container sees its own cgroup as the root) is read at the root."""
    sys_root = CGROUP_ROOT
    try:
        with open(SELF_CGROUP, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        paths[controllers] = path.strip("/")
    if "" in paths and os.path.exists(os.path.join(sys_root, "cgroup.controllers")):
        return _cgroup_left(sys_root, paths[""], _V2)
    for controllers, path in paths.items():
        if "memory" in controllers.split(","):
            return _cgroup_left(os.path.join(sys_root, "memory"), path, _V1)
    return None


# The limit, the usage (hierarchical: descendants included) and the page cache in memory.stat,
# per cgroup version; v1 writes "no limit" as a page-rounded 2**63 - 1.
_V2 = ("memory.max", "memory.current", ("inactive_file", "active_file"))
_V1 = (
    "memory.limit_in_bytes",
    "memory.usage_in_bytes",
    ("total_inactive_file", "total_active_file"),
)
_UNLIMITED = 1 << 60


def _cgroup_left(root: str, path: str, files: tuple) -> int | None:
    limit_file, usage_file, cache_keys = files
    here = os.path.join(root, path) if path and os.path.isdir(os.path.join(root, path)) else root
    lefts = []
    first = True
    while True:
        limit = _read_int(os.path.join(here, limit_file))
        used = _read_int(os.path.join(here, usage_file))
        stat = _read_stat(os.path.join(here, "memory.stat"))
        held = None if used is None else max(0, used - sum(stat.get(k, 0) for k in cache_keys))
        if held is not None and limit is not None and limit < _UNLIMITED:
            lefts.append(max(0, limit - held))
        if (
            first
            and held is not None
            and stat.get("hierarchical_memory_limit", _UNLIMITED) < _UNLIMITED
        ):
            # v1: the tightest limit above, where a container cannot see its ancestors (less
            # this cgroup's usage alone: theirs cannot be read)
            lefts.append(max(0, stat["hierarchical_memory_limit"] - held))
        if (
            os.path.samefile(here, root)
            or _read_int(os.path.join(os.path.dirname(here), "memory.use_hierarchy")) == 0
        ):
            break  # v1: a parent without hierarchy does not charge this cgroup to its limit
        here, first = os.path.dirname(here), False
    return min(lefts, default=None)


def _read_int(path: str) -> int | None:
    """The number in a cgroup file; None for "max" (no limit) or a file not there."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="ascii") as f:
            pairs = [line.split() for line in f]
    except OSError:
        return {}
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def host_pins_in_slabs() -> bool:
    """Whether pinned host memory is page-locked slab by slab (CUDA), rather than by one
    ``pin_memory`` allocation."""
    return torch.cuda.is_available()


def allocate_host(
    nbytes: int,
    *,
    pin: bool,
    slab_bytes: int = HOST_SLAB_BYTES,
    on_slab: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """A 1-D uint8 host tensor of ``nbytes``, its pages touched ``slab_bytes`` at a time
    (``on_slab(start, length)`` after each slab), then page-locked if ``pin``."""
    if slab_bytes < PAGE_BYTES or slab_bytes % PAGE_BYTES:
        raise ValueError(f"slab_bytes must be a positive multiple of {PAGE_BYTES}")
    if pin and (nbytes <= slab_bytes or not host_pins_in_slabs()):
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if on_slab is not None:
            on_slab(0, nbytes)
        return buf
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for offset in range(0, nbytes, slab_bytes):
        slab = buf[offset : offset + slab_bytes]
        slab.zero_()  # fault the pages in now, not during the first save's copy
        if on_slab is not None:
            on_slab(offset, slab.numel())
    if pin:
        # A buffer this large is a mapping of its own, so its whole pages are ours to lock.
        base = buf.data_ptr()
        first_page = base - base % PAGE_BYTES
        _register(first_page, base + nbytes - first_page)
        weakref.finalize(buf, _unregister, [first_page])
    return buf


def _register(ptr: int, nbytes: int) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {error}")


def _unregister(pointers: list[int]) -> None:
    for ptr in pointers:
        error = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if error != 0:
            logger.warning("cudaHostUnregister failed with cudaError %d", error)
