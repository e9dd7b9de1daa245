"""The benchmark commands the docs give run as written: each is `python -m bench.NAME` from the
repository root (a file path, `python bench/NAME.py`, fails with "No module named 'bench'" outside
the GPU machine's PYTHONPATH, since `bench` is not an installed package), names a module that
exists, and the report a benchmark writes records its command in the same form."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.py"))]


def test_documented_benchmark_commands_are_modules_that_exist():
    as_files, modules = [], set()
    for path in DOCUMENTED:
        text = path.read_text()
        as_files += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"python3? bench/\w+\.py", text)]
        modules.update(re.findall(r"python3? -m bench\.([a-z_0-9]+)", text))
    assert as_files == []
    assert {"serve_load", "structured_output", "decode_tpot"} <= modules
    assert [m for m in sorted(modules) if not (ROOT / "bench" / f"{m}.py").is_file()] == []


def test_a_benchmark_runs_as_a_module_from_the_repository_root():
    done = subprocess.run(
        [sys.executable, "-m", "bench.mask_cost", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--tokenizer" in done.stdout


def test_the_report_records_the_command_as_it_was_started(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(name="bench.x")))
    assert report.invocation() == "python -m bench.x"
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--out", "r.json"])
    assert report.invocation() == "python bench/x.py"
