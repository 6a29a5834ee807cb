"""PyTorch Distributed Checkpoint (DCP) storage backend on top of a ckptstore store.

``StoreWriter`` / ``StoreReader`` implement DCP's ``StorageWriter`` / ``StorageReader`` so that
``torch.distributed.checkpoint.save / async_save / load`` write and read the ckptstore format:
content-addressed, verified chunks, one index per rank and a commit manifest of kind ``dcp``
that also references DCP's ``Metadata``, stored as JSON (nothing on a load path is unpickled).
DCP's planner does the rest (deduplication of replicated items, resharding of DTensor /
ShardedTensor state at load time).

A save goes through these calls (all ranks unless noted)::

    reset                (only when DCP is given a checkpoint_id) this save's step, or a store
                         URI that replaces the store
    prepare_global_plan  (coordinator) pick the step (this save's, else the writer's ``step``,
                         else the next free one: after the latest committed step and after
                         every step this writer planned) and a fresh attempt id; take the
                         save lease; hand step and attempt to every rank in SavePlan.storage_data
    stage                (dcp.async_save only, on the caller's thread) copy the state's tensors
                         into the writer's pooled staging buffer and hand DCP that copy
    write_data           the items as tensors -> their staged chunks -> rank index;
                         each WriteResult carries (rank, tensor index) plus the index's ObjectRef
    finish               (coordinator) encode the Metadata as JSON, write it, commit the
                         manifest (the step becomes visible), release the lease, retention

Each DCP item becomes one entry of its rank's index: ``RankIndex.items`` maps the item's storage
key (``fqn`` or ``fqn@o0,o1,...`` for a shard at offset ``(o0, o1, ...)``) to its position in
``RankIndex.tensors``. Non-tensor items (``BYTE_IO``, pickled by DCP) are stored as ``uint8``
tensors of shape ``[n]`` in the same chunks (readers load them weights-only).
``Metadata.storage_data`` maps each DCP ``MetadataIndex`` to the ``(rank, tensor index)`` pair
that locates it.

Modules: ``writer`` (``StoreWriter``), ``stager`` (its ``AsyncStager`` half), ``reader``
(``StoreReader``), ``resume`` (a load of the newest step that loads: corrupt ones skipped and
quarantined), ``load`` (a whole step in one process), ``ids``
(checkpoint ids). What the core reads of a DCP step lives in the core, which never imports this
package: ``ckptstore.metadata`` (the Metadata as JSON, and old steps' pickled Metadata through an
allowlist), ``ckptstore.format.storage_key`` (item keys), ``ckptstore.step_reader`` (one
process's ``StorageReader`` of a step, which ``StoreReader`` extends; pickled values loaded
weights-only).
"""

from ckptstore.dcp.load import load_full_state_dict
from ckptstore.dcp.reader import StoreReader
from ckptstore.dcp.resume import resume
from ckptstore.dcp.writer import StoreWriter
from ckptstore.format import storage_key

__all__ = ["StoreWriter", "StoreReader", "load_full_state_dict", "resume", "storage_key"]
