"""Decode TPOT on the GPU: our engine's decode step vs transformers' eager `generate`.

TPOT here is the wall time of one engine step as the engine runs it for a batch that is only
decoding: building and copying the inputs, the model step, sampling, and the host sync that reads
the tokens back. Random weights of real shapes (speed does not depend on the values); all timings
of one invocation come from one process on one GPU, so compare them as ratios.

    python bench/decode_tpot.py --configs 1b 8b --compile-configs 1b --hf --out bench/results/decode_h200.json

With --max-model-len and --context it measures what a server configured for long contexts pays
for short ones: for each max_model_len, each live context and each batch size, eager, full graphs
and full graphs + compile, the engine's default paged KV pool and attention backend. The contexts
are written into the pool without running their prefill (decode speed does not depend on the KV
values), so a context of 4096 at batch 128 costs no half-million-token prefill.

    python bench/decode_tpot.py --configs 8b --max-model-len 512 8192 --context 256 4096 \
        --batch-sizes 1 8 32 64 128 256 --out bench/results/decode_long_context_8b_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from policies.dispatch import FallbackReason
from policies.graph_policy import GraphPolicy
from workers.model_runner.step_inputs import DecodeInputs
from workers.modeling.config import parse_config
from workers.modeling.default_model import BENCH_CONFIGS, random_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams, sample

PROMPT_LEN = 128
TENANT_DISABLED = FallbackReason.TENANT_DISABLED


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


def make_engine(model, mode: str, compile: bool, buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> LLMEngine:
    policy = GraphPolicy(mode=mode, compile=compile, decode_batch_buckets=buckets)
    config = EngineConfig(
        max_num_seqs=max(policy.decode_batch_buckets), max_model_len=model.max_model_len, graph_policy=policy
    )
    return LLMEngine(model, config)


def engine_tpot(engine: LLMEngine, batch_size: int, steps: int, warmup: int, denied: int = 0) -> list[float]:
    """Per-step wall times of a decode-only batch; `denied` rows run without graph permission."""
    g = torch.Generator().manual_seed(batch_size)
    seqs = []
    for i in range(batch_size):
        prompt = torch.randint(0, engine.model.cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()
        params = SamplingParams(max_tokens=steps + warmup + 2, temperature=0.0)
        seqs.append(engine.add_request(prompt, params, graph_denial=TENANT_DISABLED if i < denied else None))
    engine.step()  # prefill (and the first decode)
    return timed_steps(engine, seqs, steps, warmup)


def timed_steps(engine: LLMEngine, seqs: list, steps: int, warmup: int) -> list[float]:
    """Wall times (ms) of `steps` engine steps after `warmup` untimed ones; then the sequences end."""
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    for seq in seqs:
        engine.abort(seq.request_id)
    return times


def seeded_decode_batch(engine: LLMEngine, batch_size: int, context: int, max_tokens: int) -> list:
    """batch_size sequences already at `context` positions (prompt of context - 1, one output token),
    their pages allocated and handed to the device as a prefill would, without running one."""
    g = torch.Generator().manual_seed(batch_size + context)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model.cfg.vocab_size
    seqs = [
        engine.add_request(torch.randint(0, vocab, (context - 1,), generator=g).tolist(), params)
        for _ in range(batch_size)
    ]
    while engine.scheduler.waiting:  # admitted over as many calls as the step budget takes
        assert engine.scheduler.admit() or engine.scheduler.chunks, "the KV pool cannot hold this batch"
    engine.cache.set_pages(engine.scheduler.take_edits())
    for seq in seqs:  # as if prefilled whole (no chunk is left for the engine to prefill)
        seq.prefill_start = seq.prefill_end = seq.length
        seq.in_prefill = False
        seq.output_ids.append(int(torch.randint(0, vocab, (1,), generator=g)))
    engine.scheduler.prefilling.clear()
    engine.scheduler.chunks = []
    return seqs


def long_context_tpot(engine: LLMEngine, batch_size: int, context: int, steps: int, warmup: int) -> list[float]:
    return timed_steps(engine, seeded_decode_batch(engine, batch_size, context, steps + warmup + 2), steps, warmup)


def long_context(args: argparse.Namespace, bandwidth: float) -> dict:
    """The long-context matrix (see the module docstring); one row per measurement."""
    rows, engines = [], []
    buckets = tuple(sorted(set(args.batch_sizes)))
    for name in args.configs:
        cfg = parse_config(BENCH_CONFIGS[name])
        for max_model_len in args.max_model_len:
            model = random_model(name, max_model_len, "cuda")
            for mode, compiled in [("eager", False), ("full", False), ("full", True)]:
                t0 = time.perf_counter()
                policy = GraphPolicy(mode=mode, compile=compiled, decode_batch_buckets=buckets)
                engine = LLMEngine(
                    model, EngineConfig(max_num_seqs=max(buckets), max_model_len=max_model_len, graph_policy=policy)
                )
                status = engine.status()
                engines.append(
                    dict(
                        config=name,
                        max_model_len=max_model_len,
                        mode=mode,
                        compile=compiled,
                        startup_s=time.perf_counter() - t0,
                        compile_s=engine.runner.compile_s,
                        attention_backend=status.attention_backend,
                        memory_mb=status.memory_mb,
                        kv_cache=status.kv_cache,
                        buckets=status.buckets,
                    )
                )
                print({k: v for k, v in engines[-1].items() if k != "buckets"}, flush=True)
                capacity = engine.scheduler.blocks.capacity_tokens
                for context in args.context:
                    for bs in args.batch_sizes:
                        span = context + args.steps + args.warmup + 2
                        if span > max_model_len or bs * (span + engine.cache.page_size) > capacity:
                            continue
                        times = long_context_tpot(engine, bs, context, args.steps, args.warmup)
                        live_kv = bs * context * engine.model.kv_bytes_per_token()
                        rows.append(
                            dict(
                                config=name,
                                max_model_len=max_model_len,
                                context_len=context,
                                batch_size=bs,
                                mode=mode,
                                compile=compiled,
                                tpot_ms_median=statistics.median(times),
                                tpot_ms_p99=percentile(times, 0.99),
                                floor_ms=(cfg.weight_bytes() + live_kv) / bandwidth * 1e3,
                                tokens_per_s=bs / statistics.median(times) * 1e3,
                            )
                        )
                        print(rows[-1], flush=True)
                del engine
                torch.cuda.empty_cache()
            del model
            torch.cuda.empty_cache()
    return {"rows": rows, "engines": engines}


def long_context_markdown(meta: dict, rows: list[dict]) -> str:
    """TPOT per (config, mode, context, batch size), max_model_len side by side, and their ratio."""
    lines = [
        f"{meta['device']}, torch {meta['torch']}, copy bandwidth {meta['copy_bandwidth_tb_s']:.2f} TB/s, "
        f"{meta['steps']} timed steps; floor = (weights + live KV) / copy bandwidth",
        "",
    ]
    lengths = sorted({r["max_model_len"] for r in rows})
    head = " | ".join(f"mml {m} (ms)" for m in lengths)
    lines += [
        f"| config | mode | context | bs | {head} | ratio | p99 at {lengths[-1]} | floor (ms) | x floor |",
        "|---|---|---|---|" + "---|" * (len(lengths) + 4),
    ]
    keyed = {
        (r["config"], r["mode"], r["compile"], r["context_len"], r["batch_size"], r["max_model_len"]): r for r in rows
    }
    for key in sorted({k[:5] for k in keyed}, key=lambda k: (k[0], k[1], k[2], k[3], k[4])):
        got = [keyed.get((*key, m)) for m in lengths]
        last = got[-1] or next(r for r in got if r)
        cells = " | ".join(f"{r['tpot_ms_median']:.3f}" if r else "-" for r in got)
        ratio = f"{got[-1]['tpot_ms_median'] / got[0]['tpot_ms_median']:.2f}" if got[0] and got[-1] else "-"
        mode = key[1] + (" +compile" if key[2] else "")
        lines.append(
            f"| {key[0]} | {mode} | {key[3]} | {key[4]} | {cells} | {ratio} | {last['tpot_ms_p99']:.3f} | "
            f"{last['floor_ms']:.3f} | {last['tpot_ms_median'] / last['floor_ms']:.2f} |"
        )
    return "\n".join(lines)


def step_breakdown(engine: LLMEngine, steps: int = 100) -> dict[str, float]:
    """Where one full-graph bs-1 step goes: each phase timed on the host with a device sync after it."""
    seq = engine.add_request(list(range(PROMPT_LEN)), SamplingParams(max_tokens=steps + 10, temperature=0.0))
    engine.step()
    runner = engine.runner
    phases: dict[str, list[float]] = {"load_inputs": [], "replay": [], "sample_and_read": [], "whole_step": []}
    for _ in range(steps):
        batch = DecodeInputs.of([seq])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.model_runner.load(batch, 1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        logits = runner._replays[1]()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        sample(logits[:1], [seq.params], [seq.seed], [0])[0].item()
        t3 = time.perf_counter()
        engine.step()
        t4 = time.perf_counter()
        for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[name].append(value * 1e3)
    engine.abort(seq.request_id)
    return {name: statistics.median(values) for name, values in phases.items()}


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
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(4)
    short = statistics.median(run(1) for _ in range(3))
    long = statistics.median(run(steps + 1) for _ in range(3))
    return (long - short) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--hf", action="store_true", help="also time transformers' eager generate")
    ap.add_argument("--modes", nargs="+", default=["eager", "piecewise", "full"])
    ap.add_argument("--compile-configs", nargs="*", default=[], help="configs to also run with compile: true")
    ap.add_argument("--max-model-len", nargs="*", type=int, default=[], help="the long-context matrix (see above)")
    ap.add_argument("--context", nargs="*", type=int, default=[256, 4096])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    bandwidth = copy_bandwidth()
    if args.max_model_len:
        meta = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            copy_bandwidth_tb_s=bandwidth / 1e12,
            steps=args.steps,
        )
        result = {"meta": meta, **long_context(args, bandwidth)}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(long_context_markdown(meta, result["rows"]))
        return
    rows, captures, breakdowns = [], [], []

    def record(name, mode, bs, times, floor_ms, **extra):
        rows.append(
            dict(
                config=name,
                mode=mode,
                batch_size=bs,
                tpot_ms_median=statistics.median(times),
                tpot_ms_p99=percentile(times, 0.99),
                floor_ms=floor_ms,
                **extra,
            )
        )
        print(rows[-1], flush=True)

    for name in args.configs:
        cfg = parse_config(BENCH_CONFIGS[name])
        floor_ms = cfg.weight_bytes() / bandwidth * 1e3
        model = random_model(name, PROMPT_LEN + args.steps + args.warmup + 8, "cuda")
        variants = [(m, False) for m in args.modes]
        if name in args.compile_configs:
            variants.append(("full", True))
        for mode, compiled in variants:
            t0 = time.perf_counter()
            engine = make_engine(model, mode, compiled, tuple(sorted(set(args.batch_sizes))))
            runner = engine.runner
            captures.append(
                dict(
                    config=name,
                    mode=mode,
                    compile=compiled,
                    startup_s=time.perf_counter() - t0,
                    compile_s=runner.compile_s,
                    buckets=runner.report(),
                    capture_s_total=sum(r.capture_s for r in runner.records.values()),
                    memory_mb_total=sum(r.memory_mb for r in runner.records.values()),
                )
            )
            print({k: v for k, v in captures[-1].items() if k != "buckets"}, flush=True)
            extra = {"compile": compiled} if mode == "full" else {}
            for bs in args.batch_sizes:
                record(name, mode, bs, engine_tpot(engine, bs, args.steps, args.warmup), floor_ms, **extra)
            if mode == "full":
                breakdowns.append(dict(config=name, compile=compiled, **step_breakdown(engine)))
                print(breakdowns[-1], flush=True)
            if mode == "full" and not compiled:
                # The cost of a per-request graph denial: one of 8 rows eager beside a replay of 7.
                record(
                    name,
                    mode,
                    8,
                    engine_tpot(engine, 8, args.steps, args.warmup, denied=1),
                    floor_ms,
                    denied_rows=1,
                    **extra,
                )
            del engine, runner
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
        if args.hf:
            for bs in args.batch_sizes:
                ms = hf_eager_tpot(name, bs, 64)
                rows.append(
                    dict(
                        config=name,
                        mode="hf_eager",
                        batch_size=bs,
                        tpot_ms_median=ms,
                        tpot_ms_p99=None,
                        floor_ms=floor_ms,
                    )
                )
                print(rows[-1], flush=True)
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_bandwidth_tb_s=bandwidth / 1e12,
        prompt_len=PROMPT_LEN,
        steps=args.steps,
    )
    result = {"meta": meta, "rows": rows, "captures": captures, "step_breakdown_bs1": breakdowns}
    Path(args.out).write_text(json.dumps(result, indent=1))
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
        mode = r["mode"] + (" +compile" if r.get("compile") else "")
        mode += " (1 of 8 rows denied)" if r.get("denied_rows") else ""
        lines.append(
            f"| {r['config']} | {mode} | {r['batch_size']} | {r['tpot_ms_median']:.3f} | {p99} | "
            f"{r['floor_ms']:.3f} | {r['tpot_ms_median'] / r['floor_ms']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
