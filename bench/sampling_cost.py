"""What penalties, logit_bias and logprobs cost the sampler per decode step.

The engine's BatchSampler on random logits of Llama-3's vocabulary (128256) in the model's dtype
(bf16 on CUDA), every row of the batch asking for the same thing: plain greedy, plain sampling
(temperature 0.8, top_p 0.95), sampling with presence, frequency and repetition penalties over a
history of a 512-token prompt and 256 generated tokens (Zipf-distributed, so tokens repeat as in
text), sampling with a 20-token logit_bias, sampling with logprobs (top 20), and all of them. A
step is one `sample()` call as the engine makes it, its host copy of the tokens (and logprobs)
included; on CUDA each step is timed between synchronizations. Medians, and ratios to greedy.

    python -m bench.sampling_cost --device cuda --out bench/results/sampling_cost_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import write_report
from workers.serving.batch_sampler import BatchSampler
from workers.serving.sampling import SamplingParams
from workers.serving.scheduler import Sequence, new_sequence

VOCAB = 128256
PROMPT, GENERATED = 512, 256
SAMPLED = dict(temperature=0.8, top_p=0.95)
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
BIAS = dict(logit_bias=tuple((1000 + 97 * i, -5.0) for i in range(20)))
LOGPROBS = dict(logprobs=20)
KINDS = {
    "greedy": dict(temperature=0.0),
    "sampling": SAMPLED,
    "penalties": {**SAMPLED, **PENALTIES},
    "logit_bias": {**SAMPLED, **BIAS},
    "logprobs": {**SAMPLED, **LOGPROBS},
    "all": {**SAMPLED, **PENALTIES, **BIAS, **LOGPROBS},
}


def zipf_tokens(n: int, g: torch.Generator) -> list[int]:
    """Token ids whose frequencies fall off as 1/rank, as words in text do."""
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=g).tolist()


def batch(kind: str, batch_size: int, g: torch.Generator) -> list[Sequence]:
    seqs = []
    for slot in range(batch_size):
        seq = new_sequence(zipf_tokens(PROMPT, g), SamplingParams(max_tokens=4096, seed=slot, **KINDS[kind]))
        seq.output_ids = zipf_tokens(GENERATED, g)
        seq.slot = slot
        seqs.append(seq)
    return seqs


def step_times(kind: str, batch_size: int, device: torch.device, dtype: torch.dtype, steps: int) -> list[float]:
    """Milliseconds of each of `steps` sample() calls (after 5 unmeasured ones)."""
    g = torch.Generator().manual_seed(batch_size)
    sampler = BatchSampler(batch_size, VOCAB, device)
    seqs = batch(kind, batch_size, g)
    sampler.admit(seqs)
    logits = (torch.randn(batch_size, VOCAB, generator=g) * 3).to(device, dtype)
    times = []
    for i in range(steps + 5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        sampler.sample(logits, seqs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def markdown(rows: list[dict]) -> str:
    lines = ["| bs | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    keyed = {(r["kind"], r["batch_size"]): r for r in rows}
    for bs in sorted({r["batch_size"] for r in rows}):
        cells = [f"{keyed[(k, bs)]['ms_median']:.3f} ms ({keyed[(k, bs)]['ratio_to_greedy']:.2f}x)" for k in KINDS]
        lines.append(f"| {bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, help="measured steps per case (default: 50 on cuda, 3 for a cpu smoke run)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    steps = args.steps or (50 if device.type == "cuda" else 3)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for bs in args.batch_sizes:
        medians = {kind: statistics.median(step_times(kind, bs, device, dtype, steps)) for kind in KINDS}
        rows += [
            dict(kind=kind, batch_size=bs, steps=steps, ms_median=ms, ratio_to_greedy=ms / medians["greedy"])
            for kind, ms in medians.items()
        ]
        print({kind: round(ms, 3) for kind, ms in medians.items()}, f"bs {bs}", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = dict(device=name, torch=torch.__version__, vocab=VOCAB, dtype=str(dtype), prompt=PROMPT, generated=GENERATED)
    note = f"Median ms per decode step of the sampler (ratio to greedy), vocab {VOCAB}, logits in {dtype}.\n"
    write_report(args.out, {"meta": meta, "rows": rows}, markdown(rows), note)


if __name__ == "__main__":
    main()
