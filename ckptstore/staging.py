"""Device -> host staging into a bounded pool of reusable buffers.

The buffers are allocated once and reused across saves, so a save costs a copy, not fresh
allocations and page faults. With CUDA they are pinned and filled by non-blocking copies on a
dedicated stream; ``StagedCopy.wait()`` blocks the background encoder (never the training loop)
until the copy has landed. The loop's own stream is made to wait for that copy on the device, so
an in-place update it enqueues next cannot tear the staged state.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from ckptstore.format import ALIGN

logger = logging.getLogger(__name__)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingPool:
    """Host buffers for staged state, at most ``budget_bytes`` in all.

    With ``budget_bytes=None`` the pool holds a single buffer, grown to the largest state
    seen: one save can persist while the training loop runs, and a second waits for it.
    """

    def __init__(self, *, budget_bytes: int | None = None, pin_memory: bool = False) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"staging_budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = []
        self._allocated_bytes = 0
        self._buffers = 0
        self._cond = threading.Condition()
        self.allocations = 0  # how many buffers were ever allocated (tests check reuse)

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    def _fits(self, nbytes: int, dropping: int = 0) -> bool:
        if self.budget_bytes is None:
            return self._buffers - (1 if dropping else 0) == 0
        return self._allocated_bytes - dropping + nbytes <= self.budget_bytes

    def acquire(self, nbytes: int, *, block: bool = True, timeout_s: float | None = None):
        """A 1-D uint8 tensor of ``nbytes`` backed by a pooled buffer, or None when
        ``block`` is false (or ``timeout_s`` passes) and no buffer is free."""
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            raise ValueError(
                f"state needs {nbytes} bytes of staging but staging_budget_bytes is "
                f"{self.budget_bytes}"
            )
        nbytes = max(nbytes, 1)
        with self._cond:
            while True:
                fitting = [b for b in self._free if b.numel() >= nbytes]
                if fitting:
                    buf = min(fitting, key=torch.Tensor.numel)
                    self._free.remove(buf)
                    return buf[:nbytes]
                if self._fits(nbytes):
                    return self._allocate(nbytes)
                if self._free:
                    small = min(self._free, key=torch.Tensor.numel)
                    if self._fits(nbytes, dropping=small.numel()):
                        self._free.remove(small)
                        self._allocated_bytes -= small.numel()
                        self._buffers -= 1
                        return self._allocate(nbytes)
                if not block:
                    return None
                if not self._cond.wait(timeout_s) and timeout_s is not None:
                    return None

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._allocated_bytes += nbytes
        self._buffers += 1
        self.allocations += 1
        logger.debug("staging: allocated %d bytes (pinned=%s)", nbytes, self.pin_memory)
        return buf[:nbytes]

    def release(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        with self._cond:
            self._free.append(base)
            self._cond.notify_all()


@dataclass
class StagedCopy:
    """Tensors copied into ``buffer``; on CUDA the copy may still be in flight until wait()."""

    buffer: torch.Tensor
    views: list[torch.Tensor]
    """Each tensor's copy: a view of ``buffer`` with its dtype and shape."""
    event: object = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Stager:
    """Copies tensors into a buffer at given offsets; device copies go on their own stream."""

    def __init__(self) -> None:
        self._stream = None

    def copy(
        self, buffer: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]
    ) -> StagedCopy:
        on_device = any(t.device.type == "cuda" for t in tensors)
        if on_device and self._stream is None:
            self._stream = torch.cuda.Stream()
        if on_device:
            self._stream.wait_stream(torch.cuda.current_stream())
        views = []
        for t, offset in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            dest = buffer[offset : offset + n].view(t.dtype).view(t.shape)
            views.append(dest)
            if n == 0:
                continue
            if t.device.type == "cuda":
                with torch.cuda.stream(self._stream):
                    dest.copy_(t, non_blocking=True)
                    t.record_stream(self._stream)
            else:
                dest.copy_(t)
        event = None
        if on_device:
            event = torch.cuda.Event()
            event.record(self._stream)
            # The loop's next kernels (its optimizer step updates these tensors in place) wait
            # on the device for the copy to have read them; the host does not wait.
            torch.cuda.current_stream().wait_event(event)
        return StagedCopy(buffer=buffer, views=views, event=event)
