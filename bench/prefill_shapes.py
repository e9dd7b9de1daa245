"""Prefill time for prompt batches whose shape is new vs seen before, with the prefill attention
backends graphserve uses and with cuDNN attention allowed as well (torch's default on this GPU).

A serving engine prefills whatever arrived since its last step, so the total prompt length changes
from one prefill to the next. Each wave here prefills k prompts of 136 tokens on a random 1B-shape
model: first when that k is new, then once more with the same k.

    python bench/prefill_shapes.py --out bench/results/prefill_shapes_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

import workers.model
from workers.default_model import random_model
from workers.engine import EngineConfig, LLMEngine
from workers.sampling import SamplingParams

PROMPT = [256] + list(range(1, 136))
WAVES = (1, 2, 3, 5, 8, 13, 21, 32)
BACKENDS = {"graphserve": workers.model.PREFILL_ATTENTION,
            "cudnn_allowed": [SDPBackend.CUDNN_ATTENTION, *workers.model.PREFILL_ATTENTION]}  # fmt: skip


def wave(engine: LLMEngine, k: int) -> float:
    """Milliseconds for one engine step that prefills k prompts (and samples their first tokens)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(k):
        engine.add_request(PROMPT, params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = random_model("1b", 512, "cuda")
    results = {}
    for name, backends in BACKENDS.items():
        workers.model.PREFILL_ATTENTION = backends
        engine = LLMEngine(model, EngineConfig(max_model_len=512, max_num_seqs=32))
        rows = [{"prompts": k, "new_shape_ms": wave(engine, k), "seen_shape_ms": wave(engine, k)} for k in WAVES]
        extra = [r["new_shape_ms"] - r["seen_shape_ms"] for r in rows]
        results[name] = {"waves": rows, "median_new_shape_extra_ms": statistics.median(extra)}
        print(name, json.dumps(results[name]), flush=True)
        del engine
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prompt_tokens": len(PROMPT)}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
