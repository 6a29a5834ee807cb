"""Staging: the state's tensors copied into reused buffers, so that a save costs a copy, not
fresh allocations and page faults, and the training loop goes on while the copy is written.

Two ways, on any device (``ckptstore.device``):

- host staging: the tensors are copied into a pooled host buffer (pinned with an accelerator)
  on a side stream; the loop's stream waits on the device for that copy, the host does not.
- device staging: the tensors are copied into a pooled *device* buffer (a device-to-device copy,
  the only one the loop's stream waits for), then ``Drainer`` copies that buffer into a pooled
  host buffer in the background (a host buffer held by an earlier save is waited for there,
  not on the loop's thread).

``StagedCopy.wait()`` / ``DrainedCopy.wait()`` block the background writer (never the training
loop) until the bytes have landed in host memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ckptstore.device import HOST_SLAB_BYTES, Device, allocate_host
from ckptstore.format import ALIGN
from ckptstore.health import scan as health_scan

logger = logging.getLogger(__name__)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def zero_gaps(buffer: torch.Tensor, gaps: list[tuple[int, int]]) -> None:
    """Zero the bytes of ``buffer`` (1-D uint8, host or device) at ``gaps``, in one op."""
    if not gaps:
        return
    starts, ends = np.array(gaps, dtype=np.int64).T
    lengths = ends - starts
    # Each byte's index: its gap's start plus its place in the gap.
    firsts = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    index = torch.from_numpy(firsts + np.arange(int(lengths.sum()), dtype=np.int64))
    buffer.index_fill_(0, index.to(buffer.device), 0)


class StagingPool:
    """Buffers for staged state, at most ``budget_bytes`` in all, on the host (pinned if
    ``pin_memory``) or on ``device``.

    With ``budget_bytes=None`` the pool holds a single buffer, grown to the largest state
    seen: one save can persist while the training loop runs, and a second waits for it.
    Buffers are allocated outside the pool's lock, host buffers ``slab_bytes`` at a time.
    """

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        pin_memory: bool = False,
        device: Device | None = None,
        slab_bytes: int = HOST_SLAB_BYTES,
    ) -> None:
        # The option a user sets it with (the flat keyword staging_budget_bytes is deprecated)
        self.budget_name = f"StagingOptions.{'device_' if device is not None else ''}budget_bytes"
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"{self.budget_name} must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.device = device
        self.slab_bytes = slab_bytes
        self._free: list[torch.Tensor] = []
        self._allocated_bytes = 0
        self._buffers = 0
        self._cond = threading.Condition()
        self.allocations = 0  # how many buffers were ever allocated (tests check reuse)
        self.peak_allocated_bytes = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    def _fits(self, nbytes: int, dropping: int = 0) -> bool:
        if self.budget_bytes is None:
            return self._buffers - (1 if dropping else 0) == 0
        return self._allocated_bytes - dropping + nbytes <= self.budget_bytes

    def acquire(
        self,
        nbytes: int,
        *,
        block: bool = True,
        timeout_s: float | None = None,
        prefault: bool = False,
    ) -> torch.Tensor | None:
        """A 1-D uint8 tensor of ``nbytes`` backed by a pooled buffer, or None when
        ``block`` is false (or ``timeout_s`` passes) and no buffer is free. ``prefault``: a
        new host buffer has its pages touched before it is returned."""
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            raise ValueError(
                f"state needs {nbytes} bytes of staging but {self.budget_name} is "
                f"{self.budget_bytes}"
            )
        nbytes = max(nbytes, 1)
        # A Ctrl-C (KeyboardInterrupt) may land between any two lines: every path below hands
        # back what it took, or the pool's one buffer would be gone and every later save wait.
        counted = False
        buf = None
        try:
            with self._cond:
                before = None  # the pool as this thread last saw it under the lock
                try:
                    while True:
                        before = (list(self._free), self._allocated_bytes, self._buffers)
                        fitting = [b for b in self._free if b.numel() >= nbytes]
                        if fitting:
                            buf = min(fitting, key=torch.Tensor.numel)
                            self._free.remove(buf)
                            return buf[:nbytes]
                        if self._fits(nbytes):
                            break
                        if self._free:
                            small = min(self._free, key=torch.Tensor.numel)
                            if self._fits(nbytes, dropping=small.numel()):
                                self._free.remove(small)
                                self._allocated_bytes -= small.numel()
                                self._buffers -= 1
                                break
                        before = None  # the wait lets other threads change the pool
                        if not block:
                            return None
                        if not self._cond.wait(timeout_s) and timeout_s is not None:
                            return None
                    self._allocated_bytes += nbytes
                    self._buffers += 1
                    self.allocations += 1
                    self.peak_allocated_bytes = max(
                        self.peak_allocated_bytes, self._allocated_bytes
                    )
                    counted = True  # last: from here on the new buffer's bytes are counted
                except BaseException:
                    if before is not None:
                        self._free, self._allocated_bytes, self._buffers = before
                        self._cond.notify_all()
                    raise
            buf = self._allocate(nbytes, prefault=prefault)
            return buf[:nbytes]
        except BaseException:
            if buf is not None and counted:
                self.release(buf)
            elif counted:
                with self._cond:
                    self._allocated_bytes -= nbytes
                    self._buffers -= 1
                    self._cond.notify_all()
            raise

    def _allocate(self, nbytes: int, *, prefault: bool) -> torch.Tensor:
        if self.device is not None:
            buf = self.device.empty(nbytes)
        elif self.pin_memory or prefault:
            buf = allocate_host(nbytes, pin=self.pin_memory, slab_bytes=self.slab_bytes)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        where = self.device.device if self.device is not None else "host"
        logger.debug(
            "staging: allocated %d bytes on %s (pinned=%s)", nbytes, where, self.pin_memory
        )
        return buf

    def reserve(self, nbytes: int) -> None:
        """Allocate (and fault in) a buffer of ``nbytes`` now, so that a save of that size
        finds it; waits while the pool's buffers are held."""
        self.release(self.acquire(nbytes, prefault=True))

    def release(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        with self._cond:
            self._free.append(base)
            self._cond.notify_all()


@dataclass
class StagedCopy:
    """Tensors copied into ``buffer``; on an accelerator the copy may still run until wait()."""

    buffer: torch.Tensor
    views: list[torch.Tensor]
    """Each tensor's copy: a view of ``buffer`` with its dtype and shape."""
    event: object = None
    health: list | None = None
    """Each tensor's ``health.scan``, where it was taken on the device before the drain."""

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def _views(
    buffer: torch.Tensor, like: list[torch.Tensor], offsets: list[int]
) -> list[torch.Tensor]:
    """Views of ``buffer`` at ``offsets`` with the dtypes and shapes of ``like``."""
    return [
        buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, o in zip(like, offsets)
    ]


class SideStreams:
    """One stream per device, made on first use (None on the cpu)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, object] = {}

    def get(self, device: Device):
        if device.device not in self._streams:
            self._streams[device.device] = device.new_stream()
        return self._streams[device.device]


class Stager:
    """Copies tensors into a buffer at given offsets, on a side stream of their device."""

    def __init__(self) -> None:
        self.streams = SideStreams()

    def copy(
        self, buffer: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]
    ) -> StagedCopy:
        # Tensors on several accelerators: every copy synchronous (the cpu stand-in's way).
        device = Device.of(tensors) or Device("cpu")
        stream = self.streams.get(device)
        # The copy starts after the loop's work enqueued so far (its last update of the state).
        device.wait(device.record(), stream)
        views = _views(buffer, tensors, offsets)
        with device.on(stream):
            for t, dest in zip(tensors, views):
                if dest.numel():
                    dest.copy_(t, non_blocking=device.is_accelerator)
                    device.keep_alive(t, stream)
        event = device.record(stream)
        # The loop's next kernels (its optimizer step updates these tensors in place) wait on
        # the device for the copy to have read them; the host does not wait.
        device.wait(event)
        return StagedCopy(
            buffer=buffer, views=views, event=event if device.is_accelerator else None
        )


class DrainedCopy:
    """A device-staged copy on its way to a host buffer: ``wait()`` until it has landed (and
    re-raise what failed), then ``buffer`` and ``views`` are the host copy's."""

    def __init__(self, future: Future[StagedCopy], ticket: DrainTicket) -> None:
        self._future = future
        self.ticket = ticket

    def wait(self) -> None:
        self._future.result()

    @property
    def buffer(self) -> torch.Tensor:
        return self._future.result().buffer

    @property
    def views(self) -> list[torch.Tensor]:
        return self._future.result().views

    @property
    def health(self) -> list | None:
        return self._future.result().health

    def landed(self) -> StagedCopy | None:
        """The host copy once the drain ended (waiting for it), None if it failed."""
        return None if self._future.exception() is not None else self._future.result()


class DrainTicket:
    """Who owns a device-staged save's buffers where the save is interrupted (Ctrl-C) as it
    hands them to the drain: the drain once it has started (it gives the device buffer back
    and, the save gone, its host copy too), else the save (the drain then touches nothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fate: str | None = None  # "started" by the drain, or "cancelled" by the save
        self._abandoned = False
        self._landed: tuple[StagedCopy, Callable[[torch.Tensor], None]] | None = None

    def start(self) -> bool:
        """The drain: whether it may copy (the save did not cancel first)."""
        return self._decide("started")

    def cancel(self) -> bool:
        """The interrupted save: whether the drain will never run (its buffers are the save's)."""
        return self._decide("cancelled")

    def _decide(self, fate: str) -> bool:
        with self._lock:
            if self._fate is None:
                self._fate = fate
            return self._fate == fate

    def land(self, copy: StagedCopy, release: Callable[[torch.Tensor], None]) -> StagedCopy | None:
        """The drain's host copy, or None once handed back (the save abandoned it)."""
        with self._lock:
            if not self._abandoned:
                self._landed = (copy, release)
                return copy
        release(copy.buffer)
        return None

    def abandon(self) -> None:
        """The interrupted save, after the drain started: its host copy goes back to the pool
        as it lands (or now, where it has)."""
        with self._lock:
            self._abandoned = True
            landed, self._landed = self._landed, None
        if landed is not None:
            copy, release = landed
            release(copy.buffer)


class Drainer:
    """One background thread that empties device staging buffers into pooled host buffers,
    in the order saves were staged; it also reserves host buffers ahead (``submit``)."""

    def __init__(self, host_pool: StagingPool) -> None:
        self._pool = host_pool
        # Not the stager's: a save's device copy must not queue behind an earlier drain.
        self._streams = SideStreams()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-drain")

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        return self._executor.submit(fn, *args)

    def drain(
        self,
        staged: StagedCopy,
        device: Device,
        release: Callable[[torch.Tensor], None],
        *,
        ticket: DrainTicket,
        scan: bool = False,
        gaps: list[tuple[int, int]] = (),
    ) -> DrainedCopy:
        """Copy ``staged`` (in a device buffer) to a host buffer; ``release(staged.buffer)``
        once it is copied (or the copy failed), unless ``ticket`` was cancelled before the
        copy started. ``scan``: take each tensor's ``health.scan`` on the device first, while
        the copy runs. ``gaps``: zeroed in the host copy."""
        return DrainedCopy(
            self._executor.submit(self._drain, ticket, staged, device, release, scan, list(gaps)),
            ticket,
        )

    def _drain(
        self,
        ticket: DrainTicket,
        staged: StagedCopy,
        device: Device,
        release: Callable[[torch.Tensor], None],
        scan: bool = False,
        gaps: list[tuple[int, int]] = (),
    ) -> StagedCopy | None:
        if not ticket.start():  # the save was interrupted: its buffers are its own
            return None
        return ticket.land(self._copy(staged, device, release, scan, gaps), self._pool.release)

    def _copy(
        self,
        staged: StagedCopy,
        device: Device,
        release: Callable[[torch.Tensor], None],
        scan: bool,
        gaps: list[tuple[int, int]],
    ) -> StagedCopy:
        try:
            source = staged.buffer
            host = self._pool.acquire(source.numel())
            try:
                stream = self._streams.get(device)
                if staged.event is not None:
                    device.wait(staged.event, stream)  # after the device copy, not before
                with device.on(stream):
                    host.copy_(source, non_blocking=device.is_accelerator)
                    # Queued after the copy on the same stream, it reads the device buffer
                    # while the bytes travel; its one wait is for both.
                    health = health_scan(staged.views) if scan else None
                device.record(stream).synchronize()
                zero_gaps(host, gaps)  # the device buffer's padding was never written
            except BaseException:
                self._pool.release(host)
                raise
            offsets = [v.data_ptr() - source.data_ptr() if v.numel() else 0 for v in staged.views]
            return StagedCopy(buffer=host, views=_views(host, staged.views, offsets), health=health)
        finally:
            release(staged.buffer)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
