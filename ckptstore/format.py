"""The on-storage layout (docs/FORMAT.md is the prose version of this module).

::

    chunks/<h[:2]>/<h>                         encoded chunk, h = xxh3-128 of its raw bytes
    steps/<step:020d>/<attempt>/rank-<r>.json  per-rank index of one save attempt
    steps/<step:020d>/<attempt>/dcp.metadata   DCP Metadata (pickled), DCP saves only
    pending/<step:020d>-<attempt>-<r>.json     marker of a save in flight (deleted after commit)
    commits/<step:020d>.json                   the manifest; its existence is the commit

Every object is written once. A step is visible exactly when its manifest exists; the manifest
is written after every object it references is durable. This module names objects and encodes
and decodes them; ``catalog`` finds and reads them, ``commit`` writes the manifest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptstore.codec import hash_bytes
from ckptstore.errors import CheckpointCorruptError, FormatVersionError

FORMAT_NAME = "ckptstore"
FORMAT_VERSION = 1
STEP_DIGITS = 20

KIND_STATE = "state"  # saved by Checkpointer: a tree per rank
KIND_DCP = "dcp"  # saved through torch.distributed.checkpoint


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def commit_key(step: int) -> str:
    return f"commits/{step:0{STEP_DIGITS}d}.json"


def attempt_prefix(step: int, attempt: str) -> str:
    return f"steps/{step:0{STEP_DIGITS}d}/{attempt}"


def rank_index_key(step: int, attempt: str, rank: int) -> str:
    return f"{attempt_prefix(step, attempt)}/rank-{rank:05d}.json"


def dcp_metadata_key(step: int, attempt: str) -> str:
    return f"{attempt_prefix(step, attempt)}/dcp.metadata"


def pending_key(step: int, attempt: str, rank: int) -> str:
    return f"pending/{step:0{STEP_DIGITS}d}-{attempt}-{rank:05d}.json"


def dcp_item_key(fqn: str, offset: Sequence[int] | None) -> str:
    """The key of a DCP item in ``RankIndex.items``: ``fqn`` for an object DCP pickled (no
    offset), ``fqn@o0,o1`` for a tensor or a shard of one at ``offset``."""
    if offset is None:
        return fqn
    return f"{fqn}@{','.join(str(int(o)) for o in offset)}"


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


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()  # keeps key order


def _dump(kind: str, body: dict) -> bytes:
    """JSON with a ``checksum`` field: the xxh3-128 of the canonical JSON of everything else,
    so any flipped byte of a manifest or index is detected on its own."""
    doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "type": kind, **body}
    doc["checksum"] = hash_bytes(_canonical(doc))
    return _canonical(doc)


def _load(data: bytes, kind: str, name: str) -> dict:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{name}: not a {FORMAT_NAME} {kind}")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"{name}: format version {version!r}; this ckptstore reads version {FORMAT_VERSION} "
            "only (upgrade ckptstore to read it)"
        )
    if doc.get("type") != kind:
        raise CheckpointCorruptError(f"{name}: expected a {kind}, found {doc.get('type')!r}")
    checksum = doc.pop("checksum", None)
    if checksum != hash_bytes(_canonical(doc)):
        raise CheckpointCorruptError(f"{name}: checksum mismatch (the {kind} is corrupt)")
    return doc


def encode_rank_index(index: RankIndex) -> bytes:
    body = asdict(index)
    body["tensors"] = [
        {**t, "segments": [[s["chunk"], s["offset"], s["nbytes"]] for s in t["segments"]]}
        for t in body["tensors"]
    ]
    body["chunks"] = {h: [c["raw"], c["stored"]] for h, c in body["chunks"].items()}
    return _dump("rank-index", body)


def decode_rank_index(data: bytes, name: str) -> RankIndex:
    doc = _load(data, "rank-index", name)
    try:
        tensors = [
            TensorEntry(
                dtype=t["dtype"],
                shape=list(t["shape"]),
                segments=[Segment(c, o, n) for c, o, n in t["segments"]],
                numpy=bool(t.get("numpy", False)),
            )
            for t in doc["tensors"]
        ]
        chunks = {h: ChunkInfo(raw, stored) for h, (raw, stored) in doc["chunks"].items()}
        return RankIndex(
            rank=int(doc["rank"]),
            tensors=tensors,
            chunks=chunks,
            tree=doc.get("tree"),
            items=doc.get("items"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{name}: malformed rank index ({exc!r})") from exc


def encode_manifest(m: Manifest) -> bytes:
    return _dump("manifest", asdict(m))


def decode_manifest(data: bytes, name: str) -> Manifest:
    doc = _load(data, "manifest", name)
    try:
        meta = doc.get("dcp_metadata")
        return Manifest(
            step=int(doc["step"]),
            attempt=str(doc["attempt"]),
            kind=str(doc["kind"]),
            world_size=int(doc["world_size"]),
            ranks=[ObjectRef(**r) for r in doc["ranks"]],
            created_at=float(doc["created_at"]),
            dcp_metadata=ObjectRef(**meta) if meta else None,
            raw_bytes=int(doc.get("raw_bytes", 0)),
            stored_bytes=int(doc.get("stored_bytes", 0)),
            user=dict(doc.get("user") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{name}: malformed manifest ({exc!r})") from exc


def object_ref(key: str, data: bytes) -> ObjectRef:
    return ObjectRef(key=key, nbytes=len(data), xxh3=hash_bytes(data))
