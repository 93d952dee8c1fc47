"""tools/check_layering.py against a planted tree: each rule catches its violation, --fix adds
the one missing dependency it can, and a clean tree passes.

Usage: check_layering_test.py   (prints 'N passed, N failed'; exit status 1 on a failure)
"""
import os
import subprocess
import sys
import tempfile

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


def plant(root, internal_visibility, app_deps, app_includes, open_package):
    files = {
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
    r = subprocess.run([sys.executable, CHECK, *args, root], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def main():
    passed = failed = 0

    def expect(name, ok, output):
        nonlocal passed, failed
        if ok:
            passed += 1
            print(f"ok      {name}")
        else:
            failed += 1
            print(f"FAILED  {name}\n{output}")

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
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
