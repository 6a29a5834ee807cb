"""Leases: how saves and garbage collection see each other on a store that has no locks.

A lease is a small object a process renews while it works::

    leases/<kind>/<holder>/<seq:012d>.json   {"kind", "holder", "renewed_at", "ttl_s", "host", ...}

``kind`` is ``save`` (one per save in flight, held by its coordinator) or ``gc`` (a sweep of
unreferenced chunks). Objects are write-once, so renewing writes sequence number ``seq + 1`` and then deletes
``seq``; readers take the newest sequence of each holder. Ages are the *store's*: a reader
writes a probe object, and a lease's age is the probe's modification time minus that of the
lease's newest object, both stamped by the store's clock (no host's clock is compared with
another's). A lease older than its ``ttl_s`` is *stale*: its holder died (``kill -9``, a lost
node) or lost the store. The save lease of a process of this machine (same boot, same pid
namespace) that no longer exists is stale at once; a dead gc's lease only once it is older than
its ``settle_s``: by then every delete the gc could have issued has ended (at once on a disk of
this machine, where no request outlives the process that made it).

Both sides write their own lease first and look for the other's second (docs/FORMAT.md gives
the argument), so a gc never deletes a chunk that a live save may reference:

- a save, after acquiring its lease, waits while a live ``gc`` lease exists;
- a gc, after acquiring its lease, sweeps nothing while a live ``save`` lease exists, and holds
  its lease until every delete it issued has ended (a delete abandoned at its deadline may land
  late, see ``Store.settle``).

A holder whose renewals fail for ``ttl_s / 2`` considers its lease lost (a reader judges it
stale only after ``ttl_s``, by the store's clock); a save refuses to commit on a lost lease, a
gc issues no delete on it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import (
    CheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageAccessError,
    StorageError,
)
from ckptstore.store import Store
from ckptstore.store.processes import holder_alive, holder_gone, process_identity

logger = logging.getLogger(__name__)

PREFIX = "leases"
PROBES = f"{PREFIX}/clock"  # a reader's probe objects: their modification time is the store's now
SAVE = "save"
GC = "gc"
DEFAULT_TTL_S = 120.0
MAX_LEASE_TTL_S = 3600.0  # the most a holder may ask for (RetentionOptions.lease_ttl_s)
# A lease claiming a longer ttl or settle time (a crafted one) is unreadable: judged by its age.
MAX_LEASE_S = 4 * MAX_LEASE_TTL_S
MAX_LEASE_BYTES = 64 * 1024
SEQ_DIGITS = 12


class LeaseLostError(StorageError):
    """A lease could not be renewed for long enough that others may consider it stale."""


def _key(kind: str, holder: str, seq: int) -> str:
    return f"{PREFIX}/{kind}/{holder}/{seq:0{SEQ_DIGITS}d}.json"


class Lease:
    """A lease held by this process, renewed by a background thread until ``release()``."""

    def __init__(
        self,
        store: Store,
        kind: str,
        holder: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        info: dict[str, Any] | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self.store = store
        self.kind = kind
        self.holder = holder
        self.ttl_s = ttl_s
        self.info = dict(info or {})
        # A request is issued at most ttl_s / 2 after the renewal before it (``check``) and
        # ends within the store's request budget (retries included).
        self.settle_s = ttl_s / 2 + store.retry.budget_s()
        self._seq = 0
        self._renewed = 0.0  # monotonic time of the last successful write
        self._lapsed = False  # a renewal came more than ttl_s / 2 after the one before
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        return _key(self.kind, self.holder, self._seq)

    def _body(self) -> bytes:
        doc = {
            "kind": self.kind,
            "holder": self.holder,
            "renewed_at": time.time(),
            "ttl_s": self.ttl_s,
            "settle_s": self.settle_s,
            "deleting": False,
            **process_identity(),
            **self.info,
        }
        return json.dumps(doc).encode()

    def acquire(self) -> Lease:
        """Write the lease and start renewing it every ``ttl_s / 4``."""
        t0 = time.monotonic()
        try:
            self.store.put(self.key, self._body())
        except CheckpointError:
            # It may have landed all the same (an error after the write): left there, it would
            # hold gc back while this process lives, for a save that never started. Deleted
            # in the background: a store that timed out the put would double the call's bound.
            threading.Thread(
                target=_delete_quietly, args=(self.store, self.key), daemon=True
            ).start()
            raise
        self._renewed = t0
        self._thread = threading.Thread(
            target=self._keep, name=f"ckptstore-lease-{self.kind}", daemon=True
        )
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except CheckpointError as exc:
                logger.warning("lease %s in %s not renewed: %s", self.key, self.store.uri, exc)

    def renew(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            t0 = time.monotonic()
            old = self.key
            try:
                self.store.put(_key(self.kind, self.holder, self._seq + 1), self._body())
            except ObjectExistsError:
                pass  # an attempt of ours abandoned at its deadline landed: holders are unique
            if time.monotonic() - self._renewed > self.ttl_s / 2:
                self._lapsed = True  # others may have judged it stale meanwhile
            self._seq += 1
            self._renewed = t0
        try:
            self.store.delete(old)
        except CheckpointError as exc:  # readers take the newest sequence anyway
            logger.debug("old lease %s not deleted: %s", old, exc)

    def mark_deleting(self) -> None:
        """Record in the lease (a renewal) that its holder may issue deletes from now on: a gc
        that dies before this is over at once, one that dies after only once ``settle_s`` has
        passed since its last renewal."""
        self.info["deleting"] = True
        self.renew()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless the lease was renewed every ``ttl_s / 2`` since
        it was acquired (a lapse that renewals later recovered from counts too)."""
        if self._lapsed:
            raise LeaseLostError(
                f"lease {self.store.url(self.key)} went unrenewed for over half its ttl "
                f"({self.ttl_s:g}s): garbage collection may have considered this {self.kind} dead"
            )
        age = time.monotonic() - self._renewed
        if age > self.ttl_s / 2:
            raise LeaseLostError(
                f"lease {self.store.url(self.key)} not renewed for {age:.0f}s (ttl "
                f"{self.ttl_s:g}s): garbage collection may consider this {self.kind} dead"
            )

    def release(self) -> None:
        """Stop renewing and delete the lease (a lease that can't be deleted goes stale)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.store.retry.deadline_s() * self.store.retry.attempts)
        with self._lock:
            try:
                self.store.delete(self.key)
            except CheckpointError as exc:
                logger.warning(
                    "lease %s not deleted (it goes stale in %.0fs): %s",
                    self.store.url(self.key),
                    self.ttl_s,
                    exc,
                )

    def abandon(self) -> None:
        """Stop renewing, the lease left in place to go stale in ``ttl_s``, recorded as a save
        whose commit a server may still apply: stale only by its age, even once its process
        is gone (a gc of this machine would otherwise judge it dead at once)."""
        self.info["outcome_unknown"] = True
        try:
            self.renew()
        except CheckpointError as exc:  # the lease as last renewed: its ttl still holds
            logger.warning("lease %s in %s not marked: %s", self.key, self.store.uri, exc)
        self._stop.set()

    def release_when_settled(self, timeout_s: float, outcome_unknown: bool = False) -> None:
        """Release once every request the store abandoned at its deadline that could undo what
        the lease guards has ended (one may still land): a gc lease its deletes, any other its
        puts and deletes; if some still run after ``timeout_s``, the lease is kept, and
        renewed, until they end. ``outcome_unknown``: a server may still apply a put whose
        request ended here (a commit with no answer): then abandoned, not deleted, so gc keeps
        off its chunks for ``ttl_s`` more."""
        ops = ("delete",) if self.kind == GC else ("put", "delete")
        release = self.abandon if outcome_unknown else self.release
        if self.store.settle(timeout_s, ops):
            release()
            return
        logger.warning(
            "%s: requests abandoned at their deadline are still running; %s lease kept until "
            "they end",
            self.store.uri,
            self.kind,
        )

        def release_later() -> None:
            self.store.settle(None, ops)
            release()

        threading.Thread(target=release_later, name="ckptstore-lease-settle", daemon=True).start()


@dataclass
class LeaseInfo:
    """A lease found in the store: its newest object and whether its holder looks alive."""

    kind: str
    holder: str
    key: str
    keys: list[str]  # every sequence object of the holder (the newest last)
    doc: dict[str, Any]
    live: bool
    age_s: float | None = None  # by the store's clock; None: unreadable
    expires_in_s: float | None = None  # live: when it goes stale unless renewed; None: unknown

    @property
    def holder_dead(self) -> bool:
        """Its holder ran on this machine and its process is gone (a gc's lease may still be
        live: deletes it sent may land until its ``settle_s`` has passed)."""
        return holder_gone(self.doc)

    def describe(self) -> str:
        """Who holds it, and for a live one whose holder is dead, why it is still live."""
        who = f"{self.doc.get('host', '?')} pid {self.doc.get('pid', '?')}"
        if not (self.live and self.holder_dead):
            return who
        left = f"{self.expires_in_s:.0f}s" if self.expires_in_s is not None else "a while"
        return f"{who}, whose process is gone (deletes it sent may still land: held {left} more)"


def find_leases(store: Store, kind: str | None = None, now: float | None = None) -> list[LeaseInfo]:
    """Every lease of ``kind`` (all kinds if None) in ``store``, live or stale, judged by
    ``now`` (the store's clock, probed before its listing) if given, else by a probe of its own.

    A lease object that can't be read or parsed counts as live: better to sweep nothing than
    to sweep under a save; it is named in ``ckptstore ls`` for an operator to judge."""
    prefix = f"{PREFIX}/{kind}" if kind else PREFIX
    if not _lease_holders(store, prefix):
        return []
    # The store's now, taken before the listing the leases are judged by: a renewal missing
    # from it landed after the probe, so the age of the renewal before it is not overstated.
    now = store_now(store) if now is None else now
    holders = _lease_holders(store, prefix)
    return list(store.map(lambda item: _read(store, *item, now), holders.items()))


def find_lease(store: Store, kind: str, holder: str) -> LeaseInfo | None:
    """The lease ``holder`` holds, live or stale (judged as ``find_leases`` judges it); None
    where it holds none (released, or never taken)."""
    keys = _lease_holders(store, f"{PREFIX}/{kind}/{holder}/").get((kind, holder))
    if not keys:
        return None
    lease = _read(store, (kind, holder), keys, store_now(store))
    return None if lease.doc.get("error") == "released" else lease


def _lease_holders(store: Store, prefix: str) -> dict[tuple[str, str], list[str]]:
    holders: dict[tuple[str, str], list[str]] = {}
    for key in store.list(prefix):
        parts = key.split("/")
        if len(parts) != 4 or not parts[3].endswith(".json"):
            continue
        holders.setdefault((parts[1], parts[2]), []).append(key)
    return holders


def _delete_quietly(store: Store, key: str) -> None:
    try:
        store.delete(key)
    except CheckpointError as exc:
        logger.debug("failed lease %s not deleted: %s", key, exc)


def store_now(store: Store) -> float:
    """The store's current time: the modification time of a probe object written now (then
    deleted). Where the probe cannot be written (read-only credentials), this host's clock."""
    for tries_left in range(2, -1, -1):
        key = f"{PROBES}/{uuid.uuid4().hex}"
        try:
            store.put(key, b"")
        except ObjectExistsError:
            pass  # an attempt abandoned at its deadline landed: an earlier now is the safe side
        except StorageAccessError as exc:
            logger.debug("%s: no clock probe (%s); ages by this host's clock", store.uri, exc)
            return time.time()
        try:
            return store.modified(key)
        except ObjectNotFoundError:
            # Seen once in a local-store race test and not explained: a new probe is as good.
            if not tries_left:
                raise
        finally:
            try:
                store.delete(key)
            except CheckpointError as exc:  # gc removes old probes
                logger.debug("clock probe %s not deleted: %s", store.url(key), exc)


def stale_probes(store: Store, older_than_s: float, now: float | None = None) -> list[str]:
    """Keys of probe objects older than ``older_than_s`` (their reader died before deleting
    them), by ``now`` as :func:`find_leases`."""
    keys = store.list(PROBES)
    if now is None:
        now = store_now(store) if keys else 0.0

    def old(key: str) -> bool:
        try:
            return now - store.modified(key) > older_than_s
        except ObjectNotFoundError:
            return False

    return [key for key, is_old in zip(keys, store.map(old, keys), strict=True) if is_old]


def _read(store: Store, kind_holder: tuple[str, str], keys: list[str], now: float) -> LeaseInfo:
    kind, holder = kind_holder
    for _ in range(5):
        keys = sorted(keys)
        newest = keys[-1]
        try:
            data = store.get(newest, 0, MAX_LEASE_BYTES + 1)
            age = now - store.modified(newest)
        except ObjectNotFoundError:
            # Renewed (a newer sequence replaced it) or released while we listed: look again.
            keys = store.list(f"{PREFIX}/{kind}/{holder}")
            if not keys:
                return LeaseInfo(kind, holder, newest, [], {"error": "released"}, False)
            continue
        try:
            if len(data) > MAX_LEASE_BYTES:
                raise ValueError(f"over {MAX_LEASE_BYTES} bytes")
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise TypeError(f"a lease is a JSON object, not {type(doc).__name__}")
            lifetime = _lifetime(kind, doc, store.backend.requests_end_with_process)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            # Live for as long as a holder's lease lives unrenewed (better to sweep nothing than
            # to sweep under a save), not for ever: no holder of ours wrote it (puts are whole).
            live = -DEFAULT_TTL_S <= age < DEFAULT_TTL_S
            return LeaseInfo(kind, holder, newest, keys, {"error": f"unreadable: {exc}"}, live)
        # Stamped by the store's clock, as ``now`` is: an object dated over a lifetime ahead
        # of it was not stamped by the store (a crafted or re-dated file), and would never go
        # stale if it counted as live: it is stale, unless its holder is a live process of
        # this machine (a file system whose mtimes come from its writer's fast clock).
        live = -lifetime <= age < lifetime + store.clock_resolution_s
        if age < -lifetime and holder_alive(doc):
            live = True
        if lifetime == 0.0 and sorted(store.list(f"{PREFIX}/{kind}/{holder}"))[-1:] != [newest]:
            # Dead at once, judged on an object its holder may have renewed (a gc marking
            # itself deleting) after our listing and before it died: judge the newer one.
            keys = store.list(f"{PREFIX}/{kind}/{holder}")
            if not keys:
                return LeaseInfo(kind, holder, newest, [], {"error": "released"}, False)
            continue
        expires = lifetime + store.clock_resolution_s - age if live else None
        return LeaseInfo(kind, holder, newest, keys, doc, live, age, expires)
    # Renewed under us five times in a row: its holder is clearly alive.
    return LeaseInfo(kind, holder, newest, keys, {"error": "renewing"}, True)


def _lifetime(kind: str, doc: dict[str, Any], requests_end_with_process: bool) -> float:
    """How old (by the store's clock) the newest object of a lease may be while it is live.

    A save lease: ``ttl_s``, or 0 once its holder is known dead (unless it recorded that its
    commit's outcome is unknown: ``Lease.abandon``). A gc lease: until every
    delete it may have issued has ended (``settle_s``, ``ttl_s`` for a gc that recorded none),
    and no sooner than ``ttl_s`` unless its holder is known dead; on a store whose requests
    end with their process (a disk of this machine), at once when its holder is known dead."""
    ttl = _duration(doc, "ttl_s", None)
    dead = holder_gone(doc)
    if kind != GC:  # a commit whose outcome is unknown may still land after its holder died
        return 0.0 if dead and doc.get("outcome_unknown") is not True else ttl
    settle = _duration(doc, "settle_s", ttl)
    if dead:
        ended = requests_end_with_process or doc.get("deleting") is False
        return 0.0 if ended else settle
    return max(ttl, settle)


def _duration(doc: dict[str, Any], name: str, default: float | None) -> float:
    value = float(doc[name] if default is None else doc.get(name, default))
    if not 0 < value <= MAX_LEASE_S:
        raise ValueError(f"{name} {value} is not a number of seconds in (0, {MAX_LEASE_S:g}]")
    return value


def delete_stale(store: Store, leases: Iterable[LeaseInfo]) -> int:
    """Delete the objects of stale leases; how many were deleted."""
    keys = [k for lease in leases if not lease.live for k in lease.keys]
    list(store.map(store.delete, keys))
    return len(keys)


def wait_for_gc(store: Store, *, timeout_s: float, what: str) -> None:
    """Block while a live gc lease exists in ``store`` (a sweep in progress), at most
    ``timeout_s``; the wait backs off from 50 ms to 2 s between looks, and looks again as soon
    as the first live lease would go stale (a dead gc's, once its deletes have ended)."""
    deadline = time.monotonic() + timeout_s
    next_note = 0.0
    delay = 0.05
    while True:
        live = [lease for lease in find_leases(store, GC) if lease.live]
        if not live:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise StorageError(
                f"{what}: garbage collection by {live[0].describe()} has held {store.uri} for "
                f"over {timeout_s:g}s ({store.url(live[0].key)}); "
                "not saving while it may delete chunks"
            )
        if time.monotonic() >= next_note:  # the first look, then every 30 s
            # A dead gc's wait (up to its settle time, 90 s on S3) stalls saves with nothing
            # to show for it: said at WARNING once, for the operator who wonders why.
            dead = next_note == 0.0 and live[0].holder_dead
            next_note = time.monotonic() + 30.0
            logger.log(
                logging.WARNING if dead else logging.INFO,
                "%s waits for garbage collection by %s in %s to finish%s",
                what,
                live[0].describe(),
                store.uri,
                "; it goes on by itself then (a restart of the job does not make it sooner)"
                if dead
                else "",
            )
        expiries = [lease.expires_in_s for lease in live if lease.expires_in_s is not None]
        soonest = min(expiries) + 0.01 if len(expiries) == len(live) else delay
        time.sleep(max(0.01, min(delay, left, soonest)))
        delay = min(delay * 2, 2.0)


def acquire_save_lease(
    store: Store,
    holder: str,
    *,
    ttl_s: float,
    gc_wait_s: float,
    what: str,
    info: dict[str, Any] | None = None,
) -> Lease:
    """A save's lease of ``store``, taken before the save looks at any stored chunk: written,
    then held while a live gc lease exists (``wait_for_gc``, at most ``gc_wait_s``). From its
    return until it is released no gc deletes a chunk, so chunks found stored then may be
    referenced instead of written again. A wait that fails releases the lease."""
    lease = Lease(store, SAVE, holder, ttl_s=ttl_s, info=info).acquire()
    try:
        wait_for_gc(store, timeout_s=gc_wait_s, what=what)
    except BaseException:
        lease.release()
        raise
    return lease
