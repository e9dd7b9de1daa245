"""The CPU integration tests (real Ray Serve, real openai client; helpers in helpers.py).

The whole directory is skipped cleanly when Ray Serve, the openai client or an httpx-compatible
HTTP client cannot be imported (in CI they are installed, so these tests run there).
"""

import importlib.util

import pytest

pytest.importorskip("ray.serve", reason="the integration tests need ray[serve]")
pytest.importorskip("openai", reason="the integration tests need the openai client")
if importlib.util.find_spec("httpx") is None and importlib.util.find_spec("httpx2") is None:
    pytest.skip("the integration tests need httpx (or httpx2)", allow_module_level=True)
