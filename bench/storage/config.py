"""Configuration of one ``ckptbench storage`` run: modes, their defaults, the size mix."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bench.faults import Faults
from bench.report import parse_bytes
from ckptstore.store import RetryPolicy

MODES = ("steady", "burst", "read")
DEFAULT_SIZES = {"steady": "4KiB:0.7,1MiB:0.25,16MiB:0.05", "burst": "4MiB", "read": "4MiB"}
DEFAULT_WRITERS = {"steady": 4, "burst": 8, "read": 0}
DEFAULT_READERS = {"steady": 4, "burst": 1, "read": 4}
DEFAULT_READ_BYTES = {"steady": 0, "burst": 4 * 2**10, "read": 2**20}
DEFAULT_DURATION_S = {"steady": 5.0, "burst": 30.0, "read": 5.0}
# Points kept for the read-latency time series of a plot (percentiles come from histograms).
MAX_TIMELINE_POINTS = 200_000


def parse_sizes(spec: str) -> list[tuple[int, float]]:
    """``"4KiB:0.7,1MiB:0.25,16MiB:0.05"`` -> [(4096, 0.7), ...]; weights are normalised."""
    items: list[tuple[int, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        size_text, _, weight_text = part.partition(":")
        try:
            size = parse_bytes(size_text)
        except ValueError:
            raise ValueError(
                f"bad --sizes {spec!r}: {size_text.strip()!r} is not a size of at least one byte "
                "(such as 4096, 4KiB, 16MiB)"
            ) from None
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ValueError(f"bad weight {weight_text!r} in --sizes {spec!r}") from None
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"bad weight {weight_text!r} in --sizes {spec!r}: must be > 0")
        items.append((size, weight))
    if not items:
        raise ValueError(
            f"bad --sizes {spec!r}: expected SIZE[:WEIGHT],... such as 4KiB:0.7,1MiB:0.3"
        )
    total = sum(w for _, w in items)
    return [(s, w / total) for s, w in items]


def apportion(sizes: list[tuple[int, float]], count: int) -> list[int]:
    """``count`` object sizes in the proportions of the ``sizes`` mix (largest remainders: each
    size's share is off by less than one object), largest first."""
    shares = [count * w for _, w in sizes]
    counts = [math.floor(x) for x in shares]
    by_remainder = sorted(range(len(sizes)), key=lambda i: counts[i] - shares[i])
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    return [s for (s, _), n in sorted(zip(sizes, counts), reverse=True) for _ in range(n)]


@dataclass(kw_only=True)
class StorageBenchConfig:
    """One ``ckptbench storage`` run. ``None`` fields take the mode's default."""

    uri: str
    """The store under test; the bench works under ``<uri>/ckptbench-<random>/``."""
    mode: str = "steady"
    """``steady``, ``burst`` or ``read``."""
    writers: int | None = None
    """Concurrent writers (burst: ranks writing a checkpoint at once)."""
    readers: int | None = None
    """Concurrent readers (burst: background readers of small objects)."""
    sizes: list[tuple[int, float]] | None = None
    """Object-size mix: (size_bytes, weight) pairs."""
    count: int | None = None
    """steady / read: stop after this many requests."""
    duration_s: float | None = None
    """steady / read: stop after this long; burst: the most the burst may take."""
    max_write_bytes: int = 512 * 2**20
    """steady: stop once this much has been written (memory:// keeps it all in RAM)."""
    checkpoint_bytes: int = 32 * 2**20
    """burst: bytes each writer writes."""
    queue_depth: int = 4
    """burst: puts in flight per writer."""
    read_bytes: int | None = None
    """burst: size of the background small reads; read: size of each ranged get."""
    read_interval_s: float = 0.002
    """burst: pause between a background reader's reads (0: back to back)."""
    baseline_s: float = 1.0
    """burst: background reads before the burst starts."""
    after_s: float = 1.0
    """burst: background reads after the burst ends."""
    objects: int = 16
    """read: objects written in the setup step; burst: small objects for background reads."""
    read_prefix: str | None = None
    """read: read existing objects under this prefix instead of writing any."""
    faults: Faults | None = None
    """Faults injected into the store under test (setup and cleanup run without them)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    storage_options: dict[str, Any] | None = None
    seed: int | None = None
    keep: bool = False
    """Leave what the bench wrote in place."""
    progress: bool = False
    """A tqdm progress bar on stderr."""
    verbose_retries: bool = False
    """Let the store's record of each failed attempt (INFO) through (they are counted either way)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: expected one of {', '.join(MODES)}")
        self.writers = DEFAULT_WRITERS[self.mode] if self.writers is None else self.writers
        self.readers = DEFAULT_READERS[self.mode] if self.readers is None else self.readers
        if self.sizes is None:
            self.sizes = parse_sizes(DEFAULT_SIZES[self.mode])
        if self.read_bytes is None:
            self.read_bytes = DEFAULT_READ_BYTES[self.mode]
        if self.duration_s is None and (self.count is None or self.mode == "burst"):
            self.duration_s = DEFAULT_DURATION_S[self.mode]
        if not self.sizes or any(size < 1 or weight <= 0 for size, weight in self.sizes):
            raise ValueError(f"sizes must be (size_bytes >= 1, weight > 0) pairs, got {self.sizes}")
        for name in ("max_write_bytes", "checkpoint_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 byte")
        for name in ("writers", "readers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("count", "objects", "queue_depth"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.duration_s is not None and not (
            self.duration_s > 0 and math.isfinite(self.duration_s)
        ):
            raise ValueError(f"--duration-s must be > 0, got {self.duration_s}")
        for name in ("read_interval_s", "baseline_s", "after_s"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.mode == "steady" and self.writers + self.readers == 0:
            raise ValueError("steady mode needs at least one writer or reader")
        if self.mode == "burst":
            if self.writers < 1:
                raise ValueError("burst mode needs at least one writer")
            if self.count is not None:
                raise ValueError("--count does not apply to burst mode (use --checkpoint-bytes)")
        if self.mode == "read":
            if self.readers < 1:
                raise ValueError("read mode needs at least one reader")
            if self.writers:
                raise ValueError("read mode has no writers (use steady for a put/get mix)")
        if self.read_prefix is not None and self.mode != "read":
            raise ValueError("--read-prefix applies to read mode only")
