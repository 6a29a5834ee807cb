"""ckptstore.Checkpointer: round trips, ranks, crashes, preemption, partial loads, RNG."""
