"""The save half: settings and staging (``engine``) and one save walked step by step, the
commit protocol (``session``). ``Checkpointer`` and ``ckptstore.dcp.StoreWriter`` decide when
each step runs and how ranks exchange what they wrote."""

from ckptstore.save.engine import DEFAULT_GC_WAIT_S, SaveEngine, Staged, check_background_nice
from ckptstore.save.session import RankWritten, SaveSession

__all__ = [
    "SaveEngine",
    "SaveSession",
    "RankWritten",
    "Staged",
    "DEFAULT_GC_WAIT_S",
    "check_background_nice",
]
