"""EngineConfig refuses limits that cannot work, naming the key: built directly (not through
AppConfig, which checks its own), a max_num_seqs of -1 failed inside torch and a negative
max_waiting was taken, shrinking the queue below the batch."""

from __future__ import annotations

import pytest

from workers.serving.engine_config import EngineConfig


@pytest.mark.parametrize(("key", "value"), [("max_num_seqs", 0), ("max_num_seqs", -1), ("max_waiting", -1)])
def test_a_limit_that_cannot_work_is_refused_naming_its_key(key, value):
    with pytest.raises(ValueError, match=f"{key} must be"):
        EngineConfig(**{key: value})


def test_the_smallest_limits_that_work_are_taken():
    config = EngineConfig(max_num_seqs=1, max_waiting=0)
    assert (config.max_num_seqs, config.max_waiting) == (1, 0)
    assert EngineConfig().max_num_seqs is None  # the device's default
