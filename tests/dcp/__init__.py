"""torch.distributed.checkpoint through ckptstore.dcp, and torch's private names."""
