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
4. Declared package edges. docs/design/architecture.md declares by hand, per Bazel package,
   the packages its libraries may depend on and those its tests (and testonly support) may
   depend on besides. A target's edge to another package must be declared; the declared
   library edges form no cycle; a test may not reach into a package that depends on its own
   (TEST_SUPPORT excepted); a declared edge no target uses is stale. --fix never writes the
   table: a new edge is a design decision.

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
ALLOWED_BEGIN = "<!-- allowed package edges: tools/check_layering.py checks the BUILD files against them -->"
ALLOWED_END = "<!-- end of allowed package edges -->"
# Test support every package's tests use although it stands on comm (the multi-rank runner):
# a test edge into it is no reach up.
TEST_SUPPORT = ("testing",)
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


def package_of(label):
    return label[2:].partition(":")[0]


def is_test_side(kind, kw):
    """Tests, programs and testonly support: nothing a library links."""
    return kind != "cc_library" or bool(kw.get("testonly"))


def actual_edges(targets):
    """{(package, dependency package): [labels]} for the libraries, and the same for the rest."""
    lib, test = {}, {}
    for label, (kind, pkg, kw) in targets.items():
        for dep in deps_of(kw, pkg):
            if not dep.startswith("//") or package_of(dep) == pkg:
                continue
            (test if is_test_side(kind, kw) else lib).setdefault((pkg, package_of(dep)), []).append(label)
    return lib, test


def parse_allowed(text):
    """The hand-written table: {package: (library deps, extra test deps)}, or an error string."""
    begin, end = text.find(ALLOWED_BEGIN), text.find(ALLOWED_END)
    if begin < 0 or end < begin:
        return f"{EDGES_DOC}: no allowed-edges table ({ALLOWED_BEGIN} ... {ALLOWED_END})"
    allowed = {}
    for line in text[begin + len(ALLOWED_BEGIN):end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        pkg = cells[0].strip("`")
        allowed[pkg] = tuple(set(re.findall(r"`([^`]+)`", c)) for c in cells[1:])
    return allowed


def find_cycle(graph):
    """One cycle of the directed graph {node: set(nodes)} as a list of nodes, or None."""
    state = {}

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def reaches(graph, src, dst):
    seen, todo = set(), [src]
    while todo:
        node = todo.pop()
        if node == dst:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def check_allowed_edges(root, targets):
    """Rule 4: the package edges the BUILD files have against the ones declared by hand."""
    path = os.path.join(root, EDGES_DOC)
    if not os.path.isfile(path):
        return [f"{EDGES_DOC}: missing (it declares the allowed package edges)"]
    with open(path) as fh:
        allowed = parse_allowed(fh.read())
    if isinstance(allowed, str):
        return [allowed]
    out = []
    packages = {pkg for _, pkg, _ in targets.values()}
    for pkg in sorted(packages - set(allowed)):
        out.append(f"{EDGES_DOC}: package {pkg or '(root)'} is not in the allowed-edges table: declare what it "
                   "may depend on")
    for pkg in sorted(set(allowed) - packages):
        out.append(f"{EDGES_DOC}: the allowed-edges table names {pkg}, which has no BUILD file")
    library_graph = {pkg: set(libs) for pkg, (libs, _) in allowed.items()}
    cycle = find_cycle(library_graph)
    if cycle:
        out.append(f"{EDGES_DOC}: the allowed library edges have a cycle: {' -> '.join(cycle)}")
    lib, test = actual_edges(targets)
    for (pkg, dep), labels in sorted(lib.items()):
        if dep not in allowed.get(pkg, (set(), set()))[0]:
            why = (f"it reaches up: {dep} depends on {pkg}" if reaches(library_graph, dep, pkg)
                   else "declare it there if the design wants it")
            out.append(f"{labels[0]}: the library edge {pkg} -> {dep} is not allowed ({EDGES_DOC}); {why}")
    for (pkg, dep), labels in sorted(test.items()):
        libs, tests = allowed.get(pkg, (set(), set()))
        if dep not in libs | tests:
            out.append(f"{labels[0]}: the test edge {pkg} -> {dep} is not allowed ({EDGES_DOC}); declare it there "
                       "if the design wants it")
        elif dep not in TEST_SUPPORT and reaches(library_graph, dep, pkg):
            out.append(f"{labels[0]}: a test of {pkg} reaches up into {dep}, which depends on {pkg}: "
                       f"move the test above both (e.g. //tests)")
    used = set(lib) | set(test)
    for pkg, (libs, tests) in sorted(allowed.items()):
        for dep in sorted(libs | tests):
            if (pkg, dep) not in used:
                out.append(f"{EDGES_DOC}: the allowed edge {pkg} -> {dep} is used by no target: remove it")
        for dep in sorted(libs & tests):
            out.append(f"{EDGES_DOC}: {pkg} -> {dep} is declared for libraries and again for tests")
        for dep in sorted(libs):
            if is_library_package(pkg) and not is_library_package(dep):
                out.append(f"{EDGES_DOC}: library package {pkg} may not depend on the program package {dep}")
    return out


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
    violations += check_allowed_edges(root, targets)
    for v in violations:
        print(v)
    print(f"layering: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
