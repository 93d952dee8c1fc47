#!/usr/bin/env python3
"""Side-by-side tables of bench/e2e (ours) and bench/peer/e2e_peer.py (PyTorch FSDP2 / FSDP1).

Usage: e2e_table.py RESULTS.jsonl   (one JSON object per line, as the two programs print)

Time, per (model, FSDP version, world): step time of both, ours / PyTorch, and our step split
into compute, raw communication and FSDP overhead (step - compute - comm). PyTorch's overhead
is estimated with our compute and comm numbers (the same LibTorch kernels and Gloo
collectives).

Memory (MiB, max over ranks; both sides measured alike, see metrics/allocation_window.h):
  alloc peak / end  LibTorch CPU allocations counted from before the model is built: the most
                    live at once during 3 training steps, and what stays live after them;
  ZeRO-3            the estimate 4 * P / W floats (sharded parameters, gradients and AdamW's
                    two moments) + the largest FSDP unit's unsharded parameters; P = numel;
  model             `fsdp_plan --memory`'s predicted peak (tools/fsdp_memory.h; bench/e2e
                    prints it as predicted_peak), and each side's measured peak / it;
  RSS peak          the process's resident high-water mark after the timed steps (ru_maxrss);
  RSS growth        that peak minus the resident set before the model was built (PyTorch's
                    base includes the Python interpreter and `import torch`).
"""
import json
import sys

MIB = 1 << 20


def load_rows(path):
    """{(model, fsdp, world): {impl: record}} from a JSON-lines file."""
    rows = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                key = (r["model"], r.get("fsdp", 2), r["world"])
                rows.setdefault(key, {})[r["impl"]] = r
    return rows


def zero3_bytes(r):
    return 4 * (4 * r["numel"] / r["world"] + r["group_numel"])


def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"


def print_time(rows):
    print(f"{'model':<10}{'FSDP':>5}{'W':>3}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}"
          f"{'compute':>10}{'comm':>9}{'ours ovh':>10}{'torch ovh':>10}")
    for (model, fsdp, world), r in sorted(rows.items()):
        ours, torch = r.get("ours"), r.get("pytorch")
        if not ours or not torch:
            print(f"{model:<10}{fsdp:>5}{world:>3}  incomplete: {sorted(r)}")
            continue
        base = ours["compute_ms"] + ours["comm_ms"]
        print(f"{model:<10}{fsdp:>5}{world:>3}{ours['step_ms']:>10.1f}{torch['step_ms']:>10.1f}"
              f"{ratio(ours['step_ms'], torch['step_ms']):>8}{ours['compute_ms']:>10.1f}{ours['comm_ms']:>9.1f}"
              f"{ours['step_ms'] - base:>10.1f}{torch['step_ms'] - base:>10.1f}")
    print("ratio = ours / PyTorch step time (goal for the overhead-bound model: <= 0.5); "
          "ovh = step - compute - comm (negative: communication time varies more than the overhead)")


def print_memory(rows):
    print(f"\n{'':<18}{'--- LibTorch CPU allocations (MiB) ---':^78}{'------ process RSS (MiB) ------':^48}")
    print(f"{'model':<10}{'FSDP':>5}{'W':>3}{'ZeRO-3':>8}{'model':>8}{'peak':>8}{'torch':>8}{'ratio':>7}{'/Z3':>6}"
          f"{'/model':>7}{'torch':>7}{'end':>8}{'torch':>8}{'  ':>1}{'peak':>8}{'torch':>8}{'ratio':>7}"
          f"{'growth':>8}{'torch':>8}{'ratio':>7}")
    for (model, fsdp, world), r in sorted(rows.items()):
        ours, torch = r.get("ours"), r.get("pytorch")
        if not ours or not torch or "alloc_peak" not in ours or "alloc_peak" not in torch:
            print(f"{model:<10}{fsdp:>5}{world:>3}  no memory numbers for both")
            continue
        z3 = zero3_bytes(ours)
        grow_o, grow_t = ours["rss_peak"] - ours["rss_base"], torch["rss_peak"] - torch["rss_base"]
        pred = ours.get("predicted_peak", 0)
        print(f"{model:<10}{fsdp:>5}{world:>3}{z3 / MIB:>8.1f}{pred / MIB:>8.1f}{ours['alloc_peak'] / MIB:>8.1f}"
              f"{torch['alloc_peak'] / MIB:>8.1f}{ratio(ours['alloc_peak'], torch['alloc_peak']):>7}"
              f"{ratio(ours['alloc_peak'], z3):>6}{ratio(ours['alloc_peak'], pred):>7}{ratio(torch['alloc_peak'], pred):>7}"
              f"{ours['alloc_end'] / MIB:>8.1f}{torch['alloc_end'] / MIB:>8.1f} "
              f"{ours['rss_peak'] / MIB:>8.0f}{torch['rss_peak'] / MIB:>8.0f}{ratio(ours['rss_peak'], torch['rss_peak']):>7}"
              f"{grow_o / MIB:>8.0f}{grow_t / MIB:>8.0f}{ratio(grow_o, grow_t):>7}")
    print("ratio = ours / PyTorch; /Z3 = our allocation peak / the ZeRO-3 estimate (activations, "
          "prefetched units and unsharded gradients come on top of it); /model, torch = our and "
          "PyTorch's peak / the memory model's prediction")


def main():
    rows = load_rows(sys.argv[1])
    print_time(rows)
    print_memory(rows)


if __name__ == "__main__":
    main()
