"""GPU side of graphserve: model, checkpoints, KV cache, sampling, the engine."""
