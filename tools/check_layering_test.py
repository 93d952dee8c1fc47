"""tools/check_layering.py against a planted tree: each rule catches its violation (an
undeclared edge, a cycle among the declared edges, a test reaching up, a stale declaration
among them), --fix adds the one missing dependency it can, and a clean tree passes.

Usage: check_layering_test.py   (prints 'N passed, N failed'; exit status 1 on a failure)
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planted_cases import Cases, run_check  # noqa: E402

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_layering.py")

LIB_BUILD = '''load("//tools:cc.bzl", "cc_library")

cc_library(
    name = "lib",
    srcs = ["lib.cc", "lib_detail.h"],
    hdrs = ["lib.h"],
    visibility = ["//visibility:public"],
)

cc_library(
    name = "internal",
    hdrs = ["internal.h"],
    visibility = {internal_visibility},
)
'''
OPEN_BUILD = '''load("//tools:cc.bzl", "cc_library")

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "open",
    hdrs = ["open.h"],
)
'''
APP_BUILD = '''load("//tools:cc.bzl", "cc_binary")

cc_binary(
    name = "app",
    srcs = ["app.cc"],
    deps = [{app_deps}],
)
'''


# The allowed edges of the planted tree: lib at the bottom, examples above it.
ALLOWED = """<!-- allowed package edges: tools/check_layering.py checks the BUILD files against them -->
| package | its libraries may depend on | its tests may also depend on |
|---|---|---|
{rows}
<!-- end of allowed package edges -->
"""
CLEAN_ROWS = "| `lib` | - | - |\n| `examples` | - | `lib` |"


def plant(root, internal_visibility, app_deps, app_includes, open_package, rows=CLEAN_ROWS):
    files = {
        "docs/design/architecture.md": ALLOWED.format(rows=rows + ("\n| `open` | - | - |" if open_package else "")),
        "lib/BUILD.bazel": LIB_BUILD.format(internal_visibility=internal_visibility),
        "lib/lib.h": "#pragma once\n",
        "lib/lib_detail.h": "#pragma once\n",
        "lib/lib.cc": '#include "lib/lib.h"\n#include "lib/lib_detail.h"\n',
        "lib/internal.h": "#pragma once\n",
        "examples/BUILD.bazel": APP_BUILD.format(app_deps=app_deps),
        "examples/app.cc": "".join(f'#include "{h}"\n' for h in app_includes) + "int main() {}\n",
    }
    if open_package:
        files["open/BUILD.bazel"] = OPEN_BUILD
        files["open/open.h"] = "#pragma once\n"
    for path, text in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as fh:
            fh.write(text)


def run(root, *args):
    return run_check(CHECK, root, *args)


def main():
    cases = Cases()
    expect = cases.expect

    with tempfile.TemporaryDirectory() as root:
        plant(root, '["//visibility:public"]', "", ["lib/lib.h", "lib/lib_detail.h"], open_package=True)
        rc, out = run(root)
        expect("an undeclared include fails", rc == 1 and "includes lib/lib.h but none of its deps provides it" in out,
               out)
        expect("a private header of another target fails", "a private header of //lib:lib" in out, out)
        expect("a public default visibility fails", "open/BUILD.bazel: default_visibility is public" in out, out)
        expect("a public internal target fails", "//lib:internal: an internal target is visible to its package only"
               in out, out)
        rc, out = run(root, "--fix")
        with open(os.path.join(root, "examples/BUILD.bazel")) as fh:
            fixed = fh.read()
        expect("--fix adds the one providing target", '"//lib"' in fixed, out + fixed)
    with tempfile.TemporaryDirectory() as root:
        plant(root, '["//lib:__pkg__"]', '"//lib"', ["lib/lib.h"], open_package=False)
        rc, out = run(root)
        expect("a clean tree passes", rc == 0 and "layering: 0 violation(s)" in out, out)
    with tempfile.TemporaryDirectory() as root:
        plant(root, '["//lib:__pkg__"]', '"//lib"', ["lib/lib.h"], open_package=False,
              rows="| `lib` | - | - |\n| `examples` | - | - |")
        rc, out = run(root)
        expect("an undeclared edge fails", rc == 1 and "the test edge examples -> lib is not allowed" in out, out)
    with tempfile.TemporaryDirectory() as root:
        # lib's library may depend on examples and examples' on lib: a cycle; and lib's edge is unused.
        plant(root, '["//lib:__pkg__"]', '"//lib"', ["lib/lib.h"], open_package=False,
              rows="| `lib` | `examples` | - |\n| `examples` | `lib` | - |")
        rc, out = run(root)
        expect("a cycle among the declared edges fails",
               rc == 1 and "have a cycle: examples -> lib -> examples" in out, out)
        expect("a declared edge no target uses fails", "the allowed edge lib -> examples is used by no target" in out,
               out)
        expect("an edge declared for libraries serves the tests too",
               "the test edge examples -> lib" not in out, out)
    with tempfile.TemporaryDirectory() as root:
        # A test of lib that depends on examples, which depends on lib: a reach up.
        plant(root, '["//lib:__pkg__"]', '"//lib"', ["lib/lib.h"], open_package=False,
              rows="| `lib` | - | `examples` |\n| `examples` | `lib` | - |")
        with open(os.path.join(root, "lib/BUILD.bazel"), "a") as fh:
            fh.write('\ncc_test(\n    name = "lib_test",\n    srcs = ["lib_test.cc"],\n'
                     '    deps = [":lib", "//examples:app"],\n)\n')
        with open(os.path.join(root, "lib/lib_test.cc"), "w") as fh:
            fh.write('#include "lib/lib.h"\n')
        with open(os.path.join(root, "examples/BUILD.bazel")) as fh:
            text = fh.read()
        with open(os.path.join(root, "examples/BUILD.bazel"), "w") as fh:
            fh.write(text.replace("cc_binary", "cc_library").replace('"app"', '"app",\n    visibility = ["//lib:__pkg__"]'))
        rc, out = run(root)
        expect("a test reaching into a package above its own fails",
               rc == 1 and "a test of lib reaches up into examples, which depends on lib" in out, out)
    return cases.summary()


if __name__ == "__main__":
    sys.exit(main())
