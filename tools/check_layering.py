"""The layering rules the build enforces, checked over the BUILD files and the sources.

Usage: check_layering.py [--fix] [ROOT]   (exit status 1 and one line per violation when any)
--fix adds the missing dependency to the BUILD file where exactly one target provides the header.

Bazel here compiles without a sandbox (.bazelrc: --spawn_strategy=local, LibTorch's thousands
of headers), so any header in the tree is includable and a missing dependency only shows on
another build (CMake, a consumer). This check closes that gap:

1. Declared includes. A C++ target may include a project header only when the target itself
   or one of its direct `deps` lists that header in `hdrs` (a header in another target's
   `srcs` is that target's own and includable by nobody else).
2. Private by default. A library package (every package outside NON_LIBRARY_PACKAGES) has no
   public default visibility: each public target says so itself.
3. Internals stay home. A target named `internal` (or `*_internal`) is visible to its own
   package only (`:__pkg__`, or `:__subpackages__` of its package).
4. The dependency table in docs/design/architecture.md (between EDGES_BEGIN and EDGES_END)
   is the library targets' edges as the BUILD files have them (--fix rewrites it).

Targets come from cmake/bazel_build_files.py (the BUILD files evaluated as Python).
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cmake"))
import bazel_build_files as bbf  # noqa: E402

# Packages whose targets are programs, tests or test support, not libraries users link.
NON_LIBRARY_PACKAGES = ("examples", "bench", "tools", "fuzz", "tests", "third_party")
EDGES_DOC = os.path.join("docs", "design", "architecture.md")
EDGES_BEGIN = "<!-- dependency table: tools/check_layering.py --fix writes it -->"
EDGES_END = "<!-- end of dependency table -->"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
PUBLIC = "//visibility:public"


def is_library_package(pkg):
    return bool(pkg) and not any(pkg == p or pkg.startswith(p + "/") for p in NON_LIBRARY_PACKAGES)


def files_of(kw, attr, pkg):
    out = set()
    for cuda in (False, True):
        for f in bbf.resolve(kw.get(attr), cuda):
            if isinstance(f, str) and ":" not in f:
                out.add(f"{pkg}/{f}" if pkg else f)
    return out


def deps_of(kw, pkg):
    out = set()
    for cuda in (False, True):
        out.update(bbf.normalize_label(d, pkg) for d in bbf.resolve(kw.get("deps"), cuda))
    return out


def check(root):
    targets, problems = bbf.load_build_files(root)
    violations = [f"BUILD files: {p}" for p in problems if "cannot evaluate" in p]
    missing = []  # (label, the one target providing an included header)
    providers = {}  # header -> labels listing it in hdrs
    for label, (_, pkg, kw) in targets.items():
        for h in files_of(kw, "hdrs", pkg):
            providers.setdefault(h, set()).add(label)
    owned_privately = {}  # header in srcs -> label
    for label, (_, pkg, kw) in targets.items():
        for s in files_of(kw, "srcs", pkg):
            if s.endswith(".h"):
                owned_privately[s] = label

    for label, (_, pkg, kw) in targets.items():
        own = files_of(kw, "srcs", pkg) | files_of(kw, "hdrs", pkg)
        deps = deps_of(kw, pkg)
        for f in sorted(own):
            path = os.path.join(root, f)
            if not os.path.isfile(path):
                continue
            with open(path, errors="replace") as fh:
                text = fh.read()
            for inc in INCLUDE.findall(text):
                if inc in own or not os.path.isfile(os.path.join(root, inc)):
                    continue  # its own file, or not a project header (generated, system)
                provided_by = providers.get(inc, set())
                if provided_by & deps:
                    continue
                if provided_by:
                    if len(provided_by) == 1:
                        missing.append((label, next(iter(provided_by))))
                    violations.append(f"{f} (in {label}) includes {inc} but none of its deps provides it: "
                                      f"add one of {', '.join(sorted(provided_by))}")
                elif inc in owned_privately:
                    violations.append(f"{f} (in {label}) includes {inc}, a private header of "
                                      f"{owned_privately[inc]} (in its srcs): use that target's public headers")
                else:
                    violations.append(f"{f} (in {label}) includes {inc}, which no target lists in hdrs")

    packages = {}
    for label, (_, pkg, kw) in targets.items():
        packages.setdefault(pkg, []).append((label, kw))
    for pkg in sorted(packages):
        if not is_library_package(pkg):
            continue
        build = os.path.join(root, pkg, "BUILD.bazel")
        with open(build) as fh:
            text = fh.read()
        m = re.search(r"package\s*\(([^)]*)\)", text, re.S)
        if m and PUBLIC in m.group(1):
            violations.append(f"{pkg}/BUILD.bazel: default_visibility is public; "
                              "a library package lists its public targets one by one")
        for label, kw in packages[pkg]:
            name = label.rsplit(":", 1)[1]
            if name != "internal" and not name.endswith("_internal"):
                continue
            allowed = {f"//{pkg}:__pkg__", f"//{pkg}:__subpackages__"}
            vis = set(kw.get("visibility") or [])
            if not vis or not vis <= allowed:
                violations.append(f"{label}: an internal target is visible to its package only "
                                  f"(visibility = [\"//{pkg}:__pkg__\"]), got {sorted(vis) or 'the default'}")
    return violations, missing, targets


def short(label):
    pkg, _, name = label[2:].partition(":")
    return f"//{pkg}" if pkg.rsplit("/", 1)[-1] == name else label


def edges_table(targets):
    """The markdown table of each library target's dependencies inside this repository."""
    rows = ["| target | depends on |", "|---|---|"]
    def order(item):
        pkg, _, name = item[0][2:].partition(":")
        return (pkg, name != pkg.rsplit("/", 1)[-1], name)

    for label, (kind, pkg, kw) in sorted(targets.items(), key=order):
        if kind != "cc_library" or kw.get("testonly") or not is_library_package(pkg) or pkg == "testing":
            continue
        deps = sorted(short(d) for d in deps_of(kw, pkg) if d.startswith("//"))
        rows.append(f"| `{short(label)}` | {', '.join(f'`{d}`' for d in deps) or 'nothing in this repository'} |")
    return "\n".join(rows)


def check_edges_doc(root, targets, fix):
    path = os.path.join(root, EDGES_DOC)
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        text = fh.read()
    begin, end = text.find(EDGES_BEGIN), text.find(EDGES_END)
    if begin < 0 or end < begin:
        return [f"{EDGES_DOC}: no dependency table markers ({EDGES_BEGIN} ... {EDGES_END})"]
    table = "\n" + edges_table(targets) + "\n"
    if text[begin + len(EDGES_BEGIN):end] == table:
        return []
    if fix:
        with open(path, "w") as fh:
            fh.write(text[:begin + len(EDGES_BEGIN)] + table + text[end:])
        print(f"--fix: rewrote the dependency table in {EDGES_DOC}")
        return []
    return [f"{EDGES_DOC}: the dependency table differs from the BUILD files (run tools/check_layering.py --fix)"]


def written_label(dep, pkg):
    """The label as pkg's BUILD file writes it: ':x' in its own package, '//a/b' for //a/b:b."""
    dep_pkg, _, name = dep[2:].partition(":")
    if dep_pkg == pkg:
        return f":{name}"
    return f"//{dep_pkg}" if dep_pkg.rsplit("/", 1)[-1] == name else dep


def add_deps(root, missing):
    """Adds each (label, dep) to label's `deps = [...]` in its BUILD file, kept sorted."""
    for label, dep in sorted(set(missing)):
        pkg, _, name = label[2:].partition(":")
        path = os.path.join(root, pkg, "BUILD.bazel")
        with open(path) as fh:
            text = fh.read()
        start = re.search(r'name\s*=\s*"%s"' % re.escape(name), text)
        deps = re.compile(r"deps\s*=\s*\[(.*?)\]", re.S).search(text, start.end()) if start else None
        if not deps:
            print(f"--fix: no deps list for {label} in {path}; add {dep} by hand")
            continue
        items = re.findall(r'"([^"]+)"', deps.group(1))
        items.append(written_label(dep, pkg))
        local = sorted(i for i in set(items) if i.startswith(":"))
        ours = sorted(i for i in set(items) if i.startswith("//"))
        external = sorted(i for i in set(items) if i.startswith("@"))
        body = "".join(f'        "{i}",\n' for i in local + ours + external)
        text = text[:deps.start()] + "deps = [\n" + body + "    ]" + text[deps.end():]
        with open(path, "w") as fh:
            fh.write(text)
        print(f"--fix: {label} now depends on {dep}")


def main():
    args = sys.argv[1:]
    fix = "--fix" in args
    args = [a for a in args if a != "--fix"]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    violations, missing, targets = check(root)
    if fix and missing:
        add_deps(root, missing)
        violations, missing, targets = check(root)
    violations += check_edges_doc(root, targets, fix)
    for v in violations:
        print(v)
    print(f"layering: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
