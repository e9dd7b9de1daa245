"""The prefill-beside-decode benchmark on CPU (a tiny checkpoint, no streams): a prefill engine in a
thread of its own on the decode engine's weights gives each long prompt the first token it gets
alone (the benchmark fails otherwise), and every mode the CPU can run is a row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def test_prefills_beside_decode_steps_give_the_tokens_they_give_alone(tmp_path):
    out = tmp_path / "pbd.json"
    command = [sys.executable, "-m", "bench.prefill_beside_decode", "--config", "tiny", "--device", "cpu"]
    command += ["--max-model-len", "512", "--streams", "4", "--long-tokens", "200", "--decode-tokens", "64"]
    command += ["--steps", "20", "--warmup", "5", "--green-sms", "16", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["alone", "same_priority", "low_priority", "green16"]
    assert rows["green16"] == {"config": "tiny", "mode": "green16", "skipped": "no CUDA"}
    for mode in ("same_priority", "low_priority"):
        assert rows[mode]["prefills"] >= 1
        assert rows[mode]["first_tokens"] == rows["alone"]["first_tokens"][: len(rows[mode]["first_tokens"])]
        assert rows[mode]["decode_step_ms_p50"] > 0
