"""./x check (tools/x/check.sh) with a fake bazel and stubbed build scripts: the parts in
order, the sanitizers' own output bases, failures counted, the times file."""
import os
import re
import unittest

from fakes import ROOT, XCase

PARTS = ["build-all", "headers-alone", "consumer", "cmake", "cmake-parity", "cmake-package", "asan+ubsan",
         "tsan", "fuzz"]


class Check(XCase):
    def test_every_part_in_order(self):
        rc, out = self.x.run("check")
        self.assertEqual(rc, 0, out)
        bazel = self.x.calls("bazel")
        self.assertEqual(bazel[:3], [["build", "--keep_going", "//..."],
                                     ["test", "--keep_going", "--test_tag_filters=headers_alone", "//..."],
                                     ["info", "bazel-testlogs"]])
        asan = f"--output_base={self.x.cache}/bazel-check-output"
        tsan = f"--output_base={self.x.cache}/bazel-tsan-output"
        self.assertEqual([c[:3] for c in bazel[3:]], [[asan, "test", "--config=asan"],
                                                      [asan, "info", "--config=asan"],
                                                      [tsan, "test", "--config=tsan"], [tsan, "info", "--config=tsan"]])
        self.assertIn("//fsdp/...", bazel[3])
        self.assertIn("//fsdp/fsdp2:fsdp2_test", bazel[5])
        self.assertEqual([c for c in self.x.calls() if c[0].startswith(("tools/", "cmake/"))], [
            ["tools/consumer_bazel.sh"], ["tools/cmake_build.sh", "--no-check"],
            ["cmake/check_bazel_parity.py", self.x.root, f"{self.x.root}/build/cmake/bazel_parity_manifest.txt"],
            ["tools/cmake_package_check.sh"], ["tools/fuzz.sh"]])
        self.assertIn("cuda build: skipped", out)
        self.assertRegex(self.steps(out)[-1],
                         r"^results \(builds, ASan \+ UBSan, TSan, libFuzzer; times: builds \d+ s, asan\+ubsan \d+ s, "
                         r"tsan \d+ s, fuzz \d+ s\)$")
        self.assertEqual(self.last_line(out), "9 passed, 0 failed")
        self.assertEqual([n for n, _ in self.times("check")], ["set-up", *PARTS, "total"])
        # The output bases remember the checkout (reset_runfiles_if_moved).
        self.assertEqual(open(f"{self.x.cache}/bazel-tsan-output/fsdp_checkout").read().strip(), self.x.root)

    def test_a_failing_part_is_counted_and_the_others_run(self):
        rc, out = self.x.run("check", env={"X_FAKE_BAZEL_FAIL": "--config=tsan", "X_FAKE_FAIL": "consumer_bazel.sh"})
        self.assertNotEqual(rc, 0)
        self.assertIn(["tools/fuzz.sh"], self.x.calls())
        self.assertIn("tsan: 0 passed, 1 failed", out)
        self.assertEqual(self.last_line(out), "7 passed, 2 failed")

    def test_its_debian_packages_are_installed_when_missing(self):
        rc, out = self.x.run("check", env={"X_FAKE_MISSING_DEBS": "ninja-build,clang"})
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("apt-get"), [["update", "-q"], ["install", "-y", "-q", "--no-install-recommends",
                                                                      "ninja-build", "clang"]])


class SanitizedPackages(unittest.TestCase):
    """Every top-level package of the checkout with a cc_test is in CHECK_TARGETS (ASan +
    UBSan) or, by name, in CHECK_UNSANITIZED: a new package is never left out silently."""

    def test_every_package_with_tests_is_listed(self):
        text = open(os.path.join(ROOT, "tools/x/check.sh")).read()
        listed = {}
        for name in ("CHECK_TARGETS", "CHECK_UNSANITIZED"):
            m = re.search(rf"^{name}=\((.*)\)$", text, re.M)
            self.assertIsNotNone(m, f"{name} in tools/x/check.sh")
            for label in m.group(1).split():
                self.assertRegex(label, r"^//[a-z][a-z0-9_]*/\.\.\.$", f"{name}: whole top-level packages only")
                listed[label[2:-4]] = name
        with_tests = set()
        for top in os.listdir(ROOT):
            if top.startswith(("bazel-", ".")) or top in ("third_party", "build"):
                continue
            for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
                if "BUILD.bazel" in files and re.search(r"^cc_test\(", open(os.path.join(dirpath, "BUILD.bazel")).read(), re.M):
                    with_tests.add(top)
                    break
        self.assertIn("pickle", with_tests, "the scan found the packages' tests")
        self.assertEqual(sorted(with_tests - set(listed)), [], "packages with tests in neither list")
        self.assertEqual(sorted(set(listed) - with_tests), [], "listed packages without tests")
