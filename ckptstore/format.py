"""The on-storage layout (docs/FORMAT.md is the prose version of this module).

::

    chunks/<h[:2]>/<h>                         encoded chunk, h = xxh3-128 of its raw bytes
    indexes/<x[:2]>/<step:020d>/<attempt>/rank-<r>.json
                                               per-rank index of one save attempt (version 2;
                                               x = xxh3-128 of "<step:020d>/<attempt>/<r:05d>")
    steps/<step:020d>/<attempt>/rank-<r>.json  the same, in version 1 steps
    steps/<step:020d>/<attempt>/dcp.metadata   DCP Metadata (pickled), DCP saves only
    pending/<step:020d>-<attempt>-<r>.json     marker of a save in flight (deleted after commit)
    commits/<step:020d>.json                   the manifest; its existence is the commit

Every object is written once. A step is visible exactly when its manifest exists; the manifest
is written after every object it references is durable. This module names objects and encodes
and decodes them; ``catalog`` finds and reads them, ``commit`` writes the manifest.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckptstore.codec import hash_bytes, max_encoded_size
from ckptstore.errors import CheckpointCorruptError, FormatVersionError
from ckptstore.health import check_entry_health, check_manifest_health
from ckptstore.tree import SUB_BYTE_DTYPES, check_tree, shape_text

if TYPE_CHECKING:  # torch is imported by DCP's users only
    from torch.distributed.checkpoint.metadata import MetadataIndex

FORMAT_NAME = "ckptstore"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 2 moved rank indexes from one prefix per save (``steps/<step>/<attempt>/``) to 256
hash prefixes (``indexes/``): nothing else changed, so version 1 steps are read as before."""
STEP_DIGITS = 20

KIND_STATE = "state"  # saved by Checkpointer: a tree per rank
KIND_DCP = "dcp"  # saved through torch.distributed.checkpoint

# A manifest lists one small reference per rank: 64 MiB is hundreds of thousands of ranks. A
# reader reads no more of an object at a manifest's key.
MAX_MANIFEST_BYTES = 64 << 20
# A rank index or DCP metadata a manifest references is read whole into memory: no larger than
# this (a rank index is ~100 bytes per chunk and per tensor; DCP's metadata of the largest jobs
# is well under it).
MAX_REFERENCED_BYTES = 4 << 30

# A chunk holds at most this many raw bytes (a save's chunk_bytes is at most this): a reader
# allocates a chunk's declared raw size to decode it, so no DCP index may declare more (a DCP
# chunk is not bound to its index's items; a state index's chunk is, to its tensors).
MAX_CHUNK_BYTES = 1 << 30

ALIGN = 64  # every tensor starts at a multiple of this inside a chunk (and a staging buffer)


def chunk_key(digest: str) -> str:
    if not is_digest(digest):
        raise CheckpointCorruptError(f"chunk digest {digest!r} is not 32 lowercase hex digits")
    return f"chunks/{digest[:2]}/{digest}"


def commit_key(step: int) -> str:
    return f"commits/{step:0{STEP_DIGITS}d}.json"


def attempt_prefix(step: int, attempt: str) -> str:
    return f"steps/{step:0{STEP_DIGITS}d}/{attempt}"


def rank_index_key(step: int, attempt: str, rank: int, version: int = FORMAT_VERSION) -> str:
    """Where rank ``rank``'s index of a save is: under one of 256 hash prefixes (version 1:
    under the save's own prefix), so a save's thousands of indexes spread over S3 partitions
    as its chunks do."""
    name = f"{step:0{STEP_DIGITS}d}/{attempt}/rank-{rank:05d}.json"
    if version == 1:
        return f"steps/{name}"
    spread = hash_bytes(f"{step:0{STEP_DIGITS}d}/{attempt}/{rank:05d}".encode())[:2]
    return f"indexes/{spread}/{name}"


def attempt_of_key(key: str) -> str | None:
    """The attempt an index or metadata key belongs to (``steps/<step>/<attempt>/...`` or
    ``indexes/<xx>/<step>/<attempt>/...``), None for another key: one no writer of this
    format makes (a stranger's file under ``steps/`` is no save's, and gc leaves it)."""
    save = save_of_key(key)
    return save[1] if save is not None else None


def save_of_key(key: str) -> tuple[int, str] | None:
    """The step and attempt an index or metadata key belongs to, as ``attempt_of_key``."""
    parts = key.split("/")
    if parts[0] == "steps" and len(parts) >= 3:
        step, attempt = parts[1], parts[2]
    elif parts[0] == "indexes" and len(parts) >= 4 and _SPREAD.fullmatch(parts[1]):
        step, attempt = parts[2], parts[3]
    else:
        return None
    return (int(step), attempt) if _STEP_DIR.fullmatch(step) and is_attempt(attempt) else None


def digest_of_chunk_key(key: str) -> str | None:
    """The digest of a chunk key (``chunks/<xx>/<digest>``), None for any other key."""
    digest = key.rsplit("/", 1)[-1]
    return digest if is_digest(digest) and key == chunk_key(digest) else None


def dcp_metadata_key(step: int, attempt: str) -> str:
    return f"{attempt_prefix(step, attempt)}/dcp.metadata"


def dcp_item_key(fqn: str, offset: Sequence[int] | None) -> str:
    """The key of a DCP item in ``RankIndex.items``: ``fqn`` for an object DCP pickled (no
    offset), ``fqn@o0,o1`` for a tensor or a shard of one at ``offset``."""
    if offset is None:
        return fqn
    return f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def storage_key(index: MetadataIndex) -> str:
    """The key of a DCP item in ``RankIndex.items``: ``fqn``, or ``fqn@o0,o1`` for a shard."""
    return dcp_item_key(index.fqn, index.offset)


def split_dcp_item_key(key: str) -> tuple[str, list[int] | None]:
    """``(fqn, offsets)`` of a ``RankIndex.items`` key; offsets is None for a pickled object
    (or a key whose offsets do not parse)."""
    fqn, sep, offsets = key.rpartition("@")
    if not sep:
        return key, None
    try:
        return fqn, [int(o) for o in offsets.split(",")] if offsets else []
    except ValueError:
        return key, None


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or step >= 10**STEP_DIGITS:
        raise ValueError(f"step must be an int in [0, 1e{STEP_DIGITS}), got {step!r}")
    return step


USER_METADATA_MAX_BYTES = 1 << 20
USER_METADATA_MAX_DEPTH = 64
RESERVED_USER_KEY_PREFIX = "ckptstore"


def check_user_metadata(metadata: Any) -> dict:
    """``save(metadata=)`` as a manifest records it: a dict of JSON values that reads back
    as given. Anything else is refused here; written, it made a step no load could read, or
    one that read back other than saved (int keys as strings, tuples as lists, an enum or a
    numpy scalar as a plain number)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    reserved = [k for k in metadata if str(k).startswith(RESERVED_USER_KEY_PREFIX)]
    if reserved:
        raise ValueError(
            f"metadata key {reserved[0]!r}: keys starting with 'ckptstore' are ckptstore's own"
        )
    found = _not_plain_json(metadata, "", 0)
    if found is not None:
        raise TypeError(f"metadata{found} (it takes a dict of JSON values that read back as given)")
    text = json.dumps(metadata, allow_nan=False)
    if len(text) > USER_METADATA_MAX_BYTES:
        raise ValueError(
            f"metadata is {len(text)} bytes as JSON, over {USER_METADATA_MAX_BYTES}: store "
            "large values as state"
        )
    return json.loads(text)


def _not_plain_json(value: Any, where: str, depth: int) -> str | None:
    """Where in ``value`` a value is that JSON would not read back as given, and why."""
    if isinstance(value, (dict, list)) and depth >= USER_METADATA_MAX_DEPTH:
        return f"{_clip(where)} is nested deeper than {USER_METADATA_MAX_DEPTH} levels"
    if isinstance(value, dict):  # a subclass (OrderedDict) reads back as a dict of its items
        for key, item in value.items():
            if type(key) is not str:
                return f"{_clip(where)}: the key {_clip(repr(key))} is of type {_type_name(key)}, not str"
            if (found := _not_plain_json(item, f"{where}[{key!r}]", depth + 1)) is not None:
                return found
        return None
    if type(value) is list:
        for i, item in enumerate(value):
            if (found := _not_plain_json(item, f"{where}[{i}]", depth + 1)) is not None:
                return found
        return None
    if value is None or type(value) in (str, bool):
        return None
    if type(value) is int:
        try:
            str(value)
        except ValueError:
            return f"{_clip(where)} is an int too long for Python to write as text"
        return None
    if type(value) is float:
        return None if math.isfinite(value) else f"{_clip(where)} is {value!r}, not JSON"
    return f"{_clip(where)} is of type {_type_name(value)}, which JSON would not give back"


def _clip(text: str, most: int = 200) -> str:
    return text if len(text) <= most else f"...{text[-most:]}"


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


@dataclass
class Segment:
    """``nbytes`` raw bytes at ``offset`` inside chunk ``chunk`` (its xxh3 hex digest)."""

    chunk: str
    offset: int
    nbytes: int


@dataclass
class TensorEntry:
    """One saved tensor: its dtype, shape, and where its bytes are (in order)."""

    dtype: str
    shape: list[int]
    segments: list[Segment] = field(default_factory=list)
    numpy: bool = False  # saved from a numpy array; restored as one
    health: list | None = None  # floating tensors: [nan, inf, sumsq] (ckptstore.health)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


@dataclass
class ChunkInfo:
    raw: int
    stored: int


@dataclass
class ObjectRef:
    """A small object (index, metadata) named by key, with its size and xxh3."""

    key: str
    nbytes: int
    xxh3: str


@dataclass
class RankIndex:
    rank: int
    tensors: list[TensorEntry]
    chunks: dict[str, ChunkInfo]
    tree: Any = None  # KIND_STATE: the JSON tree of the rank's state (see state.py)
    items: dict[str, int] | None = None  # KIND_DCP: DCP storage key -> index in tensors


@dataclass
class Manifest:
    step: int
    attempt: str
    kind: str
    world_size: int
    ranks: list[ObjectRef]
    created_at: float = field(default_factory=time.time)
    dcp_metadata: ObjectRef | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    user: dict[str, Any] = field(default_factory=dict)
    health: dict | None = None  # the step's numbers (ckptstore.health); None: unknown
    previous: list[int] = field(default_factory=list)
    """Steps below this one (newest first: up to 32, else the newest and the oldest 16) that
    the committing process had found committed in the store: gc deletes nothing while a listing
    leaves one out that is there (``retention``)."""


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()  # keeps key order


def _dump(kind: str, body: dict) -> bytes:
    """JSON with a ``checksum`` field: the xxh3-128 of the canonical JSON of everything else,
    so any flipped byte of a manifest or index is detected on its own."""
    doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "type": kind, **body}
    doc["checksum"] = hash_bytes(_canonical(doc))
    return _canonical(doc)


def _refuse_constant(token: str) -> None:
    raise ValueError(f"{token} is not a JSON number")  # NaN, Infinity: never written


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"{token[:40]} is out of a float's range")  # 1e400 reads as inf
    return value


def _load(data: bytes, kind: str, name: str) -> dict:
    try:
        doc = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise CheckpointCorruptError(f"{name}: JSON nested too deeply to read") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
        raise CheckpointCorruptError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{name}: not a {FORMAT_NAME} {kind}")
    version = doc.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        passing = _damaged_version(doc)
        if passing is not None:  # ours, a byte of its version flipped
            raise CheckpointCorruptError(
                f"{name}: format version {version!r} fails the checksum that version "
                f"{passing} passes (the {kind} is corrupt)"
            )
        raise FormatVersionError(
            f"{name}: format version {version!r}; this ckptstore reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} only (upgrade ckptstore to read it)"
        )
    if doc.get("type") != kind:
        raise CheckpointCorruptError(f"{name}: expected a {kind}, found {doc.get('type')!r}")
    checksum = doc.pop("checksum", None)
    if checksum != hash_bytes(_canonical(doc)):
        raise CheckpointCorruptError(f"{name}: checksum mismatch (the {kind} is corrupt)")
    return doc


def _damaged_version(doc: dict) -> int | None:
    """The readable version whose document passes the checksum, where the version written is
    not one (a flipped byte, not a newer writer: its checksum holds for its own version)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    for version in READABLE_VERSIONS:
        if doc.get("checksum") == hash_bytes(_canonical({**body, "format_version": version})):
            return version
    return None


def encode_rank_index(index: RankIndex) -> bytes:
    body = asdict(index)
    body["tensors"] = [
        {
            **{k: v for k, v in t.items() if k != "health" or v is not None},
            "segments": [[s["chunk"], s["offset"], s["nbytes"]] for s in t["segments"]],
        }
        for t in body["tensors"]
    ]
    body["chunks"] = {h: [c["raw"], c["stored"]] for h, c in body["chunks"].items()}
    return _dump("rank-index", body)


def decode_rank_index(data: bytes, name: str) -> RankIndex:
    """A rank index, checked as restore will use it (see :func:`check_rank_index`)."""
    doc = _load(data, "rank-index", name)
    try:
        tensors = [
            TensorEntry(
                dtype=t["dtype"],
                shape=list(t["shape"]),
                segments=[Segment(c, o, n) for c, o, n in t["segments"]],
                numpy=bool(t.get("numpy", False)),
                health=t.get("health"),
            )
            for t in doc["tensors"]
        ]
        chunks = {h: ChunkInfo(raw, stored) for h, (raw, stored) in doc["chunks"].items()}
        index = RankIndex(
            rank=doc["rank"],
            tensors=tensors,
            chunks=chunks,
            tree=doc.get("tree"),
            items=doc.get("items"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{name}: malformed rank index ({exc!r})") from exc
    check_rank_index(index, name)
    return index


def encode_manifest(m: Manifest) -> bytes:
    body = asdict(m)
    if body["health"] is None:  # a step without health reads as before
        del body["health"]
    if not body["previous"]:
        del body["previous"]
    return _dump("manifest", body)


def _user(value: Any) -> dict:
    """A manifest's user metadata; a value not a dict (saved before ``save()`` refused one)
    is kept under the key ``"value"``: the step stays readable."""
    if value is None:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def decode_manifest(data: bytes, name: str) -> Manifest:
    """A manifest whose keys all name objects of its own step and attempt (checked before any
    of them is read: a hostile manifest cannot point a reader outside the store)."""
    doc = _load(data, "manifest", name)
    try:
        meta = doc.get("dcp_metadata")
        manifest = Manifest(
            step=doc["step"],
            attempt=doc["attempt"],
            kind=str(doc["kind"]),
            world_size=doc["world_size"],
            ranks=[ObjectRef(**r) for r in doc["ranks"]],
            created_at=float(doc["created_at"]),
            dcp_metadata=ObjectRef(**meta) if meta else None,
            raw_bytes=int(doc.get("raw_bytes", 0)),
            stored_bytes=int(doc.get("stored_bytes", 0)),
            user=_user(doc.get("user")),
            health=doc.get("health"),
            previous=doc.get("previous", []),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointCorruptError(f"{name}: malformed manifest ({exc!r})") from exc
    check_manifest(manifest, name, version=doc["format_version"])
    for field_name in ("raw_bytes", "stored_bytes"):
        if not _is_count(doc.get(field_name, 0)):
            raise CheckpointCorruptError(f"{name}: {field_name} is not a count of bytes")
    return manifest


# -- what a reader checks before it trusts a decoded object (docs/FORMAT.md) -----------------

_DIGEST = re.compile(r"[0-9a-f]{32}")  # xxh3-128, lowercase hex
_SPREAD = re.compile(r"[0-9a-f]{2}")
_STEP_DIR = re.compile(rf"[0-9]{{{STEP_DIGITS}}}")
_ATTEMPT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
INT64_MAX = 2**63 - 1
MAX_RANKS = 2**20
MAX_PREVIOUS = 64  # steps a manifest's "previous" may name (a writer names 32 at most)
MAX_TIMESTAMP = 253402300799  # 9999-12-31T23:59:59Z, the last time datetime can show


def _is_count(value: Any, limit: int = INT64_MAX) -> bool:
    """A non-negative int (not a bool) no greater than ``limit``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def is_digest(value: Any) -> bool:
    """True for a chunk digest: 32 lowercase hex digits (xxh3-128)."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def is_attempt(value: Any) -> bool:
    """True for an attempt id a writer could have made: letters, digits, ``_`` and ``-``."""
    return isinstance(value, str) and _ATTEMPT.fullmatch(value) is not None


def check_manifest(m: Manifest, name: str, *, version: int = FORMAT_VERSION) -> None:
    """:class:`CheckpointCorruptError` naming ``name`` unless every key of ``m`` is the key its
    own step and attempt give that object in its format ``version``, and every size and hash
    is well formed."""

    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{name}: {why}")

    if not _is_count(m.step, 10**STEP_DIGITS - 1):
        raise bad(f"step {m.step!r} is not an int in [0, 1e{STEP_DIGITS})")
    if not is_attempt(m.attempt):
        raise bad(f"attempt {m.attempt!r} is not an attempt id")
    if not _is_count(m.world_size, MAX_RANKS) or m.world_size < 1:
        raise bad(f"world size {m.world_size!r} is not an int in [1, {MAX_RANKS}]")
    if not 0 <= m.created_at <= MAX_TIMESTAMP:
        raise bad(f"created_at {m.created_at!r} is not a time before the year 10000")
    previous = m.previous
    if not isinstance(previous, list) or len(previous) > MAX_PREVIOUS:
        raise bad(f"previous steps {str(previous)[:80]} are not a list of at most {MAX_PREVIOUS}")
    for before in previous:
        if not (_is_count(before) and before < m.step):
            raise bad(f"previous step {before!r} is not a step below {m.step}")
    seen: set[str] = set()
    for ref in m.ranks:
        # The key its own rank gives, checked per listed rank (not a set of every rank's key:
        # a manifest of a few hundred bytes may claim 2**20 ranks)
        rank = _rank_of_key(ref.key)
        if (
            rank is None
            or rank >= m.world_size
            or ref.key != rank_index_key(m.step, m.attempt, rank, version)
            or ref.key in seen
        ):
            raise bad(
                f"rank index key {ref.key!r} is not one of this step's ranks "
                f"({rank_index_key(m.step, m.attempt, 0, version)!r} ...) or is listed twice"
            )
        seen.add(ref.key)
        _check_ref(ref, bad)
    if m.dcp_metadata is not None:
        if m.dcp_metadata.key != dcp_metadata_key(m.step, m.attempt):
            raise bad(f"DCP metadata key {m.dcp_metadata.key!r} is not this step's")
        _check_ref(m.dcp_metadata, bad)
    why = check_manifest_health(m.health)
    if why is not None:
        raise bad(why)


def _rank_of_key(key: Any) -> int | None:
    """The rank a rank index key names (``.../rank-00007.json``), None if it names none."""
    if not isinstance(key, str):
        return None
    rank = key.rsplit("/rank-", 1)[-1].removesuffix(".json")
    return int(rank) if rank.isascii() and rank.isdigit() and len(rank) <= 7 else None


def _check_ref(ref: ObjectRef, bad) -> None:
    if not _is_count(ref.nbytes) or not is_digest(ref.xxh3):
        raise bad(f"{ref.key}: size {ref.nbytes!r} or xxh3 {ref.xxh3!r} is malformed")
    if ref.nbytes > MAX_REFERENCED_BYTES:
        raise bad(f"{ref.key}: size {ref.nbytes} is over {MAX_REFERENCED_BYTES}, larger than any")


# The element sizes of the dtypes a state is usually made of, so that reading an index needs no
# torch (the CLI's ls and inspect); any other name is looked up in torch.
_COMMON_ITEMSIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


@functools.cache
def _dtype_itemsizes() -> dict[str, int]:
    """Every name restore accepts as a dtype (``getattr(torch, name)`` is a torch.dtype), but
    the quantized ones: no save holds one, and ``quint2x4``'s storage packs 4 elements a byte
    (an itemsize of 1 would size a load's copy at 4 times the tensor); nor the sub-byte
    integers (``uint3``), which torch can neither copy nor ``torch.save``."""
    import torch

    return {
        name: value.itemsize
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype) and name not in _NEVER_SAVED
    }


_NEVER_SAVED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}) | SUB_BYTE_DTYPES


def dtype_itemsize(name: Any) -> int | None:
    """The element size of the torch dtype called ``name``; None if there is no such dtype."""
    if not isinstance(name, str):
        return None
    return _COMMON_ITEMSIZES.get(name) or _dtype_itemsizes().get(name)


def check_rank_index(index: RankIndex, name: str) -> None:
    """:class:`CheckpointCorruptError` naming ``name`` unless ``index`` is exactly what restore
    can load: digests well formed, every tensor a known dtype and a shape whose byte count fits
    int64 and equals its segments', every segment inside a listed chunk's raw bytes, and every
    chunk's raw size no larger than its tensors need (plus alignment, for Checkpointer saves)
    and its stored size no larger than the codec can make of it."""

    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{name}: {why}")

    if not _is_count(index.rank, MAX_RANKS):
        raise bad(f"rank {index.rank!r} is not a rank")
    for digest, info in index.chunks.items():
        if not is_digest(digest):
            raise bad(f"chunk digest {digest!r} is not 32 lowercase hex digits")
        if not _is_count(info.raw) or not _is_count(info.stored):
            raise bad(f"chunk {digest}: sizes {info.raw!r}, {info.stored!r} are not counts")
        if index.items is not None and info.raw > MAX_CHUNK_BYTES:
            # (a state save's chunk is bound to its tensors below, whatever its chunk_bytes)
            raise bad(f"chunk {digest}: {info.raw} raw bytes, more than any chunk holds")
        if info.stored > max_encoded_size(info.raw):
            raise bad(f"chunk {digest}: {info.stored} bytes stored for {info.raw} raw")
    needed = dict.fromkeys(index.chunks, 0)  # digest -> end of the last byte a tensor uses
    for i, entry in enumerate(index.tensors):
        _check_tensor(entry, index.chunks, needed, lambda why, i=i: bad(f"tensor {i}: {why}"))
    if index.items is None:  # a Checkpointer save: each chunk is its tensors, then alignment
        check_tree(index.tree, [t.dtype for t in index.tensors], bad)
        for digest, end in needed.items():
            if index.chunks[digest].raw >= end + ALIGN:
                raise bad(
                    f"chunk {digest}: {index.chunks[digest].raw} raw bytes, its tensors use {end}"
                )
    elif index.tree is not None:  # a state save's tree with DCP items: the tree unchecked
        raise bad("holds both a state tree and DCP items")
    elif not isinstance(index.items, dict) or not all(
        isinstance(k, str) and _is_count(v, len(index.tensors) - 1) for k, v in index.items.items()
    ):
        raise bad("items do not map DCP keys to tensors of this index")


def _check_tensor(
    entry: TensorEntry, chunks: dict[str, ChunkInfo], needed: dict[str, int], bad
) -> None:
    itemsize = dtype_itemsize(entry.dtype)
    if itemsize is None:
        raise bad(f"unknown dtype {entry.dtype!r}")
    if not all(_is_count(n) for n in entry.shape):
        raise bad(f"shape {shape_text(entry.shape)} is not a list of non-negative ints")
    nbytes = span = itemsize  # span: what torch's stride and size arithmetic must fit
    for n in entry.shape:
        nbytes *= n
        span *= max(n, 1)
    if span > INT64_MAX:
        raise bad(f"shape {shape_text(entry.shape)} of {entry.dtype} overflows int64 byte counts")
    total = 0
    for seg in entry.segments:
        if not is_digest(seg.chunk):
            raise bad(f"segment chunk {seg.chunk!r} is not 32 lowercase hex digits")
        info = chunks.get(seg.chunk)
        if info is None:
            raise bad(f"chunk {seg.chunk} is not listed in the index")
        if not (_is_count(seg.offset) and _is_count(seg.nbytes)):
            raise bad(f"segment [{seg.offset!r}, +{seg.nbytes!r}) is not a byte range")
        end = seg.offset + seg.nbytes
        if end > info.raw:
            raise bad(
                f"segment [{seg.offset}, {end}) past the end of chunk {seg.chunk} "
                f"({info.raw} bytes)"
            )
        needed[seg.chunk] = max(needed[seg.chunk], end)
        total += seg.nbytes
    if total != nbytes:
        raise bad(
            f"{total} bytes in segments for {entry.dtype} {shape_text(entry.shape)} "
            f"({nbytes} bytes)"
        )
    why = check_entry_health(entry.health, entry.dtype)
    if why is not None:
        raise bad(why)


def object_ref(key: str, data: bytes) -> ObjectRef:
    return ObjectRef(key=key, nbytes=len(data), xxh3=hash_bytes(data))
