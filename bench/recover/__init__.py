"""``ckptbench recover``: time back to a loaded state after a failure, from node-local and peer
copies (tiers) vs DCP's ``load`` from durable storage, in one run.

N ranks run on this machine as gloo processes, simulated as nodes of ``--ranks-per-node`` ranks
each (``Checkpointer(node_rank=rank // ranks_per_node)``, one local directory per node under
``--local-root``). Each rank holds a deterministic state (``--size`` split over the ranks, in
``--tensors`` float32 tensors each, seeded by rank and step).

1. The save job saves ``--repeat`` fresh states twice per step, alternating which goes first:
   with tiers (``local_dir``, ``peer_copies=1``, ``durable_every=1``: every save is in the
   durable store too) and without (a plain ``Checkpointer`` on a sibling prefix of the durable
   store). Each save starts with no save in flight (the last one's copies and drain finished)
   and the staging memory reserved ahead, so ``save()``'s blocked time is its own. The last
   state is also saved once with DCP's own ``FileSystemWriter`` (``FsspecWriter`` on S3) to
   another sibling prefix. The processes then exit without closing their Checkpointers
   (``os._exit`` after ``ckpt.wait()``): the job is killed, every save committed.
2. The last node's local directory is wiped (a replaced node).
3. A fresh job restores, ``--repeat`` rounds, wiping that node again before each: with tiers
   (a new ``Checkpointer``, then ``load``: the time from before the ``Checkpointer`` is built
   until the state is loaded) and with DCP's ``load`` and its own reader from the durable store,
   alternating which goes first. Every rank checks its state against the saved one; a
   mismatch fails the run (exit 1). The durable store's reads during the tiered restore are
   counted by its ``StoreCounters``, chunk objects apart from the rest (``counting``).

``--frontend dcp`` runs the same flow through ``torch.distributed.checkpoint`` and
``ckptstore.dcp`` instead of ``Checkpointer`` (same ranks, nodes, states, wipes, counting and
durable store options):

1. Each rank saves ``--repeat`` states with ``dcp.async_save(state, storage_writer=writer,
   checkpoint_id=step)`` twice per step, alternating which goes first: ``StoreWriter(durable,
   local_dir=<node dir>, durable_every=1, peer_copies=1, node_rank=rank // ranks_per_node)``
   (tiers: each rank's local copy also goes to the rank at its position on the next node) and
   a plain ``StoreWriter`` on a sibling prefix (no tiers). The blocked time is the time until
   ``async_save`` returns (the state copied into the writer's staging buffer and the save
   handed to its thread: what the training loop waits for); the future's ``result()`` is then
   awaited outside that timing, before the next barrier, so each save starts with none in
   flight, and the time until it returned is the time to committed (with tiers: committed
   locally, copied to the peer and, ``durable_every=1``, committed to the durable store).
   Before the timed saves each writer makes one untimed warm-up save, of step 0 (older than
   every timed step, so no load uses it; the stores keep it, and their stored bytes count it):
   it allocates the writer's staging buffer (``StoreWriter``'s pool holds one, state-sized,
   reused by every later save; the ``Checkpointer`` flow reserves it with ``reserve`` instead,
   which ``StoreWriter`` does not offer), makes its gloo groups (with tiers the peer topology
   too) and does DCP's first-call work, so no timed save allocates or sets up (the pool's
   allocation count is recorded per save to show it). Then DCP's ``FileSystemWriter``
   (``FsspecWriter`` on S3) saves the last state with a synchronous ``dcp.save``, and the job
   is killed.
2. As above, the last node's local directory is wiped before each restore round.
3. Each round ``dcp.load`` runs with ``StoreReader(durable, local_dir=<node dir>)`` (tiers),
   ``StoreReader(durable)`` (no tiers) and DCP's own reader of the baseline, in alternating
   order, each timed from before its reader is built until the state is loaded, and each
   rank's state checked bit for bit (a mismatch fails the run, exit 1). Durable reads of both
   ``StoreReader`` loads are counted as above; ``reader.last_load`` gives the tiered load's
   bytes per tier.

``--damage chunk`` damages the last node less: instead of wiping its directory, each round
flips one byte in the middle of one chunk of each of its ranks' own copies of the newest step
(first putting back the chunk the round before flipped, which that round's load removed from
the tier). Each of those ranks then loads its own copy and reads that one chunk from durable
storage (the step is there: ``durable_every=1``), its other chunks from its copy: the
"nearest holder that verifies" of issue 36. The report's ``as_expected`` checks exactly one
durable chunk request per damaged rank and none elsewhere; no point-to-point bandwidth is
measured in this mode.

With one node wiped, the tiered load takes the newest step from the local tiers: the wiped
node's ranks restore their copies from their holders on the next node (``last_load.source`` is
``"peer"``), the other ranks read their own local copies, and no rank reads a chunk from durable
storage (the target "0 durable chunk bytes", met or not as the durable store counted it).

The modules: ``plan`` (what every rank does, its state), ``frontend`` (a front-end as the bench
drives it, and the save and restore jobs every front-end runs through it), ``with_checkpointer``
and ``with_dcp`` (the two front-ends), ``counting`` (the durable store's reads by its
``StoreCounters``, chunks apart), ``ranks`` (the gloo processes of a job), ``run`` (one run),
``summary`` and ``table`` (the report, the same for every front-end), ``cli`` (the flags).
"""

from bench._gloo import RankFailed
from bench.recover import cli
from bench.recover.cli import add_parser, run
from bench.recover.plan import FRONTENDS, RecoverPlan
from bench.recover.ranks import run_job
from bench.recover.run import run_recover
from bench.recover.summary import summarize
from bench.recover.table import print_table

__all__ = [
    "FRONTENDS",
    "RankFailed",
    "RecoverPlan",
    "add_parser",
    "cli",
    "print_table",
    "run",
    "run_job",
    "run_recover",
    "summarize",
]
