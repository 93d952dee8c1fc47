#!/usr/bin/env python3
"""Bar chart of bench/e2e step times: ours vs PyTorch per model, world size and FSDP version.

Usage: e2e_chart.py RESULTS.jsonl OUT.png   (the JSON lines tools/e2e_table.py reads)
One panel per model (their step times differ by orders of magnitude), one group of bars per
world size: FSDP2 ours / PyTorch, FSDP1 ours / PyTorch, each bar labelled with its time.
Needs matplotlib (./x setup installs it in the peer venv); without it, prints a note and exits 0.
"""
import os
import sys

from e2e_table import load_rows

BARS = [(2, "ours", "FSDP2 ours", "#1f77b4"), (2, "pytorch", "FSDP2 PyTorch", "#aec7e8"),
        (1, "ours", "FSDP1 ours", "#d62728"), (1, "pytorch", "FSDP1 PyTorch", "#ff9896")]


def main():
    src, out = sys.argv[1], sys.argv[2]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed for {sys.executable}; {out} not written")
        return 0
    rows = load_rows(src)
    models = sorted({m for m, _, _ in rows})
    if not models:
        print(f"note: no results in {src}; {out} not written")
        return 0
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    width = 0.8 / len(BARS)
    for ax, model in zip(axes[0], models):
        worlds = sorted({w for m, _, w in rows if m == model})
        for i, (fsdp, impl, label, color) in enumerate(BARS):
            xs, ys = [], []
            for j, w in enumerate(worlds):
                r = rows.get((model, fsdp, w), {}).get(impl)
                if r:
                    xs.append(j + (i - (len(BARS) - 1) / 2) * width)
                    ys.append(r["step_ms"])
            bars = ax.bar(xs, ys, width, label=label, color=color)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(worlds)), [f"W={w}" for w in worlds])
        ax.set_title(f"{model} model")
        ax.set_ylabel("median step time (ms)")
        ax.legend(fontsize=8)
    fig.suptitle("FSDP training step, ours (LibTorch) vs PyTorch, Gloo on CPU")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
