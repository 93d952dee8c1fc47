#!/usr/bin/env python3
"""Prints ours vs reference per benchmark size from a Google Benchmark JSON file.

Benchmarks named "<Op>/ours/<arg>" and "<Op>/<reference>/<arg>" are paired; the ratio is
ours / reference of the median real time per iteration (1.00 = no overhead).
Usage: bench_ratio.py RESULT.json [--max-ratio R]   (exit 1 if any ratio > R)
"""
import collections
import json
import sys


def main():
    path = sys.argv[1]
    max_ratio = float(sys.argv[sys.argv.index("--max-ratio") + 1]) if "--max-ratio" in sys.argv else None
    with open(path) as f:
        data = json.load(f)
    samples = collections.defaultdict(list)
    for b in data["benchmarks"]:
        parts = b["name"].split("/")
        if len(parts) < 3:
            continue
        op, side, arg = parts[0], parts[1], parts[2]
        samples[(op, int(arg), side)].append(
            b["real_time"] * {"ns": 1e-3, "us": 1, "ms": 1e3, "s": 1e6}[b["time_unit"]])
    table = collections.defaultdict(dict)
    for (op, arg, side), times in samples.items():
        times.sort()
        table[(op, arg)][side] = times[len(times) // 2]  # median over repetitions
    print(f"{'op':<16}{'bytes/rank':>12}{'ours us':>12}{'ref us':>12}{'ratio':>8}")
    worst = 0.0
    ratios = []
    for (op, arg), sides in sorted(table.items()):
        ref_name = next((s for s in sides if s != "ours"), None)
        if "ours" not in sides or ref_name is None:
            continue
        ratio = sides["ours"] / sides[ref_name]
        ratios.append(ratio)
        worst = max(worst, ratio)
        print(f"{op:<16}{arg:>12}{sides['ours']:>12.1f}{sides[ref_name]:>12.1f}{ratio:>8.3f}")
    if ratios:
        ratios.sort()
        print(f"median ratio {ratios[len(ratios) // 2]:.3f}, worst {worst:.3f}")
    if max_ratio is not None and worst > max_ratio:
        print(f"ratio above {max_ratio}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
