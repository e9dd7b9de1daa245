"""GPU side of graphserve. Sub-packages, each importing only those after it: front (the request side
of an engine), protocol, serving (engine, scheduling), tensor_parallel, graphs (capture, replay,
verification), model_runner (a model call's inputs and buffers), modeling (model, checkpoints), kv
(paged cache, attention)."""
