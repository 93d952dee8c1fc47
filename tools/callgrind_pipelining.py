#!/usr/bin/env python3
"""Prints the pipeline runtimes' instructions per action beyond the raw loop, ours and PyTorch's,
from the dumps tools/callgrind_pipelining.sh writes to DIR (DIR/ours.*, DIR/pytorch.*) and the
SCHEDULE lines of DIR/ours.log (each schedule's lowered list length and split shares, from
bench/pipelining).

Per loop, instructions per step = the slope between its two dumps (different step counts).
Per schedule and side: (step - floor) / actions, the floor being the raw loop with that side's
share of its backwards split (raw + share x (raw_split - raw), the raw loops of the schedule's
stages per rank and placement, as the SCHEDULE line names them):
PyTorch's runtime runs every I as its own autograd pass, ours runs an I whose own W comes next
as one pass, so each side's floor holds the passes its runtime runs.
Usage: callgrind_pipelining.py DIR
"""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ratio import callgrind_dumps  # noqa: E402


def per_step(prefix):
    """{name: instructions per step} from the slope between each loop's two dumps."""
    runs = collections.defaultdict(dict)
    for op, _, _, iterations, totals in callgrind_dumps(prefix):
        runs[op][iterations] = totals
    slopes = {}
    for op, by_steps in runs.items():
        if len(by_steps) != 2:
            raise SystemExit(f"{prefix}: {op} has {len(by_steps)} dumps, not 2: {sorted(by_steps)}")
        (n1, i1), (n2, i2) = sorted(by_steps.items())
        slopes[op] = (i2 - i1) / (n2 - n1)
    return slopes


def overhead(out):
    """Per SCHEDULE line of OUT/ours.log: (name, actions, split share ours, PyTorch's, ours and
    PyTorch's instructions per step, per action beyond the floor); None for the last four
    where a side has no dumps of that schedule. Also both sides' {loop: instructions per step}."""
    ours, torch = per_step(os.path.join(out, "ours")), per_step(os.path.join(out, "pytorch"))
    shapes = []
    with open(os.path.join(out, "ours.log")) as f:
        for line in f:
            m = re.search(r"SCHEDULE (\S+) actions=(\d+) split_ours=(\S+) split_pytorch=(\S+) raw=(\w+) "
                          r"raw_split=(\w+)", line)
            if m:
                shapes.append((m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4)), m.group(5),
                               m.group(6)))

    def floor(side, share, raw, raw_split):
        return side[raw] + share * (side[raw_split] - side[raw]) if share else side[raw]

    rows = []
    for name, actions, share_ours, share_torch, raw, raw_split in shapes:
        if name not in ours or name not in torch:
            rows.append((name, actions, share_ours, share_torch, None, None, None, None))
            continue
        rows.append((name, actions, share_ours, share_torch, ours[name], torch[name],
                     (ours[name] - floor(ours, share_ours, raw, raw_split)) / actions,
                     (torch[name] - floor(torch, share_torch, raw, raw_split)) / actions))
    return rows, ours, torch


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    rows, ours, torch = overhead(sys.argv[1])
    print("Instructions per step (slope between two runs of each loop); per action beyond the floor")
    print(f"{'schedule':<22}{'actions':>8}{'split':>12}{'ours':>12}{'PyTorch':>12}"
          f"{'ours/act':>10}{'PyTorch/act':>13}{'ratio':>8}")
    for name, actions, share_ours, share_torch, ours_step, torch_step, ours_per, torch_per in rows:
        if ours_step is None:
            print(f"{name:<22} missing: ours {name in ours}, PyTorch {name in torch}")
            continue
        ratio = f"{torch_per / ours_per:>8.1f}" if ours_per > 0 else "   below the floor"
        print(f"{name:<22}{actions:>8}{share_ours:>6.2f}/{share_torch:<5.2f}{ours_step:>12.0f}{torch_step:>12.0f}"
              f"{ours_per:>10.0f}{torch_per:>13.0f}{ratio}")
    for raw in sorted(name for name in ours if name.startswith("Raw")):
        print(f"raw loop {raw:<10} ours {ours.get(raw, float('nan')):>12.0f}   PyTorch {torch.get(raw, float('nan')):>12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
