"""`python -m workers generate`: the JSON it prints matches the engine run in-process, and bad
input exits 2 with a readable error instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.engine_fixtures import Tiny, load_tiny
from workers.__main__ import main
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def run_cli(tiny: Tiny, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAPHSERVE_CACHE": str(tiny.cache), "CUDA_VISIBLE_DEVICES": "", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-m", "workers", *args], cwd=ROOT, env=env, capture_output=True, timeout=100)
    # decoded by hand: text=True would turn a '\r' the model emitted into '\n'
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


@pytest.fixture(scope="module")
def hello_json(tiny) -> dict:
    proc = run_cli(tiny, "generate", "--prompt", "Hello", "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generate_json_matches_in_process_engine(tiny, hello_json, monkeypatch):
    """The CLI's --json output has the prompt ids (BOS included), 5 completion ids (unless stopped),
    their text and finish reason, all equal to the same greedy request run in-process."""
    out = hello_json
    assert {"prompt_token_ids", "completion_token_ids", "text", "finish_reason"} <= set(out)

    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tiny.cache))
    engine, tokenizer = LLMEngine.from_config(EngineConfig(max_num_seqs=1, max_model_len=2048, device="cpu"))
    prompt = tokenizer("Hello")["input_ids"]
    assert prompt[0] == tokenizer.bos_token_id and len(prompt) == 6
    seq = engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0))
    while engine.has_work():
        engine.step()

    assert out["prompt_token_ids"] == prompt
    assert out["completion_token_ids"] == seq.output_ids
    assert out["finish_reason"] == seq.finish_reason
    if seq.finish_reason == "length":
        assert len(out["completion_token_ids"]) == 5
    assert out["text"] == tokenizer.decode(seq.output_ids, skip_special_tokens=True)


def test_generate_plain_prints_text(tiny, hello_json):
    """Without --json the CLI prints just the completion text."""
    plain = run_cli(tiny, "generate", "--prompt", "Hello", "--max-tokens", "5")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == hello_json["text"] + "\n"


def test_missing_model_exits_2_with_clear_error(tiny):
    """--model pointing nowhere exits with status 2 and one line naming the path, no traceback."""
    proc = run_cli(tiny, "generate", "--model", "/nonexistent", "--prompt", "Hello", "--max-tokens", "5", "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and "/nonexistent" in proc.stderr
    assert "not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [["--max-tokens", "0"], ["--temperature", "-1"], ["--top-p", "0"]])
def test_invalid_sampling_args_exit_2(tiny, monkeypatch, capsys, args):
    """Out-of-range sampling flags are reported as errors (exit 2), not tracebacks."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tiny.cache))
    assert main(["generate", "--prompt", "Hi", "--device", "cpu", "--max-model-len", "64", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")


def test_prompt_too_long_exits_2(tiny, monkeypatch, capsys):
    """A prompt over --max-model-len is an error naming max_model_len, exit 2."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tiny.cache))
    assert main(["generate", "--prompt", "x" * 40, "--device", "cpu", "--max-model-len", "16"]) == 2
    assert "max_model_len=16" in capsys.readouterr().err


def test_generate_with_a_lora_adapter_decodes_what_the_engine_does_with_it(tiny, tmp_path, monkeypatch):
    """--lora PATH decodes with a PEFT adapter: the same tokens as the engine in-process with that
    adapter, other tokens than without it; an adapter above --max-lora-rank exits 2 naming `r`."""
    from policies.lora_slots import LoraLimits
    from tests.lora_adapters import adapter_for

    path = str(adapter_for(tiny.model_dir, tmp_path / "ad", seed=5, r=8, lora_alpha=64, target_modules="all-linear"))
    proc = run_cli(tiny, "generate", "--prompt", "Hello", "--max-tokens", "8", "--json", "--lora", path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tiny.cache))
    config = EngineConfig(max_num_seqs=1, max_model_len=2048, device="cpu", lora=LoraLimits(1, 8))
    engine, _ = LLMEngine.from_config(config)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    seqs = [engine.add_request(out["prompt_token_ids"], params, adapter=a) for a in (("ad", path), None)]
    while engine.has_work():
        engine.step()
    assert out["completion_token_ids"] == seqs[0].output_ids != seqs[1].output_ids
    small = run_cli(tiny, "generate", "--prompt", "Hello", "--lora", path, "--max-lora-rank", "4")
    assert small.returncode == 2 and "r: rank 8 is above max_lora_rank 4" in small.stderr
