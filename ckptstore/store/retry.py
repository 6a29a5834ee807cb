"""How a storage request is retried: the policy, and which errors are worth another attempt."""

from __future__ import annotations

import errno
import os
import random
from dataclasses import dataclass
from typing import Any

_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    errno.EREMOTEIO,
}
# FlexibleChecksumError: an answer whose body does not match the checksum the server sent with
# it (damaged on the way): read again. ClientPayloadError, ContentLengthError, IncompleteRead,
# ResponseStreamingError: a body cut off mid-way (a reset connection); HTTPClientError,
# ResponseParserError: an answer garbled on the way (aiohttp's and botocore's names).
_TRANSIENT_NAME_HINTS = (
    "Timeout", "Connection", "ServerDisconnected", "SlowDown", "Throttl", "FlexibleChecksum",
    "ClientPayloadError", "ContentLengthError", "IncompleteRead", "ResponseStreamingError",
    "HTTPClientError", "ResponseParserError",
)  # fmt: skip
# An S3 server's answer "busy, try later" (throttling, 500, 502, 503, 504): retried until
# the request's deadline, as a store throttling a burst asks. By the server's own code (s3fs
# keeps its error as the cause): the errnos s3fs maps them to also stand for 409 Conflict, and
# a local file system's EBUSY is no server's.
_BUSY_CODES = {
    "SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException",
    "RequestLimitExceeded", "InternalError",
}  # fmt: skip
_BUSY_STATUSES = {500, 502, 503, 504}  # 502, 504: a gateway in front of the store
# Answers to try again: ConditionalRequestConflict (409) is S3's to a create-only put while
# another to the same key is in flight (ranks writing one chunk); again, it is 412 or done.
_RETRY_CODES = {"SlowDown", "Throttling", "RequestTimeout", "ConditionalRequestConflict"}


@dataclass(kw_only=True)
class RetryPolicy:
    """How a request is retried, how long each attempt may take and how long all of them may.

    With the defaults a request to an endpoint that never answers fails after 30 s (three
    attempts of 10 s), a request that fails quickly and transiently is tried up to 5 times, one
    the server answers "busy" (503 SlowDown, 500) for as long as ``total_s`` allows.
    """

    attempts: int = 5
    """Attempts per request, the first included (more while the server says it is busy and
    ``total_s`` is not spent)."""
    base_delay_s: float = 0.05
    """Backoff before the second attempt; doubles each time, with full jitter."""
    max_delay_s: float = 2.0
    """Upper bound of one backoff."""
    timeout_s: float = 10.0
    """Deadline of one attempt of a small request."""
    total_s: float | None = 30.0
    """Deadline of a whole small request: all its attempts, backoffs included, end within this
    (None: only ``attempts`` bounds it). No attempt starts once it has passed, and the last
    one is cut short to end by it."""
    min_bytes_per_s: float = 2 * 2**20
    """Large transfers get ``size / min_bytes_per_s`` more seconds, per attempt and in total."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.timeout_s <= 0:
            raise ValueError(f"RetryPolicy.timeout_s must be > 0, got {self.timeout_s}")
        if self.total_s is not None and self.total_s <= 0:
            raise ValueError(f"RetryPolicy.total_s must be > 0 or None, got {self.total_s}")

    @classmethod
    def within(cls, total_s: float, **kwargs: Any) -> RetryPolicy:
        """The default policy with every request ending within ``total_s`` (large transfers
        get more); an attempt may take the default ``timeout_s`` or ``total_s`` if less."""
        kwargs.setdefault("timeout_s", min(cls.timeout_s, total_s))
        return cls(total_s=total_s, **kwargs)

    def deadline_s(self, nbytes: int = 0) -> float:
        """Deadline of one attempt of a request moving ``nbytes``."""
        return self.timeout_s + nbytes / self.min_bytes_per_s

    def budget_s(self, nbytes: int = 0) -> float:
        """The longest a request moving ``nbytes`` takes, all attempts and backoffs included."""
        extra = nbytes / self.min_bytes_per_s
        if self.total_s is not None:
            return self.total_s + extra
        return self.attempts * (self.timeout_s + extra) + (self.attempts - 1) * self.max_delay_s

    def backoff_s(self, attempt: int) -> float:
        # The exponent capped: a store busy for a long deadline makes a thousand attempts.
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** min(attempt, 30)))


def _chain(exc: BaseException | None):
    """``exc`` and its causes (or contexts), eight at most."""
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1


def _server_answer(exc: BaseException) -> tuple[int, str] | None:
    """The HTTP status and S3 error code of a botocore error's ``response``, if it has one."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status, str(response.get("Error", {}).get("Code", ""))


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, resets, throttling, server errors."""
    for link in _chain(exc):
        if isinstance(link, (FileNotFoundError, FileExistsError, PermissionError)):
            return False
        if isinstance(link, (TimeoutError, ConnectionError)):
            return True
        if isinstance(link, OSError) and link.errno in _TRANSIENT_ERRNOS:
            return True
        name = type(link).__name__
        if name == "NoCredentialsError":
            return False
        if any(hint in name for hint in _TRANSIENT_NAME_HINTS):
            return True
        answer = _server_answer(link)
        if answer is not None:
            status, code = answer
            if status >= 500 or code in _RETRY_CODES:
                return True
    return False


def is_unanswered(exc: BaseException) -> bool:
    """True for a request the client gave up waiting on (a read timeout): the server may
    have it still, and apply it later. Not a connection that never opened (a connect
    timeout, which aiohttp raises as a ``TimeoutError`` too): nothing was sent."""
    links = list(_chain(exc))
    if any("ConnectTimeout" in type(link).__name__ or "ConnectionTimeout" in type(link).__name__
           for link in links):  # fmt: skip
        return False
    return any(isinstance(link, TimeoutError) or "ReadTimeout" in type(link).__name__
               for link in links)  # fmt: skip


def is_busy(exc: BaseException | None) -> bool:
    """True for a server's "busy, try later" (throttling, 5xx): worth retrying for as long as
    the request's deadline allows, not only ``attempts`` times."""
    for link in _chain(exc):
        name = type(link).__name__
        if "SlowDown" in name or "Throttl" in name:
            return True
        answer = _server_answer(link)
        if answer is not None and (answer[0] in _BUSY_STATUSES or answer[1] in _BUSY_CODES):
            return True
    return False


def is_access_error(exc: BaseException) -> bool:
    names = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId"}
    return any(
        isinstance(link, PermissionError) or type(link).__name__ in names for link in _chain(exc)
    )


def is_precondition_failed(exc: BaseException) -> bool:
    """True if ``exc`` (or its cause) is an S3 ``412 PreconditionFailed`` answer."""
    answer = _server_answer(exc.__cause__) if exc.__cause__ is not None else None
    return answer is not None and (answer[1] == "PreconditionFailed" or answer[0] == 412)


def whoami() -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(os.geteuid()).pw_name!r}"
    except (ImportError, KeyError, AttributeError):
        return f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "this user"


def describe(exc: BaseException | None) -> str:
    """``Type: first line of the message`` of ``exc``, and the server's answer (HTTP status
    and S3 error code) where the message lacks it (s3fs maps a 503 SlowDown to an errno)."""
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    shown = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    answer = next(filter(None, map(_server_answer, _chain(exc))), None)
    if answer is not None and answer[0] and not (answer[1] and answer[1] in shown):
        shown += f" (HTTP {answer[0]} {answer[1]})".replace(" )", ")")
    return shown
