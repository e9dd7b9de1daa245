"""The cost of stop strings in the incremental detokenizer, which runs on the replica's event loop for
every token of every stream: ~2,000 characters fed token by token (the byte-level tokenizer of the
embedded tiny model: one token per byte) with no stop string, a short one, and stop strings at the
length cap (`STOP_MAX_CHARS`), one that never matches and one that keeps matching partway.

    python bench/stop_strings.py --out bench/results/stop_strings_cpu.json

With `--baseline` (the JSON of an earlier run, e.g. before a change) the table compares the two.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from app.openai_protocol import STOP_MAX_CHARS
from workers.modeling.default_model import build_byte_tokenizer
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


def feed(tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[float, str]:
    """Seconds to feed `ids` one token at a time and flush; the text handed out."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    t0 = time.perf_counter()
    for token in ids:
        pieces.append(detok.add([token])[0])
    pieces.append(detok.flush())
    return time.perf_counter() - t0, "".join(pieces)


def run(chars: int, cap: int, repeats: int) -> list[dict]:
    tokenizer = build_byte_tokenizer()
    feed(tokenizer, tokenizer.encode(SENTENCE * 10, add_special_tokens=False), ())  # warm-up, untimed
    rows = []
    for name, (text, stop) in cases(chars, cap).items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        times = []
        for _ in range(repeats):
            seconds, out = feed(tokenizer, ids, stop)
            assert out == text, name  # no stop string matches: everything comes out
            times.append(seconds)
        best = min(times)
        rows.append(
            {
                "case": name,
                "chars": len(text),
                "tokens": len(ids),
                "seconds": best,
                "us_per_token": best / len(ids) * 1e6,
            }
        )
    return rows


def markdown(result: dict, baseline: dict | None) -> str:
    before = {r["case"]: r for r in baseline["rows"]} if baseline else {}
    head = "| case | tokens | seconds | µs/token |"
    rule = "|---|---:|---:|---:|"
    if before:
        head += " before: seconds | speed-up |"
        rule += "---:|---:|"
    lines = [
        f"Stop strings in the detokenizer, {result['chars']} characters fed token by token (best of "
        f"{result['repeats']}, {result['machine']}).",
        "",
        head,
        rule,
    ]
    for r in result["rows"]:
        line = f"| {r['case']} | {r['tokens']} | {r['seconds']:.4f} | {r['us_per_token']:.1f} |"
        if before:
            b = before.get(r["case"])
            line += f" {b['seconds']:.4f} | {b['seconds'] / r['seconds']:.1f}x |" if b else " | |"
        lines.append(line)
    if before:
        lines += ["", "before: the `--baseline` run, kept in the JSON under `baseline`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--stop-chars", type=int, default=STOP_MAX_CHARS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", help="JSON of an earlier run to compare against")
    ap.add_argument("--out", required=True, help="JSON path; the markdown table goes next to it (.md)")
    args = ap.parse_args()
    result = {
        "chars": args.chars,
        "stop_chars": args.stop_chars,
        "repeats": args.repeats,
        "machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "rows": run(args.chars, args.stop_chars, args.repeats),
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
