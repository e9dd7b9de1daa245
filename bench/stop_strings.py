"""The cost of detokenization and stop strings per token, which the replica's event loop pays for
every token of every stream: ~2,000 characters (the byte-level tokenizer of the embedded tiny model:
one token per byte) with no stop string, a short one, and stop strings at the length cap
(`STOP_MAX_CHARS`), one that never matches and one that keeps matching partway; fed as a replica
reads a stream (`add_tokens`), one token per read (a quiet replica) and 16 (a busy one coalesces).

It also prices detokenizing in bulk across the streams of an engine step instead: the decode calls
alone of one backend `decode_batch` per step for 256 streams (each stream's window with and without
its new token), against those streams read 16 tokens at a time.

    python -m bench.stop_strings --out bench/results/stop_strings_cpu.json

With `--baseline` (the JSON of an earlier run, e.g. before a change) the table compares the two.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from app.openai_protocol import STOP_MAX_CHARS
from workers.modeling.synthetic import build_byte_tokenizer
from workers.serving.detokenizer import IncrementalDetokenizer

SENTENCE = "The quick brown fox jumps over the lazy dog; "


def cases(chars: int, cap: int) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Name -> (generated text, stop strings). No stop string ever matches the text whole."""
    prose = (SENTENCE * (chars // len(SENTENCE) + 1))[:chars]
    periodic = ("ab" * chars)[:chars]
    return {
        "no stop": (prose, ()),
        "stop of 4 chars": (prose, ("QQQQ",)),
        f"stop of {cap} chars, never a prefix": (prose, ("Q" * cap,)),
        f"stop of {cap} chars, partial matches": (periodic, ("ab" * (cap // 2 - 1) + "ac",)),
        f"4 stops of {cap} chars": (prose, tuple(c * cap for c in "QRST")),
    }


def feed(tokenizer, ids: list[int], stop: tuple[str, ...], per_read: int) -> tuple[float, str]:
    """Seconds to feed `ids` per_read tokens at a time and flush; the text handed out."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    t0 = time.perf_counter()
    for i in range(0, len(ids), per_read):
        pieces.append(detok.add_tokens(ids[i : i + per_read])[1])
    pieces.append(detok.flush()[0])
    return time.perf_counter() - t0, "".join(pieces)


def run(chars: int, cap: int, repeats: int, reads: list[int]) -> list[dict]:
    tokenizer = build_byte_tokenizer()
    feed(tokenizer, tokenizer.encode(SENTENCE * 10, add_special_tokens=False), (), 1)  # warm-up, untimed
    rows = []
    for name, (text, stop) in cases(chars, cap).items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        for per_read in reads:
            times = []
            for _ in range(repeats):
                seconds, out = feed(tokenizer, ids, stop, per_read)
                assert out == text, name  # no stop string matches: everything comes out
                times.append(seconds)
            best = min(times)
            rows.append(
                {
                    "case": name,
                    "tokens_per_read": per_read,
                    "chars": len(text),
                    "tokens": len(ids),
                    "seconds": best,
                    "us_per_token": best / len(ids) * 1e6,
                }
            )
    return rows


def across_streams(streams: int, steps: int, per_read: int, repeats: int) -> dict:
    """µs per token: the decode calls of a per-step bulk detokenizer (one `decode_batch` per step of
    every stream's window before and after its new token, nothing else counted), against reading
    each stream per_read tokens at a time with `add_tokens` (no stop strings)."""
    tokenizer = build_byte_tokenizer()
    backend = tokenizer.backend_tokenizer
    ids = tokenizer.encode((SENTENCE * (steps // len(SENTENCE) + 2))[: steps + 8], add_special_tokens=False)

    def bulk() -> float:
        t0 = time.perf_counter()
        for step in range(4, steps + 4):
            windows = [ids[step - 4 : step], ids[step - 4 : step + 1]] * streams
            backend.decode_batch(windows, skip_special_tokens=True)
        return time.perf_counter() - t0

    def per_stream() -> float:
        detoks = [IncrementalDetokenizer(tokenizer) for _ in range(streams)]
        t0 = time.perf_counter()
        for start in range(0, steps, per_read):
            for detok in detoks:
                detok.add_tokens(ids[start : start + per_read])
        return time.perf_counter() - t0

    tokens = streams * steps
    return {
        "streams": streams,
        "steps": steps,
        "tokens_per_read": per_read,
        "bulk_per_step_us_per_token": min(bulk() for _ in range(repeats)) / tokens * 1e6,
        "per_read_us_per_token": min(per_stream() for _ in range(repeats)) / tokens * 1e6,
    }


def markdown(result: dict, baseline: dict | None) -> str:
    before = {(r["case"], r.get("tokens_per_read", 1)): r for r in baseline["rows"]} if baseline else {}
    head = "| case | tokens per read | tokens | seconds | µs/token |"
    rule = "|---|---:|---:|---:|---:|"
    if before:
        head += " before: seconds | speed-up |"
        rule += "---:|---:|"
    lines = [
        f"Detokenization and stop strings, {result['chars']} characters read as a replica reads a stream "
        f"(best of {result['repeats']}, {result['machine']}).",
        "",
        head,
        rule,
    ]
    for r in result["rows"]:
        line = (
            f"| {r['case']} | {r['tokens_per_read']} | {r['tokens']} | {r['seconds']:.4f} | {r['us_per_token']:.2f} |"
        )
        if before:
            b = before.get((r["case"], r["tokens_per_read"]))
            line += f" {b['seconds']:.4f} | {b['seconds'] / r['seconds']:.1f}x |" if b else " | |"
        lines.append(line)
    if before:
        lines += ["", "before: the `--baseline` run, kept in the JSON under `baseline`."]
    a = result["across_streams"]
    lines += [
        "",
        f"Across {a['streams']} streams of {a['steps']} steps (µs per token): one `decode_batch` per step, its "
        f"decode calls alone, {a['bulk_per_step_us_per_token']:.2f}; each stream read {a['tokens_per_read']} "
        f"tokens at a time, {a['per_read_us_per_token']:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--stop-chars", type=int, default=STOP_MAX_CHARS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reads", nargs="+", type=int, default=[1, 16], help="tokens per read")
    ap.add_argument("--baseline", help="JSON of an earlier run to compare against")
    ap.add_argument("--out", required=True, help="JSON path; the markdown table goes next to it (.md)")
    args = ap.parse_args()
    result = {
        "chars": args.chars,
        "stop_chars": args.stop_chars,
        "repeats": args.repeats,
        "machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "rows": run(args.chars, args.stop_chars, args.repeats, args.reads),
        "across_streams": across_streams(256, 64, 16, args.repeats),
    }
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    if baseline:
        result["baseline"] = baseline
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result, baseline))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
