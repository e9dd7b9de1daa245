"""GPU side of graphserve: modeling (model, checkpoints), kv (paged cache, attention), graphs
(capture, replay, verification), serving (engine, scheduling, the engine process), tensor_parallel."""
