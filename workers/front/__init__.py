"""The request side of an engine: streams on an event loop, and the step loop they feed, in a thread,
in a child process of its own (`engine_process.py`) or, with tensor parallelism, in the Ray actor of
rank 0 (`shard_worker.py`). Above `serving/`, beside `protocol.py`."""
