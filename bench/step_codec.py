"""What one engine step's outputs cost to cross from the engine child to its replica: pickled (as
`multiprocessing.Connection.send` did) against the msgpack rows of `encode_step`, for 1, 32 and 256
requests with a token each, with and without logprobs (5 alternatives). The child pays the encode on
its one core between two steps; the replica pays the decode on its event loop's thread.

    python -m bench.step_codec --out bench/results/step_codec_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import timeit
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from workers.protocol import StepOutputs, TokenEvent, decode_step, encode_step
from workers.serving.sampling import TokenLogprob


def step(requests: int, logprobs: bool) -> StepOutputs:
    def event(i: int) -> TokenEvent:
        top = [TokenLogprob(-0.25, [(1000 + k, -0.25 - k) for k in range(5)])] if logprobs else None
        return TokenEvent(f"{i:032x}", [1234], None, logprobs=top, cached_tokens=0)

    return StepOutputs([event(i) for i in range(requests)])


def us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for requests in (1, 32, 256):
        for logprobs in (False, True):
            outputs = step(requests, logprobs)
            number = max(20, 20000 // requests)
            pickled, rows_bytes = bytes(ForkingPickler.dumps(outputs)), encode_step(outputs)
            assert decode_step(rows_bytes) == outputs
            rows.append(
                {
                    "requests": requests,
                    "logprobs": logprobs,
                    "pickle_encode_us": us(lambda o=outputs: ForkingPickler.dumps(o), number),
                    "pickle_decode_us": us(lambda b=pickled: pickle.loads(b), number),
                    "rows_encode_us": us(lambda o=outputs: encode_step(o), number),
                    "rows_decode_us": us(lambda b=rows_bytes: decode_step(b), number),
                    "pickle_bytes": len(pickled),
                    "rows_bytes": len(rows_bytes),
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    lines = [
        f"One step's outputs from the engine child, per step (best of 5, {machine}).",
        "",
        "| requests | logprobs | pickle: encode / decode | msgpack rows: encode / decode | bytes: pickle / rows |",
        "|---:|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['requests']} | {'top 5' if r['logprobs'] else 'no'} | {r['pickle_encode_us']:.1f} / "
            f"{r['pickle_decode_us']:.1f} us | {r['rows_encode_us']:.1f} / {r['rows_decode_us']:.1f} us | "
            f"{r['pickle_bytes']:,} / {r['rows_bytes']:,} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + f"\n\n`python -m bench.step_codec --out {args.out}`\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
