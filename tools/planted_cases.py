"""What the tests of the tree checks (tools/check_*_test.py) share: running a check script on a
planted tree, and counting named cases into the 'N passed, N failed' line ./x test reads."""
import subprocess
import sys


def run_check(script, root, *args):
    """(exit status, stdout + stderr) of `python3 script [args] root`."""
    r = subprocess.run([sys.executable, script, *args, root], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


class Cases:
    def __init__(self):
        self.passed = self.failed = 0

    def expect(self, name, ok, output):
        """One case: prints 'ok' or 'FAILED' with the check's output."""
        if ok:
            self.passed += 1
            print(f"ok      {name}")
        else:
            self.failed += 1
            print(f"FAILED  {name}\n{output}")

    def summary(self):
        """Prints the counts; the exit status (1 when a case failed)."""
        print(f"{self.passed} passed, {self.failed} failed")
        return 1 if self.failed else 0
