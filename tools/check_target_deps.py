#!/usr/bin/env python3
"""Rules on targets' dependencies and tags, read from the build graph (bazel query).

1. For each target in FSDP2_ONLY, Bazel's
`deps(T) intersect (FSDP1)` must hold no cc_library, FSDP1 being //fsdp/fsdp1/... and the FSDP1 halves of
//optim_state and //dcp. Why: the two FSDPs are siblings (docs/design/architecture.md), and a
program that uses only fully_shard, even one that checkpoints (//dcp:fsdp2), must not pay
for FSDP1's code. A Python check rather than an sh_test, so that the CMake mirror (which
does not run sh_tests) is not asked to carry it; `./x test` runs it.

  python3 tools/check_target_deps.py [ROOT]

2. Every program (cc_binary, cc_test) that links the DCP core and an FSDP runtime links that
   FSDP's DCP adapter (//dcp:fsdp2, //dcp:fsdp1; or //dcp, which bundles both): without it,
   dcp::Save of that FSDP's model is a run-time error ("link //dcp:fsdp2"), which only the
   program's own run would show. ADAPTER_EXEMPT lists the programs that leave one out on
   purpose.

3. A test target depends on the peer Python (//testing:peer_python) if and only if it has the
   tag peer_python: on a fresh machine whose peer venv is still installing when the tests are
   built, `./x test` runs the tests without that tag meanwhile and those with it once the venv
   is ready, so an untagged peer test would find no peer Python and report its cases skipped.

Prints each offending target (with the FSDP1 labels it reaches, or the adapter it lacks), and
exits 1 when there is one (or when bazel query fails).
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
# (FSDP runtime, its DCP adapter).
ADAPTERS = [("//fsdp/fsdp2", "//dcp:fsdp2"), ("//fsdp/fsdp1", "//dcp:fsdp1")]
# Proves that a binary without the FSDP1 adapter names it in its error.
ADAPTER_EXEMPT = {"//dcp:adapter_test"}
# The tag of tests that run scripts with the peer venv's Python (rule 3).
PEER_TAG = "peer_python"


def query(root, expression):
    out = subprocess.run(["bazel", "query", "--noshow_progress", "--output=label", expression], cwd=root,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bazel query '{expression}' failed:\n{out.stderr.strip()}")
    # Leave out the unity-build helpers (tools/cc.bzl): each repeats its library.
    return sorted(label for label in out.stdout.split() if not label.endswith("_unity_sources"))


def fsdp1_deps(root, target):
    return query(root, f"kind(cc_library, deps({target}) intersect ({FSDP1}))")


def missing_adapters(root):
    """[(program, runtime, adapter)] for programs linking //dcp:core and a runtime but not its adapter."""
    found = []
    for runtime, adapter in ADAPTERS:
        programs = query(root, f'kind("cc_binary|cc_test", rdeps(//..., //dcp:core) intersect '
                               f'rdeps(//..., {runtime})) except rdeps(//..., {adapter})')
        found += [(p, runtime, adapter) for p in programs if p not in ADAPTER_EXEMPT]
    return found


def peer_tag_mismatches(root):
    """(untagged tests that use the peer Python, tagged tests that do not)."""
    tests = "tests(//...)"
    users = set(query(root, f"{tests} intersect rdeps(//..., //testing:peer_python)"))
    tagged = set(query(root, f'attr(tags, "\\b{PEER_TAG}\\b", {tests})'))
    return sorted(users - tagged), sorted(tagged - users)


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
    try:
        missing = missing_adapters(root)
    except RuntimeError as e:
        print(e)
        return 1
    for program, runtime, adapter in missing:
        print(f"{program} links //dcp:core and {runtime} but not {runtime}'s checkpoint adapter {adapter}")
    print(f"DCP adapters: {'ok' if not missing else f'{len(missing)} program(s) without theirs'}")
    try:
        untagged, needless = peer_tag_mismatches(root)
    except RuntimeError as e:
        print(e)
        return 1
    for test in untagged:
        print(f"{test} depends on //testing:peer_python but lacks tags = [\"{PEER_TAG}\"]")
    for test in needless:
        print(f"{test} has the tag {PEER_TAG} but does not depend on //testing:peer_python")
    print(f"{PEER_TAG} tags: {'ok' if not untagged and not needless else f'{len(untagged) + len(needless)} wrong'}")
    return 1 if bad or missing or untagged or needless else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
