"""./x help (tools/x/help.sh) and the command files: the list is made from every file's header,
unknown commands and bad arguments are errors, every file parses (bash -n, and shellcheck
where installed) and stays short."""
import glob
import os
import re
import shutil
import subprocess

from fakes import ROOT, XCase

# A command file is one thing a successor reads whole; common.sh and ./x no longer.
MAX_LINES = {"command": 300, "other": 600}


def x_commands():
    """X_COMMANDS of ./x, in order."""
    with open(os.path.join(ROOT, "x")) as f:
        return re.search(r"^X_COMMANDS=\(([^)]*)\)", f.read(), re.M).group(1).split()


def command_files():
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools/x/*.sh"))
                  if not p.endswith("/common.sh"))


class Help(XCase):
    def test_every_command_file_is_listed_in_order(self):
        self.assertEqual(sorted(x_commands()), command_files())
        rc, out = self.x.run("help")
        self.assertEqual(rc, 0, out)
        listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
        self.assertEqual(listed, x_commands())
        for c in x_commands():
            with open(os.path.join(ROOT, f"tools/x/{c}.sh")) as f:
                usage, summary = re.match(r"# x ([^:]+): (.+)", f.readline()).groups()
            self.assertIn(f"  {usage.ljust(27)}{summary}\n", out)
        self.assertEqual(self.x.run()[1], out, "./x alone is ./x help")
        self.assertEqual(self.x.run("--help")[1], out)

    def test_help_command_prints_its_description(self):
        for c in x_commands():
            rc, out = self.x.run("help", c)
            self.assertEqual(rc, 0, out)
            lines = out.splitlines()
            self.assertTrue(lines[0].startswith(f"./x {c}"), out)
            self.assertGreater(len(lines), 3, f"tools/x/{c}.sh has no description lines:\n{out}")
            self.assertFalse([line for line in lines if line.startswith("#")], out)

    def test_a_command_file_without_its_header_is_an_error(self):
        path = os.path.join(self.x.root, "tools/x/golden.sh")
        text = open(path).read()
        with open(path, "w") as f:
            f.write(text.replace("# x golden:", "# x gold:", 1))
        rc, out = self.x.run("help")
        self.assertEqual(rc, 1)
        self.assertIn("x: error: tools/x/golden.sh: its first line is not '# x golden [ARGS]: SUMMARY'", out)

    def test_unknown_commands_and_bad_arguments_are_errors(self):
        for args, words in ((["bogus"], "unknown command 'bogus'"),
                            (["help", "bogus"], "help: unknown command 'bogus'"),
                            (["bench", "--fast"], "bench: unknown argument '--fast'"),
                            (["check", "extra"], "check takes no arguments, got 'extra'"),
                            (["golden", "extra"], "golden takes no arguments"),
                            (["setup", "extra"], "setup takes no arguments"),
                            (["run", "-n", "2"], "run: missing binary")):
            r = subprocess.run([os.path.join(self.x.root, "x"), *args], cwd=self.x.root, env=self.x.env,
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, args)
            self.assertIn(f"x: error: {words}", r.stderr, args)
            self.assertEqual(self.x.calls(), [], f"{args}: nothing ran before the error")
        self.assertIn("usage: ./x <command>", self.x.run("bogus")[1])


class Files(XCase):
    def files(self):
        return ["x"] + [f"tools/x/{c}.sh" for c in ["common"] + x_commands()]

    def test_every_file_parses_and_is_short(self):
        for rel in self.files():
            r = subprocess.run(["bash", "-n", os.path.join(ROOT, rel)], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, f"{rel}: {r.stderr}")
            limit = MAX_LINES["command" if rel.removeprefix("tools/x/")[:-3] in x_commands() else "other"]
            with open(os.path.join(ROOT, rel)) as f:
                self.assertLessEqual(len(f.readlines()), limit, rel)

    def test_shellcheck(self):
        """The files as ./x sources them, checked as one script (a function of one file may use
        another's variables); shellcheck's line numbers are mapped back to the files."""
        if not shutil.which("shellcheck"):
            self.skipTest("shellcheck not installed")
        text, starts = ["#!/usr/bin/env bash\nROOT=. CALLER_DIR=.\n"], []
        line = 3
        for rel in self.files()[1:]:
            with open(os.path.join(ROOT, rel)) as f:
                body = f.read()
            starts.append((line, rel))
            text.append(body)
            line += body.count("\n")
        whole = os.path.join(self.x.dir, "x-whole.sh")
        with open(whole, "w") as f:
            f.write("".join(text))
        problems = []
        for rel, path in (("x", os.path.join(ROOT, "x")), ("", whole)):
            r = subprocess.run(["shellcheck", "-f", "gcc", "-e", "SC1091,SC1090", path], capture_output=True, text=True)
            for p in r.stdout.splitlines():
                n = int(p.split(":")[1])
                where = f"{rel}:{n}" if rel else next((f"{f}:{n - s + 1}" for s, f in reversed(starts) if n >= s), "?")
                problems.append(f"{where}: {p.split(':', 3)[3]}")
        self.assertEqual(problems, [])
