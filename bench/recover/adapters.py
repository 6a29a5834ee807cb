"""The front-ends the bench drives, by their ``--frontend`` name."""

from __future__ import annotations

from bench.recover.frontend import Frontend
from bench.recover.with_checkpointer import CheckpointerFrontend
from bench.recover.with_dcp import DcpFrontend

ADAPTERS: dict[str, Frontend] = {fe.name: fe for fe in (CheckpointerFrontend(), DcpFrontend())}


def frontend_of(frontend: str | Frontend) -> Frontend:
    """The front-end named ``frontend`` (or ``frontend`` itself)."""
    return frontend if isinstance(frontend, Frontend) else ADAPTERS[frontend]
