"""Checks that the CMake build mirrors the Bazel BUILD files.

Usage: check_bazel_parity.py REPO_ROOT MANIFEST        (CMake runs it at configure time)
       check_bazel_parity.py REPO_ROOT --list          (prints the Bazel targets)

The BUILD files are read by cmake/bazel_build_files.py (the same evaluation that
tools/gen_cmake_targets.py generates cmake/bazel_targets.cmake from). The manifest is what
the CMake configuration declared through cmake/FsdpTargets.cmake (one line per target).
Every Bazel C++ target must be mirrored (same kind, sources, headers, deps, and for tests
size, data, env, args) or be listed as excluded with a reason. This is a self-check of the
generator and the CMake helpers: the generated file is kept fresh by
`tools/gen_cmake_targets.py --check`. Exit status 1 on any difference, with one line per
difference.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bazel_build_files import describe, load_build_files, normalize_label  # noqa: E402


def parse_manifest(path):
    """Lines: label|kind|status|srcs|cuda_srcs|deps|cuda_deps|linkopts|size|data|env|args,
    lists comma-separated, files relative to the package (as in BUILD files)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            fields = line.split("|")
            if len(fields) != 12:
                raise SystemExit(f"bad manifest line: {line}")
            label, kind, status = fields[:3]
            label = normalize_label(label, "")
            pkg = label[2:].partition(":")[0]

            def items(i):
                return [x for x in fields[i].split(",") if x]

            def files(i):
                return sorted(f"{pkg}/{s}" if pkg else s for s in items(i))

            d = {
                "kind": kind,
                "srcs": files(3),
                "cuda_srcs": files(4),
                "deps": sorted(normalize_label(x, pkg) for x in items(5)),
                "cuda_deps": sorted(normalize_label(x, pkg) for x in items(6)),
                "linkopts": sorted(items(7)),
            }
            if kind.startswith("cc_test"):
                d["size"] = fields[8] or "medium"
                d["data"] = sorted(os.path.normpath(f) for f in files(9))
                d["env"] = sorted(items(10))
                d["args"] = items(11)
            out[label] = (status, d)
    return out


def main():
    root = sys.argv[1]
    targets, problems = load_build_files(root)
    if sys.argv[2] == "--list":
        for label, (kind, pkg, kw) in sorted(targets.items()):
            print(label, describe(kind, pkg, kw))
        for p in problems:
            print("PROBLEM:", p)
        return 0
    manifest = parse_manifest(sys.argv[2])
    for label, (kind, pkg, kw) in sorted(targets.items()):
        if label not in manifest:
            problems.append(f"{label}: Bazel {kind} has no CMake counterpart "
                            "(regenerate: python3 tools/gen_cmake_targets.py)")
            continue
        status, cm = manifest[label]
        if status.startswith("excluded"):
            continue
        want = describe(kind, pkg, kw)
        for field, value in want.items():
            have = cm.get(field)
            if have == value:
                continue
            if isinstance(value, list) and isinstance(have, list) and field != "args":
                only_bazel = sorted(set(value) - set(have))
                only_cmake = sorted(set(have) - set(value))
                problems.append(f"{label}: {field}: only in BUILD.bazel {only_bazel}, "
                                f"only in CMake {only_cmake}")
            else:
                problems.append(f"{label}: {field}: BUILD.bazel {value!r}, CMake {have!r}")
    for label in sorted(set(manifest) - set(targets)):
        problems.append(f"{label}: declared in CMake but not in any BUILD.bazel")
    for p in problems:
        print(f"bazel parity: {p}")
    if problems:
        print(f"bazel parity: {len(problems)} difference(s) between the BUILD.bazel files and the CMake configuration")
        return 1
    built = sum(1 for s, _ in manifest.values() if s.startswith("built"))
    print(f"bazel parity: {len(targets)} Bazel C++ targets, {built} built by this CMake "
          f"configuration, the rest skipped or excluded with a reason; sources, deps and test "
          f"settings match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
