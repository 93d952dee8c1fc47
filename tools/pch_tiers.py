#!/usr/bin/env python3
"""Which precompiled LibTorch header each C++ target should use (tools/cc.bzl's torch_pch).

Every TU of a target is compiled with one force-included precompiled header, and that header
costs the TU more than reading it: GCC instantiates what the headers' inline code needs in
every TU that includes them, precompiled or not: an empty TU with the full header
(tools/torch_pch_headers.h: ATen + torch::nn + torch::optim) takes several times as long as
with the ATen one (tools/torch_pch_aten_headers.h), and that several times as long as with no
LibTorch header at all (figures: docs/development/building.md). So a target gets the
smallest tier that covers what its sources include (transitively):
  nn    a source includes torch/nn/module.h            (the default: torch_pch unset)
  aten  a source includes ATen/core/Tensor.h, no torch/nn  (torch_pch = "aten")
  none  no source includes a LibTorch header           (torch_pch = False)
A wrong tier is never a wrong build (GCC reads whatever the precompiled header lacks), only
a slower one; this script finds such targets:

  python3 tools/pch_tiers.py            the tier of each target, '*' where the BUILD file differs
  python3 tools/pch_tiers.py --check    exit 1 if a BUILD file differs

It preprocesses every source with `g++ -M` (~1-2 min on 2 cores; not part of ./x test).
Needs ./x setup (third_party/torch_root).
"""
import concurrent.futures
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "cmake"))
import bazel_build_files  # noqa: E402

TIERS = ("none", "aten", "nn")
# A header whose presence in a TU's dependency list puts the TU in that tier.
MARKERS = (("nn", "torch/nn/module.h"), ("aten", "ATen/core/Tensor.h"), ("aten", "ATen/core/TensorBody.h"))


def tier_of_source(path):
    torch = ROOT / "third_party" / "torch_root" / "include"
    cmd = ["g++", "-std=c++20", "-M", f"-I{ROOT}", f"-I{ROOT}/bazel-bin",
           "-isystem", str(torch / "torch" / "csrc" / "api" / "include"), "-isystem", str(torch),
           "-DUSE_C10D_GLOO", "-DUSE_DISTRIBUTED", str(ROOT / path)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return "nn", f"g++ -M failed: {out.stderr.strip().splitlines()[:1]}"
    for tier, marker in MARKERS:
        if marker in out.stdout:
            return tier, ""
    return "none", ""


def declared_tier(kw):
    value = kw.get("torch_pch", True)
    if value is True:
        return "nn"
    if value is False:
        return "none"
    return value


def main(argv):
    if argv not in ([], ["--check"]):
        print(__doc__)
        return 2
    targets, problems = bazel_build_files.load_build_files(str(ROOT))
    if problems:
        print("\n".join(problems))
        return 2
    sources = {}
    for label, (kind, pkg, kw) in targets.items():
        srcs = bazel_build_files.resolve(kw.get("srcs"), False) + \
            bazel_build_files.resolve(kw.get("srcs"), True)
        sources[label] = sorted({f"{pkg}/{s}" for s in srcs if s.endswith(".cc")})
    files = sorted({f for fs in sources.values() for f in fs})
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        tiers = dict(zip(files, pool.map(tier_of_source, files)))
    differ = 0
    for label, fs in sources.items():
        if not fs:
            continue
        want = max((tiers[f][0] for f in fs), key=TIERS.index)
        have = declared_tier(targets[label][2])
        notes = "; ".join(f"{f}: {tiers[f][1]}" for f in fs if tiers[f][1])
        mark = "*" if want != have else " "
        differ += want != have
        print(f"{mark} {label:55} {want:5} (BUILD: {have}){'  ' + notes if notes else ''}")
    print(f"{differ} target(s) whose BUILD file names another tier")
    return 1 if differ and argv == ["--check"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
