#!/usr/bin/env python3
"""FSDP bookkeeping in instructions (callgrind), against a committed budget.

From the dumps tools/callgrind_bench.sh writes (bench/out/callgrind/<bench>.<pid>.<n>), the
instructions one training step spends beyond plain LibTorch per FSDP-wrapped Linear layer,
as the slope over block counts (which drops the per-step fixed costs):
  FSDP2: bench/fsdp2's Step/ours - Step/raw, 16 -> 64 fully_shard'ed Linear(4, 4);
  FSDP1: bench/fsdp1's Step/ours - Plain/raw, 8 -> 32 wrap_fsdp'ed Linear(16, 16).
Each Linear has 2 parameters, so per parameter is half the per-module figure. Instructions
are repeatable where wall time on a shared machine is not: the check flags growth beyond
10% of bench/callgrind_budget.json (exit status 1, "OVER BUDGET").

    tools/callgrind_budget.py [DUMP_DIR] [--update]   (default bench/out/callgrind)

--update writes the measured figures as the new budget (after a deliberate change).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ratio import callgrind_samples  # noqa: E402

BUDGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "callgrind_budget.json")
TOLERANCE = 1.10

# name: (dump prefix, ours op/side, reference op/side, low and high block counts)
MEASURES = {
    "fsdp2_per_module": ("fsdp2_bench", ("Step", "ours"), ("Step", "raw"), 16, 64),
    "fsdp1_per_module": ("fsdp1_bench", ("Step", "ours"), ("Plain", "raw"), 8, 32),
}


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def per_module(samples, ours, ref, lo, hi):
    def overhead(blocks):
        return median(samples[(ours[0], blocks, ours[1])]) - median(samples[(ref[0], blocks, ref[1])])

    return (overhead(hi) - overhead(lo)) / (hi - lo)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dump_dir = args[0] if args else "bench/out/callgrind"
    measured = {}
    for name, (prefix, ours, ref, lo, hi) in MEASURES.items():
        samples = callgrind_samples(os.path.join(dump_dir, prefix))
        try:
            measured[name] = per_module(samples, ours, ref, lo, hi)
        except KeyError as missing:
            print(f"callgrind_budget: no dump for {missing} in {dump_dir}/{prefix}.*", file=sys.stderr)
            return 2
    if "--update" in sys.argv:
        with open(BUDGET, "w") as f:
            json.dump({k: round(v) for k, v in measured.items()}, f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"callgrind_budget: wrote {os.path.normpath(BUDGET)}")
    with open(BUDGET) as f:
        budget = json.load(f)
    status = 0
    for name, value in measured.items():
        label = "FSDP2 (fully_shard)" if name.startswith("fsdp2") else "FSDP1 (wrap_fsdp)  "
        limit = budget.get(name)
        verdict = "no budget"
        if limit:
            growth = value / limit - 1
            verdict = f"budget {limit:,.0f}, {growth:+.1%}"
            if value > TOLERANCE * limit:
                verdict += f": OVER BUDGET (more than {TOLERANCE - 1:.0%} above)"
                status = 1
        print(f"{label}: {value:,.0f} instructions per wrapped Linear per step, {value / 2:,.0f} per parameter ({verdict})")
    return status


if __name__ == "__main__":
    sys.exit(main())
