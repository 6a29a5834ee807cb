"""The node-local tier: one store per rank whose copies this node keeps (``policy`` says where).

A copy is a one-rank step of its rank's state: a rank's own written by the same ``SaveSession``
as any save, a peer's or a repaired one by ``tiers.transfer`` under one save lease of the store
(chunks, index, manifest last), its manifest recording whose copy it is (``tier_info``). A copy
that belongs to another job (another durable store, rank or world size) is never offered.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.catalog import list_steps, load_manifest, read_rank_index
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    FormatVersionError,
    StorageError,
    one_line,
)
from ckptstore.format import ChunkInfo, Manifest, chunk_key, commit_key
from ckptstore.health import UNHEALTHY, UNKNOWN, status
from ckptstore.leases import DEFAULT_TTL_S, find_leases
from ckptstore.render import rank_ranges
from ckptstore.retention import collect, drop_step
from ckptstore.store import RetryPolicy, Store, open_store
from ckptstore.tiers.identity import agree_identity, store_identity
from ckptstore.tiers.policy import TIER_KEY, TierPolicy, job_dir_name, rank_dir, tier_info
from ckptstore.tiers.resumes import RESUME_FIELD, Resume, left_by, made_under

if TYPE_CHECKING:
    from ckptstore.save.engine import SaveEngine
    from ckptstore.tiers.group import RankGroup
    from ckptstore.tiers.identity import StoreIdentity

logger = logging.getLogger(__name__)

DIR_TOKEN = "dir-token"  # in a job directory: the same for every process that shares the disk

_COMMITTED: dict[str, list[int]] = {}
"""By a rank's own copies directory: the last two steps this process committed there (either
front-end, whatever objects made the saves)."""
_OTHER_WORLD_SAID: set[tuple[str, Any]] = set()
_RESUMED: dict[str, int] = {}
_UNASKED: set[str] = set()  # by rank dir: loaded since a save last asked the durable store
# By rank dir: the newest step the durable store listed since this process's last load (-1: none).
_DURABLE_NEWEST: dict[str, int] = {}
_DURABLE_OUT: set[str] = set()  # by rank dir: the last ask of the durable store got no answer
_RESUME_TOKENS: dict[str, str] = {}  # by rank dir: the resume this process's copies descend from
"""By a rank's own copies directory: the step a load in this process last resumed from (a DCP
load and the next save are separate objects; a Checkpointer may be made again)."""


def _refuse_links(local_dir: str | os.PathLike, path: Path) -> None:
    """``path`` (``local_dir/job-<j>/rank-<r>``) must be those very directories: a job or rank
    directory that is a link (planted in a shared ``/dev/shm``, say) would take the tier's
    writes and its retention's deletes wherever it points, a durable store included."""
    inside = os.path.join(os.path.realpath(local_dir), path.parent.name, path.name)
    if os.path.realpath(path) != inside:
        raise StorageError(
            f"a link in the local tier, not used: {path} leads to {os.path.realpath(path)}, "
            f"outside {local_dir}"
        )


class LocalTier:
    """The stores of ``local_dir`` this rank reads and writes (its own, and its wards')."""

    def __init__(
        self,
        policy: TierPolicy,
        engine: SaveEngine | None,
        *,
        rank: int,
        world_size: int,
        durable_uri: str,
        timeout_s: float,
        thread_nice: int = 0,
        identity: StoreIdentity | None = None,
    ) -> None:
        self.policy = policy
        self.engine = engine
        self.rank = rank
        self.world_size = world_size
        self.durable_uri = durable_uri
        self.identity = identity
        """The durable store instance copies belong to (``tiers.identity``); None: the store
        records none, and only copies that record none belong to it."""
        self._foreign_warned = False
        self.timeout_s = timeout_s
        self.thread_nice = thread_nice
        self._stores: dict[int, Store] = {}
        self._lock = threading.Lock()
        self._to_drain: set[int] = set()  # steps a drain still has to copy from here
        self._fits: int | None = None  # copies kept once the disk was found full with them
        self._drained: set[int] = set()  # own copies this process drained to durable storage
        self._bad: set[str] = set()  # own chunks found corrupt, removed: the next save rewrites

    @property
    def resumed_from(self) -> int | None:
        """The step a load of this process (either front-end) last resumed from these copies:
        copies of later steps belong to a run the job left, and are unlisted before its next
        save (``TierSaver.drop_stale``); ``FRESH_START``: a load of the latest step found
        none, and the job starts over (every copy is of a run it left). None: no load since
        the last save."""
        return _RESUMED.get(str(self.rank_dir(self.rank)))

    @resumed_from.setter
    def resumed_from(self, step: int | None) -> None:
        key = str(self.rank_dir(self.rank))
        if step is None:
            _RESUMED.pop(key, None)
        else:
            _RESUMED[key] = step
            _UNASKED.add(key)
            _DURABLE_NEWEST.pop(key, None)

    @property
    def durable_unasked(self) -> bool:
        """Whether no save since this process's last load could ask the durable store
        whether it holds its step (``tiers.saving.durable_holds``): a job that rolled back
        does not know which later steps it holds."""
        return str(self.rank_dir(self.rank)) in _UNASKED

    def durable_answered(self) -> None:
        key = str(self.rank_dir(self.rank))
        _UNASKED.discard(key)
        _DURABLE_OUT.discard(key)

    @property
    def durable_newest(self) -> int | None:
        """The newest step the durable store listed since this process's last load (-1: it
        held none); None: not listed since."""
        return _DURABLE_NEWEST.get(str(self.rank_dir(self.rank)))

    def durable_listed(self, steps: list[int]) -> None:
        _DURABLE_NEWEST[str(self.rank_dir(self.rank))] = max(steps, default=-1)
        self.durable_answered()

    @property
    def durable_out(self) -> bool:
        """Whether the last ask of the durable store got no answer."""
        return str(self.rank_dir(self.rank)) in _DURABLE_OUT

    def durable_unanswered(self) -> None:
        _DURABLE_OUT.add(str(self.rank_dir(self.rank)))

    @property
    def resume_token(self) -> str | None:
        """The token of the resume this process's copies descend from (``tiers.resumes``), set
        when its first save after a load recorded one; None: not resumed."""
        return _RESUME_TOKENS.get(str(self.rank_dir(self.rank)))

    @resume_token.setter
    def resume_token(self, token: str | None) -> None:
        if token is not None:
            _RESUME_TOKENS[str(self.rank_dir(self.rank))] = token

    def note_committed(self, step: int) -> None:
        """This process committed its copy of ``step`` (``last_two_committed``)."""
        key = str(self.rank_dir(self.rank))
        _COMMITTED[key] = [*_COMMITTED.get(key, []), step][-2:]

    def last_two_committed(self) -> list[int]:
        return list(_COMMITTED.get(str(self.rank_dir(self.rank)), []))

    @classmethod
    def open(
        cls,
        policy: TierPolicy,
        engine: SaveEngine | None,
        durable: Store,
        group: RankGroup,
        *,
        create: bool,
        timeout_s: float,
        thread_nice: int = 0,
    ) -> LocalTier:
        """This rank's local tier for the ``durable`` store (collective over ``group``): the
        store's path and its identity, which rank 0 reads (``create``: makes it if it has
        none) and every rank is told (``tiers.identity.agree_identity``)."""
        _refuse_overlap(policy.local_dir, durable)
        durable_uri = store_identity(durable)
        own_dir = rank_dir(policy.local_dir, durable_uri, group.rank)
        return cls(
            policy,
            engine,
            rank=group.rank,
            world_size=group.world_size,
            durable_uri=durable_uri,
            timeout_s=timeout_s,
            thread_nice=thread_nice,
            identity=agree_identity(durable, group, create=create, own_dir=own_dir),
        )

    def protect(self, step: int) -> None:
        """Keep this rank's copy of ``step`` whatever ``local_keep_last`` says, until
        ``unprotect``: a drain to durable storage still has to read it."""
        with self._lock:
            self._to_drain.add(step)

    def unprotect(self, step: int) -> None:
        with self._lock:
            self._to_drain.discard(step)

    def to_drain(self) -> set[int]:
        with self._lock:
            return set(self._to_drain)

    def store(self, ward: int) -> Store:
        """The store of ``ward``'s copies on this node (created on first use)."""
        with self._lock:
            store = self._stores.get(ward)
            if store is None:
                path = self.rank_dir(ward)
                path.mkdir(parents=True, exist_ok=True)
                _refuse_links(self.policy.local_dir, path)
                store = Store(
                    str(path), retry=local_retry(self.timeout_s), thread_nice=self.thread_nice
                )
                self._stores[ward] = store
            return store

    def rank_dir(self, ward: int) -> Path:
        return rank_dir(self.policy.local_dir, self.durable_uri, ward)

    def info(self, ward: int) -> dict:
        info = tier_info(ward, self.world_size, self.durable_uri)
        if self.identity is not None:
            info["store_id"] = self.identity.id
        if self.resume_token is not None:
            info[RESUME_FIELD] = self.resume_token
        return info

    def wards_here(self) -> list[int]:
        """The ranks whose stores this node's job directory holds (its own ranks', and those
        whose peer copies it keeps)."""
        job_dir = self.rank_dir(self.rank).parent
        if not job_dir.is_dir():
            return []
        found = (p.name[5:] for p in job_dir.glob("rank-*") if p.is_dir())
        return sorted(int(r) for r in found if r.isdigit() and int(r) < self.world_size)

    def dir_token(self) -> str | None:
        """A random token of this node's job directory, made by the first process that asks:
        ranks that read the same one share the directory, whatever their host names say.
        None (with a warning): it cannot be made or read as a plain file (a link, a FIFO, a
        directory planted there, an unwritable ``local_dir``); then no rank removes a store
        (``remove_left_behind``)."""
        job_dir = self.rank_dir(self.rank).parent
        path = job_dir / DIR_TOKEN
        try:
            self.store(self.rank)  # the job directory made, and checked for links
            if not os.path.lexists(path):
                made = job_dir / f".{DIR_TOKEN}.tmp-{uuid.uuid4().hex}"
                try:  # removed whatever happens (a full disk fails the write, not the open)
                    with open(made, "x") as out:  # on disk before it is linked into place
                        out.write(uuid.uuid4().hex)
                        out.flush()
                        os.fsync(out.fileno())
                    os.link(made, path)  # the first process's token wins, whole
                except FileExistsError:
                    pass
                finally:
                    made.unlink(missing_ok=True)
            token = _read_plain_file(path, 64).decode("ascii", "replace").strip()
            if not re.fullmatch(r"[0-9a-f]{32}", token):  # emptied by a crash, or planted
                raise StorageError(f"{path} does not hold a token (32 hex digits): {token!r:.40}")
            return token
        except (OSError, StorageError) as exc:
            logger.warning(
                "rank %d: stores of ranks no longer on this node are not removed: %s",
                self.rank,
                one_line(exc),
            )
            return None

    def remove_left_behind(self, kept_here: set[int], older_than: int) -> None:
        """Remove the stores in this node's job directory of ranks it no longer keeps (not in
        ``kept_here``: they run elsewhere after a restart placed ranks on other nodes, or
        beyond the world size) once their newest copy is older than ``older_than`` and no
        live lease is held in them. Each is renamed aside first, so a removal cut short
        leaves no store half there (the next one finishes it)."""
        job_dir = self.rank_dir(self.rank).parent
        for path in job_dir.glob(f"{_REMOVING}*"):
            shutil.rmtree(path, ignore_errors=True)
        for ward, path, store in self.left_behind(kept_here):
            try:
                steps = list_steps(store)
                if (steps and steps[-1] >= older_than) or any(
                    lease.live for lease in find_leases(store)
                ):
                    continue
                with self._lock:
                    self._stores.pop(ward, None)
                aside = job_dir / f"{_REMOVING}{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, aside)
                shutil.rmtree(aside)
            except (CheckpointError, OSError) as exc:
                logger.warning("rank %d: %s left in place: %s", self.rank, path, one_line(exc))
                continue
            logger.info(
                "rank %d: removed %s (rank %d's copies, steps %s; the rank runs on another "
                "node now)",
                self.rank,
                path,
                ward,
                rank_ranges(steps) or "none",
            )

    def anything_left_behind(self, kept_here: set[int]) -> bool:
        """Whether this node's job directory holds a store of a rank not in ``kept_here``, or
        one a removal cut short (``remove_left_behind``'s work)."""
        job_dir = self.rank_dir(self.rank).parent
        if any(job_dir.glob(f"{_REMOVING}*")):
            return True
        return any(
            p.name[5:].isdigit() and int(p.name[5:]) not in kept_here
            for p in job_dir.glob("rank-*")
        )

    def left_behind(self, kept_here: set[int]) -> list[tuple[int, Path, Store]]:
        """The stores of this node's job directory of ranks not in ``kept_here``: rank, path,
        store (links are named and skipped)."""
        out = []
        for path in sorted(self.rank_dir(self.rank).parent.glob("rank-*")):
            number = path.name[5:]
            if not number.isdigit() or int(number) in kept_here or not path.is_dir():
                continue
            try:
                _refuse_links(self.policy.local_dir, path)
                store = Store(str(path), retry=local_retry(self.timeout_s))
            except (CheckpointError, OSError) as exc:
                logger.warning("rank %d: %s left as it is: %s", self.rank, path, one_line(exc))
                continue
            out.append((int(number), path, store))
        return out

    def belongs(self, manifest: Manifest, ward: int) -> bool:
        """Whether ``manifest`` is a copy of ``ward``'s state in this job."""
        info = manifest.user.get(TIER_KEY)
        if manifest.world_size != 1 or not isinstance(info, dict):
            return False
        path_info = {k: v for k, v in info.items() if k not in ("store_id", RESUME_FIELD)}
        mine = tier_info(ward, self.world_size, self.durable_uri)
        return path_info == mine and of_instance(info, self.identity)

    def check_copy(self, manifest: Manifest, rank: int, attempt: str | None) -> None:
        """``CheckpointNotFoundError`` unless ``manifest``, read from ``rank``'s own store, is
        this job's copy of its state and of the save ``attempt`` the load planned (a copy
        replaced since the plan listed it is not loaded)."""
        where, step = self.store(rank).uri, manifest.step
        if attempt is not None and manifest.attempt != attempt:
            raise CheckpointNotFoundError(
                f"{where} holds another save of step {step} ({manifest.attempt})"
            )
        if not self.belongs(manifest, rank):
            raise CheckpointNotFoundError(f"{where}: step {step} is not this job's copy")

    def drop_foreign(self, ward: int, step: int) -> None:
        """Unlist ``ward``'s copy of ``step`` here if it belongs to another instance of the
        durable store (deleted and made again): never loaded, it must not refuse this
        instance's save of the same step number as another save of it."""
        store = self.store(ward)
        if not store.exists(commit_key(step)):
            return
        try:
            manifest = load_manifest(store, step)
        except CheckpointError:
            return  # kept: the commit over it fails and says why
        if self.of_other_instance(manifest):
            self._unlist_foreign(store, step)

    def _unlist_foreign(self, store: Store, step: int) -> None:
        drop_step(store, step)
        logger.info(
            "rank %d: unlisted %s's step %d, a copy of another instance of %s",
            self.rank,
            store.uri,
            step,
            self.durable_uri,
        )

    def of_other_instance(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` is a copy for this job's durable store path, made for another
        instance of it (a store deleted and made again at the same path)."""
        info = manifest.user.get(TIER_KEY)
        if not isinstance(info, dict) or info.get("durable") != self.durable_uri:
            return False
        theirs = info.get("store_id")
        mine = self.identity.id if self.identity is not None else None
        if theirs is None:
            return mine is not None and not self.identity.adopted
        return theirs != mine

    def copies(self, ward: int) -> dict[int, str]:
        """``ward``'s committed copies here: step -> attempt (unreadable or foreign ones left
        out, with one log line)."""
        return {step: attempt for step, (attempt, _) in self.copies_made(ward).items()}

    def copies_made(
        self, ward: int, unread: list[str] | None = None
    ) -> dict[int, tuple[str, float]]:
        """:meth:`copies`, each with when the resume it descends from was recorded
        (``tiers.resumes.made_under``); a manifest the store did not serve (not a damaged one)
        named in ``unread``."""
        if not self.rank_dir(ward).is_dir():
            return {}
        store = self.store(ward)
        out = {}
        other_world: dict[Any, list[int]] = {}  # world size -> steps its job left here
        for step in list_steps(store):
            try:
                manifest = load_manifest(store, step)
            except CheckpointError as exc:
                logger.warning("rank %d: local copy %s unreadable: %s", self.rank, store.uri, exc)
                if unread is not None and isinstance(exc, StorageError):
                    unread.append(str(exc))
                continue
            info = manifest.user.get(TIER_KEY)
            if self.belongs(manifest, ward):
                out[step] = (manifest.attempt, made_under(info))
            elif self.of_other_instance(manifest):
                self._warn_foreign(store, step, manifest)
            elif isinstance(info, dict) and info.get("world_size") != self.world_size:
                other_world.setdefault(info.get("world_size"), []).append(step)
            else:
                logger.warning(
                    "rank %d: step %d in %s is not rank %d's copy for this job (%s); ignored",
                    self.rank,
                    step,
                    store.uri,
                    ward,
                    manifest.user.get(TIER_KEY),
                )
        for world, steps in other_world.items():
            self._warn_other_world(ward, world, steps)
        return out

    def _warn_other_world(self, ward: int, world: Any, steps: list[int]) -> None:
        """Once per process and store, from the rank whose own store holds them: copies
        a job of another world size left here are not loaded, and this job's first save after
        it resumed unlists them (they are of a run it left)."""
        said = (str(self.rank_dir(ward)), world)
        if ward != self.rank or said in _OTHER_WORLD_SAID:
            return
        _OTHER_WORLD_SAID.add(said)
        logger.warning(
            "rank %d: local copies of step(s) %s in %s were saved by a job of %s ranks and "
            "this one has %d: they are not loaded (a local copy loads at the world size that "
            "made it: resume from them with %s ranks), and this job's first save after it "
            "resumes unlists them",
            self.rank,
            ", ".join(map(str, steps)),
            self.policy.local_dir,
            world,
            self.world_size,
            world,
        )

    def newest_copy(self, ward: int, step: int) -> tuple[str | None, dict[str, ChunkInfo]]:
        """For a copy of ``ward``'s ``step`` about to be written here, under the writer's save
        lease of ``ward``'s store: the attempt of the copy of ``step`` the store holds already
        (None: none), and the chunks of its newest copy, which are stored and stay so while that
        lease is held (docs/FORMAT.md, "Known chunks"). One listing, then the manifest of
        ``step`` where it is listed, else the newest step's manifest and its index: no other
        copy is read. A ``step`` here of another instance of the durable store is unlisted; one
        that is not ``ward``'s copy for this job otherwise raises; a newest
        copy that cannot be read leaves no chunk known (each is put, one found stored kept)."""
        store = self.store(ward)
        steps = list_steps(store)
        if step in steps:
            manifest = load_manifest(store, step)
            if self.of_other_instance(manifest):  # never loaded: no other save of the step
                self._unlist_foreign(store, step)
                steps.remove(step)
            elif not self.belongs(manifest, ward):
                raise CheckpointError(f"{store.uri} holds another save of step {step}")
            else:
                return manifest.attempt, {}
        if not steps:
            return None, {}
        try:
            manifest = load_manifest(store, steps[-1])
            if not manifest.ranks:
                return None, {}
            return None, dict(read_rank_index(store, manifest.ranks[0]).chunks)
        except (CheckpointNotFoundError, CheckpointCorruptError, FormatVersionError) as exc:
            logger.info(
                "rank %d: the copy of rank %d's step %d knows no stored chunks (step %d: %s)",
                self.rank,
                ward,
                step,
                steps[-1],
                exc,
            )
            return None, {}

    def _warn_foreign(self, store: Store, step: int, manifest: Manifest) -> None:
        """One warning per tier: copies of another instance of the durable store are never
        loaded nor counted."""
        with self._lock:
            if self._foreign_warned:
                return
            self._foreign_warned = True
        theirs = manifest.user[TIER_KEY].get("store_id") or "none recorded"
        mine = self.identity.id if self.identity is not None else "none recorded"
        if self.identity is not None and self.identity.adopted:
            why = (
                "its identity.json was made when it held steps but no identity (removed, or "
                "never written by an older version), so it cannot be told from a store deleted "
                "and made again"
            )
        elif self.identity is None:
            why = (
                "the store records no identity.json (removed, or not yet written), and no copy "
                "of its own steps vouches for theirs"
            )
        else:
            why = "the store was deleted and made again"
        logger.warning(
            "rank %d: %s holds copies (step %d, ...) of another instance of %s (store id %s; "
            "the store there now is %s): %s; those copies are never loaded",
            self.rank,
            store.uri,
            step,
            self.durable_uri,
            theirs,
            mine,
            why,
        )

    def forget_bad_chunk(
        self, digest: str, missing: bool = False, then: str = "the next save writes it again"
    ) -> None:
        """A chunk of this rank's own store is ``missing`` or failed its check: remove it,
        so that the next save writes it again instead of referencing it (``take_bad``);
        ``then``: what happens to it next, as the warning says."""
        with self._lock:
            self._bad.add(digest)
        try:
            self.store(self.rank).delete(chunk_key(digest))
            what = "removed"
        except (CheckpointError, OSError) as exc:  # this process's next save still knows it
            what = f"not removed ({one_line(exc)})"
        logger.warning(
            "rank %d: chunk %s of the local tier %s; %s: %s",
            self.rank,
            digest,
            "is missing" if missing else "failed its check",
            "nothing to remove" if missing and what == "removed" else what,
            then,
        )

    def take_bad(self) -> set[str]:
        with self._lock:
            bad, self._bad = self._bad, set()
        return bad

    def note_drained(self, step: int) -> None:
        """This rank's copy of ``step`` is in durable storage too (its drain committed)."""
        with self._lock:
            self._drained = {s for s in self._drained if s > step - 10_000} | {step}

    def keep_fewer(self) -> int | None:
        """After this rank's copy failed on a full local disk: from now on keep one copy fewer
        than the tier holds (at least one) of those drained to durable storage, so that the
        next save finds room for its copy (a save writes it before retention drops the
        oldest: ``local_keep_last`` copies need room for one more); a copy only this tier holds
        stays as ``local_keep_last`` says. The new number, or None where nothing is freed."""
        held = list_steps(self.store(self.rank))
        fits = max(1, len(held) - 1)
        limit = min(self.policy.local_keep_last, self._fits or len(held) + 1)
        if fits >= limit or not self._drained.intersection(held[: len(held) - fits]):
            return None
        self._fits = fits
        return fits

    def retain(
        self, ward: int, keep: set[int] = frozenset(), ignore_attempts: set[str] = frozenset()
    ) -> None:
        """``local_keep_last`` for ``ward``'s copies; ``keep`` and a step still to be drained
        are kept. ``ignore_attempts``: the caller's own save leases, which do not stop the
        sweep (their steps are in ``keep``)."""
        store = self.store(ward)
        keep_last, keep = self.policy.local_keep_last, set(keep)
        try:
            if ward == self.rank and self._fits is not None:  # full once: fewer drained copies
                keep_last = min(keep_last, self._fits)
                # those only the tier holds stay while among the newest local_keep_last
                newest = list_steps(store)[-self.policy.local_keep_last :]
                keep |= set(newest[:-keep_last]) - self._drained
            collect(
                store,
                keep_last=keep_last,
                ignore_attempts=set(ignore_attempts),
                keep_steps=(self.to_drain() if ward == self.rank else set()) | keep,
                lease_ttl_s=self.engine.lease_ttl_s if self.engine else DEFAULT_TTL_S,
            )
        except CheckpointError as exc:
            logger.warning(
                "retention in %s failed (retried after the next save): %s", store.uri, exc
            )


_REMOVING = ".removing-"  # a left-behind store being removed (``remove_left_behind``)


def copies_under_other_paths(
    local_dir: str | os.PathLike, durable_uri: str, identity: StoreIdentity | None
) -> dict[str, list[int]]:
    """Copies in ``local_dir`` of the store instance ``identity`` made while it was at another
    path (moved, or mounted elsewhere on a new node): that path -> the steps. A copy belongs to
    the store's path, so a load never takes them; ``ckptstore ls`` and a tiered load that
    finds no copy of its own name them. Empty where the store records no identity."""
    found: dict[str, set[int]] = {}
    if identity is None or not Path(local_dir).is_dir():
        return {}
    mine = job_dir_name(durable_uri)
    for job in sorted(Path(local_dir).glob("job-*")):
        if job.name == mine or not job.is_dir() or job.is_symlink():
            continue
        for sub in sorted(job.glob("rank-*")):
            if sub.is_symlink() or not sub.is_dir():
                continue
            try:
                store = open_store(sub)
                for step in list_steps(store):
                    info = load_manifest(store, step).user.get(TIER_KEY)
                    if (
                        isinstance(info, dict)
                        and info.get("store_id") == identity.id
                        and isinstance(info.get("durable"), str)
                        and info["durable"] != durable_uri
                    ):
                        found.setdefault(info["durable"], set()).add(step)
            except (CheckpointError, OSError):
                continue  # another job's directory: not this store's to judge
    return {path: sorted(steps) for path, steps in found.items()}


def _read_plain_file(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, which must be a regular file, not a link: a FIFO
    planted there would block the open, a link lead anywhere."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a plain file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def of_instance(info: dict, identity: StoreIdentity | None) -> bool:
    """Whether a copy whose manifest records ``info`` (``tier_info``) belongs to the durable
    store instance ``identity`` (None: the store records none): a copy records its store's id;
    one that records none (written before identities) belongs to a store without one, or to one
    that adopted an identity over steps of that time."""
    if "store_id" not in info:
        return identity is None or identity.adopted
    return identity is not None and info["store_id"] == identity.id


@dataclass
class TierListing:
    """What ``ckptstore ls --local-dir`` shows of one local directory for one job."""

    job_dir: Path  # <local_dir>/job-<j>: each rank-<r>/ in it is a store of its own
    copies: dict[int, list[int]]  # step -> the ranks whose copy it holds
    problems: list[str]  # copies that cannot be read, one line each
    # step -> (ranks, the step the job resumed from): copies of a run the job left, which every
    # load passes over (``tiers.resumes``); not in ``copies``
    left: dict[int, tuple[list[int], int]] = field(default_factory=dict)
    # a path the store was at -> the steps copies made there hold (``copies_under_other_paths``)
    elsewhere: dict[str, list[int]] = field(default_factory=dict)
    # step -> the copies in ``copies``, each its rank's store and manifest (what ls says of a
    # step held only in local tiers)
    manifests: dict[int, list[tuple[Store, Manifest]]] = field(default_factory=dict)


def tier_copies(
    local_dir: str | os.PathLike,
    durable_uri: str,
    identity: StoreIdentity | None = None,
    *,
    of_identity: bool = False,
    recorded: list[Resume] | None = None,
) -> TierListing:
    """The steps of which ``local_dir`` holds a copy for the job of ``durable_uri`` (for
    ``ckptstore ls``; the store of each ``rank-<r>`` read without writing); with
    ``of_identity``, only the copies of the store instance ``identity``
    (``tiers.identity.read_identity``). ``recorded``: the durable store's resumes: a copy of a
    run the job left is listed apart (``TierListing.left``)."""
    if not Path(local_dir).is_dir():
        raise CheckpointNotFoundError(f"no local tier directory at {local_dir}")
    job_dir = Path(local_dir) / job_dir_name(durable_uri)
    out: dict[int, set[int]] = {}
    manifests: dict[int, list[tuple[Store, Manifest]]] = {}
    left: dict[int, tuple[list[int], int]] = {}
    problems: list[str] = []
    for sub in sorted(job_dir.glob("rank-*")):
        if not (sub.is_dir() and sub.name[5:].isdigit()):
            continue
        rank = int(sub.name[5:])
        try:
            _refuse_links(local_dir, sub)
        except StorageError as exc:
            problems.append(str(exc))
            continue
        store = open_store(sub)
        for step in list_steps(store):
            try:
                manifest = load_manifest(store, step)
            except CheckpointError as exc:
                problems.append(f"step {step} of rank {rank}: {' '.join(str(exc).split())}")
                continue
            info = manifest.user.get(TIER_KEY)
            if manifest.world_size == 1 and isinstance(info, dict) and info.get("rank") == rank:
                if info.get("durable") == durable_uri and (
                    not of_identity or of_instance(info, identity)
                ):
                    resume = left_by(step, made_under(info), recorded or [])
                    if resume is None:
                        out.setdefault(step, set()).add(rank)
                        manifests.setdefault(step, []).append((store, manifest))
                    else:
                        ranks, _ = left.setdefault(step, ([], resume.step))
                        ranks.append(rank)
    copies = {step: sorted(ranks) for step, ranks in out.items()}
    elsewhere = copies_under_other_paths(local_dir, durable_uri, identity)
    return TierListing(job_dir, copies, problems, left, elsewhere, manifests)


def describe_copies(copies: list[tuple[Store, Manifest]]) -> dict[str, Any]:
    """What the ranks' local copies of one step (``TierListing.manifests``) say of it, for a
    step no durable manifest describes: its kind, the job's world size, when its first copy was
    made, its health (unhealthy if a copy says so, healthy if every one does), the caller's
    metadata, and its bytes as a manifest counts them (the distinct chunks of the copies'
    indexes; None where some ranks' copies are not among ``copies`` or an index cannot be
    read)."""
    first = min((m for _, m in copies), key=lambda m: m.created_at)
    world = first.user[TIER_KEY].get("world_size")
    verdicts = {status(m.health) for _, m in copies}
    health = (
        UNHEALTHY if UNHEALTHY in verdicts else verdicts.pop() if len(verdicts) == 1 else UNKNOWN
    )
    described: dict[str, Any] = {
        "kind": first.kind,
        "world_size": world,
        "created_at": first.created_at,
        "health": health,
        "user": {k: v for k, v in first.user.items() if k != TIER_KEY},
        "raw_bytes": None,
        "stored_bytes": None,
    }
    by_rank = {m.user[TIER_KEY]["rank"]: (store, m) for store, m in copies}
    if sorted(by_rank) != list(range(world or 0)):
        return described
    chunks: dict[str, ChunkInfo] = {}
    try:
        for store, manifest in by_rank.values():
            chunks |= read_rank_index(store, manifest.ranks[0]).chunks
    except (CheckpointError, StorageError):
        return described  # a load that meets the damaged copy names it
    described["raw_bytes"] = sum(c.raw for c in chunks.values())
    described["stored_bytes"] = sum(c.stored for c in chunks.values())
    return described


def local_retry(timeout_s: float) -> RetryPolicy:
    """Requests to a local tier: a disk that does not answer within one attempt's deadline
    (at most ``timeout_s``) will not answer the next either, so no attempt follows a timeout and
    the load moves on to the next tier (peer, durable) at once; an error that comes back
    quickly is tried once more."""
    attempt_s = min(RetryPolicy.timeout_s, timeout_s)
    return RetryPolicy(attempts=2, timeout_s=attempt_s, total_s=attempt_s)


def _refuse_overlap(local_dir: Path, durable: Store) -> None:
    """A ``local_dir`` that is, or lies inside, a local durable store: the node-local copies
    would sit among the durable objects, on the same disk (a tier that is no tier)."""
    if not durable.is_local:
        return
    tiers, store = Path(os.path.realpath(local_dir)), Path(os.path.realpath(durable.root))
    if tiers == store or store in tiers.parents:
        raise ValueError(
            f"local_dir {local_dir} is inside the durable store {durable.uri}: the tiers need "
            "a node-local directory of their own"
        )
