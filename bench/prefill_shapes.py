"""Prefill time for prompt batches whose total length is new vs seen before, without and with the
engine's startup warm-up (`LLMEngine._warm_first_token_path`).

A serving engine prefills whatever arrived since its last step, so the total prompt length changes
from one prefill to the next. Each wave prefills k prompts on a random 1B-shape model: first when
that total length is new to the process, then once more. Phase `cold` builds the engine without the
warm-up (136-token prompts); then the warm-up runs (timed), and phase `warmed` repeats the waves
with 137-token prompts, so every total length is new again.

    python -m bench.prefill_shapes --out bench/results/prefill_shapes_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from workers.modeling.synthetic import random_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

WAVES = (1, 2, 3, 5, 8, 13, 21, 32)


def wave(engine: LLMEngine, k: int, prompt_len: int) -> float:
    """Milliseconds for one engine step that prefills k prompts (and samples their first tokens)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(k):
        engine.add_request([256] + list(range(1, prompt_len)), params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def phase(engine: LLMEngine, prompt_len: int) -> dict:
    rows = [
        {
            "prompts": k,
            "tokens": k * prompt_len,
            "new_length_ms": wave(engine, k, prompt_len),
            "seen_length_ms": wave(engine, k, prompt_len),
        }
        for k in WAVES
    ]
    extra = [r["new_length_ms"] - r["seen_length_ms"] for r in rows]
    return {"prompt_tokens": prompt_len, "waves": rows, "median_new_length_extra_ms": statistics.median(extra)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = random_model("1b", 512, "cuda")
    warm = LLMEngine._warm_first_token_path
    LLMEngine._warm_first_token_path = lambda self: None
    engine = LLMEngine(model, EngineConfig(max_model_len=512, max_num_seqs=32))
    LLMEngine._warm_first_token_path = warm
    results = {"cold": phase(engine, 136)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine._warm_first_token_path()
    torch.cuda.synchronize()
    results["warmup_s"] = time.perf_counter() - t0
    results["warmed"] = phase(engine, 137)
    print(json.dumps(results), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
