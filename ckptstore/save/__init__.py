"""The save half: staging (``engine``), one save walked step by step (``session``) and the
commit protocol under it (``protocol``). ``Checkpointer`` and ``ckptstore.dcp.StoreWriter``
decide when each step runs and how ranks exchange what they wrote."""

from ckptstore.save.engine import SaveEngine, Staged, check_background_nice
from ckptstore.save.protocol import DEFAULT_GC_WAIT_S, begin_save, commit_step, retain
from ckptstore.save.session import RankWritten, SaveSession

__all__ = [
    "SaveEngine",
    "SaveSession",
    "RankWritten",
    "Staged",
    "DEFAULT_GC_WAIT_S",
    "begin_save",
    "commit_step",
    "retain",
    "check_background_nice",
]
