"""Reads the BUILD.bazel files of this repository (shared by tools/gen_cmake_targets.py and
cmake/check_bazel_parity.py).

BUILD.bazel files are evaluated as Python with stand-ins for the few Starlark built-ins they
use (load, package, select, config_setting, glob, cc_library / cc_test / cc_binary, ...).
An attribute or rule the CMake build does not know is reported as a problem, so nothing
drifts silently.
"""
import os
import pathlib
import re

SKIP_DIRS = {"third_party", ".git", ".ci", "build"}
KNOWN_ATTRS = {"name", "srcs", "hdrs", "deps", "size", "data", "env", "args", "testonly",
               "linkopts", "visibility", "alwayslink", "timeout",
               # The precompiled LibTorch header's tier (tools/cc.bzl), one of PCH_TIERS;
               # CMake's PCH argument (fsdp_pch / fsdp_pch_aten in cmake/FsdpTargets.cmake).
               "torch_pch",
               # Checked against CUDA_LOCAL_DEFINES below.
               "local_defines",
               # A test's tags: CTest LABELS (`ctest -L float_parity`); shard_count: Bazel
               # splits a test's cases over processes, CTest runs them in one.
               "tags", "shard_count"}
# The only local_defines a BUILD file may set, each under //comm:with_cuda: CMake's
# FSDP_WITH_CUDA option defines them for every target (cmake/FsdpDependencies.cmake).
CUDA_LOCAL_DEFINES = {"FSDP_WITH_CUDA=1",
                      "FSDP_TORCH_NCCL_VERSION_CODE=$(FSDP_TORCH_NCCL_VERSION_CODE)"}
CC_RULES = ("cc_library", "cc_test", "cc_binary")
OTHER_RULES = ("cc_import", "filegroup", "sh_test", "sh_binary", "py_test", "py_binary",
               "py_library", "genrule", "test_suite", "alias")
# Bazel-only rules with a CMake counterpart written by hand: the precompiled LibTorch header
# (tools/cc.bzl) is CMake's fsdp_pch target (cmake/FsdpTargets.cmake).
BAZEL_ONLY_RULES = ("torch_precompiled_header",)
DEFAULT = "//conditions:default"
# Where every BUILD file loads its C++ rules from (the precompiled-header macros).
CC_BZL = "//tools:cc.bzl"
# The values of torch_pch that tools/cc.bzl accepts.
PCH_TIERS = (True, False, "nn", "aten")


class Select:
    """select(): a dict of condition label -> value."""

    def __init__(self, branches):
        self.branches = dict(branches)


class Configurable:
    """A list attribute possibly concatenated with select()s: parts are lists or Selects."""

    def __init__(self, parts):
        self.parts = parts

    def __add__(self, other):
        return Configurable(self.parts + _parts(other))

    def __radd__(self, other):
        return Configurable(_parts(other) + self.parts)


def _parts(value):
    if isinstance(value, Configurable):
        return value.parts
    return [value]


def select(branches):
    return Configurable([Select(branches)])


class GlobList(list):
    """glob()'s result: the matched files, and the patterns (the CMake helpers take globs)."""

    def __init__(self, files, patterns):
        super().__init__(files)
        self.patterns = list(patterns)


def is_cuda_condition(cond):
    """select() conditions of --config=cuda (//comm:with_cuda, :with_cuda)."""
    return cond.endswith(":with_cuda")


def parts_of(value):
    """An attribute value as a list of parts: plain lists and Selects."""
    if value is None:
        return []
    if isinstance(value, Select):
        return [value]
    if isinstance(value, Configurable):
        return value.parts
    return [value]


def resolve(value, cuda):
    """The value of an attribute in the default configuration, or with --config=cuda
    (conditions ending in ':with_cuda'). Other conditions (e.g. fuzzing) take the default."""
    if value is None:
        return []
    if not isinstance(value, (Select, Configurable)):
        return value
    out = []
    for part in parts_of(value):
        if isinstance(part, Select):
            chosen = part.branches.get(DEFAULT, [])
            if cuda:
                for cond, v in part.branches.items():
                    if is_cuda_condition(cond):
                        chosen = v
            out.extend(chosen)
        else:
            out.extend(part)
    return out


def normalize_label(label, pkg):
    if label.startswith(":"):
        label = f"//{pkg}{label}"
    if label.startswith("@") and "//" not in label:
        name = label[1:]
        return f"@{name}//:{name}"
    if label.startswith("//") or label.startswith("@"):
        repo, _, rest = label.partition("//")
        path, colon, name = rest.partition(":")
        if not colon:
            name = path.rsplit("/", 1)[-1]
        return f"{repo}//{path}:{name}"
    return f"//{pkg}:{label}"


def cuda_local_defines_only(defines):
    """Whether a local_defines value (None: unset) defines nothing but CUDA_LOCAL_DEFINES, and
    those only under --config=cuda: select()s on :with_cuda whose default branch is empty."""
    if defines is None:
        return True
    only_cuda_selects = all(isinstance(p, Select) and all(is_cuda_condition(c) or c == DEFAULT for c in p.branches)
                            for p in parts_of(defines))
    return (only_cuda_selects and not resolve(defines, False)
            and set(resolve(defines, True)) <= CUDA_LOCAL_DEFINES)


def load_build_files(root):
    """Returns (targets, problems): targets maps '//pkg:name' to (kind, pkg, kwargs) in
    package order (directories sorted) and, within a package, BUILD file order."""
    targets = {}
    problems = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel
        dirnames[:] = sorted(d for d in dirnames
                             if not d.startswith("bazel-") and d not in SKIP_DIRS
                             and not os.path.exists(os.path.join(dirpath, d, "WORKSPACE")))
        if "BUILD.bazel" not in filenames and "BUILD" not in filenames:
            continue
        path = os.path.join(dirpath, "BUILD.bazel" if "BUILD.bazel" in filenames else "BUILD")

        # package(default_visibility = ...): a target without `visibility` gets it (the
        # CMake package installs what is public, tools/gen_cmake_targets.py).
        package_defaults = {}

        def rule(kind, pkg=rel, path=path, package_defaults=package_defaults):
            def record(**kwargs):
                label = f"//{pkg}:{kwargs['name']}"
                if "visibility" not in kwargs and "default_visibility" in package_defaults:
                    kwargs["visibility"] = list(package_defaults["default_visibility"])
                if kind not in CC_RULES:
                    problems.append(f"{label}: rule {kind} ({path}) is not mirrored by CMake; "
                                    "teach tools/gen_cmake_targets.py and "
                                    "cmake/FsdpTargets.cmake about it")
                    return
                unknown = sorted(set(kwargs) - KNOWN_ATTRS)
                if not cuda_local_defines_only(kwargs.get("local_defines")):
                    problems.append(f"{label}: local_defines other than {sorted(CUDA_LOCAL_DEFINES)} "
                                    "under //comm:with_cuda are not mirrored by CMake")
                tier = kwargs.get("torch_pch", True)
                if not (isinstance(tier, bool) or tier in PCH_TIERS):
                    problems.append(f"{label}: torch_pch must be one of {PCH_TIERS}, got {tier!r}")
                if unknown:
                    problems.append(f"{label}: attribute(s) {', '.join(unknown)} not mirrored by CMake")
                targets[label] = (kind, pkg, kwargs)
            return record

        def glob(include, exclude=(), allow_empty=True, pkg_dir=dirpath):
            found = set()
            for pattern in include:
                for match in pathlib.Path(pkg_dir).glob(pattern):
                    if match.is_file():
                        found.add(str(match.relative_to(pkg_dir)))
            for pattern in exclude:
                found -= {str(m.relative_to(pkg_dir)) for m in pathlib.Path(pkg_dir).glob(pattern)}
            if exclude:
                return sorted(found)
            return GlobList(sorted(found), include)

        loaded = {}

        def load(bzl, *symbols, pkg=rel, **aliases):
            bzl = f"//{pkg}{bzl}" if bzl.startswith(":") else bzl
            for sym in symbols:
                loaded[sym] = bzl
            for alias, sym in aliases.items():
                loaded[alias] = bzl

        env = {
            "load": load,
            "package": lambda **k: package_defaults.update(k),
            "exports_files": lambda *a, **k: None,
            "licenses": lambda *a, **k: None,
            "config_setting": lambda **k: None,
            "select": select,
            "glob": glob,
        }
        for kind in CC_RULES + OTHER_RULES:
            env[kind] = rule(kind)
        for kind in BAZEL_ONLY_RULES:
            env[kind] = lambda **k: None
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        try:
            exec(code, env)  # noqa: S102 - our own BUILD files
        except Exception as e:  # a Starlark feature the stand-ins lack
            problems.append(f"{path}: cannot evaluate ({type(e).__name__}: {e})")
        # A C++ rule used without `load("//tools:cc.bzl", ...)` is Bazel's native one: no
        # precompiled header, and no torch_pch attribute.
        for kind in sorted({kind for kind, p, _ in targets.values() if p == rel}):
            if kind in CC_RULES and loaded.get(kind) != CC_BZL:
                problems.append(f"{path}: {kind} is not loaded from {CC_BZL}")
    return targets, problems


def describe(kind, pkg, kw):
    """The fields CMake must mirror (lists of strings, sorted except args), as
    cmake/FsdpTargets.cmake records them in its manifest."""
    def files(attr, cuda):
        return sorted(f"{pkg}/{s}" if pkg else s for s in resolve(kw.get(attr), cuda))

    def labels(cuda):
        return sorted(normalize_label(d, pkg) for d in resolve(kw.get("deps"), cuda))

    d = {
        "kind": kind + ("+alwayslink" if kw.get("alwayslink") else ""),
        "srcs": sorted(files("srcs", False) + files("hdrs", False)),
        "cuda_srcs": sorted(files("srcs", True) + files("hdrs", True)),
        "deps": labels(False),
        "cuda_deps": labels(True),
        "linkopts": sorted(resolve(kw.get("linkopts"), False)),
    }
    if kind == "cc_test":
        d["size"] = kw.get("size", "medium") + (f"+{kw['timeout']}" if kw.get("timeout") else "")
        # A target in `data` is a build dependency (CMake builds the binaries anyway), not a
        # file; "$(rootpath :bin)" in args is that binary's path, which
        # tools/gen_cmake_targets.py writes as FSDP_TARGET_FILE://pkg:bin.
        d["data"] = sorted(data_file(f, pkg) for f in resolve(kw.get("data"), False) if data_file(f, pkg))
        d["env"] = sorted(f"{k}={v}" for k, v in (kw.get("env") or {}).items())
        d["args"] = [rootpath_as_cmake(a, pkg) for a in kw.get("args") or []]
    return d


def data_file(entry, pkg):
    """A test's data entry as a path from the repository root, or None for a target (a
    binary the test runs: a build dependency, not a file). Files of other packages are
    labels //other:file.ext (exports_files)."""
    if ":" not in entry:
        return os.path.normpath(f"{pkg}/{entry}" if pkg else entry)
    other, _, name = entry.lstrip("/").partition(":")
    if entry.startswith("//") and "." in name:
        return f"{other}/{name}" if other else name
    return None


def rootpath_as_cmake(arg, pkg):
    """"$(rootpath :bin)" -> "FSDP_TARGET_FILE://pkg:bin" (other args unchanged)."""
    m = re.fullmatch(r"\$\(rootpath (:[\w.-]+|//[\w/.-]*:[\w.-]+)\)", arg)
    if not m:
        return arg
    return "FSDP_TARGET_FILE:" + normalize_label(m.group(1), pkg)
