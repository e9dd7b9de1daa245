"""Can a long prompt's prefill run beside the decode steps instead of inside them, and at what cost
to each? The measurement that decides whether to build it (docs/design.md, "Chunked prefill": no
schedule that runs prefill and decodes one after the other meets both of chunked prefill's
targets; running them at once on the GPU is what escapes that bound).

Engine `decode` keeps `--streams` sequences decoding through full CUDA graphs on a stream of the
highest priority; engine `prefill`, on the same weights with a KV pool of its own, prefills
`--long-tokens`-token prompts back to back (a first token each) in a thread of its own, on a
second stream. Modes: each alone; the prefill on a stream of the same priority; of the lowest
priority; and confined to a CUDA green context of each of `--green-sms` SM counts (where this
torch and driver have them) with the lowest priority the decode stream does not share. Per mode: the decode step's
wall time (median and p99 over `--steps` steps, from one `step()` return to the next) against the
decode alone, and the prefill's wall time per prompt against the prefill alone. The targets of
the chunked-prefill issue, read per mode: the decode step's p99 within 1.5x of alone (the running
streams' inter-token latency) and the prefill within 1.2x of alone (the long prompt's TTFT).

Every prompt's first token is checked against the same prompt's alone (greedy, same weights), so
a mode that computed something else fails rather than timing it.

    python -m bench.prefill_beside_decode --config 1b --out bench/results/prefill_beside_decode_h200.json
    python -m bench.prefill_beside_decode --config tiny --device cpu --max-model-len 512 --streams 4 \\
        --long-tokens 200 --decode-tokens 64 --steps 20 --warmup 5 --modes alone same_priority \\
        --out /tmp/prefill_beside_decode_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import threading
import time

import torch

from bench.chunked_prefill import p
from bench.prefix_cache import bench_model, random_tokens, sync
from bench.report import write_report
from policies.graph_policy import GraphPolicy
from workers.modeling.model import LlamaModel
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

MODES = ("alone", "same_priority", "low_priority", "green")
GREEN_CONTEXTS: list = []  # kept for the process's life
GIL_SWITCH_S = 1e-4  # two Python threads launch kernels: neither holds the other off for 5 ms (the default)


def streams(device: str, green_sms: list[int]) -> dict[str, object]:
    """The streams each mode runs on (None: the current one, on CPU). The decode stream has the
    highest priority; `greenN` is the stream of a green context of N SMs, or the reason there is none."""
    if device != "cuda":
        return {"decode": None, "same_priority": None, "low_priority": None} | {
            f"green{n}": "no CUDA" for n in green_sms
        }
    low, high = torch.cuda.Stream.priority_range()
    out: dict[str, object] = {
        "decode": torch.cuda.Stream(priority=high),
        "same_priority": torch.cuda.Stream(priority=high),
        "low_priority": torch.cuda.Stream(priority=low),
    }
    for n in green_sms:
        try:
            from torch.cuda.green_contexts import GreenContext

            context = GreenContext.create(num_sms=n, device_id=torch.cuda.current_device())
            GREEN_CONTEXTS.append(context)  # its streams die with it
            out[f"green{n}"] = context.Stream()
        except Exception as e:  # noqa: BLE001 - an older torch or driver: the mode is reported as not run
            out[f"green{n}"] = f"{type(e).__name__}: {e}"
    return out


def on(stream: object) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def decode_engine(model: LlamaModel, args: argparse.Namespace) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=args.streams,
        max_model_len=model.max_model_len,
        kv_cache_tokens=max(model.max_model_len, args.streams * (args.short_tokens + args.decode_tokens + 64)),
        graph_policy=GraphPolicy(compile=False, decode_batch_buckets=(args.streams,)),
        enable_prefix_caching=False,
    )
    return LLMEngine(model, config)


def prefill_engine(model: LlamaModel, args: argparse.Namespace) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=2,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=args.prefill_budget,
        kv_cache_tokens=2 * model.max_model_len,
        graph_policy=GraphPolicy(compile=False, decode_batch_buckets=(1,)),
        enable_prefix_caching=False,
    )
    return LLMEngine(model, config)


def prefill_one(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """(wall ms, first token) of one prompt's prefill, steps until it has its token."""
    start = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return (time.perf_counter() - start) * 1e3, seq.output_ids[0]


def decode_steps(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> list[float]:
    """Step walls (ms) of `--steps` steps of `--streams` decoding sequences, after `--warmup`."""
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    seqs = [engine.add_request(random_tokens(rng, args.short_tokens, vocab), params) for _ in range(args.streams)]
    walls, last = [], None
    for i in range(args.warmup + args.steps):
        engine.step()
        now = time.perf_counter()
        if i > args.warmup:
            walls.append((now - last) * 1e3)
        last = now
    for seq in seqs:
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
    return walls


def run_mode(
    mode: str, engines: tuple[LLMEngine, LLMEngine], prompts: list[list[int]], args: argparse.Namespace, lanes: dict
) -> dict:
    """Decode steps with prompts prefilling beside them on `lanes[mode]`'s stream, back to back
    until the decode steps end; `alone` runs each by itself."""
    decode, prefill = engines
    rng = random.Random(1)
    row: dict = {"config": args.config, "mode": mode}
    if mode == "alone":
        with on(lanes["decode"]):
            walls = decode_steps(decode, args, rng)
        with on(lanes["same_priority"]):
            timed = [prefill_one(prefill, p) for p in prompts]
    else:
        lane = lanes[mode]
        if isinstance(lane, str):
            return {**row, "skipped": lane}
        timed, done, failure = [], threading.Event(), []

        def prefill_beside() -> None:
            try:
                with on(lane):
                    while not done.is_set():
                        timed.append(prefill_one(prefill, prompts[len(timed) % len(prompts)]))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                failure.append(e)

        thread = threading.Thread(target=prefill_beside, name=f"prefill-{mode}")
        with on(lanes["decode"]):
            thread.start()
            try:
                walls = decode_steps(decode, args, rng)
            finally:
                done.set()
                thread.join()
        if failure:
            raise failure[0]
    sync(decode)
    row["decode_step_ms_p50"] = statistics.median(walls)
    row["decode_step_ms_p99"] = p(walls, 0.99)
    row["prefill_ms_p50"] = statistics.median(t for t, _ in timed) if timed else None
    row["prefills"] = len(timed)
    row["first_tokens"] = [token for _, token in timed[: len(prompts)]]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b", choices=["tiny", "1b", "8b"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--short-tokens", type=int, default=136)
    ap.add_argument("--decode-tokens", type=int, default=1024, help="each decoding sequence's max_tokens")
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=4, help="distinct long prompts, cycled")
    ap.add_argument("--prefill-budget", type=int, default=8192, help="the prefill engine's max_num_batched_tokens")
    ap.add_argument("--green-sms", nargs="+", type=int, default=[16, 32, 66], help="a green mode per SM count")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.modes[0] != "alone":
        ap.error("--modes must start with alone: every other mode is read against it")
    sys.setswitchinterval(GIL_SWITCH_S)
    torch.manual_seed(0)
    model = bench_model(args.config, args.max_model_len, args.device)
    lanes = streams(args.device, args.green_sms)
    with on(lanes["decode"]):
        decode = decode_engine(model, args)
    prefill = prefill_engine(model, args)
    rng = random.Random(0)
    prompts = [random_tokens(rng, args.long_tokens, model.cfg.vocab_size) for _ in range(args.prompts)]
    modes = [
        name for mode in args.modes for name in ([f"green{n}" for n in args.green_sms] if mode == "green" else [mode])
    ]
    rows = [run_mode(mode, (decode, prefill), prompts, args, lanes) for mode in modes]
    alone = rows[0]
    for row in rows:
        if "skipped" in row:
            continue
        got = row["first_tokens"]
        if got != alone["first_tokens"][: len(got)]:
            raise SystemExit(f"{row['mode']}: first tokens {got} differ from the prefill alone's")
        row["decode_p99_x_alone"] = row["decode_step_ms_p99"] / alone["decode_step_ms_p50"]
        row["decode_p50_x_alone"] = row["decode_step_ms_p50"] / alone["decode_step_ms_p50"]
        row["prefill_x_alone"] = row["prefill_ms_p50"] / alone["prefill_ms_p50"] if row["prefills"] else None
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    meta = {**{k: v for k, v in vars(args).items() if k != "out"}, "device": device, "torch": torch.__version__}
    lines = [
        "| config | mode | decode step p50 ms | p99 ms | p99 / alone p50 (target <= 1.5) | prefill p50 ms "
        "| / alone (target <= 1.2) | prefills |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['config']} | {r['mode']} | not run: {r['skipped']} | | | | | |")
            continue
        ratio = f"{r['prefill_x_alone']:.2f}" if r["prefill_x_alone"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['decode_step_ms_p50']:.2f} | {r['decode_step_ms_p99']:.2f} "
            f"| {r['decode_p99_x_alone']:.2f} | {r['prefill_ms_p50']:.1f} | {ratio} | {r['prefills']} |"
        )
    note = (
        f"{args.streams} sequences decoding ({args.short_tokens}-token prompts) through full CUDA graphs on the "
        f"highest-priority stream; beside them {args.long_tokens}-token prompts prefill back to back (budget "
        f"{args.prefill_budget}) in a second thread; `alone` times each by itself; greenN: a green context of N SMs."
        "\n\n"
    )
    write_report(args.out, {"meta": meta, "rows": rows}, "\n".join(lines), note)


if __name__ == "__main__":
    main()
