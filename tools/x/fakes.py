"""Fakes for the tests of ./x's commands (tools/x/*_test.py): a copy of the checkout whose
tools are stubs, with a fake bazel, apt, pip and venvs first on PATH, so `./x test`,
`./x check`, `./x setup`... run in seconds without a build, a network or root.

As a library: FakeCheckout. As a program (how the fakes on PATH run):
  python3 fakes.py ROLE ARG...   ROLE: bazel, dpkg-query, apt-get, sudo, venv, venv-python,
                                 stub, program

Every fake appends what it was asked, as one JSON list, to STATE/calls.jsonl (STATE is
X_FAKE_DIR): ["bazel", "test", ...], ["apt-get", ...], ["pip", VENV, ...], ["tools/NAME", ...],
["program", PATH, RANK, ...]. What a fake does is set by environment variables:
  X_FAKE_FAIL        comma-separated names that fail: a stub (NAME of tools/NAME), a program
                     (its file name), pip
  X_FAKE_BAZEL_FAIL  a bazel build or test whose argv (joined by spaces) contains this fails
  X_FAKE_MISSING_DEBS comma-separated Debian packages dpkg-query reports missing (until
                     apt-get installs them)
  X_FAKE_APT_RC      apt-get's exit status (default 0)
  X_FAKE_PIP_WAITS=1 pip install torch waits for STATE/release, which the first bazel test
                     writes: the peer venv is still installing when the build ends
  X_FAKE_BUILD_WAITS=1 bazel build waits until its parent's other children have exited: the
                     peer venv is installed when the build ends
Waits end after DEADLINE_S (a failure, never a pass).
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

DEADLINE_S = 120
HERE = os.path.abspath(__file__)
# What of the checkout the copy keeps as it is; every other tools/*.py, tools/*.sh and
# cmake/*.py becomes a stub (so ./x test's own checks do not run ./x test again).
KEPT = ["x", ".ci/run", "tools/test_summary.py", "third_party/torch_version.txt"]


def state():
    return os.environ["X_FAKE_DIR"]


def record(*words):
    with open(os.path.join(state(), "calls.jsonl"), "a") as f:
        f.write(json.dumps(list(words)) + "\n")


def failing(word):
    return word in os.environ.get("X_FAKE_FAIL", "").split(",")


def wait_for(pred, what):
    end = time.monotonic() + DEADLINE_S
    while not pred():
        if time.monotonic() > end:
            sys.exit(f"fake: not within {DEADLINE_S} s: {what}")
        time.sleep(0.05)


def other_children_done(ppid, me):
    """Every other child of ppid has exited (gone or a zombie)."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.split("/")[2])
        if pid != me and int(fields[1]) == ppid and fields[0] != "Z":
            return False
    return True


def bazel_fails(args):
    word = os.environ.get("X_FAKE_BAZEL_FAIL")
    return bool(word) and word in " ".join(args)


def bazel(args):
    record("bazel", *args)
    words = [a for a in args if not a.startswith("-")]
    command = words[0] if words else ""
    if command == "info":
        print(os.path.join(state(), "testlogs" if words[-1] == "bazel-testlogs" else "bazel-bin"))
        return 0
    if command == "build":
        if os.environ.get("X_FAKE_BUILD_WAITS") == "1":
            wait_for(lambda: other_children_done(os.getppid(), os.getpid()), "the peer venv installed")
        return 1 if bazel_fails(args) else 0
    if command == "test":
        open(os.path.join(state(), "release"), "w").close()
        failed = bazel_fails(args)
        print(f"//fake:test {'FAILED' if failed else 'PASSED'} in 0.1s")
        return 3 if failed else 0
    return 0


def dpkg_query(args):
    package = args[-1]
    missing = os.environ.get("X_FAKE_MISSING_DEBS", "").split(",")
    installed = os.path.join(state(), "debs-installed")
    if package in missing and package not in (open(installed).read().split() if os.path.exists(installed) else []):
        return 1
    print("install ok installed", end="")
    return 0


def apt_get(args):
    record("apt-get", *args)
    rc = int(os.environ.get("X_FAKE_APT_RC", "0"))
    if rc == 0 and "install" in args:
        with open(os.path.join(state(), "debs-installed"), "a") as f:
            f.write(" ".join(a for a in args if not a.startswith("-") and a != "install") + "\n")
    return rc


def make_venv(venv, installed=()):
    """A venv whose python is venv-python below; `installed` names the packages it has."""
    os.makedirs(os.path.join(venv, "bin"), exist_ok=True)
    python = os.path.join(venv, "bin", "python")
    with open(python, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{HERE}" venv-python "{venv}" "$@"\n')
    os.chmod(python, 0o755)
    for p in installed:
        open(os.path.join(venv, p + "-installed"), "w").close()


def venv_python(venv, args):
    """A venv's python as set-up probes it: '-' (a script on stdin: torch's version or
    directory), '-c CODE' (imports: each needs its package installed), '-m pip install'."""
    has = lambda p: os.path.exists(os.path.join(venv, p + "-installed"))  # noqa: E731
    if args[:1] == ["-"]:
        script = sys.stdin.read()
        if not has("torch"):
            return 1
        if 'version("torch")' in script:
            print(open(os.path.join(state(), "torch_version")).read().strip())
        elif "find_spec" in script:
            print(os.path.join(state(), "torch"))
        return 0
    if args[:1] == ["-c"]:
        code = args[1]
        if "nvidia" in code:
            return 1
        return 0 if all(has(p) for p in ("torch", "torchtitan", "torchao", "transformers", "numpy", "matplotlib") if p in code) else 1
    if args[:3] == ["-m", "pip", "install"]:
        record("pip", venv, *args[3:])
        packages = [a.split("==")[0] for a in args[3:] if not a.startswith("-")]
        if "torch" in packages and os.environ.get("X_FAKE_PIP_WAITS") == "1":
            wait_for(lambda: os.path.exists(os.path.join(state(), "release")), "a bazel test")
        if failing("pip"):
            return 1
        make_venv(venv, packages)
        return 0
    record("python", venv, *args)
    return 0


def stub(name, args):
    """A tool of the checkout (tools/NAME): records, prints the one line of a script that
    counts its own cases, fails when X_FAKE_FAIL names it."""
    record(name, *args)
    bad = failing(os.path.basename(name))
    print(f"{name}: {'fake failure' if bad else 'ok'}")
    print(f"{0 if bad else 1} passed, {1 if bad else 0} failed")
    return 1 if bad else 0


def program(path, args):
    """A built binary (a rank of ./x run, or one process): records its rank and arguments,
    prints one JSON line (what the e2e benchmark's caller keeps)."""
    record("program", os.path.relpath(path, state()), os.environ.get("RANK", "-"), *args)
    print(json.dumps({"program": os.path.basename(path)}))
    return 1 if failing(os.path.basename(path)) else 0


def main(argv):
    role, args = argv[0], argv[1:]
    if role == "bazel":
        return bazel(args)
    if role == "dpkg-query":
        return dpkg_query(args)
    if role == "apt-get":
        return apt_get(args)
    if role == "sudo":
        os.execvp(args[0], args)
    if role == "venv":  # python3 -m venv DIR
        record("venv", args[-1])
        make_venv(args[-1])
        return 0
    if role == "venv-python":
        return venv_python(args[0], args[1:])
    if role == "stub":
        return stub(args[0], args[1:])
    if role == "program":
        return program(args[0], args[1:])
    sys.exit(f"fakes.py: unknown role {role}")


class FakeCheckout:
    """A temporary copy of ROOT's ./x (x, tools/x/*.sh, .ci/run, test_summary.py) whose other
    tools are stubs, with the fakes first on PATH and FSDP_CACHE_DIR inside it.
    venvs: 'present' (both venvs installed), 'no-peer' (a fresh machine: the build venv only),
    'none'."""

    def __init__(self, root, venvs="present"):
        self.dir = tempfile.mkdtemp(prefix="x_test_")
        self.root = os.path.join(self.dir, "checkout")
        self.state = os.path.join(self.dir, "state")
        self.cache = os.path.join(self.dir, "cache")
        for d in (self.root, self.state, self.cache, os.path.join(self.state, "bin"),
                  os.path.join(self.state, "testlogs"), os.path.join(self.state, "torch", "lib")):
            os.makedirs(d, exist_ok=True)
        open(os.path.join(self.state, "torch", "lib", "libtorch_cpu.so"), "w").close()
        for rel in KEPT + [os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "tools/x/*.sh"))]:
            os.makedirs(os.path.dirname(os.path.join(self.root, rel)), exist_ok=True)
            shutil.copy2(os.path.join(root, rel), os.path.join(self.root, rel))
        for pattern in ("tools/*.py", "tools/*.sh", "cmake/*.py"):
            for p in glob.glob(os.path.join(root, pattern)):
                rel = os.path.relpath(p, root)
                if rel not in KEPT:
                    self.stub(rel)
        self.version = open(os.path.join(root, "third_party/torch_version.txt")).read().strip()
        with open(os.path.join(self.state, "torch_version"), "w") as f:
            f.write(self.version)
        bin_dir = os.path.join(self.state, "bin")
        for role in ("bazel", "dpkg-query", "apt-get", "sudo"):
            self.script(os.path.join(bin_dir, role), f'exec "{sys.executable}" "{HERE}" {role} "$@"')
        # python3 -m venv makes a fake venv; every other python3 is the real one.
        self.script(os.path.join(bin_dir, "python3"),
                    f'if [ "$1" = -m ] && [ "$2" = venv ]; then exec "{sys.executable}" "{HERE}" venv "$@"; fi\n'
                    f'exec "{sys.executable}" "$@"')
        self.venv = os.path.join(self.cache, f"venv-torch-{self.version}")
        self.peer_venv = os.path.join(self.cache, f"peer-venv-torch-{self.version}")
        if venvs in ("present", "no-peer"):
            make_venv(self.venv, ["torch"])
        if venvs == "present":
            make_venv(self.peer_venv, ["torch", "transformers", "torchtitan", "torchao", "matplotlib"])
        # The real PATH without nvcc: the CUDA parts of set-up and check stay out, whatever
        # the machine has.
        path = [d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "X_FAKE_"))}
        self.env.update(PATH=os.pathsep.join([bin_dir] + path), X_FAKE_DIR=self.state, FSDP_CACHE_DIR=self.cache)

    @staticmethod
    def script(path, body):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + body + "\n")
        os.chmod(path, 0o755)

    def stub(self, rel):
        """tools/NAME.py or .sh (relative to the checkout) becomes a stub."""
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if rel.endswith(".py"):
            with open(path, "w") as f:
                f.write(f"import sys\nsys.path.insert(0, {os.path.dirname(HERE)!r})\nimport fakes\n"
                        f"sys.exit(fakes.main(['stub', {rel!r}] + sys.argv[1:]))\n")
        else:
            self.script(path, f'exec "{sys.executable}" "{HERE}" stub "{rel}" "$@"')

    def program(self, rel):
        """A fake binary at bazel-bin/REL (bazel info bazel-bin names STATE/bazel-bin)."""
        path = os.path.join(self.state, "bazel-bin", rel)
        self.script(path, f'exec "{sys.executable}" "{HERE}" program "$0" "$@"')
        return path

    def run(self, *args, env=None, cmd=None):
        """Runs ./x ARGS (or CMD) in the copy; (exit status, stdout + stderr)."""
        r = subprocess.run(cmd or [os.path.join(self.root, "x"), *args], cwd=self.root, text=True,
                           env={**self.env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=DEADLINE_S * 2)
        return r.returncode, r.stdout

    def calls(self, first=None):
        """The recorded calls, each a list; with FIRST only those whose first word it is."""
        try:
            with open(os.path.join(self.state, "calls.jsonl")) as f:
                calls = [json.loads(line) for line in f]
        except FileNotFoundError:
            return []
        return [c[1:] for c in calls if c[0] == first] if first else calls

    def read(self, rel):
        with open(os.path.join(self.root, rel)) as f:
            return f.read()

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


ROOT = os.path.abspath(os.environ.get("X_TEST_ROOT") or os.path.join(os.path.dirname(HERE), "..", ".."))


class XCase(unittest.TestCase):
    """A case with a fresh FakeCheckout of ROOT (X_TEST_ROOT, set by tools/x_test.py) as self.x."""
    venvs = "present"

    def setUp(self):
        self.x = FakeCheckout(ROOT, self.venvs)

    def tearDown(self):
        self.x.cleanup()

    def last_line(self, out):
        return out.rstrip("\n").splitlines()[-1]

    def steps(self, out):
        return [line[4:] for line in out.splitlines() if line.startswith("==> ")]

    def times(self, command):
        """build/x-times-COMMAND.txt as [(name, seconds)]."""
        lines = self.x.read(f"build/x-times-{command}.txt").splitlines()
        return [(name, int(seconds)) for name, seconds in (line.split() for line in lines)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
