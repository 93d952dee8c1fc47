#!/usr/bin/env python3
"""FSDP2-only targets link no FSDP1 code: for each target in FSDP2_ONLY, Bazel's
`deps(T) intersect (FSDP1)` must hold no cc_library, FSDP1 being //fsdp/fsdp1/... and the FSDP1 halves of
//optim_state and //dcp. Why: the two FSDPs are siblings (docs/design/architecture.md), and a
program that uses only fully_shard, even one that checkpoints (//dcp:fsdp2), must not pay
for FSDP1's code. A Python check rather than an sh_test, so that the CMake mirror (which
does not run sh_tests) is not asked to carry it; `./x test` runs it.

  python3 tools/check_fsdp2_only.py [ROOT]

Prints each offending target with the FSDP1 labels it reaches, and exits 1 when there is one
(or when bazel query fails).
"""
import os
import subprocess
import sys

# What an FSDP2-only program depends on: the examples a user copies, and the FSDP2 halves
# of the checkpoint and optimizer-state packages.
FSDP2_ONLY = [
    "//examples:fsdp2_demo",
    "//examples:readme_example",
    "//dcp:fsdp2",
    "//optim_state:fsdp2",
]
FSDP1 = "//fsdp/fsdp1/... + //optim_state:fsdp1 + //dcp:fsdp1"


def fsdp1_deps(root, target):
    query = f"kind(cc_library, deps({target}) intersect ({FSDP1}))"
    out = subprocess.run(["bazel", "query", "--noshow_progress", "--output=label", query], cwd=root,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bazel query '{query}' failed:\n{out.stderr.strip()}")
    # Leave out the unity-build helpers (tools/cc.bzl): each repeats its library.
    return sorted(label for label in out.stdout.split() if not label.endswith("_unity_sources"))


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    bad = 0
    for target in FSDP2_ONLY:
        try:
            found = fsdp1_deps(root, target)
        except RuntimeError as e:
            print(e)
            return 1
        if found:
            bad += 1
            print(f"{target} links FSDP1 code: {', '.join(found[:8])}"
                  + (f" (and {len(found) - 8} more)" if len(found) > 8 else ""))
    print(f"{len(FSDP2_ONLY)} FSDP2-only targets: {'ok' if not bad else f'{bad} link FSDP1'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
