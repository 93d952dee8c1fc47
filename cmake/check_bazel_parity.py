#!/usr/bin/env python3
"""Checks that the CMake build mirrors the Bazel BUILD files.

Usage: check_bazel_parity.py REPO_ROOT MANIFEST        (CMake runs it at configure time)
       check_bazel_parity.py REPO_ROOT --list          (prints the Bazel targets)

BUILD.bazel files are evaluated as Python with stand-ins for the few Starlark built-ins they
use (load, package, select, config_setting, cc_library / cc_test / cc_binary, ...). The
manifest is what CMakeLists.txt declared through cmake/FsdpTargets.cmake (one line per
target). Every Bazel C++ target must be mirrored (same kind, sources, headers, deps, and for
tests size, data, env, args) or be listed as excluded with a reason; a Bazel attribute or
rule this script does not know is reported too, so nothing drifts silently. Exit status 1 on
any difference, with one line per difference.
"""
import os
import pathlib
import sys

SKIP_DIRS = {"third_party", ".git", ".ci", "build"}
KNOWN_ATTRS = {"name", "srcs", "hdrs", "deps", "size", "data", "env", "args", "testonly",
               "linkopts", "visibility", "alwayslink", "timeout"}
CC_RULES = ("cc_library", "cc_test", "cc_binary")


class Select:
    """select(): a dict of condition label -> value."""

    def __init__(self, branches):
        self.branches = dict(branches)


class Configurable:
    """A list attribute possibly concatenated with select()s."""

    def __init__(self, parts):
        self.parts = parts

    def __add__(self, other):
        return Configurable(self.parts + _parts(other))

    def __radd__(self, other):
        return Configurable(_parts(other) + self.parts)


def _parts(value):
    if isinstance(value, Configurable):
        return value.parts
    if isinstance(value, Select):
        return [value]
    return [value]


def select(branches):
    return Configurable([Select(branches)])


def resolve(value, cuda):
    """The value of an attribute in the default configuration, or with --config=cuda
    (conditions ending in ':with_cuda'). Other conditions (e.g. fuzzing) take the default."""
    if value is None:
        return []
    if isinstance(value, Select):
        value = Configurable([value])
    if not isinstance(value, Configurable):
        return value
    out = []
    for part in value.parts:
        if isinstance(part, Select):
            chosen = part.branches.get("//conditions:default", [])
            if cuda:
                for cond, v in part.branches.items():
                    if cond.endswith(":with_cuda"):
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


def load_build_files(root):
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

        def rule(kind, pkg=rel, path=path):
            def record(**kwargs):
                label = f"//{pkg}:{kwargs['name']}"
                if kind not in CC_RULES:
                    problems.append(f"{label}: rule {kind} ({path}) is not mirrored by CMake; "
                                    "teach cmake/check_bazel_parity.py and CMakeLists.txt about it")
                    return
                unknown = sorted(set(kwargs) - KNOWN_ATTRS)
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
            return sorted(found)

        env = {
            "load": lambda *a, **k: None,
            "package": lambda **k: None,
            "exports_files": lambda *a, **k: None,
            "licenses": lambda *a, **k: None,
            "config_setting": lambda **k: None,
            "select": select,
            "glob": glob,
        }
        for kind in CC_RULES + ("cc_import", "filegroup", "sh_test", "sh_binary", "py_test",
                                "py_binary", "py_library", "genrule", "test_suite", "alias"):
            env[kind] = rule(kind)
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        try:
            exec(code, env)  # noqa: S102 - our own BUILD files
        except Exception as e:  # a Starlark feature the stand-ins lack
            problems.append(f"{path}: cannot evaluate ({type(e).__name__}: {e})")
    return targets, problems


def describe(kind, pkg, kw):
    """The fields CMake must mirror (lists of strings, sorted except args)."""
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
        d["data"] = files("data", False)
        d["env"] = sorted(f"{k}={v}" for k, v in (kw.get("env") or {}).items())
        d["args"] = list(kw.get("args") or [])
    return d


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
                d["data"] = files(9)
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
                            "(add it to CMakeLists.txt, or fsdp_bazel_excluded() with a reason)")
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
                                f"only in CMakeLists.txt {only_cmake}")
            else:
                problems.append(f"{label}: {field}: BUILD.bazel {value!r}, CMakeLists.txt {have!r}")
    for label in sorted(set(manifest) - set(targets)):
        problems.append(f"{label}: declared in CMakeLists.txt but not in any BUILD.bazel")
    for p in problems:
        print(f"bazel parity: {p}")
    if problems:
        print(f"bazel parity: {len(problems)} difference(s) between BUILD.bazel files and CMakeLists.txt")
        return 1
    built = sum(1 for s, _ in manifest.values() if s.startswith("built"))
    print(f"bazel parity: {len(targets)} Bazel C++ targets, {built} built by this CMake "
          f"configuration, the rest skipped or excluded with a reason; sources, deps and test "
          f"settings match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
