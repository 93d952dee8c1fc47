#!/usr/bin/env python3
"""Tests `./x run` (the torchrun-compatible launcher, tools/x/run.sh) and its arguments. The
other commands' tests are tools/x_test.py's (tools/x/*_test.py).

  python3 tools/x_run_test.py [ROOT]     (exit status 0 when every case passed)

The ranks are a shell script that records its pid and environment, then sleeps or exits, so
the cases need no build. Each wait has a deadline (DEADLINE_S), generous next to `./x run`'s
own grace period (RUN_GRACE_S in tools/x/run.sh), so a slow machine cannot fail a case that
works.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
X = os.path.join(ROOT, "x")
DEADLINE_S = 60

# $1: directory for the pid files; $2: the exit status of rank FAIL_RANK (every rank's when
# FAIL_RANK=all); the others sleep.
RANK_SCRIPT = """#!/usr/bin/env bash
echo "$$ $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT" > "$1/rank$RANK"
if [ "$RANK" = "${FAIL_RANK:-none}" ] || [ "${FAIL_RANK:-}" = all ]; then exit "$2"; fi
exec sleep 1000
"""


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: it waits for a parent that is gone or not reaping yet.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(pred, what):
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {DEADLINE_S} s: {what}")


class XRun(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="x_run_test_")
        self.rank = os.path.join(self.dir, "rank.sh")
        with open(self.rank, "w") as f:
            f.write(RANK_SCRIPT)
        os.chmod(self.rank, 0o755)

    def tearDown(self):
        # A failed case must not leave sleeping ranks behind.
        for f in os.listdir(self.dir):
            if f.startswith("rank") and f != "rank.sh":
                try:
                    os.kill(int(open(os.path.join(self.dir, f)).read().split()[0]), signal.SIGKILL)
                except (ProcessLookupError, ValueError, IndexError):
                    pass

    def launch(self, args, env=None):
        # A new session: the signal goes to ./x alone, as a terminal's Ctrl-C would reach a
        # launcher whose ranks ignore SIGINT (background jobs of a script). SIGINT back to its
        # default first: started as a background job of a script (`./x test &`, CI), this
        # test inherits SIGINT ignored, and bash cannot trap a signal ignored on entry.
        return subprocess.Popen([X, "run"] + args, cwd=ROOT, env={**os.environ, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def rank_pids(self, n):
        files = [os.path.join(self.dir, f"rank{r}") for r in range(n)]
        wait_for(lambda: all(os.path.exists(f) and os.path.getsize(f) > 0 for f in files), f"{n} ranks started")
        return [int(open(f).read().split()[0]) for f in files]

    def expect_signal_stops_every_rank(self, sig, status, world):
        p = self.launch(["-n", str(world), self.rank, self.dir, "0"])
        pids = self.rank_pids(world)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=DEADLINE_S)
        self.assertEqual(p.returncode, status, out)
        wait_for(lambda: not any(alive(pid) for pid in pids), f"every rank gone after {sig.name}")

    def test_sigint_stops_every_rank(self):
        self.expect_signal_stops_every_rank(signal.SIGINT, 130, 3)

    def test_sigterm_stops_every_rank(self):
        self.expect_signal_stops_every_rank(signal.SIGTERM, 143, 2)

    def test_a_failing_rank_stops_the_others(self):
        p = self.launch(["-n", "3", self.rank, self.dir, "7"], env={"FAIL_RANK": "1"})
        out, _ = p.communicate(timeout=DEADLINE_S)
        self.assertEqual(p.returncode, 7, out)
        self.assertIn("rank 1 exited with 7", out)
        pids = self.rank_pids(3)
        wait_for(lambda: not any(alive(pid) for pid in pids), "every rank gone after rank 1 failed")

    def test_torchrun_environment_and_option_spellings(self):
        for args in (["-n", "2"], ["-n=2"], ["--nproc-per-node", "2"], ["--nproc_per_node=2"]):
            for f in os.listdir(self.dir):
                if f.startswith("rank") and f != "rank.sh":
                    os.remove(os.path.join(self.dir, f))
            p = self.launch(args + [self.rank, self.dir, "0"], env={"FAIL_RANK": "all"})
            out, _ = p.communicate(timeout=DEADLINE_S)
            p.stdout.close()
            self.assertEqual(p.returncode, 0, f"{args}: {out}")
            fields = [open(os.path.join(self.dir, f"rank{r}")).read().split() for r in range(2)]
            self.assertEqual([f[1:4] for f in fields], [["0", "2", "0"], ["1", "2", "1"]], args)
            self.assertEqual(fields[0][4:], fields[1][4:], "one rendezvous address for all ranks")

    def test_ranks_run_in_the_callers_directory(self):
        # A relative program and a relative argument, from a directory outside the checkout.
        caller = os.path.join(self.dir, "caller")
        os.makedirs(caller)
        shutil.copy(self.rank, os.path.join(caller, "prog.sh"))
        os.makedirs(os.path.join(caller, "out"))
        r = subprocess.run([X, "run", "-n", "2", "./prog.sh", "out", "0"], cwd=caller, capture_output=True, text=True,
                           timeout=DEADLINE_S, env={**os.environ, "FAIL_RANK": "all"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for rank in range(2):
            self.assertTrue(os.path.exists(os.path.join(caller, "out", f"rank{rank}")), r.stdout + r.stderr)

    def test_bad_arguments_are_errors_naming_them(self):
        for args, words in ((["-n", "0", self.rank], "positive integer, got '0'"),
                            (["-n", "x", self.rank], "got 'x'"),
                            (["-q", self.rank], "unknown option '-q'"),
                            (["-n", "2"], "missing binary")):
            r = subprocess.run([X, "run"] + args, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(words, r.stderr, args)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
