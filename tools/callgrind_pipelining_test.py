#!/usr/bin/env python3
"""Tests tools/callgrind_pipelining.py on made-up dumps: the slope between a loop's two runs, the
floor interpolated between the whole and the split raw loop with each side's share, and a loop
without its second dump is an error naming it.

  python3 tools/callgrind_pipelining_test.py   (prints 'N passed, N failed'; exit status 1 on a failure)
"""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import callgrind_pipelining  # noqa: E402

BRACKET = 777  # what bracketing a loop costs, in both runs: the slope must cancel it


class Overhead(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.count = 0

    def dump(self, side, name, steps, per_step, trigger="Client Request: "):
        self.count += 1
        with open(os.path.join(self.dir, f"{side}.100.{self.count}"), "w") as f:
            f.write(f"version: 1\ndesc: Trigger: {trigger}{name}/{side}/16 iters={steps}\n"
                    f"events: Ir\ntotals: {steps * per_step + BRACKET}\n")

    def loops(self, side, per_step, steps=(4, 20), trigger="Client Request: "):
        for name, value in per_step.items():
            for n in steps:
                self.dump(side, name, n, value, trigger)

    def log(self, *lines):
        with open(os.path.join(self.dir, "ours.log"), "w") as f:
            f.write("[0;32mnoise\n" + "".join(line + "\n" for line in lines))

    def test_per_action_beyond_each_sides_floor(self):
        self.loops("ours", {"Raw2V": 6000, "Raw2VSplit": 8000, "ZBVZeroBubble": 7500})
        self.loops("pytorch", {"Raw2V": 10000, "Raw2VSplit": 16000, "ZBVZeroBubble": 40000}, (2, 6), "dump ")
        self.log("SCHEDULE ZBVZeroBubble actions=100 split_ours=0.500000 split_pytorch=1.000000 raw=Raw2V "
                 "raw_split=Raw2VSplit")
        rows, ours, torch = callgrind_pipelining.overhead(self.dir)
        self.assertEqual(ours["Raw2V"], 6000)
        self.assertEqual(torch["Raw2VSplit"], 16000)
        # Ours: floor 6000 + 0.5 x (8000 - 6000) = 7000, (7500 - 7000) / 100 = 5. PyTorch's:
        # floor 16000 (share 1), (40000 - 16000) / 100 = 240.
        self.assertEqual(rows, [("ZBVZeroBubble", 100, 0.5, 1.0, 7500, 40000, 5.0, 240.0)])

    def test_a_schedule_without_pytorchs_dumps_is_reported_missing(self):
        self.loops("ours", {"Raw1": 4000, "1F1B": 4200})
        self.loops("pytorch", {"Raw1": 7000}, (2, 6), "dump ")
        self.log("SCHEDULE 1F1B actions=84 split_ours=0.000000 split_pytorch=0.000000 raw=Raw1 raw_split=Raw1Split")
        rows, _, _ = callgrind_pipelining.overhead(self.dir)
        self.assertEqual(rows, [("1F1B", 84, 0.0, 0.0, None, None, None, None)])
        r = subprocess.run([sys.executable, os.path.join(HERE, "callgrind_pipelining.py"), self.dir],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1F1B                   missing: ours True, PyTorch False", r.stdout)

    def test_a_loop_with_one_dump_is_an_error_naming_it(self):
        self.dump("ours", "GPipe", 4, 4400)
        self.log()
        r = subprocess.run([sys.executable, os.path.join(HERE, "callgrind_pipelining.py"), self.dir],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("GPipe has 1 dumps, not 2: [4]", r.stderr)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed - len(result.skipped)} passed, {failed} failed, {len(result.skipped)} skipped")
    sys.exit(1 if failed else 0)
