import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` without CUDA (by marker: a parameter id like `gpu` must not count)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
