"""Exceptions raised by ckptstore. Each names the object, step or rank involved."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error ckptstore raises on purpose."""


class RankLostError(CheckpointError):
    """A rank stopped answering the exchanges of a tiered save, load or drain (killed, exited
    after SIGTERM, its node gone): ``lost`` names the ranks whose heartbeat stopped (empty when
    the job's rendezvous store went with them). Raised within
    ``StorageOptions.lost_rank_timeout_s``; the ranks' tier group is then spent, so every later
    tiered save or load of the process fails at once with it: restart the job."""

    def __init__(self, message: str, lost: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost = list(lost or [])

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.lost))


class RanksOutOfStepError(RankLostError):
    """Ranks made different collective calls at once (one rank in ``latest()`` while another
    saves, say): every rank in the exchange fails at once naming both calls, instead of pairing
    collectives that do not match. The ranks' ckptstore group is spent, as after a lost rank."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """Stored bytes do not match what the manifest says (hash, size, header)."""


class PickledValueRefusedError(CheckpointError, ValueError):
    """A value stored pickled (by DCP) that a safe load will not unpickle: torch's weights-only
    unpickler cannot load it. Its bytes are intact; the reader's ``trust_pickled_objects=True``
    loads it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step, or an object a committed step references, does not exist."""


class NoLoadableStepError(CheckpointNotFoundError):
    """A load of the latest step found committed saves and could load none of them (each
    misses data, or with ``healthy=True`` is not healthy). Not "nothing to resume": a job that
    started over would save over those steps."""


class NoHealthyStepError(NoLoadableStepError):
    """A ``healthy=True`` load of the latest step found committed steps and none healthy
    (unhealthy, or health unknown: saved with ``HealthPolicy(scan=False)`` or before health was
    recorded)."""


class PartialLoadError(CheckpointCorruptError):
    """A load failed after bytes of the checkpoint had reached some of the caller's tensors.

    ``written`` lists the state paths of those tensors (e.g. ``model/0.weight``): each may hold
    a mix of the checkpoint's bytes and its previous ones. Nothing else in the state was
    changed: no non-tensor value was set and no ``load_state_dict`` called. ``__cause__`` is
    what made the load fail (a corrupt or missing chunk, a storage error, another rank's
    failure)."""

    def __init__(self, message: str, written: list[str] | None = None) -> None:
        super().__init__(message)
        self.written = list(written or [])

    def __reduce__(self):
        return type(self), (str(self), self.written)


class StepExistsError(CheckpointError, FileExistsError):
    """A step is already committed; steps are write-once."""


class DrainSupersededError(CheckpointError):
    """A save bound for durable storage was not drained there: drains fell behind saves and a
    newer step was drained in its place (its local copies were kept until then)."""


class UnhealthyStepError(CheckpointError):
    """A save whose numbers are unhealthy (NaN or Inf, or a norm jump) was refused
    (``HealthPolicy(on_unhealthy="raise")``), or no healthy step could be loaded."""


class TooLargeForHostError(CheckpointError):
    """A tensor a step declares is larger than the memory this process may take (the host's
    available memory, or what its cgroup's limit leaves): a damaged or hostile index's, or a
    step for a larger host; refused before it is allocated."""


class FormatVersionError(CheckpointError, ValueError):
    """The store was written in a format version this reader does not know."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds a value ckptstore cannot save, or does not match the checkpoint."""


class StorageError(CheckpointError, OSError):
    """A storage request failed after its retries, or the store is unreachable."""

    unanswered: bool = False
    """Set where an attempt of the request got no answer by its deadline: a server may still
    apply it (a put) after the client gave up."""


class ObjectExistsError(StorageError, FileExistsError):
    """A write-once put found the object already there."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist in the store."""


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket a remote store's URI names does not exist."""


class UnsafeObjectError(StorageError):
    """A local store's object that is not a plain file of the store: never followed or opened
    (a hostile or damaged store)."""


class ObjectOutsideRootError(UnsafeObjectError):
    """A local store's object is a link leading out of its root."""


class ObjectNotRegularError(UnsafeObjectError):
    """A local store's object is not a regular file (a FIFO, a device, a socket): opening a FIFO
    would wait for a writer for ever."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage request exceeded its deadline."""


class StorageAccessError(StorageError, PermissionError):
    """Credentials are missing or do not grant access."""


class StorageFullError(StorageError):
    """The store has no room left (``ENOSPC``: no byte or no inode)."""


class CommitUnknownError(StorageError):
    """A step's commit failed ambiguously and reading it back failed too: whether the step is
    committed is unknown until the store answers (``ckptstore ls`` tells)."""


_ONE_LINE_CHARS = 1000


def is_full_store(error: object) -> bool:
    """Whether ``error`` (or what it wraps) is a full store's."""
    for _ in range(8):
        if isinstance(error, StorageFullError):
            return True
        if not isinstance(error, BaseException):
            return False
        error = error.__cause__ or error.__context__
    return False


def no_step_loaded(
    where: str,
    skipped: list[tuple[int, BaseException]],
    passed_over: dict[int, str] | None = None,
) -> CheckpointError:
    """The error of a load that tried steps newest first and loaded none (both front-ends':
    ``Checkpointer.load(fallback=True)``, ``dcp.resume``): every step and why, newest first,
    ``passed_over`` the steps a ``healthy`` load passed over and why; ``NoLoadableStepError``
    when each tried step missed objects, else ``CheckpointCorruptError``."""
    failed = {s: _of_step(s, " ".join(str(e).split()) or type(e).__name__) for s, e in skipped}
    failed.update(passed_over or {})
    every = "; ".join(failed[s] for s in sorted(failed, reverse=True))
    missing = all(isinstance(e, CheckpointNotFoundError) for _, e in skipped)
    found = NoLoadableStepError if skipped or passed_over else CheckpointNotFoundError
    return (found if missing else CheckpointCorruptError)(
        f"no {where} could be loaded, every one failed: {every}"
    )


def _of_step(step: int, why: str) -> str:
    """``why`` named by its step once (an error may name it already)."""
    return why if why.startswith(f"step {step}:") else f"step {step}: {why}"


def same_kind(
    error: BaseException, message: str, fallback: type[CheckpointError] = CheckpointError
) -> CheckpointError:
    """``message`` as an error of ``error``'s class where it is a ``fallback`` (a full disk
    stays ``StorageFullError``), else (or where that class takes other arguments) a
    ``fallback``."""
    if isinstance(error, fallback):
        try:
            return type(error)(message)
        except Exception:  # noqa: BLE001 - an error class with another signature
            pass
    return fallback(message)


def one_line(error: BaseException) -> str:
    """``error`` as one short line for another rank or a log: its type and first line (cut
    at a word past 1000 characters, marked: several ranks' reasons fit, the end says so)."""
    text = str(error).splitlines()[0] if str(error) else ""
    line = f"{type(error).__name__}: {text}"
    if len(line) <= _ONE_LINE_CHARS:
        return line
    return line[:_ONE_LINE_CHARS].rsplit(" ", 1)[0] + " [...]"
