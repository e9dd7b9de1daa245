"""Prefix caching: time to first token of a request whose long prefix is cached, against the same
request with nothing cached, and a multi-turn chat whose growing history is cached turn by turn.

1. TTFT: a request of a `--prefix-tokens` prefix plus a `--suffix-tokens` suffix of its own, after
   another request with that prefix has run (cached) and with a prefix never seen (uncached), on
   the same engine (caching on, warm), median of `--repeats` pairs.
2. Multi-turn: `--conversations` chats of `--turns` turns sharing a system prompt; each turn sends
   the history so far plus a new user message, all conversations' turn together; the answers join
   the history. Per turn: the prefix-cache hit rate (cached prompt tokens / prompt tokens) and the
   median TTFT, with caching on and off.

TTFT is what the engine gives a client: from adding the request to the moment the step loop hands
its first token out, right after the prefill that sampled it (before that step's decode).
`--cached-attention flash` keeps flash attention for every prefill over a cached context, to
compare with the paged kernel the engine picks for a few tokens over a long one
(`policies/cached_prefill.py`). Random weights of real shapes
(`1b`, `8b`; `tiny`: the embedded tiny model's shape), in-process, one GPU.

    python -m bench.prefix_cache --configs 1b 8b --out bench/results/prefix_cache_h200.json
    python -m bench.prefix_cache --configs tiny --device cpu --repeats 2 --out /tmp/prefix_cache_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.report import write_report
from policies.graph_policy import GraphPolicy
from workers.kv import prefill_attention
from workers.modeling.checkpoint import load_model
from workers.modeling.model import LlamaModel
from workers.modeling.synthetic import random_model, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

SYSTEM_TOKENS = 256  # the multi-turn chats' shared system prompt
USER_TOKENS = 48  # each turn's new user message
ANSWER_TOKENS = 32  # each turn's answer (generated, then part of the history)


def bench_model(name: str, max_model_len: int, device: str) -> LlamaModel:
    if name != "tiny":
        return random_model(name, max_model_len, device)
    path = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny", tiny_hf_config(261), None, seed=0)
    return load_model(path, max_model_len, device)


def make_engine(model: LlamaModel, caching: bool, max_num_seqs: int, compile: bool) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=model.max_model_len,
        graph_policy=GraphPolicy(compile=compile),
        enable_prefix_caching=caching,
    )
    return LLMEngine(model, config)


def sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def ttfts(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list]:
    """Submit the prompts together and step to the end: each one's TTFT (ms: when its first token
    is handed out, as the step loop hands a prefill's first tokens out) and its Sequence."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync(engine)
    start = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}

    def record(events: list) -> None:
        now = time.perf_counter()
        for e in events:
            if e.token_ids:
                first.setdefault(e.request_id, (now - start) * 1e3)

    while engine.has_work():
        record(engine.step(record))
    return [first[s.request_id] for s in seqs], seqs


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def ttft_row(name: str, engine: LLMEngine, prefix_tokens: int, suffix_tokens: int, repeats: int) -> dict:
    rng, vocab = random.Random(0), engine.model.cfg.vocab_size
    cached, uncached = [], []
    for i in range(repeats + 1):  # the first pair warms up, untimed
        prefix = random_tokens(rng, prefix_tokens, vocab)
        (cold,), _ = ttfts(engine, [prefix + random_tokens(rng, suffix_tokens, vocab)], 2)
        (warm,), (seq,) = ttfts(engine, [prefix + random_tokens(rng, suffix_tokens, vocab)], 2)
        assert seq.cached_tokens >= prefix_tokens - engine.cache.page_size, "the prefix was not reused"
        if i:
            uncached.append(cold)
            cached.append(warm)
    c, u = statistics.median(cached), statistics.median(uncached)
    return {"config": name, "prefix_tokens": prefix_tokens, "ttft_ms_cached": c, "ttft_ms_uncached": u, "ratio": c / u}


def multi_turn(engine: LLMEngine, conversations: int, turns: int) -> list[dict]:
    """Per turn: mean prompt tokens, hit rate and median TTFT of the conversations' requests."""
    rng, vocab = random.Random(1), engine.model.cfg.vocab_size
    system = random_tokens(rng, SYSTEM_TOKENS, vocab)
    histories = [list(system) for _ in range(conversations)]
    out = []
    for turn in range(1, turns + 1):
        prompts = [h + random_tokens(rng, USER_TOKENS, vocab) for h in histories]
        times, seqs = ttfts(engine, prompts, ANSWER_TOKENS)
        histories = [p + s.output_ids for p, s in zip(prompts, seqs)]
        out.append(
            {
                "turn": turn,
                "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                "hit_rate": sum(s.cached_tokens for s in seqs) / sum(len(p) for p in prompts),
                "ttft_ms_median": statistics.median(times),
            }
        )
    return out


def run_config(name: str, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    history = SYSTEM_TOKENS + args.turns * (USER_TOKENS + ANSWER_TOKENS)
    max_model_len = max(args.max_model_len, args.prefix_tokens + args.suffix_tokens + 8, history + 8)
    model = bench_model(name, max_model_len, args.device)
    on = make_engine(model, True, max(args.max_num_seqs, args.conversations), args.compile)
    row = ttft_row(name, on, args.prefix_tokens, args.suffix_tokens, args.repeats)
    with_cache = multi_turn(on, args.conversations, args.turns)
    del on  # its KV pool goes before the next engine sizes its own from free memory
    free_device_memory(args.device)
    without = make_engine(model, False, max(args.max_num_seqs, args.conversations), args.compile)
    without = multi_turn(without, args.conversations, args.turns)
    turns = [
        {
            "config": name,
            "turn": a["turn"],
            "prompt_tokens_mean": a["prompt_tokens_mean"],
            "hit_rate": a["hit_rate"],
            "ttft_ms_cached": a["ttft_ms_median"],
            "ttft_ms_uncached": b["ttft_ms_median"],
        }
        for a, b in zip(with_cache, without, strict=True)
    ]
    del model
    free_device_memory(args.device)
    return row, turns


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def markdown(meta: dict, rows: list[dict], turns: list[dict]) -> str:
    lines = [
        f"# Prefix caching: TTFT with a cached {meta['prefix_tokens']}-token prefix",
        "",
        f"{meta['device']}, torch {meta['torch']}; suffix {meta['suffix_tokens']} tokens, median of "
        f"{meta['repeats']} pairs; page {meta['page_size']} tokens; cached attention: {meta['cached_attention']}; "
        f"max_num_seqs {meta.get('max_num_seqs', 16)}, compile {meta.get('compile', False)}, "
        f"max_model_len {meta.get('max_model_len', 'the prompts need')}",
        "",
        "| config | prefix tokens | TTFT cached (ms) | TTFT uncached (ms) | cached / uncached (target <= 0.25) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['prefix_tokens']} | {r['ttft_ms_cached']:.2f} | {r['ttft_ms_uncached']:.2f} | "
            f"{r['ratio']:.2f} |"
        )
    lines += [
        "",
        f"## Multi-turn: {meta['conversations']} conversations x {meta['turns']} turns "
        f"(system {SYSTEM_TOKENS}, user {USER_TOKENS}, answer {ANSWER_TOKENS} tokens a turn)",
        "",
        "| config | turn | prompt tokens (mean) | hit rate | TTFT cached (ms) | TTFT uncached (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for t in turns:
        lines.append(
            f"| {t['config']} | {t['turn']} | {t['prompt_tokens_mean']:.0f} | {t['hit_rate']:.1%} | "
            f"{t['ttft_ms_cached']:.2f} | {t['ttft_ms_uncached']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b"], choices=["tiny", "1b", "8b"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="as the server's GPU default: its decode buckets (up to it) also run short prefills as rows",
    )
    ap.add_argument(
        "--cached-attention",
        choices=["rule", "flash"],
        default="rule",
        help="flash: never the paged kernel for a prefill over a cached context (the engine's rule picks otherwise)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="as the serving benchmarks' (raised to what the prompts need): it sizes the block table the steps read",
    )
    ap.add_argument("--compile", action="store_true", help="compile the decode step, as the GPU defaults do")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.cached_attention == "flash":
        prefill_attention.paged_prefill_pays = lambda tokens, context_lens: False
    rows, turns = [], []
    for name in args.configs:
        row, per_turn = run_config(name, args)
        rows.append(row)
        turns += per_turn
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    meta = {
        "device": device,
        "torch": torch.__version__,
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "repeats": args.repeats,
        "conversations": args.conversations,
        "turns": args.turns,
        "page_size": EngineConfig().kv_page_size,
        "cached_attention": args.cached_attention,
        "max_num_seqs": args.max_num_seqs,
        "compile": args.compile,
        "max_model_len": args.max_model_len,
    }
    write_report(args.out, {"meta": meta, "ttft": rows, "multi_turn": turns}, markdown(meta, rows, turns))


if __name__ == "__main__":
    main()
