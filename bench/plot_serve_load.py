"""Plot served / engine-alone tokens/s per concurrency level from serve_load.py JSONs, one line per
file and prompt kind (needs matplotlib: the `bench` extra).

python -m bench.plot_serve_load bench/results/serve_load_h200.png bench/results/serve_load_baseline_h200.json \
    bench/results/serve_load_proxy_h200.json bench/results/serve_load_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(dst: str, *sources: str) -> None:
    fig, (ratio, ttft) = plt.subplots(1, 2, figsize=(12, 4))
    for src in sources:
        rows = [r for r in json.load(open(src))["rows"] if not r.get("request_rate")]
        for prompt in sorted({r["prompt"] for r in rows}):
            pts = sorted((r["streams"], r["ratio"], r["ttft_ms_p50"]) for r in rows if r["prompt"] == prompt)
            label = f"{Path(src).stem}, {prompt} prompts"
            ratio.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ttft.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    ratio.axhline(1.0, color="gray", linestyle="--")
    for ax, name in ((ratio, "served / engine-alone tokens/s"), (ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
