"""The request-bound floor of a save and of a restore on S3 (``ckptbench plan``).

S3 serves about 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD (LIST included) requests per
second per partitioned prefix, once it has split its partitions to the load; past that it
answers 503 SlowDown. A save or restore cannot end sooner than its busiest prefix can take its
requests, whatever the bandwidth: that time is the floor.

Where the requests go (docs/FORMAT.md): chunk keys ``chunks/<h[:2]>/<h>`` spread by hash over
256 prefixes, and so do rank indexes since format version 2 (``indexes/<x[:2]>/...``: a rank's
requests besides its chunks, its index put and read, ``index_prefixes``; 1 models a version 1
store, whose indexes of one save sit under one prefix). The coordinator's requests (lease,
listings, the manifest, read once per restore and broadcast) land on a few prefixes that every
save shares, counted here as ``hot_prefixes``.

The counts: a save writes each new chunk with one request and a restore reads each chunk with
one (tests/store/test_requests.py holds the code to that), plus requests per rank and per save that
``ckptbench scale`` measures; ``counts_from_scale`` fits them as ``fixed + per_rank * ranks``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

S3_WRITES_PER_PREFIX_S = 3500.0
S3_READS_PER_PREFIX_S = 5500.0
CHUNK_PREFIXES = 256
"""``chunks/<h[:2]>/``: two hex digits of the chunk's hash."""
WRITE_OPS = ("put", "delete")
"""Store operations S3 counts against the PUT/DELETE rate; every other one is a GET/HEAD/LIST."""


@dataclass(kw_only=True)
class RequestCounts:
    """Requests besides the chunks' own, as ``{"write": n, "read": n}``: of a save and of a
    restore, fixed (the coordinator's) and per rank. Defaults: ``ckptbench scale`` on
    2026-11-25 (moto and local alike): a save writes the lease, the manifest and a lease delete,
    reads two listings and the latest manifest, and per rank puts its index and reads its index
    of the latest step; a restore lists once and reads the manifest once (rank 0, broadcast since
    2026-11-26; every rank read it before), and per rank reads its index."""

    save_fixed: dict[str, float] = field(default_factory=lambda: {"write": 3.0, "read": 3.0})
    save_per_rank: dict[str, float] = field(default_factory=lambda: {"write": 1.0, "read": 1.0})
    restore_fixed: dict[str, float] = field(default_factory=lambda: {"write": 0.0, "read": 2.0})
    restore_per_rank: dict[str, float] = field(default_factory=lambda: {"write": 0.0, "read": 1.0})
    source: str = "default"


@dataclass(kw_only=True)
class Limits:
    writes_per_prefix_s: float = S3_WRITES_PER_PREFIX_S
    reads_per_prefix_s: float = S3_READS_PER_PREFIX_S
    chunk_prefixes: int = CHUNK_PREFIXES
    index_prefixes: int = CHUNK_PREFIXES
    """Prefixes a rank's requests besides its chunks (its index) spread over."""
    hot_prefixes: int = 1
    """Prefixes the coordinator's requests (fixed per save) spread over."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def by_class(requests: dict[str, float]) -> dict[str, float]:
    """Store operations summed into S3's two rate classes."""
    write = sum(n for op, n in requests.items() if op in WRITE_OPS)
    return {"write": write, "read": sum(requests.values()) - write}


def counts_from_scale(scale: dict[str, Any], *, source: str) -> RequestCounts:
    """``fixed + per_rank * ranks`` fitted (least squares) to each rank count's requests of
    a ``ckptbench scale --json`` run, after one request per chunk: a put per new chunk saved
    (every save of the scale bench writes a fresh state), a get per chunk restored."""
    runs = scale.get("runs") or []
    if scale.get("bench") != "scale" or not runs:
        raise ValueError(f"--scale-json {source!r} is not `ckptbench scale --json` output")
    chunks = scale["chunks_per_rank"]
    ranks = [r["ranks"] for r in runs]
    save = [by_class(r["save_requests"]) for r in runs]
    restore = [by_class(r["restore"]["requests"]) for r in runs]
    for n, s, r in zip(ranks, save, restore, strict=True):
        s["write"] -= n * chunks
        r["read"] -= n * chunks
    fitted: dict[str, dict[str, float]] = {}
    for name, counts in (("save", save), ("restore", restore)):
        for kind in ("write", "read"):
            fixed, per_rank = _line(ranks, [c[kind] for c in counts])
            fitted.setdefault(f"{name}_fixed", {})[kind] = fixed
            fitted.setdefault(f"{name}_per_rank", {})[kind] = per_rank
    return RequestCounts(**fitted, source=source)


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope, neither below 0; through the origin for one distinct x."""
    if len(set(xs)) < 2:
        return 0.0, max(0.0, sum(ys) / sum(xs))
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def floor(
    counts: RequestCounts, limits: Limits, *, ranks: int, state_bytes: float, chunk_bytes: int
) -> dict[str, Any]:
    """The request-bound floor of one save (every chunk new) and one restore of
    ``state_bytes`` sharded over ``ranks``, in ``chunk_bytes`` chunks."""
    if ranks < 1 or chunk_bytes < 1 or state_bytes <= 0:
        raise ValueError("the floor needs ranks, a chunk size and a state size above 0")
    chunks = ranks * math.ceil(state_bytes / ranks / chunk_bytes)
    rate = {"write": limits.writes_per_prefix_s, "read": limits.reads_per_prefix_s}

    def one(name: str, chunk_kind: str) -> dict[str, Any]:
        fixed, per_rank = getattr(counts, f"{name}_fixed"), getattr(counts, f"{name}_per_rank")
        other = {k: fixed[k] + per_rank[k] * ranks for k in ("write", "read")}
        # seconds each busiest prefix needs for its class of requests
        bounds = {
            f"chunks ({chunk_kind})": chunks / (limits.chunk_prefixes * rate[chunk_kind]),
            **{
                f"indexes ({k})": per_rank[k] * ranks / (limits.index_prefixes * rate[k])
                for k in ("write", "read")
            },
            **{
                f"other ({k})": fixed[k] / (limits.hot_prefixes * rate[k])
                for k in ("write", "read")
            },
        }
        bound_by = max(bounds, key=bounds.__getitem__)
        return {
            "chunk_requests": chunks,
            "other_requests": other,
            "requests": chunks + other["write"] + other["read"],
            "bounds_s": bounds,
            "floor_s": bounds[bound_by],
            "bound_by": bound_by,
        }

    return {
        "ranks": ranks,
        "state_bytes": state_bytes,
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "limits": asdict(limits),
        "counts": asdict(counts),
        "save": one("save", "write"),
        "restore": one("restore", "read"),
    }
