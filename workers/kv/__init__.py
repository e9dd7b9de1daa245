"""The paged KV cache and attention over it: the pool, the attention backends and kernels."""
