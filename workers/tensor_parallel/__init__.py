"""Tensor parallelism: sharded layers, the step channel from rank 0, the shard worker."""
