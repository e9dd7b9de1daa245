"""Tensor parallelism across a replica's ranks: the process group, the step channel from rank 0 and
the follower loop of ranks > 0 (`tp.py`). The sharded layers are `modeling/parallel.py`; the Ray
actor that hosts a rank is `front/shard_worker.py`."""
