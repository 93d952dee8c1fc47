"""tools/check_doc_claims.py against a planted tree: each kind of false claim (label, path,
test filter, C++ name, ./x command and flag, tool flag, FSDP_* variable) is caught on its line,
and the same document with true claims passes.

Usage: check_doc_claims_test.py   (prints 'N passed, N failed'; exit status 1 on a failure)
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planted_cases import Cases, run_check  # noqa: E402

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_doc_claims.py")

LIB_BUILD = '''load("//tools:cc.bzl", "cc_library", "cc_test")

cc_library(
    name = "lib",
    srcs = ["lib.cc"],
    hdrs = ["lib.h"],
)

cc_test(
    name = "lib_test",
    srcs = ["lib_test.cc"],
    deps = [":lib"],
)

config_setting(
    name = "with_cuda",
    define_values = {"with_cuda": "true"},
)
'''
FILES = {
    "lib/BUILD.bazel": LIB_BUILD,
    "lib/lib.h": "#pragma once\nnamespace lib {\n// DumpOld was renamed.\nvoid DumpAll();\n"
                 'inline const char* kRange = "LIB::pre_forward";\n}\n',
    "lib/lib.cc": '#include "lib/lib.h"\n#include <cstdlib>\n'
                  'void lib::DumpAll() { std::getenv("FSDP_LIB_DEBUG"); }\n',
    "lib/lib_test.cc": "TEST(LibSuite, Works) {}\nTEST_P(LibParam, Each) {}\n"
                       "INSTANTIATE_TEST_SUITE_P(Sizes, LibParam, testing::Values(1));\n",
    "tools/BUILD.bazel": "",
    "tools/gen.py": 'import sys\nCHECK = "--check" in sys.argv\n',
    "x": 'X_COMMANDS=(test bench help)\n',
    "tools/x/test.sh": "# x test [TARGET]: the tests\nx_test() { :; }\n",
    "tools/x/bench.sh": "# x bench [--quick]: the benchmarks\nx_bench() { echo --quick; }\n",
    "tools/x/help.sh": "# x help: this text\n",
}
# (true claim, false claim, what the checker says about the false one)
CLAIMS = [
    ("`//lib`, `//lib:lib_test`, `@libtorch_fsdp//lib:lib`, `//lib/...`, `//lib:with_cuda`",
     "`//lib:gone`", "no Bazel target //lib:gone"),
    ("`//lib:lib.h` and `@libtorch//:torch` (another repository)", "`//nopkg/...`",
     "no Bazel target //nopkg/..."),
    ("`lib/lib.h`, `lib/`, `lib/*.cc`, `tools/gen.py`, `torch/distributed/fsdp/_flat_param.py`",
     "`lib/old.h`", "no file or directory lib/old.h"),
    ("the end of a path: `lib/lib_test.cc`", "`lib/*.py`", "no file or directory lib/*.py"),
    ("`bazel test //lib:lib_test --test_arg=--gtest_filter='LibSuite.*:Sizes/LibParam.*-LibSuite.Works'`",
     "`--gtest_filter=LibSweet*`", "--gtest_filter pattern LibSweet* matches no test"),
    ("`LibSuite.Work*`", "`LibSuite.Fails*`", "LibSuite.Fails* matches no test and no name in code"),
    ("`lib::DumpAll()`, `DumpAll()`, `LIB::pre_forward`, `torch::nn::Gone`", "`lib::DumpOld()`",
     "DumpOld is in the code of no .h/.cc file"),
    ("`./x test //lib/...`, `./x bench --quick`", "`./x golden`", "./x has no command golden"),
    ("`./x help`", "`./x bench --slow`", "./x bench has no flag --slow"),
    ("`tools/gen.py --check`", "`tools/gen.py --fix`", "tools/gen.py has no flag --fix"),
    ("`FSDP_LIB_DEBUG=1`", "`FSDP_LIB_TRACE`", "no source reads or sets FSDP_LIB_TRACE"),
]
FENCED_TRUE = "```sh\n// a comment, not a label\n./x test //lib:lib_test --test_arg=--gtest_filter=LibSuite.*\n```\n"
FENCED_FALSE = "```sh\n./x demo\nbazel test //lib:nope\n```\n"


def plant(root, docs):
    files = dict(FILES, **docs)
    for path, text in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as fh:
            fh.write(text)


def run(root):
    return run_check(CHECK, root)


def main():
    cases = Cases()
    expect = cases.expect

    with tempfile.TemporaryDirectory() as root:
        doc = "".join(f"{false}\n" for _, false, _ in CLAIMS) + FENCED_FALSE
        plant(root, {"README.md": "# t\n", "docs/guide/a.md": doc})
        rc, out = run(root)
        for number, (_, false, message) in enumerate(CLAIMS, 1):
            expect(f"false {false} is caught", f"docs/guide/a.md:{number}: {message}" in out, out)
        fence = len(CLAIMS) + 2
        expect("a fenced ./x command is checked", f"docs/guide/a.md:{fence}: ./x has no command demo" in out, out)
        expect("a fenced label is checked", f"docs/guide/a.md:{fence + 1}: no Bazel target //lib:nope" in out, out)
        expect("the false claims fail", rc == 1 and f"doc claims: {len(CLAIMS) + 2} false claim(s)" in out, out)
    with tempfile.TemporaryDirectory() as root:
        doc = "".join(f"{true}\n" for true, _, _ in CLAIMS) + FENCED_TRUE
        plant(root, {"README.md": "`//lib` in the README\n", "docs/guide/a.md": doc})
        rc, out = run(root)
        expect("true claims pass", rc == 0 and "doc claims: 0 false claim(s)" in out, out)
    return cases.summary()


if __name__ == "__main__":
    sys.exit(main())
