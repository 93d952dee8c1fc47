#!/usr/bin/env python3
"""Side-by-side table of bench/e2e (ours) and bench/peer/e2e_peer.py (PyTorch FSDP2).

Usage: e2e_table.py RESULTS.jsonl   (one JSON object per line, as the two programs print)
For each (model, world): step time of both, ours / PyTorch, and our step split into compute,
raw communication and FSDP overhead (step - compute - comm). PyTorch's overhead is estimated
with our compute and comm numbers (the same LibTorch kernels and Gloo collectives).
"""
import json
import sys


def main():
    rows = {}
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                rows.setdefault((r["model"], r["world"]), {})[r["impl"]] = r
    print(f"{'model':<10}{'W':>3}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}"
          f"{'compute':>10}{'comm':>9}{'ours ovh':>10}{'torch ovh':>10}")
    for (model, world), r in sorted(rows.items()):
        ours, torch = r.get("ours"), r.get("pytorch")
        if not ours or not torch:
            print(f"{model:<10}{world:>3}  incomplete: {sorted(r)}")
            continue
        base = ours["compute_ms"] + ours["comm_ms"]
        print(f"{model:<10}{world:>3}{ours['step_ms']:>10.1f}{torch['step_ms']:>10.1f}"
              f"{ours['step_ms'] / torch['step_ms']:>8.2f}{ours['compute_ms']:>10.1f}{ours['comm_ms']:>9.1f}"
              f"{ours['step_ms'] - base:>10.1f}{torch['step_ms'] - base:>10.1f}")
    print("ratio = ours / PyTorch step time (goal for the overhead-bound model: <= 0.5); "
          "ovh = step - compute - comm (negative: communication time varies more than the overhead)")


if __name__ == "__main__":
    main()
