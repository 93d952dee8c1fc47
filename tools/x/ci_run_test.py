""".ci/run with a fake bazel: ./x test then ./x check, the table of each part's wall time, and
the combined 'N passed, N failed' as the last line (CI reads only that line)."""
import os
import re

from fakes import XCase

ROW = re.compile(r"^(test|check) +(\S+) +(\d+)$")


class CiRun(XCase):
    def ci(self, **env):
        return self.x.run(cmd=[os.path.join(self.x.root, ".ci/run")], env={"FSDP_AVX2_RERUN": "0", **env})

    def test_times_table_then_the_sum_last(self):
        rc, out = self.ci()
        self.assertEqual(rc, 0, out)
        lines = out.rstrip("\n").splitlines()
        self.assertEqual(lines[-1], "22 passed, 0 failed")
        table = lines.index("==> wall time of each part (s)")
        self.assertLess(table, lines.index("==> results (test check)"))
        rows = [ROW.match(line).groups()[:2] for line in lines[table + 1:] if ROW.match(line)]
        expected = [("test", n) for n, _ in self.times("test")] + [("check", n) for n, _ in self.times("check")]
        self.assertEqual(rows, expected)
        self.assertIn(("test", "set-up"), rows)
        self.assertIn(("test", "bazel"), rows)
        self.assertIn(("check", "asan+ubsan"), rows)
        self.assertIn(("check", "fuzz"), rows)

    def test_skip_check_and_no_stale_times(self):
        os.makedirs(os.path.join(self.x.root, "build"))
        with open(os.path.join(self.x.root, "build/x-times-check.txt"), "w") as f:
            f.write("fuzz 999\n")
        rc, out = self.ci(FSDP_CI_SKIP_CHECK="1", X_FAKE_FAIL="check_layering.py")
        self.assertEqual(rc, 1)
        self.assertFalse([c for c in self.x.calls("bazel") if c[0] == "build" and c[-1] == "//..."], "no ./x check")
        self.assertEqual({ROW.match(line).group(1) for line in out.splitlines() if ROW.match(line)}, {"test"})
        self.assertEqual(out.rstrip("\n").splitlines()[-1], "12 passed, 1 failed")
