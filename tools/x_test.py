#!/usr/bin/env python3
"""Tests ./x's commands: every tools/x/*_test.py (one per command file, and .ci/run's), each
running ./x in a copy of the checkout with a fake bazel, apt and pip (tools/x/fakes.py), so
no case builds, downloads or installs anything. `./x run` has its own: tools/x_run_test.py.

  python3 tools/x_test.py [ROOT] [-k PATTERN]   (exit status 0 when every case passed)

ROOT (default: this checkout) is the checkout whose ./x is tested. The files run as separate
processes, two at a time (their cases wait on subprocesses, so two share a 2-core machine
well; each case has its own temporary checkout); each file's output is printed whole, in file
order. The last line is 'N passed, N failed', a part of ./x test's sum.
"""
import concurrent.futures
import glob
import importlib.util
import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PARALLEL_FILES = 2


def run_file(path, pattern):
    """One test file's cases in this process: prints its report and 'N passed, N failed'."""
    sys.path.insert(0, os.path.join(HERE, "x"))
    name = os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    if pattern:
        suite = unittest.TestSuite(t for s in suite for t in s if pattern in t.id())
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv):
    root = os.path.abspath(argv.pop(0) if argv and not argv[0].startswith("-") else os.path.join(HERE, ".."))
    os.environ["X_TEST_ROOT"] = root
    pattern = argv[argv.index("-k") + 1] if "-k" in argv else None
    if "--file" in argv:
        return run_file(argv[argv.index("--file") + 1], pattern)
    files = sorted(glob.glob(os.path.join(HERE, "x", "*_test.py")))

    def run(path):
        cmd = [sys.executable, os.path.abspath(__file__), root, "--file", path] + (["-k", pattern] if pattern else [])
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    passed = failed = 0
    with concurrent.futures.ThreadPoolExecutor(PARALLEL_FILES) as pool:
        for path, proc in zip(files, pool.map(run, files)):
            sys.stdout.write(proc.stdout)
            counts = re.findall(r"^(\d+) passed, (\d+) failed$", proc.stdout, re.M)
            if counts:
                passed += int(counts[-1][0])
                failed += int(counts[-1][1])
            if not counts or proc.returncode != 0 and int(counts[-1][1]) == 0:
                print(f"{os.path.relpath(path, HERE)}: exited with {proc.returncode} without its count")
                failed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
