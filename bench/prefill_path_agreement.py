"""Does the prefill attention path decide SmolLM2's answers? Greedy agreement with transformers'
bf16 `generate` (sdpa and eager attention) when graphserve's prefill packs every prompt into one
variable-length flash-attention call (the CUDA default) and when it makes one SDPA call per prompt,
on the prompts of `real_model_agreement.py`. A diagnostic, not a server option.

    python -m bench.prefill_path_agreement --out bench/results/prefill_path_agreement_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import workers.modeling.model as model_module
from bench.real_model_agreement import chat_prompts, ours, transformers_greedy
from workers.modeling.default_model import cache_dir, smollm2_file
from workers.modeling.gguf import converted

MAX_TOKENS = 48


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    checkpoint = converted(smollm2_file(), cache_dir())
    tokenizer, prompts = chat_prompts(checkpoint)
    packed, engine = ours(checkpoint, prompts, MAX_TOKENS, "cuda")
    eos = set(engine.eos_token_ids)
    del engine
    packed_supported = model_module.packed_supported
    model_module.packed_supported = lambda *_: False  # every prefill takes the per-prompt SDPA path
    per_prompt, engine = ours(checkpoint, prompts, MAX_TOKENS, "cuda")
    del engine
    model_module.packed_supported = packed_supported
    sdpa = transformers_greedy(checkpoint, prompts, MAX_TOKENS, "cuda", "sdpa", eos)
    eager = transformers_greedy(checkpoint, prompts, MAX_TOKENS, "cuda", "eager", eos)
    answers = {"packed": packed, "per_prompt": per_prompt, "sdpa": sdpa, "eager": eager}
    pairs = [
        ("packed", "sdpa"),
        ("per_prompt", "sdpa"),
        ("packed", "eager"),
        ("per_prompt", "eager"),
        ("sdpa", "eager"),
        ("packed", "per_prompt"),
    ]
    result = {f"{a}_vs_{b}": sum(x == y for x, y in zip(answers[a], answers[b], strict=True)) for a, b in pairs}
    result["france"] = {k: tokenizer.decode(answers[k][0]) for k in ("packed", "per_prompt", "sdpa")}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
