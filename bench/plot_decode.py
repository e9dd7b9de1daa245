"""Plot TPOT per mode and batch size from a decode_tpot.py JSON (needs matplotlib: the `bench` extra).

python -m bench.plot_decode bench/results/decode_h200.json bench/results/decode_h200.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    configs = sorted({r["config"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        rows = [r for r in data["rows"] if r["config"] == config and not r.get("denied_rows")]
        for mode in ("hf_eager", "eager", "piecewise", "full"):
            pts = sorted((r["batch_size"], r["tpot_ms_median"]) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.axhline(rows[0]["floor_ms"], color="gray", linestyle="--", label="HBM floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("TPOT median (ms)")
        ax.set_title(f"{config} config, {data['meta']['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
