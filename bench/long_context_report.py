"""Merge long-context runs of decode_tpot.py into one result file, its markdown table and a plot
(needs matplotlib: the `bench` extra). Each input is one process's run; ratios between
max_model_len values compare rows of the same run where one run has both (the 1B), and of two
runs minutes apart on the same machine otherwise (the 8B), which the table's header says.

    PYTHONPATH=. python -m bench.long_context_report bench/results/decode_long_context_1b_h200.json \\
        bench/results/decode_long_context_8b_8192_h200.json bench/results/decode_long_context_8b_512_h200.json \\
        --out bench/results/decode_long_context_h200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.decode_tpot import context_label, long_context_markdown, long_context_title  # noqa: E402

FIELDS = (
    "config",
    "max_model_len",
    "context_mix",
    "context_len",
    "context_min",
    "context_max",
    "live_tokens",
    "batch_size",
    "mode",
    "compile",
    "tpot_ms_median",
    "tpot_ms_p99",
    "floor_ms",
    "x_floor",
    "tokens_per_s",
)


def plot(rows: list[dict], dst: Path) -> None:
    """TPOT against batch size per config, context 256: each mode at both max_model_len values."""
    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(6.5 * len(configs), 4.5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        mine = [r for r in rows if r["config"] == config and context_label(r) == 256]
        for mode, compiled in (("eager", False), ("full", False), ("full", True)):
            for mml, style in ((512, "--"), (8192, "-")):
                pts = sorted(
                    (r["batch_size"], r["tpot_ms_median"])
                    for r in mine
                    if (r["mode"], r["compile"], r["max_model_len"]) == (mode, compiled, mml)
                )
                label = f"{mode}{' +compile' if compiled else ''}, max_model_len {mml}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        floor = sorted({(r["batch_size"], r["floor_ms"]) for r in mine if r["max_model_len"] == 8192})
        ax.plot([p[0] for p in floor], [p[1] for p in floor], ":", color="gray", label="floor (weights + live KV)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (context 256)")
        ax.set_ylabel("TPOT median (ms)")
        ax.set_title(f"{config}: TPOT does not follow max_model_len")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True, help="path without suffix: .json, .md and .png are written")
    args = ap.parse_args()
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    rows = [{k: r[k] for k in FIELDS if k in r} for run in runs for r in run["rows"]]
    engines = [e for run in runs for e in run["engines"]]
    meta = dict(runs[0]["meta"], sources=[Path(p).name for p in args.runs])
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "engines": engines}, indent=1))
    md = [long_context_title(meta["sources"], rows), "", long_context_markdown(meta, rows)]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
