"""One committed step, whatever wrote it: the only place that tells a Checkpointer step (kind
``state``: a tree per rank) from a DCP one (kind ``dcp``: items located by DCP's metadata).

Every reader (``inspect``, ``verify``, ``restore``, export, ``Checkpointer.load``, the DCP
``StoreReader``) asks a :class:`StepView` for what it needs instead of switching on the kind::

    StepView.open(store, step)      a committed step ("latest" or a number)
    view.index(rank)                a rank's index, checked against the manifest, read once
    view.tensor_names(index)        tensor index -> name (tree path, or DCP fqn[@offsets])
    view.shard_offsets(index)       DCP: tensor index -> shard offsets (None: a pickled value)
    view.whole_tensors(rank)        named whole tensors, each with the stored pieces it is made of
    view.problems(indexes)          what restore would refuse beyond the objects themselves
    view.load_plain(on_chunk)       the whole step as plain Python objects
    view.require(loader)            the step refused, naming the loader to use, if it is not its

Importing this module needs no torch (``ls`` and ``inspect`` run without it); what reads tensors
or DCP metadata imports it when called: ``pipeline``, ``state``, ``metadata`` (DCP's Metadata
decoded) and ``step_reader`` (a DCP step's pickled values and whole state), all core modules that
import torch. Nothing here imports the DCP front-end, ``ckptstore.dcp``, which builds on this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptstore.catalog import load_manifest, open_step, rank_of, read_object, read_rank_index
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    UnsupportedStateError,
)
from ckptstore.format import (
    KIND_DCP,
    KIND_STATE,
    Manifest,
    RankIndex,
    commit_key,
    split_dcp_item_key,
    storage_key,
)
from ckptstore.store import Store
from ckptstore.tiers.policy import TIER_KEY
from ckptstore.tree import leaves, tensor_of, tensor_paths

KINDS = (KIND_STATE, KIND_DCP)
CHECKPOINTER = "checkpointer"
DCP = "dcp"
_LOADERS = {KIND_STATE: CHECKPOINTER, KIND_DCP: DCP}
_HOW_TO_LOAD = {
    CHECKPOINTER: "was saved by ckptstore.Checkpointer; load it with Checkpointer.load",
    DCP: "was saved through DCP; load it with torch.distributed.checkpoint.load(..., "
    "storage_reader=ckptstore.dcp.StoreReader(...))",
}


@dataclass
class Piece:
    """Stored tensor ``tensor`` of rank ``rank``: the block at ``offsets`` of a whole tensor."""

    rank: int
    tensor: int
    offsets: list[int]
    shape: list[int]


@dataclass
class WholeTensor:
    """A tensor as the step's writer saw it, whole: its name, dtype (torch's name without
    ``torch.``), shape, and the stored pieces it is assembled from."""

    name: str
    dtype: str
    shape: list[int]
    pieces: list[Piece]


@dataclass
class Found:
    """Something wrong with a step that restore would trip over: the object it is in, what
    that object is (``manifest``, ``dcp-metadata``, ``dcp-item``) and the error."""

    key: str
    what: str
    error: BaseException
    hint: str = ""


class StepView:
    """A committed step's manifest with its rank indexes (each read and checked once, when
    first needed) and, for a DCP step, its metadata."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        if manifest.kind not in KINDS:
            raise CheckpointCorruptError(
                f"step {manifest.step} in {store.uri}: unknown checkpoint kind {manifest.kind!r}"
            )
        if manifest.kind == KIND_STATE and len(manifest.ranks) != manifest.world_size:
            raise CheckpointCorruptError(  # each rank saved its own state
                f"step {manifest.step} in {store.uri}: the manifest lists {len(manifest.ranks)} "
                f"rank index(es) for a step saved by {manifest.world_size} ranks"
            )
        self.store = store
        self.manifest = manifest
        self._indexes: dict[int, RankIndex] = {}
        self._metadata: Any = None

    @classmethod
    def open(cls, store: Store, step: int | str | None = "latest") -> StepView:
        return cls(store, open_step(store, step))

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def is_dcp(self) -> bool:
        return self.manifest.kind == KIND_DCP

    @property
    def per_rank(self) -> bool:
        """Whether each rank saved a state of its own (a Checkpointer step of several ranks),
        rather than one state sharded over the ranks (DCP) or a single rank's."""
        return self.kind == KIND_STATE and self.manifest.world_size > 1

    @property
    def tier_rank(self) -> int | None:
        """The job rank whose local tier copy of a DCP step this is (its one index, rank 0's
        here, holds that rank's items only; the metadata names every rank's); else None."""
        info = self.manifest.user.get(TIER_KEY)
        if self.is_dcp and self.manifest.world_size == 1 and isinstance(info, dict):
            rank = info.get("rank")
            return rank if isinstance(rank, int) and not isinstance(rank, bool) else None
        return None

    def _refuse_tier_copy(self) -> None:
        if self.tier_rank is not None:
            raise UnsupportedStateError(
                f"step {self.step} in {self.store.uri} is rank {self.tier_rank}'s local tier "
                "copy of a DCP step (that rank's items only): restore the step from its durable "
                "store, or load it in the job with StoreReader(uri, tiers=TierOptions(local_dir=...))"
            )

    def require(self, loader: str) -> None:
        """Refuse a step ``loader`` (``CHECKPOINTER`` or ``DCP``) cannot load, naming the one
        that can."""
        if self.is_dcp and self.manifest.dcp_metadata is None:  # corrupt, whoever loads it
            raise CheckpointCorruptError(
                f"step {self.step} of {self.store.uri} has no DCP metadata"
            )
        if _LOADERS[self.kind] != loader:
            raise UnsupportedStateError(
                f"step {self.step} in {self.store.uri} {_HOW_TO_LOAD[_LOADERS[self.kind]]}"
            )

    # -- indexes and names ------------------------------------------------------------------

    def index(self, rank: int) -> RankIndex:
        """Rank ``rank``'s index (a DCP rank that wrote nothing has none:
        :class:`CheckpointNotFoundError`)."""
        if rank not in self._indexes:
            for ref in self.manifest.ranks:
                if rank_of(ref.key) == rank:
                    index = read_rank_index(self.store, ref)
                    self.check_kind(index, self.store.url(ref.key))
                    self._indexes[rank] = index
                    break
            else:
                raise CheckpointNotFoundError(f"step {self.step} has no index for rank {rank}")
        return self._indexes[rank]

    def adopt_index(self, index: RankIndex) -> None:
        """Use ``index`` (read by the rank whose tier copy holds it) as rank ``index.rank``'s."""
        self.check_kind(index, f"rank {index.rank}'s index of step {self.step}")
        self._indexes[index.rank] = index

    def check_kind(self, index: RankIndex, name: str) -> None:
        """:class:`CheckpointCorruptError` naming ``name`` unless ``index`` is of this step's
        kind: a state step's index holds a tree and no DCP items, a DCP step's the items (a
        state index dressed as DCP's skips the tree's checks; one without a tree loads
        nothing)."""
        if self.kind == KIND_STATE and index.items is not None:
            raise CheckpointCorruptError(f"{name}: a state step's index holds DCP items")
        if self.kind == KIND_DCP and index.items is None:
            raise CheckpointCorruptError(f"{name}: a DCP step's index holds no DCP items")

    def indexes(self) -> list[RankIndex]:
        """Every rank index, in the manifest's order."""
        return [self.index(rank_of(ref.key)) for ref in self.manifest.ranks]

    def tensor_names(self, index: RankIndex) -> dict[int, str]:
        """Tensor index -> name, for every tensor of ``index`` (unnamed ones ``<tensor i>``)."""
        return tensor_names(self.manifest, index)

    def shard_offsets(self, index: RankIndex) -> dict[int, list[int] | None]:
        """A DCP rank's tensors: the offsets of each shard in its whole tensor (None for a value
        DCP pickled); nothing for a state step."""
        return {i: offsets for i, (_, offsets) in dcp_items(index).items()} if self.is_dcp else {}

    def raw_bytes(self) -> int:
        """The raw bytes of every chunk the step's indexes name."""
        return sum(c.raw for index in self.indexes() for c in index.chunks.values())

    # -- whole tensors ----------------------------------------------------------------------

    def whole_tensors(self, rank: int = 0) -> tuple[list[WholeTensor], list[str]]:
        """The step's tensors, whole and named by their dotted path (``model.0.weight``: a
        state's tree path, a DCP fqn), and the names of the values that are not tensors. A
        state step saved by several ranks: rank ``rank``'s state; a DCP step: every rank's
        shards, each tensor the union of its pieces."""
        self._refuse_tier_copy()
        return self._dcp_tensors() if self.is_dcp else self._state_tensors(rank)

    def _state_tensors(self, rank: int) -> tuple[list[WholeTensor], list[str]]:
        index = self.index(rank)
        named: list[WholeTensor] = []
        skipped: list[str] = []
        for path, node in leaves(index.tree):
            name = ".".join(map(str, path)) or "<root>"
            tensor = tensor_of(node)
            if tensor is None:
                skipped.append(name)
                continue
            entry = index.tensors[tensor]
            piece = Piece(rank, tensor, [0] * len(entry.shape), list(entry.shape))
            named.append(WholeTensor(name, entry.dtype, list(entry.shape), [piece]))
        return named, skipped

    def _dcp_tensors(self) -> tuple[list[WholeTensor], list[str]]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        metadata = self.dcp_metadata()
        named: list[WholeTensor] = []
        skipped: list[str] = []
        for fqn, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                skipped.append(fqn)
                continue
            pieces = []
            for chunk in meta.chunks:
                rank, tensor = self.locate(MetadataIndex(fqn, chunk.offsets))
                pieces.append(Piece(rank, tensor, list(chunk.offsets), list(chunk.sizes)))
            dtype = str(meta.properties.dtype).removeprefix("torch.")
            named.append(WholeTensor(fqn, dtype, list(meta.size), pieces))
        return named, skipped

    # -- DCP metadata -----------------------------------------------------------------------

    def dcp_metadata(self) -> Any:
        """The DCP ``Metadata`` of a DCP step, checked against the manifest and decoded
        without running code (``ckptstore.metadata``); read once."""
        self.require(DCP)
        if self._metadata is None:
            from ckptstore.metadata import decode_metadata  # imports torch: DCP steps only

            ref = self.manifest.dcp_metadata
            blob = read_object(self.store, ref, "DCP metadata")
            self._metadata = decode_metadata(blob, self.store.url(ref.key))
        return self._metadata

    def adopt_metadata(self, metadata: Any) -> None:
        """Use ``metadata`` (decoded by another rank, which read it once for all) as this
        step's DCP metadata."""
        self.require(DCP)
        self._metadata = metadata

    def locate(self, item: Any) -> tuple[int, int]:
        """Where DCP item ``item`` (a ``MetadataIndex``) is stored: ``(rank, tensor)``, checked
        against that rank's index."""
        key = storage_key(item)
        try:
            rank, tensor = self.dcp_metadata().storage_data[item]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"DCP item {key!r} of step {self.step} in {self.store.uri} has no location"
            ) from exc
        index = self.index(rank)
        if (index.items or {}).get(key) != tensor or not 0 <= tensor < len(index.tensors):
            raise CheckpointCorruptError(
                f"DCP item {key!r}: the index of rank {rank} does not hold it at {tensor}"
            )
        disagree = _metadata_disagrees(self.dcp_metadata(), item, index.tensors[tensor])
        if disagree:
            raise CheckpointCorruptError(
                f"DCP item {key!r} of step {self.step} in {self.store.uri}: {disagree}"
            )
        return rank, tensor

    # -- what restore would refuse ----------------------------------------------------------

    def problems(self, indexes: dict[int, RankIndex]) -> Iterator[Found]:
        """What would stop a restore beyond the manifest and the readable rank ``indexes``
        themselves: for a DCP step, metadata that is missing, unreadable or naming items the
        indexes do not hold, and pickled values torch's weights-only unpickler refuses."""
        if not self.is_dcp:
            return
        ref = self.manifest.dcp_metadata
        if ref is None:
            yield Found(
                commit_key(self.step),
                "manifest",
                CheckpointCorruptError("a dcp step without DCP metadata"),
            )
            return
        from ckptstore.metadata import check_covered  # torch: a DCP step's metadata is read

        try:
            metadata = self.dcp_metadata()
            check_covered(metadata, f"step {self.step}")
        except Exception as exc:  # noqa: BLE001 - reported as a problem of this object
            yield Found(ref.key, "dcp-metadata", exc)
            return
        self._indexes.update(indexes)
        ranks = {rank_of(r.key) for r in self.manifest.ranks}
        tier = self.tier_rank
        for item, (rank, tensor) in metadata.storage_data.items():
            if tier is not None:  # a tier copy holds its rank's items, under index 0
                if rank == tier and 0 in indexes:
                    problem = _not_held(indexes[0], item, tensor, tier)
                    if problem is not None:
                        yield Found(ref.key, "dcp-metadata", problem)
                        return
                continue
            if rank not in ranks:
                why = f"DCP item {storage_key(item)!r} is stored by rank {rank}, which has no index"
                yield Found(ref.key, "dcp-metadata", CheckpointCorruptError(why))
                return
            if rank not in indexes:
                continue  # its index is unreadable: reported already
            try:
                self.locate(item)
            except CheckpointError as exc:
                yield Found(ref.key, "dcp-metadata", exc)
                return
        yield from self._refused_pickled_values(metadata, indexes)

    def _refused_pickled_values(
        self, metadata: Any, indexes: dict[int, RankIndex]
    ) -> Iterator[Found]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        from ckptstore.pipeline import PipelineConfig, read_tensors
        from ckptstore.step_reader import load_pickled_value

        keys = {rank_of(ref.key): ref.key for ref in self.manifest.ranks}
        pickled: dict[int, dict[int, str]] = {}  # rank -> tensor -> item key
        tier = self.tier_rank
        for item, (rank, tensor) in metadata.storage_data.items():
            if tier is not None:  # a tier copy: its rank's items, under index 0
                if rank != tier:
                    continue
                rank = 0
            described = metadata.state_dict_metadata.get(item.fqn)
            if isinstance(described, BytesStorageMetadata) and rank in indexes:
                pickled.setdefault(rank, {})[tensor] = repr(storage_key(item))
        for rank, items in pickled.items():
            try:  # one read per rank: a chunk holding several values is fetched once
                values = read_tensors(
                    self.store, indexes[rank], dict.fromkeys(items), PipelineConfig()
                )
            except CheckpointError:
                continue  # a chunk that is missing or corrupt: the chunk check names it
            except Exception as exc:  # noqa: BLE001 - reported as a problem of this rank's items
                yield Found(keys[rank], "dcp-item", exc)
                continue
            for tensor, name in items.items():
                try:
                    load_pickled_value(values[tensor].numpy().tobytes(), name)
                except CheckpointError as exc:
                    yield Found(keys[rank], "dcp-item", exc)

    # -- the whole step ---------------------------------------------------------------------

    def load_plain(self, *, on_chunk: Callable[[int], None] | None = None) -> Any:
        """The whole step as plain Python objects: a state step saved by one rank, its state;
        by several, ``{"rank0": ..., "rank1": ...}``; a DCP step, its full (unsharded) state
        dict. ``on_chunk`` is called with each chunk's raw bytes as it is read (state steps:
        DCP's loader reads through its own planner and reports nothing)."""
        self._refuse_tier_copy()
        if self.is_dcp:
            from ckptstore.step_reader import full_state_dict  # imports torch: DCP steps only

            self.require(DCP)
            return full_state_dict(self)
        from ckptstore.pipeline import PipelineConfig, read_tensors
        from ckptstore.state import to_plain

        states = {}
        for index in self.indexes():
            wanted: dict[int, Any] = dict.fromkeys(range(len(index.tensors)))
            tensors = read_tensors(self.store, index, wanted, PipelineConfig(), on_chunk=on_chunk)
            states[index.rank] = to_plain(index.tree, tensors)
        if self.manifest.world_size == 1 and list(states) == [0]:
            return states[0]
        # Every rank is here: the view refuses a state manifest not listing each rank's index.
        return {f"rank{r}": states[r] for r in sorted(states)}

    def still_committed(self) -> bool:
        """Whether the store still holds this very save of the step (not removed by another
        process's keep_last or gc, nor committed again); a manifest that cannot be read now
        counts as still there (its read will say what is wrong)."""
        try:
            return load_manifest(self.store, self.step).attempt == self.manifest.attempt
        except CheckpointNotFoundError:
            return False
        except CheckpointError:
            return True

    def progress_bytes(self) -> int:
        """The raw bytes :meth:`load_plain` reports through ``on_chunk`` (0: it reports none,
        or the indexes could not be read: the load itself will say why)."""
        if self.is_dcp:
            return 0
        try:
            return self.raw_bytes()
        except CheckpointError:
            return 0


def _metadata_disagrees(metadata: Any, item: Any, entry: Any) -> str | None:
    """How the DCP metadata's shard ``item`` and the rank index's ``entry`` of it differ in
    shape or dtype (a load would hand DCP bytes of one shape for the other); None: they agree,
    or the item is a pickled value (stored as bytes)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = metadata.state_dict_metadata.get(item.fqn)
    if not isinstance(meta, TensorStorageMetadata):
        return None
    offset = list(item.offset) if item.offset is not None else None
    sizes = next((list(c.sizes) for c in meta.chunks if list(c.offsets) == offset), None)
    if sizes is not None and sizes != list(entry.shape):
        return f"the metadata's shard is {sizes}, the index's {list(entry.shape)}"
    dtype = str(meta.properties.dtype).removeprefix("torch.")
    if dtype != entry.dtype:
        return f"the metadata says {dtype}, the index {entry.dtype}"
    return None


def _not_held(index: RankIndex, item: Any, tensor: int, rank: int) -> Exception | None:
    """Why a tier copy's ``index`` does not hold DCP ``item`` of its ``rank`` at ``tensor``."""
    key = storage_key(item)
    if (index.items or {}).get(key) != tensor or not 0 <= tensor < len(index.tensors):
        return CheckpointCorruptError(
            f"DCP item {key!r} of rank {rank}: this copy's index does not hold it at {tensor}"
        )
    return None


def dcp_items(index: RankIndex) -> dict[int, tuple[str, list[int] | None]]:
    """Tensor index -> (fqn, offsets) of a DCP rank index; offsets is None for an object DCP
    pickled (a ``BYTE_IO`` item, stored as uint8 bytes), else the shard's offsets (all zero
    for a whole tensor)."""
    return {int(i): split_dcp_item_key(key) for key, i in (index.items or {}).items()}


def tensor_names(manifest: Manifest, index: RankIndex) -> dict[int, str]:
    """Tensor index -> name, for every tensor of ``index`` (unnamed ones as ``<tensor i>``).

    Tensors of a state step are named by their path in the saved state (``model/0.weight``);
    DCP items by their fqn, with ``@offsets`` added for a shard that does not start at the
    origin."""
    if manifest.kind == KIND_DCP and index.items is not None:
        names = {
            i: fqn if not offsets or not any(offsets) else f"{fqn}@{','.join(map(str, offsets))}"
            for i, (fqn, offsets) in dcp_items(index).items()
        }
    elif index.tree is not None:
        names = tensor_paths(index.tree)
    else:
        names = {}
    return {i: names.get(i, f"<tensor {i}>") for i in range(len(index.tensors))}
