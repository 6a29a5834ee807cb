"""What stays the same from save to save: how chunks are cut and encoded, and the staging pools
tensors are copied into before a save writes them (``SaveSession`` walks one save).

Where a save stages (``staging``): ``"host"``, a pooled host buffer; ``"device"``, a pooled
buffer on the state's device first, drained to a host buffer in the background
(``ckptstore.staging``); ``"auto"``, the device where the state lives on an accelerator and
fits the device budget, else the host, and its first save through the host (the training loop's
memory peak is known only once it ran a step: ``SaveEngine._before_loop_peak``). A state that
does not fit the budget is staged through the host, with one log line each time that starts
happening."""

from __future__ import annotations

import gc
import logging
import numbers
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.device import Device
from ckptstore.leases import DEFAULT_TTL_S
from ckptstore.options import DEFAULT_GC_WAIT_S, HealthPolicy
from ckptstore.pipeline import ChunkLayout, CompressionGovernor, PipelineConfig, plan_layout
from ckptstore.staging import (
    DrainedCopy,
    Drainer,
    DrainTicket,
    StagedCopy,
    Stager,
    StagingPool,
    zero_gaps,
)

logger = logging.getLogger(__name__)

STAGING_MODES = ("host", "device", "auto")
# Without a device budget: the share of the device's free memory a staging buffer may take.
# Not all of it: the loop may not have reached its peak memory yet when it first saves.
DEVICE_FREE_SHARE = 0.5


def check_background_nice(background_nice: int) -> None:
    if not 0 <= background_nice <= 19:
        raise ValueError(f"background_nice must be within [0, 19], got {background_nice}")


@dataclass
class Staged:
    """Tensors copied into a staging buffer (the copy may still run: ``copy.wait()``, after
    which ``buffer`` is the host buffer holding them)."""

    layout: ChunkLayout
    copy: StagedCopy | DrainedCopy
    pooled: bool  # the buffer goes back to the engine's pool once written

    @property
    def buffer(self) -> torch.Tensor:
        return self.copy.buffer

    @property
    def health(self) -> list | None:
        """Each tensor's ``health.scan`` where device staging took it on the device (after
        ``copy.wait()``); None: the save scans the host buffer."""
        return self.copy.health


class SaveEngine:
    """The settings every save of a front-end shares, and its staging pool.

    Args:
        chunk_bytes / compression / encode_threads: how chunks are cut, encoded and how many
            are in flight (``PipelineConfig``); ``"auto"`` compression is governed chunk by
            chunk (``CompressionGovernor``).
        hedge_uploads: duplicate slow chunk puts (the store's hedging, ``Store.hedger``).
        recheck_every: a reused chunk is read back by about one save in this many
            (``SaveSession.rechecks``; 0: never).
        staging_budget_bytes: host memory for staging buffers (None: one, state-sized).
        staging: ``"host"``, ``"device"`` or ``"auto"`` (module docstring).
        device_staging_budget_bytes: device memory for device staging buffers (None: one
            buffer, staged into while the state fits ``DEVICE_FREE_SHARE`` of the device's free
            memory, ``Device.free_bytes``, its own buffer counted as free).
        keep_last: retention after each commit (None: keep everything).
        lease_ttl_s / gc_wait_s: the save lease's ttl, and how long a save waits for a gc.
    """

    @classmethod
    def build(cls, options: dict[str, Any], *, keep_last: int | None, store: Any) -> SaveEngine:
        """The engine of a front-end's resolved ``ckptstore.options`` groups (``encoding``,
        ``staging``, ``retention``); uploads are hedged by default on remote stores only (a
        duplicate local write rarely helps)."""
        encoding, staging, retention = options["encoding"], options["staging"], options["retention"]
        hedge = encoding.hedge_uploads
        return cls(
            chunk_bytes=encoding.chunk_bytes,
            compression=encoding.compression,
            encode_threads=encoding.encode_threads,
            hedge_uploads=not store.is_local if hedge is None else hedge,
            recheck_every=encoding.recheck_every,
            staging_budget_bytes=staging.budget_bytes,
            keep_last=keep_last,
            lease_ttl_s=retention.lease_ttl_s,
            gc_wait_s=retention.gc_wait_s,
            staging="host" if staging.mode == "peer" else staging.mode,
            device_staging_budget_bytes=staging.device_budget_bytes,
            health=options.get("health"),
        )

    def __init__(
        self,
        *,
        chunk_bytes: int | None = None,
        compression: str | int | None = "auto",
        encode_threads: int | None = None,
        hedge_uploads: bool = False,
        recheck_every: int = 16,
        staging_budget_bytes: int | None = None,
        keep_last: int | None = None,
        lease_ttl_s: float = DEFAULT_TTL_S,
        gc_wait_s: float = DEFAULT_GC_WAIT_S,
        staging: str = "auto",
        device_staging_budget_bytes: int | None = None,
        health: HealthPolicy | None = None,
    ) -> None:
        if staging not in STAGING_MODES:
            raise ValueError(f"staging must be one of {', '.join(STAGING_MODES)}, got {staging!r}")
        if device_staging_budget_bytes is not None and device_staging_budget_bytes <= 0:
            raise ValueError(
                f"device_staging_budget_bytes must be > 0, got {device_staging_budget_bytes}"
            )
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, numbers.Integral)
        ):
            raise TypeError(
                f"keep_last takes an int or None, got {type(keep_last).__name__} {keep_last!r}"
            )
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if lease_ttl_s <= 0 or gc_wait_s < 0:
            raise ValueError("lease_ttl_s must be > 0 and gc_wait_s >= 0")
        self.config = PipelineConfig.from_args(
            chunk_bytes=chunk_bytes, compression=compression, encode_threads=encode_threads
        )
        self.governor = CompressionGovernor() if self.config.codec.adaptive else None
        self.hedge_uploads = hedge_uploads
        self.recheck_every = recheck_every
        self.pool = StagingPool(
            budget_bytes=staging_budget_bytes, pin_memory=torch.cuda.is_available()
        )
        self.stager = Stager()
        self.staging = staging
        self.device_staging_budget_bytes = device_staging_budget_bytes
        self.device_pool: StagingPool | None = None  # on the device of the last device staging
        self._drainer: Drainer | None = None
        self._drainer_lock = threading.Lock()
        self._fallback_logged = False
        self._loop_peak_seen = False  # "auto": its first save has passed (a step ran since)
        self.keep_last = keep_last
        self.retained_good: set[tuple[int, str]] = set()  # (step, attempt) retention re-hashed
        # by store URI: the step this engine committed there last (its retention's check that
        # the store's listing does not lag)
        self.committed_last: dict[str, int] = {}
        self.lease_ttl_s = lease_ttl_s
        self.gc_wait_s = gc_wait_s
        self.health = health or HealthPolicy()
        # (rank, where it writes) found to be the committing rank's store: checked once
        self.places_seen: set[tuple[int, str]] = set()

    def stage(
        self,
        tensors: list[torch.Tensor],
        *,
        block: bool = True,
        timeout_s: float | None = None,
        rank: int = 0,
    ) -> Staged | None:
        """Copy ``tensors`` into a pooled buffer (on their device first, by ``staging``); None
        when none is free (``block=False``, or after ``timeout_s``)."""
        layout = plan_layout(tensors, self.config)
        device = self._staging_device(tensors, layout.total_bytes, rank)
        pool = self.pool if device is None else self._device_pool(device)
        buffer, ticket = None, DrainTicket()
        try:
            buffer = pool.acquire(layout.total_bytes, block=block, timeout_s=timeout_s)
            if buffer is None:
                return None
            if device is None:
                zero_gaps(buffer, layout.gaps)  # host bytes no copy writes: before it starts
            copied = self.stager.copy(buffer, tensors, layout.offsets)
            if device is None:
                return Staged(layout, copied, True)
            drained = self.drainer().drain(
                copied, device, pool.release, ticket=ticket, scan=self.health.scan, gaps=layout.gaps
            )
            return Staged(layout, drained, True)
        except BaseException:  # a copy torch refuses (a dtype it cannot copy), or a Ctrl-C
            if not ticket.cancel():  # the drain has the device buffer: it hands both back
                ticket.abandon()
            elif buffer is not None:
                pool.release(buffer)
            raise

    def _staging_device(
        self, tensors: list[torch.Tensor], nbytes: int, rank: int, *, reserving: bool = False
    ):
        """The device to stage ``tensors`` on first, or None to stage them on the host.
        ``reserving``: asked by ``reserve``, not by a save."""
        if self.staging == "host":
            return None
        device = Device.of(tensors)
        if device is None:
            why = "the state spans several devices"
        elif self.staging == "auto" and not device.is_accelerator:
            return None
        elif self._before_loop_peak(reserving):
            return None
        else:
            budget = self._device_budget(device)
            if nbytes <= budget:
                self._fallback_logged = False
                return device
            why = f"{nbytes} bytes of state exceed the device staging budget of {budget} bytes"
        if not self._fallback_logged:
            self._fallback_logged = True
            # Asked for, device staging falling back is news; under "auto" it is the policy.
            level = logging.WARNING if self.staging == "device" else logging.INFO
            logger.log(level, "rank %d: staging through host memory: %s", rank, why)
        return None

    def _before_loop_peak(self, reserving: bool) -> bool:
        """``"auto"`` without a device budget stages its first save (and a reservation before
        it) through the host: the device memory the training loop's step needs is known (the
        allocator's high-water mark, ``Device.free_bytes``) only once a step ran, and a save
        before the first step must not take the memory that step's activations need."""
        if self.staging != "auto" or self.device_staging_budget_bytes is not None:
            return False
        if self._loop_peak_seen:
            return False
        if not reserving:
            self._loop_peak_seen = True
        return True

    def _device_budget(self, device: Device) -> int:
        if self.device_staging_budget_bytes is not None:
            return self.device_staging_budget_bytes
        held = 0
        if self.device_pool is not None and self.device_pool.device.device == device.device:
            held = self.device_pool.allocated_bytes
        return int(device.free_bytes() * DEVICE_FREE_SHARE) + held

    def _device_pool(self, device: Device) -> StagingPool:
        if self.device_pool is None or self.device_pool.device.device != device.device:
            self.device_pool = StagingPool(
                budget_bytes=self.device_staging_budget_bytes, device=device
            )
        return self.device_pool

    def drainer(self) -> Drainer:
        """The background thread of device staging and host reservations (started on use)."""
        with self._drainer_lock:
            if self._drainer is None:
                self._drainer = Drainer(self.pool)
            return self._drainer

    def staged_bytes(self, tensors: list[torch.Tensor]) -> int:
        """The size of the staging buffer a save of ``tensors`` takes."""
        return plan_layout(tensors, self.config).total_bytes

    def reserve(
        self, nbytes: int, tensors: list[torch.Tensor] | None = None, *, rank: int = 0
    ) -> Future:
        """Allocate the host staging buffer for a state of ``nbytes`` in the background, slab
        by slab; the future is done once it is. Given the state's ``tensors``, the device
        buffer their next save stages into (``_staging_device``) is allocated first, here."""
        if nbytes <= 0:
            raise ValueError(f"reserve needs a positive number of bytes, got {nbytes}")
        device = (
            None if tensors is None else self._staging_device(tensors, nbytes, rank, reserving=True)
        )
        if device is not None:
            self._device_pool(device).reserve(nbytes)
        return self.drainer().submit(self.pool.reserve, nbytes)

    def stage_somewhere(
        self,
        tensors: list[torch.Tensor],
        *,
        wait_s: float,
        rank: int,
        pooled: bool = True,
        reclaim: Callable[[], None] | None = None,
    ) -> Staged:
        """Copy ``tensors`` into a pooled buffer, waiting up to ``wait_s`` for one, else into a
        buffer of their own: a buffer still held by a failed save (its error kept alive by a
        caller) must not stall this save forever. ``pooled=False`` goes there directly.
        ``reclaim``: hands back buffers of saves known over, called while waiting."""
        copied = self.stage(tensors, block=False) if pooled else None
        if pooled and copied is None:
            gc.collect()  # a failed save's staged state may be waiting in a reference cycle
            if reclaim is None:
                copied = self.stage(tensors, block=wait_s > 0, timeout_s=wait_s)
            end = time.monotonic() + wait_s
            while copied is None and reclaim is not None:  # waits in slices, reclaiming
                reclaim()
                left = end - time.monotonic()
                copied = self.stage(tensors, block=left > 0, timeout_s=min(max(left, 0), 0.05))
                if left <= 0:
                    break
            if copied is None and wait_s > 0:
                logger.warning(
                    "rank %d: the previous save still holds the staging buffer after %.0fs "
                    "(a save that failed holds it while its future or error is referenced: "
                    "drop those); staging this one in a new buffer",
                    rank,
                    wait_s,
                )
        return copied or self._stage_unpooled(tensors)

    def _stage_unpooled(self, tensors: list[torch.Tensor]) -> Staged:
        layout = plan_layout(tensors, self.config)
        buffer = torch.empty(
            max(layout.total_bytes, 1), dtype=torch.uint8, pin_memory=self.pool.pin_memory
        )
        zero_gaps(buffer, layout.gaps)
        return Staged(layout, self.stager.copy(buffer, tensors, layout.offsets), False)

    def release(self, staged: Staged) -> None:
        """Hand the host buffer of ``staged`` back to the pool (a device-staged copy's once its
        drain ended; a failed drain holds none)."""
        if not staged.pooled:
            return
        copied = staged.copy.landed() if isinstance(staged.copy, DrainedCopy) else staged.copy
        if copied is not None:
            self.pool.release(copied.buffer)

    def abandon(self, staged: Staged) -> None:
        """Hand back the buffers of a save that will not be persisted (its ``save()`` was
        interrupted) without waiting: a drain under way hands its host copy back as it lands
        (a second Ctrl-C in that wait kept it)."""
        if not staged.pooled:
            return
        if isinstance(staged.copy, DrainedCopy):
            staged.copy.ticket.abandon()
        else:
            self.pool.release(staged.copy.buffer)

    def close(self) -> None:
        """Stop the drain thread once it has drained what was staged."""
        with self._drainer_lock:
            drainer, self._drainer = self._drainer, None
        if drainer is not None:
            drainer.close()
