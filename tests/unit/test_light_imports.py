"""The processes that do not run the model import no torch when they start: the ingress, the
controller and a replica (whose engine process does). A replica that imported torch with its module
came up seconds later, and only then started its engine process (bench/results/startup_cpu.md)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "triton", "safetensors")


@pytest.mark.parametrize(
    "module", ["app", "app.ingress", "app.replica", "app.controller", "app.failover", "workers.protocol"]
)
def test_a_serving_module_imports_no_torch(module):
    probe = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "", f"importing {module} imported {done.stdout.strip()}"


def test_the_builder_is_still_found_as_app_deployment():
    probe = "import app; print(app.deployment.__module__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "app.builder"
