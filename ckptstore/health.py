"""What a step knows about its numbers (docs/FORMAT.md, "Health").

Every save scans each floating tensor of its staged copy, where it is staged (on the device for
a device-staged save, device-generic torch ops only), in the background pass that hashes it:

    scan       per tensor ``[nan, inf, sumsq]``: NaN count, ±Inf count, sum of squares of the
               finite values (float64; None where it overflows float64), recorded in the rank
               index (``TensorEntry.health``); on the host ``ChunkScan`` takes it in the pass
               that hashes each chunk, from the same cache-sized pieces (each byte read from
               memory once for both), ``scan`` on a device
    summarize  a rank's totals, its sums of squares per named group, its worst tensors: what
               the rank hands the coordinator with its index (``RankWritten.health``)
    verdict    (the coordinator) the step's totals over every rank and whether it is healthy:
               no NaN or Inf anywhere, and with ``HealthPolicy.norm_jump`` no global (or group)
               norm that moved by more than that factor from the previous healthy step; the
               manifest's ``health``

A step saved before health was recorded has none: its status is ``"unknown"``, never healthy or
unhealthy. Imports no torch until a scan needs it.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from ckptstore.errors import UnhealthyStepError
from ckptstore.render import printable

logger = logging.getLogger(__name__)

HEALTHY = "healthy"
UNHEALTHY = "unhealthy"
UNKNOWN = "unknown"

WORST_KEPT = 8  # tensors named per rank and per step, worst first
_BLOCK_ELEMENTS = 1 << 22  # a scan reads a tensor in blocks of this many elements


def is_floating(dtype_name: str) -> bool:
    """True for a dtype (by name) whose values can be NaN or Inf and are scanned."""
    floating = dtype_name.startswith("float") or dtype_name == "bfloat16"
    return floating and dtype_name not in _PACKED


# Two values to a byte: torch converts them to no other dtype, so they are not scanned.
_PACKED = frozenset({"float4_e2m1fn_x2"})


def _scanned(dtype: Any) -> bool:
    return is_floating(str(dtype).removeprefix("torch."))


def scan(tensors: list[Any]) -> list[list | None]:
    """Each tensor's ``[nan, inf, sumsq]`` (None for a tensor that is not floating), computed
    where the tensors are: one pass of a dot product per block, and for the rare tensor whose
    result is not finite a second pass counting NaN and Inf. The host waits for the device
    once per pass, not per tensor."""
    import torch

    floating = [i for i, t in enumerate(tensors) if _scanned(t.dtype) and t.numel() > 0]
    out: list[list | None] = [[0, 0, 0.0] if _scanned(t.dtype) else None for t in tensors]
    if not floating:
        return out
    sums = []
    for i in floating:
        flat = tensors[i].reshape(-1)
        parts = []
        for block in flat.split(_BLOCK_ELEMENTS):
            if block.dtype not in (torch.float32, torch.float64):
                block = block.float()
            parts.append(torch.dot(block, block).double())
        sums.append(torch.stack(parts).sum())
    fast = torch.stack(sums).tolist()
    slow = [i for i, s in zip(floating, fast) if not math.isfinite(s)]
    for i, s in zip(floating, fast):
        out[i] = [0, 0, float(s)]
    if slow:
        counted = [
            torch.stack([_counted(b) for b in tensors[i].reshape(-1).split(_BLOCK_ELEMENTS)]).sum(0)
            for i in slow
        ]
        for i, (nan, inf, sq) in zip(slow, torch.stack(counted).tolist()):
            out[i] = [int(nan), int(inf), sq if math.isfinite(sq) else None]
    return out


def _counted(block: Any) -> Any:
    """The slow path of a block whose sum of squares is not finite: its NaN count, Inf count
    and the sum of squares of its finite values (float64), as one float64 tensor of 3."""
    import torch

    if block.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        # float8: torch counts Inf in no float8 dtype; float32 holds every float8 value
        parts = block.reshape(-1).split(_BLOCK_ELEMENTS)
        return torch.stack([_counted(part.float()) for part in parts]).sum(0)
    finite = torch.isfinite(block)
    b64 = torch.where(finite, block, 0).double()
    return torch.stack(
        [torch.isnan(block).sum().double(), torch.isinf(block).sum().double(), torch.dot(b64, b64)]
    )


@dataclass(frozen=True)
class _Part:
    """The bytes of one floating tensor inside one chunk: ``[start, end)`` of the chunk."""

    tensor: int
    start: int
    end: int
    dtype: Any
    itemsize: int


class ChunkScan:
    """``scan`` of the tensors staged in a host buffer, fused into the pass that hashes the
    buffer's chunks (``pipeline.write_chunks``): the hash reads each chunk in cache-sized
    pieces (``codec.hash_bytes``) and, right before it hashes a piece, takes the sum
    of squares of the tensor elements that start in it, so each byte comes from memory once for
    both. A piece whose sum is not finite is counted there (NaN, Inf, finite sum of squares in
    float64), while it is still in cache. ``result`` adds each tensor's partial results up once
    every chunk was hashed; the same ``[nan, inf, sumsq]`` as ``scan``.

    ``tensors`` sit at ``offsets`` in the buffer, cut by ``chunks`` (``(start, end)`` in it,
    ``pipeline.ChunkLayout.chunks``); every chunk holding a floating tensor's bytes must be
    hashed through ``hash``, from any thread."""

    def __init__(self, tensors: list[Any], offsets: list[int], chunks: list[Any]) -> None:
        self._kinds = [None if not _scanned(t.dtype) else t.numel() > 0 for t in tensors]
        self._parts: dict[int, list[_Part]] = {}
        starts = [c.start for c in chunks]
        for i, (t, offset) in enumerate(zip(tensors, offsets)):
            if not self._kinds[i]:
                continue
            end, size = offset + t.numel() * t.element_size(), t.element_size()
            c = bisect.bisect_right(starts, offset) - 1
            while c < len(chunks) and chunks[c].start < end:
                lo, hi = max(offset, chunks[c].start), min(end, chunks[c].end)
                assert (lo - offset) % size == 0, "a chunk boundary splits an element"
                part = _Part(i, lo - chunks[c].start, hi - chunks[c].start, t.dtype, size)
                self._parts.setdefault(chunks[c].start, []).append(part)
                c += 1
        for parts in self._parts.values():
            parts.sort(key=lambda p: p.start)
        self._partials: dict[int, dict[int, list]] = {}

    def hash(self, chunk_start: int, raw: Any) -> str:
        """``codec.hash_bytes`` of the chunk at ``chunk_start`` (``raw``, its bytes as a uint8
        array), scanning the floating tensor elements in each piece right before it is hashed."""
        import numpy as np

        from ckptstore.codec import hash_bytes

        parts = self._parts.get(chunk_start)
        if parts is None:
            return hash_bytes(raw)
        partial: dict[int, list] = {}
        self._partials[chunk_start] = partial  # a dict's item assignment is atomic
        with np.errstate(over="ignore", invalid="ignore"):  # a sum of squares past float32
            return hash_bytes(raw, _PieceScan(parts, raw, partial))

    def result(self) -> list[list | None]:
        """Each tensor's ``[nan, inf, sumsq]`` (None for a tensor that is not floating)."""
        missing = set(self._parts) - set(self._partials)
        assert not missing, f"chunks at {sorted(missing)[:3]} were not scanned"
        out: list[list | None] = [None if k is None else [0, 0, 0.0] for k in self._kinds]
        for partial in self._partials.values():
            for i, (nan, inf, sq) in partial.items():
                total = out[i]
                total[0] += nan
                total[1] += inf
                total[2] += sq
        for total in out:
            if total is not None and not math.isfinite(total[2]):
                total[2] = None  # overflowed float64
        return out


class _PieceScan:
    """One chunk's part of a ``ChunkScan``: called on its pieces in order, it adds the sum of
    squares of the elements of each part that start in the piece to ``partial`` (by tensor:
    ``[nan, inf, sumsq]``)."""

    def __init__(self, parts: list[_Part], raw: Any, partial: dict[int, list]) -> None:
        self.parts = parts
        self.raw = raw
        self.partial = partial
        self.k = 0  # the part being read
        self.position = parts[0].start  # its next element

    def __call__(self, start: int, end: int) -> None:
        parts = self.parts
        while self.k < len(parts) and parts[self.k].start < end:
            part = parts[self.k]
            lo = max(self.position, part.start)
            # every element whose first byte is before ``end``
            hi = min(part.end, part.start + -(-(end - part.start) // part.itemsize) * part.itemsize)
            if hi > lo:
                self._add(part, lo, hi)
            if hi < part.end:
                self.position = hi
                return
            self.k += 1
            self.position = parts[self.k].start if self.k < len(parts) else end

    def _add(self, part: _Part, lo: int, hi: int) -> None:
        sq = _sumsq(self.raw[lo:hi], part.dtype)
        total = self.partial.setdefault(part.tensor, [0, 0, 0.0])
        if math.isfinite(sq):
            total[2] += sq
            return
        import torch

        nan, inf, sq = _counted(torch.from_numpy(self.raw[lo:hi]).view(part.dtype)).tolist()
        total[0] += int(nan)
        total[1] += int(inf)
        total[2] += sq


_scratch = threading.local()


def _sumsq(piece: Any, dtype: Any) -> float:
    """The sum of squares of a piece of a tensor's bytes (a uint8 array), by numpy: float32 and
    float64 as they are, bfloat16 as the float32 halves of its element pairs, the others
    converted by torch; a converted piece goes through a per-thread buffer. (A torch op this
    small may wait on torch's thread pool, whose threads the other hashing threads keep
    busy.)"""
    import numpy as np
    import torch

    if dtype == torch.float32 or dtype == torch.float64:
        x = piece.view(np.float32 if dtype == torch.float32 else np.float64)
        return float(np.dot(x, x))
    if dtype == torch.bfloat16:
        even = piece.size // 4 * 4
        words = piece[:even].view(np.uint32)  # two elements, each the upper half of a float32
        out = _buffer(words.size)
        x = out.view(np.float32)
        np.bitwise_and(words, 0xFFFF0000, out=out)
        sq = float(np.dot(x, x))
        np.left_shift(words, 16, out=out)
        sq += float(np.dot(x, x))
        if even < piece.size:
            last = (piece[even:].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            sq += float(np.dot(last, last))
        return sq
    out = _buffer(piece.size // dtype.itemsize).view(np.float32)
    torch.from_numpy(out).copy_(torch.from_numpy(piece).view(dtype))
    return float(np.dot(out, out))


def _buffer(n: int) -> Any:
    """``n`` uint32 of this thread's scratch buffer, which its next call reuses."""
    import numpy as np

    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < n:
        buffer = np.empty(n, dtype=np.uint32)
        _scratch.buffer = buffer
    return buffer[:n]


def check_entry_health(value: Any, dtype: str) -> str | None:
    """Why ``value``, a rank index entry's ``health``, is malformed; None if it is well formed
    (or absent)."""
    if value is None:
        return None
    if not is_floating(dtype):
        return f"health recorded for a {dtype} tensor"
    if not (isinstance(value, list) and len(value) == 3):
        return f"health {value!r} is not [nan, inf, sumsq]"
    nan, inf, sq = value
    if not (_is_count(nan) and _is_count(inf)):
        return f"health counts {nan!r}, {inf!r} are not counts"
    if sq is not None and not (_is_number(sq) and sq >= 0):
        return f"health sum of squares {sq!r} is not a non-negative number"
    return None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v: Any) -> bool:
    """A finite int or float (not a bool); an int no float holds (10**400) is not one."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _add(a: float | None, b: float | None) -> float | None:
    """Sums of squares add; None (overflowed) absorbs."""
    if a is None or b is None:
        return None
    s = a + b
    return s if math.isfinite(s) else None


@dataclass
class RankHealth:
    """One rank's part of a step's health, handed to the coordinator with its index."""

    nan: int = 0
    inf: int = 0
    sumsq: float | None = 0.0
    groups: dict[str, float | None] = field(default_factory=dict)
    worst: list[dict] = field(default_factory=list)
    """Up to ``WORST_KEPT`` tensors with NaN or Inf, worst first: ``{"rank", "tensor", "nan",
    "inf"}``."""

    def as_rank(self, rank: int) -> RankHealth:
        """The same numbers, its tensors named as rank ``rank``'s (a tier copy is rank 0 of
        a one-rank step)."""
        worst = [{**t, "rank": rank} for t in self.worst]
        return RankHealth(self.nan, self.inf, self.sumsq, dict(self.groups), worst)


def summarize(
    rank: int,
    entries: list[Any],
    names: dict[int, str],
    groups: dict[str, tuple[str, ...]] | None = None,
    ignore: tuple[str, ...] = (),
) -> RankHealth | None:
    """A rank's totals over its index ``entries`` (``TensorEntry``: ``dtype``, ``health``;
    ``names``: tensor index -> name), leaving out the tensors named under an ``ignore``
    prefix; None when a floating tensor records no health (an index written before health
    was recorded)."""
    if any(e.health is None and is_floating(e.dtype) for e in entries):
        return None
    healths = [e.health for e in entries]
    out = RankHealth(groups=dict.fromkeys(groups or {}, 0.0))
    bad = []
    for i, h in enumerate(healths):
        if h is None:
            continue
        name = names.get(i, f"tensor {i}")
        if ignore and name.startswith(tuple(ignore)):
            continue
        nan, inf, sq = h
        out.nan += nan
        out.inf += inf
        out.sumsq = _add(out.sumsq, sq)
        for group, prefixes in (groups or {}).items():
            if name.startswith(tuple(prefixes)):
                out.groups[group] = _add(out.groups[group], sq)
        if nan or inf:
            bad.append({"rank": rank, "tensor": name, "nan": nan, "inf": inf})
    out.worst = sorted(bad, key=_badness)[:WORST_KEPT]
    return out


def rank_health(
    rank: int,
    scans: list[tuple[list[Any], ChunkScan]],
    entries: list[Any],
    names: dict[int, str],
    groups: dict[str, tuple[str, ...]] | None = None,
    ignore: tuple[str, ...] = (),
) -> RankHealth | None:
    """A rank's health as its index records it: each of ``scans`` (a write's entries and the
    ``ChunkScan`` taken as their chunks were hashed) recorded in its entries, then the rank's
    totals over ``entries`` (``summarize``)."""
    for scanned, scan in scans:
        for entry, h in zip(scanned, scan.result()):
            entry.health = h
    return summarize(rank, entries, names, groups, ignore)


def _badness(t: dict) -> tuple:
    return (-(t["nan"] + t["inf"]), t["rank"], t["tensor"])


def norm(sumsq: float | None) -> float:
    return math.inf if sumsq is None else math.sqrt(sumsq)


def verdict(
    ranks: list[RankHealth | None],
    *,
    previous: dict | None = None,
    previous_step: int | None = None,
    norm_jump: float | None = None,
) -> dict | None:
    """The manifest's ``health`` of a step whose ranks report ``ranks`` (None: a rank with no
    health recorded, which makes the step's health unknown). ``previous``: the health of the
    previous healthy step, against which ``norm_jump`` compares the global norm and each
    group's."""
    if not ranks or any(r is None for r in ranks):
        return None
    nan = sum(r.nan for r in ranks)
    inf = sum(r.inf for r in ranks)
    sumsq: float | None = 0.0
    groups: dict[str, float | None] = {}
    for r in ranks:
        sumsq = _add(sumsq, r.sumsq)
        for g, s in r.groups.items():
            groups[g] = _add(groups.get(g, 0.0), s)
    worst = sorted((t for r in ranks for t in r.worst), key=_badness)[:WORST_KEPT]
    reasons = []
    if nan or inf:
        reasons.append(f"{nan} NaN and {inf} Inf values")
    if norm_jump is not None and previous is not None:
        olds = {"global": previous.get("sumsq"), **(previous.get("groups") or {})}
        news = {"global": sumsq, **groups}
        for name, new in news.items():
            if name not in olds:
                continue
            old_n, new_n = norm(olds[name]), norm(new)
            if not (math.isfinite(old_n) and old_n > 0):
                continue
            if not (old_n / norm_jump <= new_n <= old_n * norm_jump):
                reasons.append(
                    f"{name} norm {new_n:.6g} moved more than {norm_jump:g}x from "
                    f"{old_n:.6g} (step {previous_step})"
                )
    return {
        "healthy": not reasons,
        "nan": nan,
        "inf": inf,
        "sumsq": sumsq,
        "groups": groups,
        "worst": worst,
        "reasons": reasons,
    }


def check_manifest_health(value: Any) -> str | None:
    """Why a manifest's ``health`` is malformed; None if it is well formed (or absent)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "health is not an object"
    if not isinstance(value.get("healthy"), bool):
        return "health.healthy is not a bool"
    if not (_is_count(value.get("nan")) and _is_count(value.get("inf"))):
        return "health counts are not counts"
    sq = value.get("sumsq")
    if sq is not None and not (_is_number(sq) and sq >= 0):
        return "health.sumsq is not a non-negative number"
    groups = value.get("groups", {})
    if not isinstance(groups, dict) or not all(
        isinstance(k, str) and (v is None or (_is_number(v) and v >= 0)) for k, v in groups.items()
    ):
        return "health.groups is not a map of names to sums of squares"
    worst = value.get("worst", [])
    if not isinstance(worst, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("tensor"), str)
        and _is_count(t.get("rank"))
        and _is_count(t.get("nan"))
        and _is_count(t.get("inf"))
        for t in worst
    ):
        return "health.worst is malformed"
    reasons = value.get("reasons", [])
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        return "health.reasons is not a list of strings"
    return None


def status(health: dict | None) -> str:
    """``"healthy"``, ``"unhealthy"`` or ``"unknown"`` (a step saved without health)."""
    if health is None:
        return UNKNOWN
    return HEALTHY if health["healthy"] else UNHEALTHY


@dataclass(frozen=True)
class StepHealth:
    """A committed step's health as a training loop sees it (``SaveHandle.health``)."""

    step: int
    status: str
    """``"healthy"``, ``"unhealthy"`` or ``"unknown"``."""
    nan: int = 0
    inf: int = 0
    norm: float | None = None
    """The global norm (sqrt of every rank's sums of squares); inf where it overflowed."""
    group_norms: dict[str, float] = field(default_factory=dict)
    worst: tuple[str, ...] = ()
    """The worst tensors, as ``"rank R tensor NAME: N NaN, M Inf"``."""
    reasons: tuple[str, ...] = ()
    committed: bool = True
    """False for an unhealthy save that ``HealthPolicy(on_unhealthy="skip")`` did not store."""

    @property
    def healthy(self) -> bool:
        return self.status == HEALTHY

    @classmethod
    def of(cls, step: int, health: dict | None, *, committed: bool = True) -> StepHealth:
        if health is None:
            return cls(step, UNKNOWN, committed=committed)
        return cls(
            step,
            status(health),
            nan=health["nan"],
            inf=health["inf"],
            norm=norm(health.get("sumsq")),
            group_norms={g: norm(s) for g, s in (health.get("groups") or {}).items()},
            worst=tuple(describe(t) for t in health.get("worst") or ()),
            reasons=tuple(printable(r) for r in health.get("reasons") or ()),
            committed=committed,
        )


def describe(t: dict) -> str:
    return f"rank {t['rank']} {printable(str(t['tensor']))}: {t['nan']} NaN, {t['inf']} Inf"


def one_line(step: int, health: dict) -> str:
    """The log line of an unhealthy step: why, and its worst tensors."""
    worst = "; ".join(describe(t) for t in (health.get("worst") or [])[:3])
    why = printable("; ".join(health.get("reasons") or ()))
    return f"step {step} is unhealthy ({why})" + (f"; worst: {worst}" if worst else "")


def to_commit(
    step: int, health: dict | None, on_unhealthy: str, where: str, *, log: bool = True
) -> bool:
    """Whether ``step`` of ``health`` is committed to ``where`` under
    ``HealthPolicy(on_unhealthy=...)``: a healthy or unknown step is; an unhealthy one is
    ("save", one warning by the caller's commit), is not ("skip", one warning here if
    ``log``), or is refused (``UnhealthyStepError``)."""
    if health is None or health["healthy"] or on_unhealthy == "save":
        return True
    if on_unhealthy == "raise":
        raise UnhealthyStepError(
            f"{one_line(step, health)}; not committed to {where} "
            "(HealthPolicy(on_unhealthy='raise'))"
        )
    if log:
        logger.warning(
            "%s; not committed to %s (HealthPolicy(on_unhealthy='skip'))",
            one_line(step, health),
            where,
        )
    return False


def why_not_healthy(step: int, health: dict | None) -> str:
    """Why ``step`` is not a healthy step, in one line."""
    if health is None:
        return f"step {step}: health unknown (saved without a health record)"
    return one_line(step, health).replace(" is unhealthy (", ": unhealthy (", 1)


class Unreadable(str):
    """Why ``find_healthy`` passed over a step whose manifest cannot be read (a str, as each
    other reason), and the error: a load that then loads an older step quarantines it, as a
    fallback quarantines a step it skipped."""

    error: BaseException | None

    def __new__(cls, text: str, error: BaseException | None = None) -> Unreadable:
        self = super().__new__(cls, text)
        self.error = error
        return self


def find_healthy(store: Any, steps: list[int], *, limit: int | None = None):
    """Walk ``steps`` newest first: the healthy ones (at most ``limit``) and, by step, why
    each other one is not (its manifest read; one that cannot be read says why). Errors of
    the store itself are raised."""
    from ckptstore.catalog import load_manifest
    from ckptstore.errors import CheckpointCorruptError, CheckpointNotFoundError, FormatVersionError

    healthy: list[int] = []
    why: dict[int, str] = {}
    for step in sorted(steps, reverse=True):
        if limit is not None and len(healthy) >= limit:
            break
        try:
            health = load_manifest(store, step).health
        except (CheckpointCorruptError, CheckpointNotFoundError, FormatVersionError) as exc:
            why[step] = Unreadable(f"step {step}: cannot be read ({exc})", exc)
            continue
        if health is not None and health["healthy"]:
            healthy.append(step)
        else:
            why[step] = why_not_healthy(step, health)
    return healthy, why


def name_passed_over(
    not_healthy: dict[int, str], above: int, *, where: str = "", say: bool = True
) -> list[tuple[int, BaseException]]:
    """Name once (where ``say``: rank 0) each step newer than ``above`` that a ``healthy=True``
    load passed over, taking it out of ``not_healthy`` (``where``: the store, for steps a tier
    plan's reasons do not place); those whose manifests cannot be read, to be quarantined as a
    step a fallback skipped is. Every front-end's healthy load says it so."""
    unreadable: list[tuple[int, BaseException]] = []
    for step in sorted((s for s in not_healthy if s > above), reverse=True):
        why = not_healthy.pop(step)
        if say:
            logger.warning("%s%s: skipped by healthy=True", why, where)
        if isinstance(why, Unreadable) and why.error is not None:
            unreadable.append((step, why.error))
    return unreadable


def resumable_steps(
    store: Any, *, healthy: bool, limit: int | None = None
) -> tuple[list[int], dict[int, str]]:
    """The durable steps a resume of "latest" tries, newest first (at most ``limit``), and
    why each newer one ``healthy`` passed over is not healthy: every front-end's untiered
    ``latest()`` and resume. Steps of which none is healthy raise ``NoHealthyStepError``
    naming them; no step at all is an empty list."""
    from ckptstore.catalog import steps_to_resume

    steps = steps_to_resume(store)
    if not healthy:
        return steps[::-1][:limit], {}
    good, why = find_healthy(store, steps, limit=limit)
    if not good and why:
        raise no_healthy_step(f"no healthy committed step in {store.uri}", why)
    return good, why


def healthy_steps_to_load(store: Any, step: int | str | None, *, limit: int | None = 1):
    """The healthy steps a ``healthy=True`` load of ``step`` takes, newest first (at most
    ``limit``), and why each newer one passed over is not healthy: ``step`` itself when it is
    healthy (else ``UnhealthyStepError``), or for ``"latest"`` the newest healthy ones (none:
    ``NoHealthyStepError`` naming the newest steps and why; no step at all:
    ``CheckpointNotFoundError``)."""
    from ckptstore.catalog import list_steps, parse_step, resolve_step
    from ckptstore.errors import CheckpointNotFoundError, UnhealthyStepError

    if parse_step(step) is not None:
        wanted = resolve_step(store, step)
        good, why = find_healthy(store, [wanted])
        if not good:
            raise UnhealthyStepError(f"{why[wanted]} in {store.uri} (healthy=True)")
        return good, {}
    good, why = find_healthy(store, list_steps(store), limit=limit)
    if not good and why:
        raise no_healthy_step(f"no healthy committed step in {store.uri}", why)
    if not good:
        raise CheckpointNotFoundError(f"no committed step in {store.uri}")
    return good, why


def no_healthy_step(lead: str, why: dict[int, str]):
    """The ``NoHealthyStepError`` of a load that found the steps of ``why`` (by step, why each
    is not healthy), none healthy; it says how to load a step of unknown health."""
    from ckptstore.errors import NoHealthyStepError

    every = "; ".join(why[s] for s in sorted(why, reverse=True)[:5])
    unknown = any("health unknown" in line for line in why.values())
    hint = " (a step of unknown health loads without healthy=True)" if unknown else ""
    return NoHealthyStepError(f"{lead}: {every}{hint}")


def tiered_verdict(step: int, own: list[Any], durable: Any) -> str | None:
    """Why a save the tiers can load is not healthy (None: it is), for both front-ends: a
    rank's own copy that records NaN or Inf rules it out; else the durable manifest of the same
    save decides (``durable``: its health, None when unknown, ``"absent"`` when the durable
    store does not hold that save); else every rank's own copy (``own``, by rank: its health,
    or ``"absent"``) must say healthy."""
    bad = next(
        ((r, h) for r, h in enumerate(own) if isinstance(h, dict) and not h["healthy"]), None
    )
    if bad is not None:  # a copy is rank 0 of a one-rank step: its tensors are named as rank r's
        rank, health = bad
        worst = [{**t, "rank": rank} for t in health.get("worst") or ()]
        return why_not_healthy(step, {**health, "worst": worst})
    if durable != "absent":
        healthy = durable is not None and durable["healthy"]
        return None if healthy else why_not_healthy(step, durable)
    return None if all(isinstance(h, dict) for h in own) else why_not_healthy(step, None)
