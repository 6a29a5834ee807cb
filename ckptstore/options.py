"""Options of every front-end, grouped: ``Checkpointer``, ``dcp.StoreWriter`` and
``dcp.StoreReader`` take the same objects, each field documented and checked once.

    Checkpointer(uri, keep_last=3)                                   # the common case
    Checkpointer(uri, tiers=TierOptions(local_dir="/dev/shm/run", durable_every=10))
    StoreWriter(uri, encoding=EncodingOptions(compression="none"), tiers=same_tiers)

The flat keywords of earlier releases (``Checkpointer(uri, compression="none")``) still work for
this release, with a ``DeprecationWarning`` naming the option object to use instead.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Any

from ckptstore.codec import CodecConfig
from ckptstore.leases import DEFAULT_TTL_S, MAX_LEASE_TTL_S
from ckptstore.tiers.policy import (
    DEFAULT_LOCAL_KEEP_LAST,
    DEFAULT_PEER_BUDGET_BYTES,
    DEFAULT_REPAIR_MEMORY_BYTES,
    TierPolicy,
)

DEFAULT_GC_WAIT_S = 600.0
DEFAULT_SHARED_READ_BUDGET_BYTES = 256 * 2**20
STAGING_MODES = ("host", "device", "auto", "peer")


_KINDS = {
    "int": (numbers.Integral,),
    "float": (numbers.Real,),
    "str": (str,),
    "bool": (bool,),
    "None": (type(None),),
}


def _check_kinds(options: Any) -> None:
    """Each field whose annotation names only ``int``, ``float``, ``str``, ``bool`` or ``None``
    holds one of them (a bool is no number here, an int is a float): ``keep_last=2.5`` or
    ``timeout_s="30"`` fail here, naming the field, not deep inside a save."""
    for f in dataclasses.fields(options):
        names = [n.strip() for n in str(f.type).split("|")]
        if not f.init or not all(n in _KINDS for n in names):
            continue
        value = getattr(options, f.name)
        if isinstance(value, bool) and "bool" not in names:
            ok = False
        else:
            ok = isinstance(value, tuple(k for n in names for k in _KINDS[n]))
        if not ok:
            raise TypeError(
                f"{type(options).__name__}.{f.name} takes {' or '.join(names)}, "
                f"got {type(value).__name__} {value!r}"
            )


def _at_least(name: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(kw_only=True, frozen=True)
class StorageOptions:
    """How the store is reached."""

    max_concurrency: int = 16
    """Storage requests in flight at once."""
    timeout_s: float = 30.0
    """Deadline of one storage request, its retries included (large transfers get 1 s more per
    2 MiB): a store that never answers fails the call after about this long."""
    background_nice: int = 0
    """Added to the nice value of the threads that encode, upload and drain (Linux), so that
    the training loop's own threads get the cores first; 0 leaves priorities alone."""
    lost_rank_timeout_s: float = 30.0
    """The bound on a lost rank (killed, exited after SIGTERM, node gone). A rank that stops
    answering before an exchange of a save or load (a ``Checkpointer``'s, or a ``StoreWriter``'s
    or ``StoreReader``'s own exchanges) ends every other rank's
    save, load, ``wait()`` and ``close()`` within about this long, with one error naming it
    (``RankLostError``); ranks that came to an exchange in different calls (one in ``load()``,
    one saving) fail at once (``RanksOutOfStepError``). A rank alive but slow (its heartbeat
    moves) is waited for up to ``group_timeout_s()`` (a save may wait for a gc). With tiers
    (``TierOptions.local_dir``) it bounds the drains too, and a rank lost within an exchange;
    without tiers the bound is four times this, and one lost within an exchange is found when
    its connection closes, else after ``group_timeout_s()`` (reads shared over the group wait
    for durable storage). A rank's heartbeat is a Python thread: one call that holds the GIL
    for more than a quarter of the bound (a sort of a huge list, a large ``json.loads``) makes
    a live rank look lost; raise the bound for such a job."""
    store: Any = None
    """An already open ``ckptstore.Store`` to use instead of opening the URI (e.g. with fault
    injection); ``storage_options`` are then ignored."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        _at_least("max_concurrency", self.max_concurrency, 1)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.lost_rank_timeout_s < 4:
            raise ValueError(
                f"lost_rank_timeout_s must be >= 4 (a roll call takes a quarter of it), "
                f"got {self.lost_rank_timeout_s}"
            )
        if not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice must be within [0, 19], got {self.background_nice}")

    def group_timeout_s(self, gc_wait_s: float) -> float:
        """How long a rank waits in a collective of a save: the other ranks may wait while rank
        0 waits for a gc (up to ``gc_wait_s``) and its requests time out."""
        return max(self.timeout_s * 20, 600.0) + gc_wait_s


@dataclass(kw_only=True, frozen=True)
class EncodingOptions:
    """How chunks are cut, encoded and uploaded."""

    compression: str | int | None = "auto"
    """``"auto"`` (byte-grouping + zstd for as long as compressing a chunk is faster than
    uploading what it saves), ``"zstd"`` (always), ``"zstd:N"``, ``"none"``."""
    chunk_bytes: int | None = None
    """Large tensors are cut into chunks of this size (default 32 MiB); small ones are packed."""
    encode_threads: int | None = None
    """Chunks hashed, encoded and uploaded at once (default: cores, at least 4)."""
    hedge_uploads: bool | None = None
    """Duplicate slow chunk uploads (default: on for remote stores)."""
    recheck_every: int = 16
    """A chunk a save references without writing it (its bytes unchanged since an earlier
    save: frozen weights, say) is read back and verified by about one save in this many
    (chosen per chunk and step), and written again from the save's bytes if it is found
    damaged or missing, which repairs every step that shares it. The cost: a save reads back
    about 1/N of the bytes it did not change (a frozen 100 GB base: about 6 GB a save at 16), in
    the background as its writes are. 0: never (a damaged chunk then stays referenced by every
    later save of the same bytes until a load or ``ckptstore verify`` finds it)."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        _at_least("chunk_bytes", self.chunk_bytes, 1)
        _at_least("recheck_every", self.recheck_every, 0)
        _at_least("encode_threads", self.encode_threads, 1)
        CodecConfig.parse(self.compression)  # "gzip" is refused here, not at the first save


@dataclass(kw_only=True, frozen=True)
class StagingOptions:
    """Where ``save()`` copies the state before it returns."""

    mode: str = "auto"
    """``"auto"`` (default): ``"device"`` where the state lives on an accelerator and fits
    the device budget, else ``"host"`` (one log line when a state stops fitting), and the
    first save ``"host"`` unless ``device_budget_bytes`` is given (the loop's memory peak is
    known once it ran a step); a DCP save stages on the host, DCP having staged the state.
    ``"host"``: into a pooled host buffer (pinned with an accelerator; the loop's stream waits
    for that device-to-host copy).
    ``"device"``: into a pooled buffer on the state's device, copied to the host in the
    background (a state over the device budget goes through the host, one log line).
    ``"peer"`` (Checkpointer): host staging, and each rank also sends its staged state to a
    guard rank one node over, whose memory ``load`` takes it from first."""
    budget_bytes: int | None = None
    """Host memory for staged copies (None: one buffer, state-sized). A state that needs more
    than this to stage is refused: ``save()`` raises ``ValueError`` naming both sizes."""
    device_budget_bytes: int | None = None
    """Device memory for device staging (None: one buffer, while the state fits half of the
    device's free memory less the room the training loop's memory peak needs)."""
    when_busy: str = "wait"
    """A save asked for while the previous one still holds the staging memory ``"wait"``s for
    it, or is ``"skip"``ped with a warning (one process only)."""
    ranks_per_node: int | None = None
    """For ``mode="peer"``: the guard of rank r is r + ranks_per_node (default:
    ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1)."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        if self.mode not in STAGING_MODES:
            raise ValueError(
                f"staging must be one of {', '.join(STAGING_MODES)}, got {self.mode!r}"
            )
        if self.when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {self.when_busy!r}")
        _at_least("budget_bytes", self.budget_bytes, 1)
        _at_least("device_budget_bytes", self.device_budget_bytes, 1)


@dataclass(kw_only=True, frozen=True)
class RetentionOptions:
    """How long steps and leases live (``keep_last`` itself is a front-end argument)."""

    lease_ttl_s: float = DEFAULT_TTL_S
    """A save renews its lease every ``lease_ttl_s / 4``; a lease not renewed for this long
    marks a dead writer, whose leftovers gc removes. A save whose lease could not be renewed
    for half of it is not committed."""
    gc_wait_s: float = DEFAULT_GC_WAIT_S
    """How long a save waits for a garbage collection of the store to finish before failing."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.gc_wait_s < 0:
            raise ValueError(f"gc_wait_s must be >= 0, got {self.gc_wait_s}")
        if self.lease_ttl_s > MAX_LEASE_TTL_S:
            raise ValueError(
                f"lease_ttl_s must be <= {MAX_LEASE_TTL_S:g} (a lease claiming longer is not "
                f"trusted by readers), got {self.lease_ttl_s:g}"
            )


@dataclass(kw_only=True, frozen=True)
class TierOptions:
    """Tiers (docs/FORMAT.md, "Tiers"): every save committed to a node-local directory first,
    copies on peer nodes, durable storage every M saves, drained in the background."""

    local_dir: str | os.PathLike | None = None
    """A node-local directory (a RAM disk such as ``/dev/shm/run7`` survives a process crash,
    an NVMe path a reboot), not inside a local durable store; each rank's copies go to
    ``local_dir/job-<j>/rank-<r:05d>/``. None: no tiers, every save goes to the durable store."""
    peer_copies: int = 0
    """Each rank's copy is also sent, over the process group (never through storage), to the
    ranks at its position on the next K nodes, which keep it: a replaced node restores from
    them. Needs K + 1 nodes."""
    durable_every: int = 1
    """The first save and every M-th after it also go to durable storage, drained in the
    background from the local copies; the others stay in the tiers only. The save after one
    bound for durable storage that did not get there (its drain or the save failed) goes too."""
    local_keep_last: int = DEFAULT_LOCAL_KEEP_LAST
    """Retention of each store in ``local_dir`` (a step still to be drained is kept). A save
    writes its copy before retention drops the oldest: give ``local_dir`` room for one copy
    more. A tier found full with its copies keeps one fewer of those already drained to
    durable storage from then on (one warning); a copy only the tier holds stays."""
    peer_budget_bytes: int = DEFAULT_PEER_BUDGET_BYTES
    """A peer copy or repair moves chunks in rounds, two in flight per transfer: the bound of
    each transfer's two round buffers together (a chunk larger than half of it goes alone)."""
    repair_memory_bytes: int = DEFAULT_REPAIR_MEMORY_BYTES
    """A load that repairs this rank's copy from a peer's (its node was wiped) keeps the
    received chunks in memory, verified once, and loads from them; the copy is written to
    ``local_dir`` after the tensors are filled, in the background (the next save, tiered load
    or ``close()`` waits for it). A copy whose stored chunks take more than this many bytes is
    written first and read back instead (0: always). Default 1 GiB."""
    node_rank: int | None = None
    """This rank's node, for ``peer_copies`` (default: torchrun's ``GROUP_RANK``, else
    ``rank // LOCAL_WORLD_SIZE``, else the host name)."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        _at_least("TierOptions.node_rank", self.node_rank, 0)
        self.policy()  # checks every field

    def policy(self) -> TierPolicy | None:
        return TierPolicy.build(
            self.local_dir,
            peer_copies=self.peer_copies,
            durable_every=self.durable_every,
            local_keep_last=self.local_keep_last,
            peer_budget_bytes=self.peer_budget_bytes,
            repair_memory_bytes=self.repair_memory_bytes,
        )


@dataclass(kw_only=True, frozen=True)
class ReadOptions:
    """How loads read."""

    shared_read_budget_bytes: int = DEFAULT_SHARED_READ_BUDGET_BYTES
    """With several ranks, a chunk that several of them load (replicated state) is fetched by
    one and sent to the others, in rounds of at most this many bytes: the memory a load takes
    beyond its tensors. 0: every rank reads all its chunks from storage."""
    read_concurrency: int = 8
    """Chunks fetched and decoded at once by one rank's load (both front-ends)."""
    read_batch_bytes: int = 1 << 30
    """DCP loads read stored items in batches of about this many bytes, which bounds a load's
    temporary memory."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        _at_least("shared_read_budget_bytes", self.shared_read_budget_bytes, 0)
        _at_least("read_concurrency", self.read_concurrency, 1)
        _at_least("read_batch_bytes", self.read_batch_bytes, 1)


@dataclass(kw_only=True, frozen=True)
class PreemptionOptions:
    """SIGTERM (a spot reclaim, a scheduler's preemption) for a Checkpointer."""

    handle_sigterm: bool = False
    """Install a SIGTERM handler (main thread only): ``preempted`` becomes true, pending saves
    finish within ``sigterm_grace_s``, one log line per save says committed or abandoned, then
    the process exits as SIGTERM would have."""
    sigterm_grace_s: float = 25.0
    """How long pending saves may take after SIGTERM."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        if self.sigterm_grace_s <= 0:
            raise ValueError(f"sigterm_grace_s must be > 0, got {self.sigterm_grace_s}")


ON_UNHEALTHY = ("save", "skip", "raise")


@dataclass(kw_only=True, frozen=True)
class HealthPolicy:
    """What a save records of its numbers and when a step counts as healthy (docs/FORMAT.md,
    "Health"). A step is unhealthy when a floating value is NaN or Inf on any rank, or, with
    ``norm_jump``, when a norm moved by more than that factor from the previous healthy step."""

    scan: bool = True
    """Scan every floating tensor of each save (NaN and Inf counts, sum of squares) in the
    background pass. Off: steps are saved with unknown health (``ls`` says ``unknown``)."""
    on_unhealthy: str = "save"
    """An unhealthy save is ``"save"``d anyway (for forensics; one warning line at commit
    naming its worst tensors), ``"skip"``ped (not committed, one warning; ``wait()`` returns
    and ``handle.health.committed`` is False) or makes ``wait()`` ``"raise"``
    ``UnhealthyStepError`` (not committed)."""
    norm_jump: float | None = None
    """Also unhealthy: the global norm (the square root of every rank's sums of squares, a
    replicated tensor counted once per rank that saves it), or a group's of ``norm_groups``,
    is more than this factor above or below that of the previous healthy step (a cheap sign of
    silent data corruption). None: off."""
    norm_groups: dict[str, tuple[str, ...]] | None = None
    """Named groups of tensors by name prefix (``{"model": ("model/",)}``; a Checkpointer
    tensor's name is its path in the state, a DCP one its key), each recorded and, with
    ``norm_jump``, compared on its own besides the global norm."""
    ignore: tuple[str, ...] = ()
    """Tensor-name prefixes (named as in ``norm_groups``) whose values never make a step
    unhealthy nor count in a norm: sentinels that are Inf by design, such as a best score that
    starts at inf. Their NaN and Inf counts are still recorded per tensor (``inspect``)."""

    def __post_init__(self) -> None:
        _check_kinds(self)
        if self.on_unhealthy not in ON_UNHEALTHY:
            raise ValueError(
                f"on_unhealthy must be one of {', '.join(ON_UNHEALTHY)}, got {self.on_unhealthy!r}"
            )
        if self.norm_jump is not None and not self.norm_jump > 1:
            raise ValueError(f"norm_jump must be > 1 (a factor), got {self.norm_jump}")
        if self.norm_groups is not None:
            if not isinstance(self.norm_groups, dict) or not all(
                isinstance(k, str) and not isinstance(v, str) and all(isinstance(p, str) for p in v)
                for k, v in self.norm_groups.items()
            ):
                raise ValueError(
                    "norm_groups must map group names to tuples of tensor-name prefixes, got "
                    f"{self.norm_groups!r:.200}"
                )
            if "global" in self.norm_groups:
                raise ValueError("norm_groups: 'global' names the norm of every tensor")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) for p in self.ignore):
            raise ValueError(f"ignore must be a tuple of tensor-name prefixes, got {self.ignore!r}")
        if self.norm_jump is not None and not self.scan:
            raise ValueError("norm_jump needs scan=True")


# The flat keywords of earlier releases: keyword -> (option group, field).
_FLAT: dict[str, tuple[str, str]] = {
    "max_concurrency": ("storage", "max_concurrency"),
    "timeout_s": ("storage", "timeout_s"),
    "background_nice": ("storage", "background_nice"),
    "store": ("storage", "store"),
    "compression": ("encoding", "compression"),
    "chunk_bytes": ("encoding", "chunk_bytes"),
    "encode_threads": ("encoding", "encode_threads"),
    "hedge_uploads": ("encoding", "hedge_uploads"),
    "staging_budget_bytes": ("staging", "budget_bytes"),
    "device_staging_budget_bytes": ("staging", "device_budget_bytes"),
    "when_busy": ("staging", "when_busy"),
    "ranks_per_node": ("staging", "ranks_per_node"),
    "lease_ttl_s": ("retention", "lease_ttl_s"),
    "gc_wait_s": ("retention", "gc_wait_s"),
    "local_dir": ("tiers", "local_dir"),
    "peer_copies": ("tiers", "peer_copies"),
    "durable_every": ("tiers", "durable_every"),
    "local_keep_last": ("tiers", "local_keep_last"),
    "peer_budget_bytes": ("tiers", "peer_budget_bytes"),
    "node_rank": ("tiers", "node_rank"),
    "shared_read_budget_bytes": ("reads", "shared_read_budget_bytes"),
    "read_concurrency": ("reads", "read_concurrency"),
    "read_batch_bytes": ("reads", "read_batch_bytes"),
    "handle_sigterm": ("preemption", "handle_sigterm"),
    "sigterm_grace_s": ("preemption", "sigterm_grace_s"),
}
_GROUPS: dict[str, type] = {
    "storage": StorageOptions,
    "encoding": EncodingOptions,
    "staging": StagingOptions,
    "retention": RetentionOptions,
    "tiers": TierOptions,
    "reads": ReadOptions,
    "preemption": PreemptionOptions,
    "health": HealthPolicy,
}


def resolve(owner: str, given: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """Every option group ``owner`` takes (the keys of ``given``), made whole: a group not
    given is its defaults, a flat keyword of earlier releases is folded into its group (one
    ``DeprecationWarning`` per call), ``staging="device"`` stands for ``StagingOptions(mode=...)``.
    A keyword ``owner`` does not take is a ``TypeError``, as Python's own."""
    fields: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        group, field = _FLAT.get(name, (None, None))
        if group not in given:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        fields.setdefault(group, {})[field] = value
    if flat:
        hint = ", ".join(
            f"{_GROUPS[g].__name__}({', '.join(f'{k}=...' for k in kv)})"
            for g, kv in fields.items()
        )
        warnings.warn(
            f"{owner}({', '.join(f'{k}=' for k in flat)}) is deprecated: pass {hint}",
            DeprecationWarning,
            stacklevel=3,
        )
    out = {}
    for group, value in given.items():
        if group == "staging" and isinstance(value, str):
            value = StagingOptions(mode=value)  # with flat staging keywords, as they came
        elif value is not None and group in fields:
            # a keyword of earlier releases beside the group it belongs to: which one is meant?
            raise TypeError(
                f"{owner}() got {', '.join(f'{k}=' for k in fields[group])} and {group}=: pass "
                f"{'them' if len(fields[group]) > 1 else 'it'} in the {group} options alone"
            )
        if value is None:
            value = _GROUPS[group]()
        if not isinstance(value, _GROUPS[group]):
            article = "an" if _GROUPS[group].__name__[0] in "AEIOU" else "a"
            raise TypeError(
                f"{owner}({group}=...) takes {article} {_GROUPS[group].__name__}, got "
                f"{type(value).__name__}"
            )
        out[group] = dataclasses.replace(value, **fields.get(group, {}))
    return out
