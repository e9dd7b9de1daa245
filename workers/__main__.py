"""`python -m workers generate ...`: run one prompt through the engine and print the completion."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from policies.lora_slots import LoraLimits
from workers.front.async_engine import AsyncEngine
from workers.modeling.config import CheckpointError
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import InvalidRequest, SamplingParams


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("--model", help="Hugging Face checkpoint directory (default: the embedded tiny Llama)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--lora", help="a PEFT LoRA adapter directory to decode with")
    gen.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank its slot holds")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token ids and text")
    return parser.parse_args(argv)


async def generate(args: argparse.Namespace) -> dict:
    lora = LoraLimits(max_loras=1, max_lora_rank=args.max_lora_rank) if args.lora else None
    engine, tokenizer = LLMEngine.from_config(
        EngineConfig(model=args.model, max_num_seqs=1, max_model_len=args.max_model_len, device=args.device, lora=lora)
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    prompt_ids = tokenizer(args.prompt)["input_ids"]
    runner = AsyncEngine(engine, tokenizer).start()
    try:
        ids, text, reason = [], "", None
        adapter = (Path(args.lora).name, args.lora) if args.lora else None
        async for event in runner.submit(prompt_ids, params, adapter=adapter):
            ids += event.token_ids
            text += event.text
            reason = event.finish_reason
    finally:
        runner.shutdown()
    return {"prompt_token_ids": prompt_ids, "completion_token_ids": ids, "text": text, "finish_reason": reason}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = asyncio.run(generate(args))
    except (InvalidRequest, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
