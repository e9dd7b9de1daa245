"""Decode TPOT on the GPU: our engine's decode step vs transformers' eager `generate`.

TPOT here is the wall time of one engine step as the engine runs it for a batch that is only
decoding: building and copying the inputs, the model step, sampling, and the host sync that reads
the tokens back. Random weights of real shapes (speed does not depend on the values); all timings
of one invocation come from one process on one GPU, so compare them as ratios.

    python bench/decode_tpot.py --configs 1b --batch-sizes 1 8 32 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from workers.config import parse_config
from workers.default_model import BENCH_CONFIGS, random_model
from workers.engine import EngineConfig, LLMEngine
from workers.sampling import SamplingParams

PROMPT_LEN = 128


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.nbytes * 20 / (start.elapsed_time(end) / 1e3)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def engine_tpot(model, batch_size: int, steps: int, warmup: int) -> list[float]:
    engine = LLMEngine(model, EngineConfig(max_num_seqs=batch_size, max_model_len=model.max_model_len))
    g = torch.Generator().manual_seed(batch_size)
    for _ in range(batch_size):
        prompt = torch.randint(0, model.cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + warmup + 2, temperature=0.0))
    engine.step()  # prefill (and the first decode)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    return times


def hf_eager_tpot(name: str, batch_size: int, steps: int) -> float:
    """Per-token time of transformers' own `generate` (eager, dynamic cache): (t(1+n) - t(1)) / n."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {k: v for k, v in BENCH_CONFIGS[name].items() if k not in ("model_type", "dtype")}
    cfg = AutoConfig.for_model("llama", **raw)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch_size, PROMPT_LEN), device="cuda")

    def run(new: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(4)
    short = statistics.median(run(1) for _ in range(3))
    long = statistics.median(run(steps + 1) for _ in range(3))
    del hf
    torch.cuda.empty_cache()
    return (long - short) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--hf", action="store_true", help="also time transformers' eager generate")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    bandwidth = copy_bandwidth()
    rows = []
    for name in args.configs:
        cfg = parse_config(BENCH_CONFIGS[name])
        floor_ms = cfg.weight_bytes() / bandwidth * 1e3
        max_len = PROMPT_LEN + args.steps + args.warmup + 8
        model = random_model(name, max_len, "cuda")
        for bs in args.batch_sizes:
            times = engine_tpot(model, bs, args.steps, args.warmup)
            rows.append(dict(config=name, mode="eager", batch_size=bs, tpot_ms_median=statistics.median(times),
                             tpot_ms_p99=percentile(times, 0.99), floor_ms=floor_ms))  # fmt: skip
            print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
        if args.hf:
            for bs in args.batch_sizes:
                ms = hf_eager_tpot(name, bs, 64)
                rows.append(dict(config=name, mode="hf_eager", batch_size=bs, tpot_ms_median=ms, tpot_ms_p99=None,
                                 floor_ms=floor_ms))  # fmt: skip
                print(rows[-1], flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bandwidth_tb_s=bandwidth / 1e12,
                prompt_len=PROMPT_LEN, steps=args.steps)  # fmt: skip
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(markdown(meta, rows))


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"{meta['device']}, torch {meta['torch']}, copy bandwidth {meta['copy_bandwidth_tb_s']:.2f} TB/s, "
        f"prompt {meta['prompt_len']} tokens, {meta['steps']} timed steps",
        "",
        "| config | mode | bs | TPOT median (ms) | TPOT p99 (ms) | floor (ms) | x floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p99 = f"{r['tpot_ms_p99']:.3f}" if r["tpot_ms_p99"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['batch_size']} | {r['tpot_ms_median']:.3f} | {p99} | "
            f"{r['floor_ms']:.3f} | {r['tpot_ms_median'] / r['floor_ms']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
