#!/usr/bin/env python3
"""Generates cmake/bazel_targets.cmake, the CMake build's target list, from the BUILD.bazel
files (the one source of truth for targets, sources, deps and test settings).

Usage: python3 tools/gen_cmake_targets.py           rewrite cmake/bazel_targets.cmake
       python3 tools/gen_cmake_targets.py --check   exit 1 with one line if it is stale
       python3 tools/gen_cmake_targets.py --smoke   print the smoke tests' labels

Each Bazel cc_library / cc_binary / cc_test becomes one fsdp_cc_library / fsdp_cc_binary /
fsdp_cc_test call (cmake/FsdpTargets.cmake). A select() on //comm:with_cuda becomes the
CUDA_SRCS / NOCUDA_SRCS / CUDA_DEPS branches; any other select() condition (e.g. fuzz's
--define=fuzzing=libfuzzer) is a configuration CMake does not build, so its default branch
is taken. The BUILD files are read by cmake/bazel_build_files.py (the evaluation the
configure-time check cmake/check_bazel_parity.py uses too). What CMake builds differently
from Bazel is in the three tables below, each with its reason; a table entry naming a target
that no longer exists is an error, so they cannot go stale either.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "cmake"))
from bazel_build_files import (DEFAULT, GlobList, Select, is_cuda_condition,  # noqa: E402
                               load_build_files, parts_of, rootpath_as_cmake)

OUTPUT = "cmake/bazel_targets.cmake"
COMMAND = "python3 tools/gen_cmake_targets.py"

# Bazel targets CMake never builds: label -> reason (fsdp_bazel_excluded, printed at
# configure time). None today: fuzz/ builds with the standalone driver (the default branch of
# its selects) and the peer tests skip themselves without FSDP_PEER_PYTHON, as under Bazel.
EXCLUDED = {
}

FUZZ_WHY = "fuzz binaries, on the standalone driver (the libFuzzer build is tools/fuzz.sh's)"

# Bazel targets CMake builds only when an option is ON: label (or '//pkg:*', the whole
# package) -> (option, reason).
OPTIONAL = {
    "//bench:*": ("FSDP_BUILD_BENCH", "benchmarks need Debian's libbenchmark-dev"),
    "//fuzz:standalone_driver": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:full_state_dict_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:optim_state_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:dcp_metadata_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:safetensors_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:fr_trace_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:token_dataset_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:hf_checkpoint_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:torchrun_env_fuzz": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
    "//fuzz:make_seeds": ("FSDP_BUILD_FUZZ", FUZZ_WHY),
}

# The smoke set (FSDP_CMAKE_SMOKE, `ctest -L smoke`): one test per package with tests, the
# first cc_test of its BUILD file unless this table says otherwise: package -> (test name,
# or None for no smoke test, reason).
SMOKE_OVERRIDES = {
    # Where the first test is a bundle of several TUs, a one- or two-TU test that still runs
    # the package's core against an independent reference (PyTorch's golden layouts), to keep
    # the smoke build's compile work down (a test TU is ~7 s on 2 cores).
    "fsdp/fsdp2": ("golden_test", "FSDP2 layouts vs the PyTorch 2.15 corpus; 2 TUs, "
                       "fsdp2_test is 9"),
    "fsdp/fsdp1": ("golden_test", "FSDP1 layouts vs the PyTorch 2.15 corpus; 1 TU"),
    "dtensor": (None, "dtensor_test is 4 TUs; //tensor_parallel's smoke test runs DTensor's "
                "redistributes under the parallel styles"),
    "optim_state": (None, "its one test target (6 files) trains both FSDPs at several world sizes"),
    "tests/peer": (None, "runs against the peer PyTorch: skips without it, minutes with it"),
    "examples/llama": (None, "trains Hugging Face's Llama under PyTorch FSDP2 in the peer venv "
                       "first (~50 s); Bazel runs it, the smoke build still builds the demo"),
}

# Cases a smoke test leaves out (CMake's smoke run only; Bazel and `--full` run every case):
# label -> (GoogleTest negative filter, reason). The smoke run checks that the CMake build of
# a package works; cases that mostly wait out deadlines or repeat a long run add minutes of
# CTest time on 2 cores without testing the build further.
SMOKE_GTEST_FILTERS = {
    "//examples:restart_test": (
        "-TorchrunRestart.ResumesFromTheLatestCompleteCheckpointWithTheSameBits",
        "~28 s of demo runs; the two-launcher and killed-rank cases still run the demo"),
    "//testing:testing_test": (
        "-MultiRankDeadline.ARankProcess*:MultiRankDeadline.AThreadedRank*",
        "~35 s of waiting out deadlines; the Gloo-threads deadline case stays"),
    "//comm:comm_test": (
        "-MultiRankRunner.ProcessModeKillsRanksPastTheDeadline:MultiRankRunnerDeathTest.*",
        "~16 s of waiting out deadlines"),
    "//fuzz:corrupt_checkpoint_test": (
        "-CorruptCheckpoint.EveryBitFlipIsAnErrorOrHarmless",
        "~11 s: one load per bit of a file; the truncation and crafted-file cases stay"),
}


# The CMake package (`cmake --install`, find_package(LibtorchFsdp), cmake/FsdpInstall.cmake)
# installs what another Bazel workspace may depend on: every cc_library visible to
# //visibility:public that is neither testonly nor built only with an option, and the
# libraries those link (e.g. the runtimes, visible to a few packages only). Such libraries are
# called with INSTALL; their headers install at their paths in the repository.
PUBLIC = "//visibility:public"


def die(msg):
    print(f"gen_cmake_targets: {msg}", file=sys.stderr)
    sys.exit(1)


def short_label(label):
    """//comm:comm -> //comm (as BUILD files write a package's default target)."""
    pkg, _, name = label[2:].partition(":")
    return f"//{pkg}" if pkg and pkg.rsplit("/", 1)[-1] == name else label


def absolute_label(dep, pkg):
    """':x' or '//a/b' in package pkg -> '//pkg:x' or '//a/b:b' (external labels unchanged)."""
    if dep.startswith(":"):
        return f"//{pkg}{dep}"
    if dep.startswith("//") and ":" not in dep:
        return f"{dep}:{dep.rsplit('/', 1)[-1]}"
    return dep


def split_select(label, attr, value):
    """(common, cuda, nocuda) parts of a list attribute: a select() on ...:with_cuda gives the
    CUDA / non-CUDA branches; any other select() its default branch."""
    common, cuda, nocuda = [], [], []
    for part in parts_of(value):
        if not isinstance(part, Select):
            common.extend(part)
            continue
        conds = [c for c in part.branches if c != DEFAULT]
        if any(is_cuda_condition(c) for c in conds):
            if len(conds) != 1:
                die(f"{label}: {attr}: a select() mixing :with_cuda with other conditions {conds}")
            cuda.extend(part.branches[conds[0]])
            nocuda.extend(part.branches.get(DEFAULT, []))
        else:
            common.extend(part.branches.get(DEFAULT, []))
    return common, cuda, nocuda


def plain_list(label, attr, value):
    common, cuda, nocuda = split_select(label, attr, value)
    if cuda or nocuda:
        die(f"{label}: {attr}: select() on :with_cuda is not supported by cmake/FsdpTargets.cmake")
    return common


def data_files(label, pkg, value):
    if isinstance(value, GlobList):
        return value.patterns  # the helper expands globs itself (Bazel's glob())
    out = []
    for d in plain_list(label, "data", value):
        if d.startswith(":"):
            d = d[1:]
        elif d.startswith(f"//{pkg}:"):
            d = d.partition(":")[2]
        elif d.startswith("//") and "." in d.rpartition(":")[2]:
            # Another package's file (exports_files): relative to this package, as CMake
            # records data (tests run in the source root, so the file is where it is).
            other, _, name = d[2:].partition(":")
            d = os.path.relpath(f"{other}/{name}", pkg or ".")
        elif d.startswith("//") or d.startswith("@"):
            die(f"{label}: data {d}: only files (this package's, or another's by label) are supported")
        out.append(d)
    return out


def cmake_word(s):
    s = str(s)
    if s and not re.search(r'[\s;"$()#\\]', s):
        return s
    if ";" in s:
        die(f"'{s}': a ';' cannot pass through CMake's argument lists")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def emit_call(func, head, fields):
    """func(head\n  KEY words...) with lines wrapped at 100 columns."""
    lines = [f"{func}({' '.join(head)}"]
    for key, words in fields:
        if not words:
            continue
        indent = " " * (2 + len(key) + 1)
        line = f"  {key}"
        for w in map(cmake_word, words):
            if len(line) + 1 + len(w) > 100 and line.strip() != key:
                lines.append(line)
                line = indent + w
            else:
                line += " " + w
        lines.append(line)
    lines[-1] += ")"
    return "\n".join(lines)


def comment_lines(words, note):
    """'#   w1 w2 ...: note' wrapped at 100 columns."""
    text = " ".join(words) + (f": {note}" if note else "")
    lines, line = [], "#  "
    for w in text.split(" "):
        if len(line) + 1 + len(w) > 100:
            lines.append(line)
            line = "#    "
        line += " " + w
    return lines + [line]


def optional_for(label, pkg):
    return OPTIONAL.get(label) or OPTIONAL.get(f"//{pkg}:*")


def check_tables(targets):
    labels = set(targets)
    pkgs = {pkg for _, pkg, _ in targets.values()}
    for key in list(EXCLUDED) + list(OPTIONAL):
        if key.endswith(":*") and key[2:-2] in pkgs or key in labels:
            continue
        die(f"table entry {key} names no Bazel C++ target (update tools/gen_cmake_targets.py)")
    # A target CMake always builds must not depend on one it builds only with an option
    # (CMake would link the missing library by name: `-lfuzz_standalone_driver`).
    for label, (kind, pkg, kw) in targets.items():
        if optional_for(label, pkg):
            continue
        for dep in split_select(label, "deps", kw.get("deps"))[0]:
            full = absolute_label(dep, pkg)
            opt = full in labels and optional_for(full, targets[full][1])
            if opt:
                die(f"{label} depends on {dep}, which CMake builds only with {opt[0]}=ON: "
                    f"add {label} to OPTIONAL (tools/gen_cmake_targets.py)")
    for label in SMOKE_GTEST_FILTERS:
        if targets.get(label, ("",))[0] != "cc_test":
            die(f"SMOKE_GTEST_FILTERS: {label} is not a cc_test (update tools/gen_cmake_targets.py)")
    for pkg, (name, _) in SMOKE_OVERRIDES.items():
        if pkg not in pkgs or (name and targets.get(f"//{pkg}:{name}", ("",))[0] != "cc_test"):
            die(f"SMOKE_OVERRIDES: //{pkg}:{name or '*'} is not a cc_test of a Bazel package "
                "(update tools/gen_cmake_targets.py)")


def all_deps(label, kw):
    """Every dep in either branch of a select() (the package installs both configurations)."""
    common, cuda, nocuda = split_select(label, "deps", kw.get("deps"))
    return common + cuda + nocuda


# The programs the CMake package installs (to bin/), with the libraries they link.
INSTALLED_PROGRAMS = {"//train:train"}


def installed_set(targets):
    """The libraries the CMake package installs (see PUBLIC above), and INSTALLED_PROGRAMS."""
    todo = [label for label, (kind, pkg, kw) in targets.items()
            if kind == "cc_library" and not kw.get("testonly") and not optional_for(label, pkg)
            and PUBLIC in (kw.get("visibility") or [])]
    for program in sorted(INSTALLED_PROGRAMS):
        if targets.get(program, (None,))[0] != "cc_binary":
            die(f"INSTALLED_PROGRAMS: {program} is not a cc_binary")
        todo.append(program)
    installed = set()
    while todo:
        label = todo.pop()
        if label in installed:
            continue
        installed.add(label)
        kind, pkg, kw = targets[label]
        for dep in all_deps(label, kw):
            full = absolute_label(dep, pkg)
            if not full.startswith("//"):
                continue  # @libtorch, @system, @cuda: the package's Config finds them
            dkind, dpkg, dkw = targets.get(full, (None, None, {}))
            if dkind != "cc_library" or dkw.get("testonly") or optional_for(full, dpkg):
                die(f"{label} is installed (a public library or one it links) but depends on {dep}, "
                    "which is not an installable library (testonly, optional or no cc_library)")
            todo.append(full)
    return installed


def smoke_set(targets):
    """Label of each package's smoke test, in package order."""
    chosen = {}
    for label, (kind, pkg, _) in targets.items():
        if kind != "cc_test" or pkg in chosen or label in EXCLUDED or optional_for(label, pkg):
            continue
        chosen[pkg] = label
    for pkg, (name, _) in SMOKE_OVERRIDES.items():
        if name is None:
            chosen.pop(pkg, None)
        else:
            chosen[pkg] = f"//{pkg}:{name}"
    packages = dict.fromkeys(pkg for _, pkg, _ in targets.values())  # in BUILD file order
    return [chosen[p] for p in packages if p in chosen]


def rootpath_arg(label, pkg, arg, targets):
    """An arg as CMake passes it: "$(rootpath :bin)" of a binary of this package becomes
    FSDP_TARGET_FILE://pkg:bin (cmake/FsdpTargets.cmake turns that into $<TARGET_FILE:...>);
    other make variables are refused. (A target in `data` is a build dependency, not a file.)"""
    mapped = rootpath_as_cmake(arg, pkg)
    if mapped != arg:
        if mapped.partition(":")[2] not in targets:
            die(f"{label}: args: {arg} names no target of this repository")
        return mapped
    if "$(" in arg:
        die(f"{label}: args: make variables / $(location) other than $(rootpath :target) are not supported")
    return arg


def target_call(label, kind, pkg, kw, smoke, installed, targets):
    head = [short_label(label)]
    if kw.get("testonly") and kind != "cc_test":
        head.append("TESTONLY")
    if kw.get("alwayslink"):
        head.append("ALWAYSLINK")
    if label in installed:
        head.append("INSTALL")
    if kind == "cc_test":
        head += ["SIZE", kw.get("size", "medium")]
        if kw.get("timeout"):
            head += ["TIMEOUT", kw["timeout"]]
    opt = optional_for(label, pkg)
    if opt:
        head += ["OPTION", opt[0]]
    if label in smoke:
        head.append("SMOKE")
        if label in SMOKE_GTEST_FILTERS:
            head += ["SMOKE_FILTER", f'"{SMOKE_GTEST_FILTERS[label][0]}"']
    tier = kw.get("torch_pch", True)
    if tier is not True:
        # The precompiled-header tier (tools/cc.bzl): cmake/FsdpTargets.cmake's PCH argument.
        head += ["PCH", "none" if tier is False else tier]

    srcs, cuda_srcs, nocuda_srcs = split_select(label, "srcs", kw.get("srcs"))
    hdrs, cuda_hdrs, nocuda_hdrs = split_select(label, "hdrs", kw.get("hdrs"))
    deps, cuda_deps, nocuda_deps = split_select(label, "deps", kw.get("deps"))
    if nocuda_deps:
        die(f"{label}: deps: a non-empty default branch of a :with_cuda select() is not "
            "supported by cmake/FsdpTargets.cmake (only CUDA_DEPS)")
    fields = [("SRCS", srcs),
              ("CUDA_SRCS", cuda_srcs + cuda_hdrs),
              ("NOCUDA_SRCS", nocuda_srcs + nocuda_hdrs),
              ("HDRS", hdrs)]
    if kind == "cc_test":
        env = kw.get("env") or {}
        if not isinstance(env, dict):
            die(f"{label}: env: only a plain dict is supported")
        args = [rootpath_arg(label, pkg, a, targets) for a in plain_list(label, "args", kw.get("args"))]
        data = [d for d in data_files(label, pkg, kw.get("data")) if f"//{pkg}:{d}" not in targets]
        fields += [("DATA", data),
                   ("ENV", [f"{k}={v}" for k, v in env.items()]),
                   ("ARGS", args),
                   ("TAGS", plain_list(label, "tags", kw.get("tags")))]
    fields += [("LINKOPTS", plain_list(label, "linkopts", kw.get("linkopts"))),
               ("DEPS", deps),
               ("CUDA_DEPS", cuda_deps)]
    return emit_call(f"fsdp_{kind}", head, fields)


def generate(root):
    targets, problems = load_build_files(root)
    if problems:
        die("the BUILD files use what CMake does not mirror:\n  " + "\n  ".join(problems))
    check_tables(targets)
    smoke = smoke_set(targets)
    installed = installed_set(targets)
    out = [
        f"# GENERATED by `{COMMAND}` from the BUILD.bazel files: do not edit.",
        f"# Check that it is current: `{COMMAND} --check` (./x test and CMake's",
        "# configure step run it). Helpers: cmake/FsdpTargets.cmake. What CMake builds",
        "# differently from Bazel, with the reasons, is in the tables of that script:",
    ]
    groups = {}
    for key, (option, why) in OPTIONAL.items():
        groups.setdefault((option, why), []).append(key)
    for (option, why), keys in groups.items():
        out += comment_lines(keys, f"only with {option}=ON: {why}")
    for key, why in EXCLUDED.items():
        out += comment_lines([key], f"not built: {why}")
    out.append("# INSTALL: in the CMake package (`cmake --install`): the public libraries, not testonly,")
    out.append("# and the libraries they link.")
    out.append("# Smoke set (FSDP_CMAKE_SMOKE=ON builds these by default; `ctest -L smoke`):")
    out += comment_lines(smoke, "")
    for pkg, (name, why) in SMOKE_OVERRIDES.items():
        out += comment_lines([f"//{pkg}"], f"{name or 'no smoke test'} ({why})")
    for label, (gtest_filter, why) in SMOKE_GTEST_FILTERS.items():
        out += comment_lines([label], f"smoke run without {gtest_filter[1:]} ({why})")
    out.append("")
    current = None
    for label, (kind, pkg, kw) in targets.items():
        if pkg != current:
            current = pkg
            out.append(f"# {'=' * 64} //{pkg}")
        if label in EXCLUDED:
            out.append(emit_call("fsdp_bazel_excluded", [label],
                                 [("KIND", [kind]), ("REASON", [EXCLUDED[label].replace(";", ",")])]))
        else:
            out.append(target_call(label, kind, pkg, kw, smoke, installed, targets))
        out.append("")
    while out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n", targets, smoke


def main(argv):
    if argv not in ([], ["--check"], ["--smoke"]):
        print(__doc__, file=sys.stderr)
        return 2
    text, targets, smoke = generate(ROOT)
    path = os.path.join(ROOT, OUTPUT)
    if argv == ["--smoke"]:
        print("\n".join(smoke))
        return 0
    try:
        with open(path) as f:
            current = f.read()
    except OSError:
        current = None
    if argv == ["--check"]:
        if current != text:
            print(f"{OUTPUT} is stale (the BUILD.bazel files changed): run {COMMAND}")
            return 1
        print(f"{OUTPUT} is current ({len(targets)} Bazel C++ targets)")
        return 0
    if current != text:
        with open(path, "w") as f:
            f.write(text)
    print(f"{'wrote' if current != text else 'unchanged:'} {OUTPUT}: {len(targets)} Bazel C++ "
          f"targets; smoke set: {' '.join(smoke)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
