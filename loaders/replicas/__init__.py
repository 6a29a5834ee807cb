"""Reads over replicas of one dataset: healthy replicas first, failover, benching, hedged reads.

:class:`ReplicaSet` (``replica_set``) puts together replica health (``health``: each replica's
median latency and errors, benching and probation, which replica an attempt goes to), the read
race (``race``: failover for every request, hedging for data reads, deadlines) and the shard
survey (``survey``: which shards each replica holds, their sizes, compared as a dataset opens).
The package logs as ``loaders.replicas``.
"""

from loaders.replicas.replica_set import ReplicaSet, replica_retry_policy

__all__ = ["ReplicaSet", "replica_retry_policy"]
