"""Decode TPOT on the GPU: our engine's decode step vs transformers' eager `generate`.

TPOT here is the wall time between consecutive engine steps of a batch that is only decoding, the
steps run back to back as a replica runs them: building and copying the inputs, the model step,
sampling, and reading the tokens back, with async scheduling (the default) the host's work on one
step overlapping the device's on the next. Random weights of real shapes (speed does not depend on
the values); all timings of one invocation come from one process on one GPU, so compare them as
ratios.

    python -m bench.decode_tpot --configs 1b 8b --compile-configs 1b --hf --out bench/results/decode_h200.json

With --max-model-len and --context it measures what a server configured for long contexts pays
for short ones: for each max_model_len, each live context and each batch size, eager, full graphs
and full graphs + compile (--variants), the engine's default paged KV pool and attention backend.
The contexts are written into the pool without running their prefill (decode speed does not depend
on the KV values), so a context of 4096 at batch 128 costs no half-million-token prefill.

    python -m bench.decode_tpot --configs 8b --max-model-len 512 8192 --context 256 4096 \
        --batch-sizes 1 8 32 64 128 256 --out bench/results/decode_long_context_8b_h200.json

--context-mix adds batches whose rows have different live contexts (`mixed_contexts`: lognormal,
mean ~1,175 tokens; bimodal, half 128 and half 7,000), made by a real prefill through the engine;
an empty --context leaves the uniform ones out. Every row has its x_floor: TPOT over (weights +
the batch's live KV) at the measured copy bandwidth. --merge-into adds the rows to a results file
of earlier runs (a row of the same config, max_model_len, context, batch size and variant is
replaced) and rewrites its markdown table.

    python -m bench.decode_tpot --configs 8b --max-model-len 8192 --variants full+compile --context \
        --context-mix lognormal --batch-sizes 32 64 128 --out bench/results/decode_mixed_8b_lognormal_h200.json \
        --merge-into bench/results/decode_long_context_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from statistics import NormalDist

import torch

from policies.dispatch import FallbackReason
from policies.graph_policy import GraphPolicy
from workers.model_runner.step_inputs import DecodeInputs
from workers.modeling.config import parse_config
from workers.modeling.synthetic import BENCH_CONFIGS, random_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams
from workers.serving.sampling_ops import sample

PROMPT_LEN = 128
TENANT_DISABLED = FallbackReason.TENANT_DISABLED
VARIANTS = {"eager": ("eager", False), "full": ("full", False), "full+compile": ("full", True)}
# The log-normal mix: median 750 tokens, sigma 1.0 (of the log), clipped to [32, 6000]: mean ~1,175.
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA, LOGNORMAL_CLIP = 750, 1.0, (32, 6000)
BIMODAL = (128, 7000)


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
    """Wall times (ms) between the returns of `steps` engine steps run back to back, as a replica
    runs them, after `warmup` untimed ones; then the sequences end. Not one step between device
    synchronizations: with async scheduling a step returns once it has launched, so that timed the
    launch alone (the host waits for a step's tokens in the step after it)."""
    for _ in range(warmup):
        engine.step()
    times = []
    last = time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    torch.cuda.synchronize()
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


def mixed_contexts(mix: str, batch_size: int) -> list[int]:
    """Live contexts of a mixed batch, in a seeded random order. lognormal: the batch_size quantiles
    of the log-normal above (not random draws, so every batch size has the mix's mean, ~1,175);
    bimodal: half BIMODAL[0] tokens, half BIMODAL[1]."""
    if mix == "lognormal":
        normal, (low, high) = NormalDist(), LOGNORMAL_CLIP
        quantiles = (math.exp(LOGNORMAL_SIGMA * normal.inv_cdf((i + 0.5) / batch_size)) for i in range(batch_size))
        contexts = [min(high, max(low, round(LOGNORMAL_MEDIAN * q))) for q in quantiles]
    else:
        contexts = [BIMODAL[i % 2] for i in range(batch_size)]
    order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(batch_size))
    return [contexts[i] for i in order.tolist()]


def prefilled_batch(engine: LLMEngine, contexts: list[int]) -> list:
    """One sequence per context, prefilled for real through the engine (prompts of context - 1
    random tokens, chunked by the step budget) and stepped until none has prompt left; the ones done
    first decode meanwhile, so they are a few tokens past their context. Seeded by the contexts, so
    two mixes of one batch size share no prompt prefix (the prefix cache would skip its prefill)."""
    g = torch.Generator().manual_seed(sum(contexts))
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=engine.scheduler.max_model_len, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(torch.randint(0, vocab, (n - 1,), generator=g).tolist(), params) for n in contexts]
    while engine.scheduler.waiting or any(s.in_prefill for s in seqs):
        engine.step()
    return seqs


def mixed_row(engine: LLMEngine, mix: str, batch_size: int, args: argparse.Namespace) -> dict | None:
    """TPOT of a batch of `mix` contexts, or None when the KV pool cannot hold it. Its live KV is
    taken at the first timed step (after the warmup)."""
    contexts = mixed_contexts(mix, batch_size)
    budget, page = engine.config.max_num_batched_tokens, engine.cache.page_size
    prefill_steps = -(-sum(contexts) // max(1, budget - batch_size)) + 1
    growth = prefill_steps + args.warmup + args.steps + 2 * page
    scheduler = engine.scheduler
    if max(contexts) + growth > scheduler.max_model_len:
        return None
    if sum(contexts) + batch_size * growth > scheduler.blocks.capacity_tokens:
        return None
    seqs = prefilled_batch(engine, contexts)
    for _ in range(args.warmup):
        engine.step()
    live = [s.length for s in seqs]
    times = timed_steps(engine, seqs, args.steps, 0)
    return dict(
        context_len=statistics.mean(live),
        context_min=min(live),
        context_max=max(live),
        live_tokens=sum(live),
        times=times,
    )


def tpot_row(base: dict, bs: int, mix: str, context_len: float, floor_ms: float, times: list[float], **extra) -> dict:
    row = dict(
        base,
        context_mix=mix,
        context_len=context_len,
        batch_size=bs,
        tpot_ms_median=statistics.median(times),
        tpot_ms_p99=percentile(times, 0.99),
        floor_ms=floor_ms,
        x_floor=statistics.median(times) / floor_ms,
        tokens_per_s=bs / statistics.median(times) * 1e3,
        **extra,
    )
    print(row, flush=True)
    return row


def engine_rows(engine: LLMEngine, weight_bytes: int, base: dict, args: argparse.Namespace, bandwidth: float) -> list:
    """One engine's rows: each uniform context, then each mix, at each batch size that fits."""
    rows = []
    kv_per_token = engine.model.kv_bytes_per_token()
    capacity = engine.scheduler.blocks.capacity_tokens
    max_model_len = engine.scheduler.max_model_len

    def floor_ms(live_tokens: int) -> float:
        return (weight_bytes + live_tokens * kv_per_token) / bandwidth * 1e3

    for context in args.context:
        for bs in args.batch_sizes:
            span = context + args.steps + args.warmup + 2
            if span > max_model_len or bs * (span + engine.cache.page_size) > capacity:
                continue
            times = long_context_tpot(engine, bs, context, args.steps, args.warmup)
            rows.append(tpot_row(base, bs, "uniform", context, floor_ms(bs * context), times))
    for mix in args.context_mix:
        for bs in args.batch_sizes:
            measured = mixed_row(engine, mix, bs, args)
            if measured is None:
                print(f"skipped: {mix} at batch {bs} does not fit the KV pool or max_model_len", flush=True)
                continue
            live_tokens = measured.pop("live_tokens")
            rows.append(tpot_row(base, bs, mix, floor_ms=floor_ms(live_tokens), live_tokens=live_tokens, **measured))
    return rows


def long_context(args: argparse.Namespace, bandwidth: float) -> dict:
    """The long-context matrix (see the module docstring); one row per measurement."""
    rows, engines = [], []
    buckets = tuple(sorted(set(args.batch_sizes)))
    for name in args.configs:
        cfg = parse_config(BENCH_CONFIGS[name])
        for max_model_len in args.max_model_len:
            model = random_model(name, max_model_len, "cuda")
            for mode, compiled in (VARIANTS[v] for v in args.variants):
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
                        kv_cache=dataclasses.asdict(status.kv_cache),
                        buckets=status.buckets,
                    )
                )
                print({k: v for k, v in engines[-1].items() if k != "buckets"}, flush=True)
                base = dict(config=name, max_model_len=max_model_len, mode=mode, compile=compiled)
                rows += engine_rows(engine, cfg.weight_bytes(), base, args, bandwidth)
                del engine
                torch.cuda.empty_cache()
            del model
            torch.cuda.empty_cache()
    return {"rows": rows, "engines": engines}


def context_label(row: dict) -> int | str:
    """A uniform row's context length, or a mixed row's mix and its mean live context."""
    mix = row.get("context_mix", "uniform")
    return row["context_len"] if mix == "uniform" else f"{mix} (mean {row['context_len']:.0f})"


def long_context_title(sources: list[str], rows: list[dict]) -> str:
    """The long-context table's heading: which contexts its rows have, and the runs they come from."""
    mixed = any(r.get("context_mix", "uniform") != "uniform" for r in rows)
    contexts = "short and mixed live contexts" if mixed else "short live contexts"
    return f"# Decode TPOT at long max_model_len, {contexts} ({', '.join(sources)})"


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
        (r["config"], r["mode"], r["compile"], context_label(r), r["batch_size"], r["max_model_len"]): r for r in rows
    }
    order = lambda k: (k[0], k[1], k[2], isinstance(k[3], str), k[3], k[4])  # noqa: E731
    for key in sorted({k[:5] for k in keyed}, key=order):
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


def row_key(row: dict) -> tuple:
    """What a row measured: a later run's row of the same key replaces it. A mixed row's key is its
    mix, not its measured mean context."""
    mix = row.get("context_mix", "uniform")
    context = row["context_len"] if mix == "uniform" else None
    return (row["config"], row["max_model_len"], mix, context, row["batch_size"], row["mode"], row["compile"])


def merge_into(path: Path, meta: dict, result: dict, source: str) -> None:
    """This run's rows and engines added to the results file at `path` (its rows of the same key
    replaced, the others kept), this run's meta listed under meta.merged_runs, and the markdown table
    beside it (.md) rewritten from all its rows."""
    merged = json.loads(path.read_text())
    new_keys = {row_key(r) for r in result["rows"]}
    merged["rows"] = [r for r in merged["rows"] if row_key(r) not in new_keys] + result["rows"]
    merged["engines"] = merged.get("engines", []) + result["engines"]
    merged["meta"].setdefault("merged_runs", []).append(dict(meta, source=source))
    path.write_text(json.dumps(merged, indent=1))
    sources = merged["meta"].get("sources", []) + [r["source"] for r in merged["meta"]["merged_runs"]]
    markdown = [long_context_title(sources, merged["rows"]), "", long_context_markdown(merged["meta"], merged["rows"])]
    path.with_suffix(".md").write_text("\n".join(markdown) + "\n")


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
    ap.add_argument("--context-mix", nargs="*", default=[], choices=["lognormal", "bimodal"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--merge-into", type=Path, help="a long-context results file to add this run's rows to")
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
        if args.merge_into:
            merge_into(args.merge_into, meta, result, Path(args.out).name)
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
