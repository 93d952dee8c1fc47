#!/usr/bin/env python3
"""Tests tools/plot_metrics.py: two small runs give a PNG; bad files are errors naming them.

  python3 tools/plot_metrics_test.py   (prints 'N passed, N failed'; exit status 1 on a failure)

The plot runs with a Python that has matplotlib: this one, else the peer venv's (FSDP_PEER_PYTHON,
else ./x setup's at $FSDP_CACHE_DIR or ~/.cache/libtorch-fsdp/peer-venv-torch-<version>, where
./x setup installs it); the cases that draw skip, with the reason, where none has it. The error
cases need no matplotlib (the files are read first).
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLOT = os.path.join(HERE, "plot_metrics.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def has_matplotlib(python):
    return subprocess.run([python, "-c", "import matplotlib"], capture_output=True).returncode == 0


def plotting_python():
    """(a Python with matplotlib, or None; why not)."""
    if has_matplotlib(sys.executable):
        return sys.executable, ""
    peer = os.environ.get("FSDP_PEER_PYTHON")
    if not peer:
        with open(os.path.join(ROOT, "third_party", "torch_version.txt")) as f:
            version = f.read().strip()
        cache = os.environ.get("FSDP_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "libtorch-fsdp")
        peer = os.path.join(cache, f"peer-venv-torch-{version}", "bin", "python")
    if not os.access(peer, os.X_OK):
        return None, f"no matplotlib for {sys.executable} and no peer venv Python at {peer} (./x setup)"
    if not has_matplotlib(peer):
        return None, f"matplotlib is not installed for {sys.executable} nor {peer} (./x setup installs it)"
    return peer, ""


PYTHON, WHY_NOT = plotting_python()


def run_lines(losses, lr0, validate_at=()):
    lines = []
    for i, loss in enumerate(losses):
        step = i + 1
        lines.append(json.dumps({"step": step, "loss_metrics/global_avg_loss": loss, "grad_norm": 1.0 / step,
                                 "lr": lr0 * step, "throughput(tps)": 1000.0 + 10 * step, "n_tokens_seen": 64 * step}))
        if step in validate_at:
            lines.append(json.dumps({"step": step, "validation_metrics/loss": loss + 0.1}))
    return "\n".join(lines) + "\n"


class PlotMetrics(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def plot(self, *args, python=None):
        return subprocess.run([python or PYTHON or sys.executable, PLOT, *args], capture_output=True, text=True,
                              timeout=120)

    @unittest.skipIf(PYTHON is None, WHY_NOT)
    def test_two_runs_give_a_png(self):
        a = self.write("run_a.jsonl", run_lines([8.0, 7.5, 7.1, 6.8], 1e-4, validate_at=(2, 4)))
        # A run with a non-finite loss (the trainer writes null) and a blank line.
        b = self.write("run_b.jsonl", run_lines([8.1, 7.9, 7.6, 7.4, 7.3], 2e-4).replace('"loss_metrics/global_avg_loss": 7.9',
                                                                                          '"loss_metrics/global_avg_loss": null') + "\n")
        out = os.path.join(self.dir, "out", "curves.png")
        r = self.plot(a, b, "--output", out)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"wrote {out}", r.stdout)
        with open(out, "rb") as f:
            data = f.read()
        self.assertEqual(data[:8], PNG_SIGNATURE)
        self.assertGreater(len(data), 1000)

    def test_a_missing_file_is_an_error_naming_it(self):
        good = self.write("good.jsonl", run_lines([8.0, 7.0], 1e-4))
        missing = os.path.join(self.dir, "missing.jsonl")
        out = os.path.join(self.dir, "curves.png")
        r = self.plot(good, missing, "--output", out)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"plot_metrics: error: {missing}: cannot read", r.stderr)
        self.assertFalse(os.path.exists(out))

    def test_a_bad_line_is_an_error_naming_the_file_and_line(self):
        bad = self.write("bad.jsonl", run_lines([8.0], 1e-4) + "{not json\n")
        r = self.plot(bad, "--output", os.path.join(self.dir, "curves.png"))
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"{bad}:2: ", r.stderr)
        no_step = self.write("no_step.jsonl", '{"loss_metrics/global_avg_loss": 1.0}\n')
        r = self.plot(no_step, "--output", os.path.join(self.dir, "curves.png"))
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f'{no_step}:1: not a JSON object with a "step"', r.stderr)

    def test_a_file_without_training_steps_is_an_error_naming_it(self):
        other = self.write("other.jsonl", '{"step": 1, "validation_metrics/loss": 2.0}\n')
        r = self.plot(other, "--output", os.path.join(self.dir, "curves.png"))
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"{other}: no training step", r.stderr)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed - len(result.skipped)} passed, {failed} failed, {len(result.skipped)} skipped")
    sys.exit(1 if failed else 0)
