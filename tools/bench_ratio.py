#!/usr/bin/env python3
"""Prints ours vs reference per benchmark size from a Google Benchmark JSON file, or from the
callgrind dumps tools/callgrind_bench.sh writes.

Benchmarks named "<Op>/ours/<arg>" and "<Op>/<reference>/<arg>" are paired; the ratio is
ours / reference of the median real time per iteration (1.00 = no overhead), or with
--callgrind of the instructions per iteration (each dump is one run of a timed loop, see
bench/callgrind_loop.h).
Usage: bench_ratio.py RESULT.json [--max-ratio R]   (exit 1 if any ratio > R)
       bench_ratio.py --callgrind PREFIX [--max-ratio R]   (the dumps PREFIX.<pid>.<n>)
"""
import collections
import glob
import json
import re
import sys


def json_samples(path):
    """{(op, arg, side): [us per iteration, ...]} from a Google Benchmark JSON file."""
    with open(path) as f:
        data = json.load(f)
    samples = collections.defaultdict(list)
    for b in data["benchmarks"]:
        parts = b["name"].split("/")
        if len(parts) < 3:
            continue
        samples[(parts[0], int(parts[2]), parts[1])].append(
            b["real_time"] * {"ns": 1e-3, "us": 1, "ms": 1e3, "s": 1e6}[b["time_unit"]])
    return samples


def callgrind_dumps(prefix):
    """[(op, arg, side, iterations, instructions)] from the callgrind dumps PREFIX.* whose
    trigger is "<Op>/<side>/<arg> iters=<N>": a client request (bench/callgrind_loop.h) or
    `callgrind_control -d` (bench/peer/pipelining_peer.py)."""
    dumps = []
    for path in sorted(glob.glob(prefix + ".*")):
        if path.endswith(".log"):
            continue
        desc = totals = None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    desc = line.split(": ", 3)[3].strip()
                elif line.startswith("desc: Trigger: dump "):
                    desc = line[len("desc: Trigger: dump "):].strip()
                elif line.startswith("totals:"):
                    totals = int(line.split()[1])
        m = re.fullmatch(r"(\w+)/(\w+)/(\d+) iters=(\d+)", desc or "")
        if m and totals is not None and int(m.group(4)) > 0:
            dumps.append((m.group(1), int(m.group(3)), m.group(2), int(m.group(4)), totals))
    return dumps


def callgrind_samples(prefix):
    """{(op, arg, side): [instructions per iteration, ...]} from callgrind_dumps(prefix)."""
    samples = collections.defaultdict(list)
    for op, arg, side, iterations, totals in callgrind_dumps(prefix):
        samples[(op, arg, side)].append(totals / iterations)
    return samples


def print_pairs(samples, unit, max_ratio):
    table = collections.defaultdict(dict)
    for (op, arg, side), values in samples.items():
        values.sort()
        table[(op, arg)][side] = values[len(values) // 2]  # median over repetitions
    print(f"{'op':<16}{'arg':>12}{'ours ' + unit:>14}{'ref ' + unit:>14}{'ours-ref':>14}{'ref':>10}{'ratio':>8}")
    worst = 0.0
    ratios = []
    for (op, arg), sides in sorted(table.items()):
        ref_name = next((s for s in sides if s != "ours"), None)
        if "ours" not in sides or ref_name is None:
            continue
        ratio = sides["ours"] / sides[ref_name]
        ratios.append(ratio)
        worst = max(worst, ratio)
        print(f"{op:<16}{arg:>12}{sides['ours']:>14.1f}{sides[ref_name]:>14.1f}"
              f"{sides['ours'] - sides[ref_name]:>14.1f}{ref_name:>10}{ratio:>8.3f}")
    if ratios:
        ratios.sort()
        print(f"median ratio {ratios[len(ratios) // 2]:.3f}, worst {worst:.3f}")
    if max_ratio is not None and worst > max_ratio:
        print(f"ratio above {max_ratio}")
        return 1
    return 0


def main():
    args = sys.argv[1:]
    max_ratio = float(args[args.index("--max-ratio") + 1]) if "--max-ratio" in args else None
    if "--callgrind" in args:
        return print_pairs(callgrind_samples(args[args.index("--callgrind") + 1]), "Ir", max_ratio)
    return print_pairs(json_samples(args[0]), "us", max_ratio)


if __name__ == "__main__":
    sys.exit(main())
