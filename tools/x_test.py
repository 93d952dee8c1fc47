#!/usr/bin/env python3
"""Tests ./x's commands: every tools/x/*_test.py (one per command file, and .ci/run's), each
running ./x in a copy of the checkout with a fake bazel, apt and pip (tools/x/fakes.py), so
no case builds, downloads or installs anything. `./x run` has its own: tools/x_run_test.py.

  python3 tools/x_test.py [ROOT] [-k PATTERN]   (exit status 0 when every case passed)

ROOT (default: this checkout) is the checkout whose ./x is tested. The last line is
'N passed, N failed', a part of ./x test's sum.
"""
import glob
import importlib.util
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv):
    root = os.path.abspath(argv.pop(0) if argv and not argv[0].startswith("-") else os.path.join(HERE, ".."))
    os.environ["X_TEST_ROOT"] = root
    sys.path.insert(0, os.path.join(HERE, "x"))
    suite = unittest.TestSuite()
    for path in sorted(glob.glob(os.path.join(HERE, "x", "*_test.py"))):
        name = os.path.basename(path)[:-3]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        suite.addTests(unittest.defaultTestLoader.loadTestsFromModule(module))
    pattern = argv[argv.index("-k") + 1] if "-k" in argv else None
    if pattern:
        suite = unittest.TestSuite(t for s in suite for t in s if pattern in t.id())
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    return 1 if failed or result.testsRun == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
