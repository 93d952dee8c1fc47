#!/usr/bin/env python3
"""The trainer's curves: loss, learning rate and tokens per second against step, one line per run.

Usage: plot_metrics.py RUN.jsonl [RUN2.jsonl ...] [--output curves.png]

Each RUN.jsonl is a file the trainer writes with metrics.enable_jsonl (train/metrics_log.h: one
JSON object a line, torchtitan's names): the panels plot "loss_metrics/global_avg_loss" (and
"validation_metrics/loss", dashed, where the run validated), "lr" and "throughput(tps)" against
"step", each run labelled by its file. The PNG is drawn with matplotlib's Agg backend
(./x setup installs matplotlib in the peer venv:
~/.cache/libtorch-fsdp/peer-venv-torch-<version>/bin/python tools/plot_metrics.py ...).
A file that cannot be read, a line that is not a JSON object with a "step", or a file without a
training step is an error naming the file (and the line); exit status 1, nothing written.
"""
import argparse
import json
import math
import os
import sys

PANELS = [("loss_metrics/global_avg_loss", "loss"), ("lr", "learning rate"), ("throughput(tps)", "tokens per second")]
VALIDATION = "validation_metrics/loss"


class MetricsError(Exception):
    pass


def number(value):
    """A JSON value as a float: null (a non-finite value, as the trainer writes it) is NaN."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def load_run(path):
    """{key: ([step], [value])} of one JSONL file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MetricsError(f"{path}: cannot read: {e}") from e
    series = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError('not a JSON object with a "step"')
            step = number(row["step"])
            for key in [k for k, _ in PANELS] + [VALIDATION]:
                if key in row:
                    steps, values = series.setdefault(key, ([], []))
                    steps.append(step)
                    values.append(number(row[key]))
        except ValueError as e:  # json.JSONDecodeError is one
            raise MetricsError(f"{path}:{n}: {e}") from e
    if PANELS[0][0] not in series:
        raise MetricsError(f'{path}: no training step (no "{PANELS[0][0]}"): not a metrics.enable_jsonl file?')
    return series


def labels(paths):
    """Each file's name, or its path where two runs share a name."""
    names = [os.path.basename(p) for p in paths]
    return [n if names.count(n) == 1 else p for n, p in zip(names, paths)]


def plot(runs, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.5 * len(PANELS), 4.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], PANELS):
        for i, (label, series) in enumerate(runs):
            color = f"C{i % 10}"
            if key in series:
                ax.plot(*series[key], color=color, label=label)
            if key == PANELS[0][0] and VALIDATION in series:
                ax.plot(*series[VALIDATION], color=color, linestyle="--", marker=".", label=f"{label} (validation)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot the trainer's JSONL metrics (loss, lr, tps) against step.")
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="metrics files (metrics.enable_jsonl)")
    parser.add_argument("--output", "-o", default="curves.png", help="the PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    try:
        runs = list(zip(labels(args.runs), [load_run(p) for p in args.runs]))
    except MetricsError as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"plot_metrics: error: matplotlib is not installed for {sys.executable} (./x setup installs it in "
              "the peer venv: run this with ~/.cache/libtorch-fsdp/peer-venv-torch-<version>/bin/python)",
              file=sys.stderr)
        return 1
    plot(runs, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
