"""./x test (tools/x/test.sh) with a fake bazel: the parts, the bazel invocations, the AVX2
rerun, a fresh machine's background peer venv, failures counted, the times file."""
import os

from fakes import XCase

WHOLE = ["--build_tests_only", "//..."]
CHECKS = ["tools/gen_cmake_targets.py", "tools/check_doc_links.py", "tools/check_layering.py",
          "tools/check_target_deps.py", "tools/check_doc_claims.py", "tools/check_format.py",
          "tools/check_layering_test.py", "tools/check_doc_claims_test.py", "tools/x_run_test.py", "tools/plot_metrics_test.py",
          "tools/callgrind_pipelining_test.py", "tools/x_test.py"]
PARTS = ["cmake-targets", "doc-links", "layering", "target-deps", "doc-claims", "format", "layering-check",
         "doc-claims-check", "x", "plot-metrics", "pipeline-overhead", "x-commands"]


class WholeSuite(XCase):
    def test_every_part_once_without_the_rerun(self):
        rc, out = self.x.run("test", env={"FSDP_AVX2_RERUN": "0"})
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("bazel"), [["test", "--keep_going", *WHOLE, "--test_tag_filters=-headers_alone"],
                                                 ["info", "bazel-testlogs"]])
        self.assertEqual([c[0] for c in self.x.calls() if c[0].startswith("tools/")], CHECKS)
        self.assertIn(["tools/check_layering.py", self.x.root], self.x.calls())
        self.assertIn(["tools/gen_cmake_targets.py", "--check"], self.x.calls())
        self.assertIn("float_parity rerun under ATEN_CPU_CAPABILITY=avx2: not needed", out)
        self.assertEqual(self.last_line(out), "13 passed, 0 failed")
        self.assertTrue(self.steps(out)[-1].startswith(f"results ({' '.join(PARTS)} bazel; times: bazel "), out)
        self.assertEqual([n for n, _ in self.times("test")], ["set-up", *PARTS, "bazel", "total"])
        for part in PARTS + ["bazel"]:
            self.assertTrue(os.path.exists(os.path.join(self.x.root, f"build/test-{part}.txt")), part)

    def test_the_avx2_rerun_when_forced(self):
        rc, out = self.x.run("test", env={"FSDP_AVX2_RERUN": "1"})
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("bazel")[2:], [
            ["test", "--keep_going", "--test_tag_filters=float_parity", "--test_env=ATEN_CPU_CAPABILITY=avx2", *WHOLE],
            ["info", "bazel-testlogs"]])
        self.assertIn(", avx2 rerun ", self.steps(out)[-1])
        self.assertEqual(self.last_line(out), "14 passed, 0 failed")
        self.assertEqual([n for n, _ in self.times("test")][-2:], ["avx2", "total"])

    def test_failures_are_counted_and_every_part_still_runs(self):
        rc, out = self.x.run("test", env={"FSDP_AVX2_RERUN": "1", "X_FAKE_FAIL": "check_format.py",
                                          "X_FAKE_BAZEL_FAIL": "float_parity"})
        self.assertNotEqual(rc, 0)
        self.assertIn("tools/check_format.py: fake failure", out)
        self.assertIn("format: 0 passed, 1 failed", out)
        self.assertIn("FAILED: //fake:test: FAILED", out)
        self.assertEqual(len(self.x.calls("bazel")), 4)
        self.assertEqual(self.last_line(out), "12 passed, 2 failed")


class Targets(XCase):
    def test_only_bazel_test_of_the_targets_with_the_flags(self):
        rc, out = self.x.run("test", "--config=opt", "//foo:bar", "//baz/...", env={"FSDP_AVX2_RERUN": "1"})
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("bazel"), [["test", "--keep_going", "//foo:bar", "//baz/...", "--config=opt"],
                                                 ["info", "bazel-testlogs"]])
        self.assertFalse([c for c in self.x.calls() if c[0].startswith("tools/")])
        self.assertEqual(self.last_line(out), "1 passed, 0 failed")
        self.assertEqual([n for n, _ in self.times("test")], ["set-up", "bazel", "total"])


class FreshMachine(XCase):
    """No peer venv yet: it installs in the background while the tests build."""
    venvs = "no-peer"

    def test_tests_without_the_peer_venv_run_while_it_installs(self):
        rc, out = self.x.run("test", env={"FSDP_AVX2_RERUN": "0", "X_FAKE_PIP_WAITS": "1"})
        self.assertEqual(rc, 0, out)
        build = ["build", "--keep_going", *WHOLE, "--test_tag_filters=-headers_alone"]
        self.assertEqual(self.x.calls("bazel"), [
            build, ["test", "--keep_going", *WHOLE, "--test_tag_filters=-headers_alone,-peer_python"],
            ["info", "bazel-testlogs"],
            ["test", "--keep_going", *WHOLE, "--test_tag_filters=-headers_alone,peer_python"],
            ["info", "bazel-testlogs"]])
        self.assertEqual([c[1:] for c in self.x.calls("pip") if c[0] == self.x.peer_venv],
                         [["-q", "--no-compile", f"torch=={self.x.version}"],
                          ["-q", "--no-compile", "transformers==5.24.0"],
                          ["-q", "--no-compile", "torchtitan==0.3.0", "torchao==0.18.0", f"torch=={self.x.version}"],
                          ["-q", "--no-compile", "matplotlib==3.11.2"]])
        self.assertIn(f"FSDP_PEER_PYTHON={self.x.peer_venv}/bin/python", self.x.read(".bazelrc.user"))
        self.assertIn("times: build ", self.steps(out)[-1])
        self.assertIn(", peer tests (and the wait) ", self.steps(out)[-1])
        self.assertEqual([n for n, _ in self.times("test")][-4:], ["build", "bazel", "bazel-peer", "total"])
        self.assertEqual(self.last_line(out), "14 passed, 0 failed")

    def test_one_bazel_test_when_the_peer_venv_is_ready_after_the_build(self):
        rc, out = self.x.run("test", env={"FSDP_AVX2_RERUN": "0", "X_FAKE_BUILD_WAITS": "1"})
        self.assertEqual(rc, 0, out)
        self.assertEqual(self.x.calls("bazel"), [
            ["build", "--keep_going", *WHOLE, "--test_tag_filters=-headers_alone"],
            ["test", "--keep_going", *WHOLE, "--test_tag_filters=-headers_alone"], ["info", "bazel-testlogs"]])
        self.assertIn("peer venv ready after", out)
        self.assertIn(f"FSDP_PEER_PYTHON={self.x.peer_venv}/bin/python", self.x.read(".bazelrc.user"))
        self.assertEqual(self.last_line(out), "13 passed, 0 failed")
