"""Lightning checkpoints in a ckptstore URI: ``Trainer(plugins=[CkptstoreCheckpointIO(uri)])``.

Each checkpoint Lightning saves is two things:

- the data: a new step of the store ``uri``, saved through a :class:`ckptstore.Checkpointer`
  (``save_checkpoint`` returns once the state is staged in host memory; encoding, upload and
  commit run in the background; ``teardown``, at the end of ``fit``, waits for them and raises a
  failed save's error). The step is ``checkpoint["global_step"]``, or one past the newest step
  of the store when that one is not newer (``last.ckpt`` saved at the step of its top-k file,
  a second ``fit`` into the same store): every save gets its own step, a newer save a higher
  one, so ``"latest"`` is the newest save, as Lightning's ``"last"`` is.
- a pointer file at the path Lightning names (in ``ModelCheckpoint(dirpath=...)``, a local
  path or any fsspec URL): a small JSON document naming the store, the step and the save's id
  (also kept in the step's metadata). Lightning lists, versions (``-v1``), links, resolves
  (``ckpt_path="last"``) and removes these files as it does its own checkpoint files.

A pointer at a new path is written as the save starts (Lightning versions names by the files
there and may link to it at once), marked pending, and rewritten once the save commits; loaded
after a kill left it pending, it loads the newest save committed before it (what Lightning's own
IO would have left there), with a warning. One that replaces a pointer of this store
(``last.ckpt``) is written once the save commits, so a kill, a failed save or one skipped as
unhealthy leaves it naming the committed save it held.
Loading a pointer checks that its step still holds the save it names: a pointer whose save did
not commit (the process was killed mid-save) or was removed is refused with
:class:`ckptstore.CheckpointNotFoundError`, never loaded from another save. ``remove_checkpoint``
deletes the pointer (a link: only the link) and unlists the step it names once the newest save
has committed (Lightning removes the top-k file a save replaces right after starting it); the
step a replaced pointer named goes the same way; the chunks no remaining step uses are swept in
the background. A kill before then leaves such a step listed though no pointer names it: a
rewritten pointer records the saves it replaced, and the next overwrite of that path (in any
process) unlists them; a step whose pointer was removed stays (nothing removes it by itself:
it is a step ``"latest"`` may resume from).
``load_checkpoint`` also takes a step number, ``"latest"`` or ``"last"`` (the newest step), a
torch checkpoint file (loaded by Lightning's ``TorchCheckpointIO``), and, for stores written
before pointer files, a path recorded in a step's metadata.

Values a ckptstore state cannot represent (enums, dataclasses, paths in hyper-parameters) are
saved as pickled blobs with their tensors pulled out and stored as verified chunks; loading them
follows ``weights_only`` as ``torch.load`` does (``ckptstore.integrations._pickled``).

Single-device strategies and DDP are supported: under DDP global rank 0 saves the whole state
(as Lightning has it) and every rank loads the step on its own, verified. FSDP and DeepSpeed
read their checkpoints with their own code, not through a ``CheckpointIO``: use
``ckptstore.dcp`` for those.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
except ImportError:
    try:
        from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO
    except ImportError:
        raise ImportError(
            "ckptstore.integrations.lightning needs Lightning: pip install lightning"
        ) from None

import torch
import torch.distributed as dist

from ckptstore.catalog import list_steps, load_manifest, saves_in_flight
from ckptstore.checkpointer import Checkpointer, SaveHandle
from ckptstore.errors import CheckpointCorruptError, CheckpointNotFoundError, one_line
from ckptstore.integrations import _pointer
from ckptstore.integrations._pickled import unwrap, wrap
from ckptstore.integrations._pointer import Pointer
from ckptstore.options import HealthPolicy
from ckptstore.retention import collect, drop_step
from ckptstore.store import Store

__all__ = ["CkptstoreCheckpointIO"]

logger = logging.getLogger(__name__)

META_KEY = "lightning"
STEP_WORDS = ("latest", "last")
CALLBACK_STATE = ("callbacks/",)  # its scores start at Inf: never a sign of a blow-up


SAVE_IN_FLIGHT_WAIT_S = 600.0  # how long a load waits for another process's save of its step
QUEUED_SAVE_S = 30.0  # a pending pointer this young may name a save not yet started
# How often a writer rewrites the pending pointers of its unfinished saves with the time: a
# save queued behind another (or behind its retention) holds no lease, and only this tells
# a reader that the process that will commit it is alive.
REFRESH_PENDING_S = QUEUED_SAVE_S / 3


def _steps_once_saved(store: Store, pending: Pointer, path: str) -> list[int]:
    """The committed steps of ``store`` once the save ``pending`` names can no longer commit:
    a pointer is written as its save is queued, so while the writer's saves up to its step are
    in flight (their leases live), or the pointer is younger than ``QUEUED_SAVE_S`` (its
    writer rewrites it every ``REFRESH_PENDING_S`` until the save is done), it may commit in a
    moment; past that, a kill interrupted it."""
    deadline, pause = time.monotonic() + SAVE_IN_FLIGHT_WAIT_S, 0.05
    while True:
        steps = list_steps(store)
        if pending.step in steps:
            return steps
        live = [
            save
            for save in saves_in_flight(store)
            if save["kind"] == "save"
            and not save["stale"]
            and isinstance(save["step"], int)
            and save["step"] <= pending.step
        ]
        written_at = _rewritten_at(path, pending)
        young = written_at is not None and abs(time.time() - written_at) < QUEUED_SAVE_S
        if not live and not young:
            return list_steps(store)  # it may have committed since the listing above
        if time.monotonic() > deadline:
            why = f"a save ({live[0]['key']})" if live else "its save"
            raise CheckpointNotFoundError(
                f"{path} points to step {pending.step}: {why} still in flight after "
                f"{SAVE_IN_FLIGHT_WAIT_S:.0f}s"
            )
        if pause == 0.05:
            logger.info(
                "%s names step %d, whose save is in flight: waiting for it", path, pending.step
            )
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _rewritten_at(path: str, pending: Pointer) -> float | None:
    """When the pending pointer at ``path`` was last written, as its writer rewrites it while
    the save waits; ``pending``'s own time once the file holds another save, or none."""
    try:
        now = _pointer.load(path)
    except (OSError, CheckpointCorruptError):
        now = None
    if now is not None and now.save_id == pending.save_id and now.written_at is not None:
        return now.written_at
    return pending.written_at


class CkptstoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves into the ckptstore ``uri``, leaving a pointer
    file at each path Lightning names.

    Args:
        uri: the store: a path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: passed to fsspec for the store (credentials, endpoint, ...); pointer
            files are reached as Lightning reaches its checkpoint directory.
        **checkpointer_options: passed to :class:`ckptstore.Checkpointer` (``encoding=``,
            ``staging=``, ... option objects). Leave ``keep_last`` unset to let
            ``ModelCheckpoint(save_top_k=...)`` decide which steps go. The default
            ``health`` ignores the callbacks' state (``ModelCheckpoint`` and ``EarlyStopping``
            keep scores that are Inf by design): ``HealthPolicy(ignore=("callbacks/",))``.
            Not ``tiers`` (nor ``local_dir``): the pointers name steps of the durable store.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        **checkpointer_options: Any,
    ) -> None:
        tiers = checkpointer_options.get("tiers")
        if checkpointer_options.get("local_dir") or getattr(tiers, "local_dir", None):
            # A pointer to a step held only by a local tier would not load after a restart.
            raise ValueError(
                "the Lightning plugin does not take tiers (local_dir): its pointer files name "
                "steps of the durable store; give it the fast store itself as its uri"
            )
        self.uri = str(uri)
        self._store_id = _pointer.store_id(self.uri)
        self._storage_options = storage_options
        health = HealthPolicy(ignore=CALLBACK_STATE)
        self._options = {
            "storage_options": storage_options,
            "health": health,
            **checkpointer_options,
        }
        self._checkpointer: Checkpointer | None = None
        self._pending: dict[int, SaveHandle] = {}
        self._newest = -1  # the highest step this process saved
        # Steps to unlist once a save commits (kept if it fails or is skipped): a pointer it
        # overwrites, one Lightning removed while it ran, its own if its path was removed.
        self._drops: list[tuple[SaveHandle, Pointer]] = []
        # path -> the saves, oldest first, whose pointers wait for their commits to go there
        self._overwrites: dict[str, list[tuple[SaveHandle, Pointer]]] = {}
        self._pointing = threading.Condition()  # guards the two above; counts callbacks
        self._callbacks = 0  # pointer updates still to run on saving threads
        self._pointer_errors: list[BaseException] = []
        self._paths: dict[int, str] = {}  # committed step -> the path it was saved as (cache)
        # path -> the save and the pending pointer written there, until the save is done
        # (guarded by ``_pointing``); rewritten every REFRESH_PENDING_S by ``_refresher``
        self._queued: dict[str, tuple[SaveHandle, Pointer]] = {}
        self._refresher: threading.Thread | None = None
        self._sweeper: ThreadPoolExecutor | None = None
        self._sweeps: list[Future] = []
        # path -> the pointer this process wrote or loaded there (a regular file then); where
        # save_last="link" later links over it (os.remove, not through the plugin), the step
        # it named is unlisted at teardown: nothing names it any more.
        self._named: dict[str, Pointer] = {}
        self._dropped: set[tuple[int, str]] = set()  # (step, save_id) unlisted or found gone

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            # Under DDP Lightning saves the whole state from global rank 0 only and loads it
            # on every rank: each process checkpoints on its own (DCP's no_dist).
            several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            self._checkpointer = Checkpointer(self.uri, no_dist=several, **self._options)
        return self._checkpointer

    # -- CheckpointIO -----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage ``checkpoint`` as a new step and write the pointer at ``path``; the commit
        runs in the background."""
        if storage_options is not None:
            raise TypeError(
                "CkptstoreCheckpointIO takes storage options in its constructor, not per save"
            )
        global_step = checkpoint.get("global_step")
        if isinstance(global_step, bool) or not isinstance(global_step, int):
            raise ValueError(
                f"{path}: the checkpoint has no integer 'global_step' ({global_step!r})"
            )
        path = str(path)
        self._drop_replaced(block=False)
        step = self._next_step(global_step)
        save_id = uuid.uuid4().hex
        with self._pointing:
            waiting = self._overwrites.get(path)
        # A link there (save_last="link") names another file's step: the save replaces the link
        # alone, and that file keeps its step (a resume's first last.ckpt save is one).
        replaced = waiting[-1][1] if waiting else None
        if replaced is None and not os.path.islink(path):
            replaced = self._own_pointer_at(path)
        meta = {META_KEY: {"path": path, "global_step": global_step, "save_id": save_id}}
        handle = self.checkpointer.save(step, wrap(checkpoint), metadata=meta)
        if handle.skipped:
            logger.warning(
                "%s: not saved, the previous save of %s is still running", path, self.uri
            )
            return
        self._pending[step] = handle
        self._newest = max(self._newest, step)
        pointer = Pointer(self._store_id, step, save_id, global_step)
        self._named[path] = pointer
        if replaced is None:
            # A new name, written now (Lightning versions names by the files there and may
            # link to it at once), marked pending until the save commits: a kill in between
            # leaves a pointer that loads the newest save committed before it.
            pending = dataclasses.replace(pointer, pending=True, written_at=time.time())
            with self._pointing:
                _pointer.write(path, pending)
                self._queued[path] = (handle, pending)
                self._refresh_pending()
            self._when_done(handle, lambda: self._settle(handle, path))
            return
        # ``last.ckpt`` names the save it holds until this one commits: a kill (or a failed or
        # skipped save) in between leaves it naming a committed step, as an atomic write does.
        # The new pointer names the saves to unlist once it is written, for a kill before.
        gone = self._replaced_by(replaced)
        pointer = dataclasses.replace(pointer, replaces=tuple((p.step, p.save_id) for p in gone))
        self._named[path] = pointer
        with self._pointing:
            self._overwrites.setdefault(path, []).append((handle, pointer))
        self._drops.extend((handle, old) for old in gone)
        self._when_done(handle, lambda: self._point_committed(handle, path, pointer))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint whose pointer is at ``path`` (also a step number, ``"latest"``,
        ``"last"`` or a torch checkpoint file), verified; tensors on the CPU unless
        ``map_location`` says otherwise."""
        self._wait_saves()
        if _is_step_word(path):
            state = self._load_step(self.checkpointer, self._step_of_word(path))
        else:
            data = _pointer.read(str(path))
            if data == b"":
                raise CheckpointCorruptError(
                    f"{path} is empty: neither a ckptstore pointer nor a torch checkpoint (a "
                    "save killed as it wrote the file?); 'latest' loads the store's newest step"
                )
            if data is not None and not _pointer.is_pointer(data):
                return _torch_checkpoint(path, map_location, weights_only)
            if data is None:
                state = self._load_step(self.checkpointer, self._labelled(str(path)))
            else:
                pointer = _pointer.decode(data, str(path))
                state = self._load_pointer(pointer, str(path))
                if not os.path.islink(path) and pointer.store == self._store_id:
                    self._named[str(path)] = pointer
        checkpoint = unwrap(
            _map_tensors(state, map_location), weights_only=weights_only is not False
        )
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the pointer at ``path`` and unlist the step it names: its chunks that no other
        step references are swept by ckptstore's garbage collection in the background."""
        path = str(path)
        self._named.pop(path, None)
        if os.path.islink(path):  # save_last="link": the file it links to names the step
            os.unlink(path)
            return
        with self._pointing:
            waiting = self._overwrites.pop(path, [])
            pointer = self._own_pointer_at(path)
            if not _pointer.remove(path):
                logger.warning("remove_checkpoint: there is no checkpoint at %s", path)
        self._drops.extend(waiting)  # their pointers are never written: nothing names them
        if pointer is None:
            return
        for old in self._replaced_by(pointer):
            if self._pending:
                # The top-k file Lightning replaces goes once the save that replaces it
                # commits: a kill (or a failed or skipped save) before leaves a step to resume.
                self._drops.append((self._pending[max(self._pending)], old))
            else:
                self._drop(old)

    def teardown(self) -> None:
        """Wait for every pending save and chunk sweep; raise the first that failed."""
        self._wait_saves()
        self._drop_replaced(block=True)
        self._drop_linked_over()
        sweeps, self._sweeps = self._sweeps, []
        for sweep in sweeps:
            sweep.result()
        errors, self._pointer_errors = self._pointer_errors, []
        if errors:
            raise errors[0]

    # -- beyond CheckpointIO ----------------------------------------------------------------

    def steps(self) -> dict[int, str]:
        """Committed steps, ascending, with the path each was saved as."""
        self._wait_saves()
        return {step: self._saved_path(step) for step in list_steps(self.checkpointer.store)}

    def close(self) -> None:
        """``teardown`` and stop the checkpointer's background thread."""
        try:
            self.teardown()
        finally:
            if self._sweeper is not None:
                self._sweeper.shutdown()
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None

    # -- saving -----------------------------------------------------------------------------

    def _next_step(self, global_step: int) -> int:
        """``global_step`` unless the store (or a save in flight) already has it or a later
        step: then one past the newest."""
        newest = max([self._newest, *list_steps(self.checkpointer.store)])
        return max(global_step, newest + 1)

    def _wait_saves(self) -> None:
        self._pending.clear()
        if self._checkpointer is not None:
            try:
                self._checkpointer.wait()
            finally:  # the pointer updates of the saves that finished
                with self._pointing:
                    self._pointing.wait_for(lambda: self._callbacks == 0)

    def _own_pointer_at(self, path: str, *, quiet: bool = False) -> Pointer | None:
        """The pointer at ``path`` if it names a step of this store (anything else there, a
        damaged pointer included, is not ours to drop)."""
        try:
            pointer = _pointer.load(path)
        except OSError:
            if quiet:
                return None
            raise
        except CheckpointCorruptError as exc:
            if not quiet:
                logger.warning("%s", exc)
            return None
        return pointer if pointer is not None and pointer.store == self._store_id else None

    def _drop_replaced(self, *, block: bool) -> None:
        """Unlist the steps waiting on a save, once it has committed (if it failed or was
        skipped, they stay)."""
        kept = []
        for handle, old in self._drops:
            if not handle.done():
                assert not block, "teardown waits for every save first"
                kept.append((handle, old))
            elif handle.committed:
                self._drop(old)
            else:
                logger.info(
                    "step %d of %s kept: the save after it did not commit", old.step, self.uri
                )
        self._drops = kept

    def _drop_linked_over(self) -> None:
        """Unlist the steps of the pointers in ``_named`` that a link to another step's file
        has replaced, where the step was saved as that very path (a pointer a user copied
        there names a step another file names too)."""
        named, self._named = self._named, {}
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return  # every rank loads the pointer; rank 0 saves and drops, as Lightning does
        for path, pointer in named.items():
            if not os.path.islink(path):
                if os.path.isfile(path):
                    self._named[path] = pointer
                continue
            there = self._own_pointer_at(path, quiet=True)
            if there is None or there.step == pointer.step:
                continue  # a link to something else, or to nothing: not ours to judge
            try:
                saved_as = self._saved_path(pointer.step)
            except CheckpointNotFoundError:
                continue  # gone already
            if os.path.abspath(saved_as) != os.path.abspath(path):
                continue
            elsewhere = _file_naming(pointer, os.path.dirname(os.path.abspath(path)))
            if elsewhere is not None:  # moved or copied there: the step is still named
                logger.info("step %d kept: %s names it", pointer.step, elsewhere)
            else:
                logger.info(
                    "%s now links to step %d: step %d, saved there, is unlisted",
                    path,
                    there.step,
                    pointer.step,
                )
                self._drop(pointer)

    def _when_done(self, handle: SaveHandle, update: Any) -> None:
        """Run ``update`` once ``handle`` is done, on the thread that finished it; waited for
        by ``_wait_saves``."""

        def run(_: SaveHandle) -> None:
            try:
                update()
            except Exception as exc:  # noqa: BLE001 - raised by teardown
                self._pointer_errors.append(exc)
            finally:
                with self._pointing:
                    self._callbacks -= 1
                    self._pointing.notify_all()

        with self._pointing:
            self._callbacks += 1
        handle.add_done_callback(run)

    def _point_committed(self, handle: SaveHandle, path: str, pointer: Pointer) -> None:
        """On the saving thread, once ``handle`` is done: the pointer at ``path`` names its
        save if it committed and Lightning still wants that path."""
        with self._pointing:
            waiting = self._overwrites.get(path, [])
            mine = [i for i, (h, _) in enumerate(waiting) if h is handle]
            if not mine:
                return  # the path was removed meanwhile
            del waiting[: mine[0] + 1]  # saves commit in order: the older ones are done
            if not waiting:
                del self._overwrites[path]
            if handle.committed:
                _pointer.write(path, pointer)

    def _settle(self, handle: SaveHandle, path: str) -> None:
        """Once ``handle`` is done, the pending pointer at ``path`` (if still there): rewritten
        as committed, or removed (a failed or skipped save leaves no pointer naming it)."""
        with self._pointing:
            queued, pending = self._queued.get(path, (None, None))
            if queued is not handle:
                return  # another save took the path since
            del self._queued[path]
            if self._own_pointer_at(path, quiet=True) != pending:
                return  # removed or replaced meanwhile
            if handle.committed:
                _pointer.write(path, dataclasses.replace(pending, pending=False, written_at=None))
            else:
                _pointer.remove(path)

    def _refresh_pending(self) -> None:
        """Keep the pending pointers' ``written_at`` recent while their saves run (a thread,
        started under ``_pointing`` when there is one and ending when there is none)."""
        if self._refresher is not None:
            return

        def refresh(path: str, handle: SaveHandle, pending: Pointer) -> None:
            if handle.done() or self._own_pointer_at(path, quiet=True) != pending:
                return  # settled in a moment; or removed or replaced
            fresh = dataclasses.replace(pending, written_at=time.time())
            _pointer.write(path, fresh)
            self._queued[path] = (handle, fresh)

        def run() -> None:
            try:
                while True:
                    time.sleep(REFRESH_PENDING_S)
                    with self._pointing:
                        if not self._queued:
                            return
                        for path, (handle, pending) in list(self._queued.items()):
                            try:
                                refresh(path, handle, pending)
                            except Exception as exc:  # noqa: BLE001 - the next round tries again
                                logger.warning("%s: pending pointer not refreshed: %s", path, exc)
            finally:
                with self._pointing:
                    self._refresher = None

        self._refresher = threading.Thread(
            target=run, name="ckptstore-lightning-pending", daemon=True
        )
        self._refresher.start()

    def _replaced_by(self, pointer: Pointer) -> list[Pointer]:
        """The saves that go when ``pointer`` is overwritten or removed: its own, and those
        it was written to replace that this process has not unlisted (or found gone)."""
        older = [
            dataclasses.replace(pointer, step=step, save_id=save_id, replaces=())
            for step, save_id in pointer.replaces
            if (step, save_id) not in self._dropped
        ]
        return [dataclasses.replace(pointer, replaces=()), *older]

    def _drop(self, pointer: Pointer) -> None:
        """Unlist ``pointer``'s step if it still holds that save, and sweep in the background."""
        pending = self._pending.pop(pointer.step, None)
        if pending is not None:
            pending.wait()
        store = self.checkpointer.store
        try:
            saved = _pointer.user_save_id(load_manifest(store, pointer.step).user, META_KEY)
        except CheckpointNotFoundError:
            saved = None
        self._dropped.add((pointer.step, pointer.save_id))
        if saved != pointer.save_id:
            logger.info(
                "step %d of %s no longer holds save %s", pointer.step, self.uri, pointer.save_id
            )
            return
        drop_step(store, pointer.step)
        self._paths.pop(pointer.step, None)
        logger.info("removed step %d from %s", pointer.step, self.uri)
        if self._sweeper is None:
            self._sweeper = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-lightning-gc")
        self._sweeps.append(self._sweeper.submit(collect, store, keep_last=None))

    # -- loading ----------------------------------------------------------------------------

    def _load_pointer(self, pointer: Pointer, path: str) -> dict[str, Any]:
        if pointer.pending and pointer.store == self._store_id:
            pointer = self._settled(pointer, path)
        if pointer.store == self._store_id:
            self._check(pointer, path, self.checkpointer.store)
            return self._load_step(self.checkpointer, pointer.step, pointer, path)
        logger.warning(  # the file, not this plugin, chose that store
            "%s points to another store than %s: loading step %d of %s",
            path,
            self.uri,
            pointer.step,
            pointer.store,
        )
        with Checkpointer(pointer.store, storage_options=self._storage_options) as other:
            self._check(pointer, path, other.store)
            return self._load_step(other, pointer.step, pointer, path)

    def _settled(self, pending: Pointer, path: str) -> Pointer:
        """A pointer written as its save started, loaded by a new process: the save it names if
        that committed; else (the job was killed mid-save, as ``ckpt_path="last"`` finds it)
        the newest save committed before it, as Lightning's own IO would have left the file
        before that save."""
        store = self.checkpointer.store
        steps = _steps_once_saved(store, pending, path)
        if pending.step in steps:
            return dataclasses.replace(pending, pending=False, written_at=None)
        earlier = [s for s in steps if s < pending.step]
        if not earlier:  # a pointer to nothing that will ever commit: every restart would fail
            _pointer.remove(path)
            raise CheckpointNotFoundError(
                f"{path} pointed to step {pending.step} of {pending.store}, whose save was "
                "interrupted before it committed, and no earlier step is committed: nothing "
                "to resume; the file is removed, so the next start begins afresh"
            )
        manifest = load_manifest(store, earlier[-1])
        save_id = _pointer.user_save_id(manifest.user, META_KEY) or ""
        global_step = int((manifest.user.get(META_KEY) or {}).get("global_step", earlier[-1]))
        logger.warning(
            "%s names step %d, whose save was interrupted before it committed: loading step %d, "
            "the newest committed before it",
            path,
            pending.step,
            earlier[-1],
        )
        return Pointer(pending.store, earlier[-1], save_id, global_step)

    def _load_step(
        self, checkpointer: Checkpointer, step: int, pointer: Pointer | None = None, path: str = ""
    ) -> dict[str, Any]:
        state: dict[str, Any] = {}
        checkpointer.load(state, step)
        if pointer is not None:  # the step could have been replaced while it loaded
            self._check(pointer, path, checkpointer.store)
        return state

    @staticmethod
    def _check(pointer: Pointer, path: str, store: Store) -> None:
        """Raise unless ``pointer``'s step is committed and holds the save it names."""
        where = f"{path} points to step {pointer.step} of {pointer.store}"
        try:
            manifest = load_manifest(store, pointer.step)
        except CheckpointNotFoundError:
            if pointer.pending:
                raise CheckpointNotFoundError(
                    f"{where}, whose save was interrupted before it committed"
                ) from None
            if not list_steps(store) and not store.list(""):
                raise CheckpointNotFoundError(
                    f"{where}, a store that holds nothing: moved, deleted or mistyped?"
                ) from None
            raise CheckpointNotFoundError(
                f"{where}, which is not committed: its save did not finish or was removed"
            ) from None
        if _pointer.user_save_id(manifest.user, META_KEY) != pointer.save_id:
            raise CheckpointNotFoundError(
                f"{where}, which now holds another save: the save it names "
                f"({pointer.save_id}) was removed"
            )

    def _step_of_word(self, word: Any) -> int:
        if word not in STEP_WORDS:
            return int(word)
        latest = self.checkpointer.latest()
        if latest is None:
            raise CheckpointNotFoundError(f"{self.uri} has no committed step")
        return latest

    def _labelled(self, path: str) -> int:
        """The newest step saved as ``path`` (stores written before pointer files)."""
        for step in list_steps(self.checkpointer.store)[::-1]:
            if self._saved_path(step) == path:
                return step
        raise CheckpointNotFoundError(
            f"there is no checkpoint at {path}, and no step in {self.uri} was saved as it "
            f"(steps: {self._steps_shown()}); pass a pointer file, a step number or 'latest'"
        )

    def _saved_path(self, step: int) -> str:
        if step not in self._paths:
            user = load_manifest(self.checkpointer.store, step).user
            self._paths[step] = str((user.get(META_KEY) or {}).get("path", ""))
        return self._paths[step]

    def _steps_shown(self, shown: int = 8) -> str:
        steps = list_steps(self.checkpointer.store)
        more = f" and {len(steps) - shown} older" if len(steps) > shown else ""
        return (", ".join(map(str, steps[::-1][:shown])) + more) or "none"


def _file_naming(pointer: Pointer, directory: str) -> str | None:
    """A regular file in ``directory`` holding a pointer to ``pointer``'s save (a user moved or
    copied the pointer there), if any."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return directory  # not known: as if named
    for entry in entries:
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_size > _pointer.MAX_BYTES:
                continue  # no pointer: not read
            there = _pointer.load(entry.path)
        except (OSError, CheckpointCorruptError):
            continue
        if there is not None and (there.store, there.step, there.save_id) == (
            pointer.store,
            pointer.step,
            pointer.save_id,
        ):
            return entry.path
    return None


def _torch_checkpoint(path: Any, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    """The torch checkpoint file at ``path`` (one saved before the job used ckptstore), loaded
    as Lightning's own IO loads it; a file that is none is named as such."""
    options = {} if map_location is None else {"map_location": map_location}
    try:
        return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **options)
    except Exception as exc:
        if "was not an allowed global" in str(exc):
            raise  # a torch checkpoint indeed, holding objects: torch says how to allow them
        raise CheckpointCorruptError(
            f"{path} is neither a ckptstore pointer nor a torch checkpoint ({one_line(exc)})"
        ) from exc


def _is_step_word(path: Any) -> bool:
    """Whether ``path`` is a step number, ``"latest"`` or ``"last"`` rather than a file."""
    if isinstance(path, int):
        return not isinstance(path, bool)
    return isinstance(path, str) and (path.isdigit() or path in STEP_WORDS)


def _map_tensors(value: Any, map_location: Any) -> Any:
    """``value`` with its tensors moved as ``torch.load(map_location=...)`` would move tensors
    saved on the CPU (a callable is called as ``fn(tensor, "cpu")``)."""
    if map_location is None:
        return value
    if isinstance(value, torch.Tensor):
        if callable(map_location):
            return map_location(value, "cpu")
        if isinstance(map_location, dict):
            target = map_location.get("cpu")
            return value if target is None else value.to(target)
        return value.to(map_location)
    if isinstance(value, dict):
        return {k: _map_tensors(v, map_location) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, map_location) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, map_location) for v in value)
    return value
