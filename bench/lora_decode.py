"""What LoRA slots cost a decode step on the GPU, and how long loading an adapter takes.

Two models of real shape (random bf16 weights, max_model_len 8192, live contexts of 256), each with
its engine: the base engine without LoRA, and a LoRA engine (max_loras 8, every linear layer).
At each batch size, turns of `--steps` decode steps taking turns between: the base engine; the LoRA
engine with rows that name no adapter (its plain graphs); the same rows forced through its LoRA
graphs (what a server without separate plain graphs would pay: the measurement behind keeping
both); and rows spread over 1, 4 and 8 distinct rank-16 adapters (in slots of `--max-lora-rank`, 16
unless set). Compare TPOT as ratios to the base engine within this run. Then the extra memory
(slots, graphs) and adapter loads: the copy into a slot (the <= 50 ms target) and the whole load
with the disk read and the verification probe.

    python -m bench.lora_decode --config 8b --out bench/results/lora_decode_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_tpot import percentile, timed_steps
from bench.report import write_report
from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits
from workers.modeling.synthetic import random_model, write_random_adapter
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

MAX_MODEL_LEN = 8192  # as a server is configured: long max_model_len, short live contexts
CONTEXT = 256
RANK = 16
MAX_LORAS = 8
KINDS = ("base", "lora_engine_no_adapter", "lora_graphs_no_adapter", "adapters_1", "adapters_4", "adapters_8")


def make_engine(model, buckets: tuple[int, ...], lora: LoraLimits | None, compile: bool) -> LLMEngine:
    policy = GraphPolicy(decode_batch_buckets=buckets, compile=compile)
    config = EngineConfig(
        max_num_seqs=max(buckets),
        max_model_len=model.max_model_len,
        graph_policy=policy,
        kv_cache_tokens=2 * max(buckets) * (CONTEXT + 1024),
        lora=lora,
    )
    return LLMEngine(model, config)


def adapter_rows(kind: str, batch_size: int, adapters: list[tuple[str, str]]) -> list[tuple[str, str] | None]:
    if not kind.startswith("adapters_"):
        return [None] * batch_size
    distinct = adapters[: int(kind.split("_")[1])]
    return [distinct[i % len(distinct)] for i in range(batch_size)]


def turn(engine: LLMEngine, batch_size: int, rows: list, steps: int, force_lora_graphs: bool) -> list[float]:
    """Step times (ms) of a decode-only batch at CONTEXT, each row with its adapter (or none)."""
    g = torch.Generator().manual_seed(batch_size)
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=steps + 20, temperature=0.0, ignore_eos=True)
    seqs = [
        engine.add_request(torch.randint(0, vocab, (CONTEXT,), generator=g).tolist(), params, adapter=a) for a in rows
    ]
    engine.step()  # prefill and the first decode
    runners = engine.runners
    if force_lora_graphs:  # every call through the LoRA graphs, rows naming the null slot
        engine.runners = runners._replace(base=runners.lora)
    try:
        return timed_steps(engine, seqs, steps, warmup=5)
    finally:
        engine.runners = runners


def load_times(engine: LLMEngine, adapters: list[tuple[str, str]], repeats: int) -> dict:
    """Loads into a slot, each of an adapter no slot holds (slots emptied before each): the copy
    (stats: adapter_load_s), and check_adapter's whole time (disk read, copy, verification)."""
    copies, whole = [], []
    for i in range(repeats):
        engine.forget_adapters()
        name, path = adapters[i % len(adapters)]
        before = engine.stats.adapter_load_s
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.check_adapter(name, path)
        torch.cuda.synchronize()
        whole.append((time.perf_counter() - start) * 1e3)
        copies.append((engine.stats.adapter_load_s - before) * 1e3)
    return {
        "copy_ms_median": statistics.median(copies),
        "copy_ms_max": max(copies),
        "whole_ms_median": statistics.median(whole),
        "whole_ms_max": max(whole),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="8b")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compile", action="store_true", help="torch.compile the step (off: plain graphs)")
    ap.add_argument("--max-lora-rank", type=int, default=RANK, help="slot size; the adapters stay rank 16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    buckets = tuple(sorted(set(args.batch_sizes)))
    base = make_engine(random_model(args.config, MAX_MODEL_LEN, "cuda"), buckets, None, args.compile)
    model = random_model(args.config, MAX_MODEL_LEN, "cuda")  # its own: slots of A go under its weights
    lora = make_engine(model, buckets, LoraLimits(MAX_LORAS, args.max_lora_rank), args.compile)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [
        (f"a{i}", str(write_random_adapter(tmp / f"a{i}", model.cfg, RANK, seed=i, device="cuda")))
        for i in range(MAX_LORAS)
    ]
    times: dict[tuple[str, int], list[float]] = {}
    for bs in args.batch_sizes:
        for _ in range(args.rounds):
            for kind in KINDS:
                engine = base if kind == "base" else lora
                rows = adapter_rows(kind, bs, adapters)
                times.setdefault((kind, bs), []).extend(
                    turn(engine, bs, rows, args.steps, force_lora_graphs=kind == "lora_graphs_no_adapter")
                )
        print({k: round(statistics.median(v), 3) for k, v in times.items() if k[1] == bs}, flush=True)
    rows = []
    for (kind, bs), ms in sorted(times.items(), key=lambda kv: (kv[0][1], KINDS.index(kv[0][0]))):
        base_ms = statistics.median(times[("base", bs)])
        rows.append(
            dict(
                kind=kind,
                batch_size=bs,
                steps=len(ms),
                tpot_ms_median=statistics.median(ms),
                tpot_ms_p99=percentile(ms, 0.99),
                ratio_to_base=statistics.median(ms) / base_ms,
            )
        )
    status = lora.status()
    memory = {
        "base_graphs_mb": base.status().memory_mb["graphs"],
        "lora_engine_graphs_mb": status.memory_mb["graphs"],
        "lora_slots_mb": status.memory_mb["lora"],
        "lora_graphs_mb": lora.runners.lora.graph_memory_mb(),
    }
    loads = load_times(lora, adapters, repeats=8)
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        config=args.config,
        context=CONTEXT,
        rank=RANK,
        max_lora_rank=args.max_lora_rank,
        max_loras=MAX_LORAS,
        compile=args.compile,
        rounds=args.rounds,
    )
    write_report(
        args.out, {"meta": meta, "rows": rows, "memory": memory, "loads": loads}, markdown(rows, memory, loads)
    )


def markdown(rows: list[dict], memory: dict, loads: dict) -> str:
    lines = ["| bs | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    keyed = {(r["kind"], r["batch_size"]): r for r in rows}
    for bs in sorted({r["batch_size"] for r in rows}):
        cells = [f"{keyed[(k, bs)]['tpot_ms_median']:.2f} ms ({keyed[(k, bs)]['ratio_to_base']:.3f}x)" for k in KINDS]
        lines.append(f"| {bs} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Memory: LoRA slots {memory['lora_slots_mb']:.0f} MB; graphs: base engine "
        f"{memory['base_graphs_mb']:.0f} MB, LoRA engine {memory['lora_engine_graphs_mb']:.0f} MB (of which "
        f"LoRA graphs {memory['lora_graphs_mb']:.0f} MB).",
        f"Adapter load (rank {RANK}): copy into a slot median {loads['copy_ms_median']:.1f} ms (max "
        f"{loads['copy_ms_max']:.1f}); with the disk read and verification median {loads['whole_ms_median']:.1f}"
        f" ms (max {loads['whole_ms_max']:.1f}).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
