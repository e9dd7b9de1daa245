"""The paged KV cache and attention over it: the pool, its sizing, the attention backends and kernels."""
