#!/usr/bin/env python3
"""Checks that what README.md and docs/**/*.md name in code is in the tree: every inline code
span (`...`), and the lines of fenced code blocks for the checks marked (fences) below.

  python3 tools/check_doc_claims.py [ROOT]

- Bazel labels (fences too): `//pkg:name`, `//pkg`, `@libtorch_fsdp//pkg:name` name a target of
  the BUILD files (cmake/bazel_build_files.py, plus any other rule's `name =` and the package's
  files); `//pkg/...` names a package or a directory above packages. Other repositories
  (`@libtorch`, `@system`) are not checked.
- Repository paths: a word with a `/` that ends in `/` or in an extension (`fsdp/fsdp2/fully_shard.h`)
  exists (globs: something matches); one whose first directory is not the tree's may be the
  end of a path (`testdata/x.py`). Paths outside the tree (OUTSIDE), a lone `dir/` (a cache's
  or an export's as often as the tree's) and the words of a flag (`-include tools/x.h`, a
  generated header) are skipped.
- `--gtest_filter=PATTERN` (fences too): each positive pattern matches a test name of the tree's
  .cc files (TEST / TEST_F / TEST_P / TYPED_TEST, and the INSTANTIATE_TEST_SUITE_P names).
- Project C++ names: in `a::b::Name`, the last name is in the code (not a comment or a string)
  of some .h/.cc file, or the span is a string there (a profiler range); torch::, at::, c10::,
  c10d::, std::, absl:: names are not the project's. `Name(...)` and a bare `CamelCase` name
  are words of some source file (the code's comments cite PyTorch's Python names); a `Name*` /
  `Suite.Name*` glob matches a test or a name in code.
- `./x COMMAND` (fences too) is a command of ./x (a tools/x/COMMAND.sh whose first line is
  `# x COMMAND ...`); a `--flag` after `./x bench` (setup, golden, check, demo; not test or
  run, whose flags are Bazel's and the binary's) or after `tools/NAME` is in ./x's source
  (x, tools/x/*.sh) or that tool's.
- `FSDP_*` variables are in some source file (not a .md).

Prints one line per false claim, FILE:LINE: ..., then 'doc claims: N false claim(s) of M
checked'; exit status 1 when there is one.
"""
import fnmatch
import glob
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cmake"))
import bazel_build_files as bbf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_doc_links import documents, markdown_lines  # noqa: E402

SKIP_DIRS = {".git", "build"}
# Paths that are not this tree's: PyTorch's and other projects' sources (cited for what a
# mirror follows), absolute / home / variable paths, URLs, and what builds and ./x setup make
# (git-ignored: bazel-bin, build trees, bench output, the links to the venvs' wheels).
OUTSIDE = ("/", "~", "$", "torch/", "torchtitan/", "torchao/", "transformers/", "safetensors/",
           "http", "bazel-", "build/", "bench/out/", ".gpu-deps/", "third_party/torch_root",
           "third_party/cuda_root", "third_party/torch_cuda_deps/", "site-packages/", "nvidia/",
           "aten/", "ATen/", "c10/", "REF/", "<")
# Spans that look like claims about the tree but are not (each with its reason).
ALLOW = {
    "//some:target": "a placeholder in the example of `./x test TARGET`",
    "//pkg:name": "a placeholder: the form of a label",
    "@libtorch_fsdp//pkg:name": "a placeholder: the form of a label from another workspace",
    "ProcessGroupGloo::runLoop": "PyTorch's c10d class (c10d::ProcessGroupGloo), named for its thread",
}
# Namespaces whose names are LibTorch's, the standard library's or Abseil's, not the project's.
FOREIGN_NS = ("torch", "at", "c10", "c10d", "std", "absl", "nn", "py", "gloo", "cuda")

SPAN = re.compile(r"(`+)(.+?)\1")
LABEL = re.compile(r"(?<![\w:/@])(@[\w.-]+)?//([\w./-]*)(?::([\w./+-]+))?")
PATH = re.compile(r"^\.?[\w.+-]+(?:/[\w.+*?\[\]-]*)+$")
EXT = re.compile(r"\.[A-Za-z][\w]*$")
GTEST_FILTER = re.compile(r"--gtest_filter=(['\"]?)([^\s'\"`]+)\1")
X_COMMAND = re.compile(r"(?:^|[\s(`;&|])\./x\s+([a-z][\w-]*)((?:\s+--?[\w-]+(?:=\S*)?)*)")
TOOL_FLAGS = re.compile(r"(?:^|\s)(tools/[\w.-]+)((?:\s+--[\w-]+(?:=\S*)?)+)")
CPP_NAME = re.compile(r"^~?(?:[A-Za-z_]\w*::)+~?([A-Za-z_]\w*)(?:<[^<>]*>)?(?:\(.*\))?$")
CALL = re.compile(r"^([A-Z]\w*[a-z]\w*)\((?:[^()]*)\)$")
BARE_NAME = re.compile(r"^(?:[A-Z][a-z0-9]+[A-Z]\w*|[A-Z]{2,}[a-z]\w*)$")
GLOB_NAME = re.compile(r"^[A-Z]\w*(?:\.\w*)?\*$")
COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)
FSDP_VAR = re.compile(r"\bFSDP_[A-Z0-9_]*[A-Z0-9]\b")
TEST_MACRO = re.compile(r"\b(TEST|TEST_F|TEST_P|TYPED_TEST|TYPED_TEST_P)\(\s*(\w+)\s*,\s*(\w+)\s*\)")
INSTANTIATE = re.compile(r"\bINSTANTIATE_(?:TYPED_)?TEST_SUITE_P\(\s*(\w*)\s*,\s*(\w+)")


def claims(path):
    """Yields (line number, text, in a fence) for each inline code span and fenced line."""
    for number, line, in_fence in markdown_lines(path):
        if in_fence:
            yield number, line, True
            continue
        for m in SPAN.finditer(line):
            yield number, m.group(2).strip(), False


class Tree:
    """What the tree has: files, BUILD targets, test names, C++ words, ./x commands."""

    def __init__(self, root):
        self.root = root
        self.files, self.dirs, sources = set(), set(), {}
        for base, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("bazel-"))
            rel = os.path.relpath(base, root)
            rel = "" if rel == "." else rel + "/"
            for d in dirs:
                self.dirs.add(rel + d)
            for f in files:
                self.files.add(rel + f)
                if not f.endswith(".md"):
                    sources[rel + f] = os.path.join(base, f)
        self.text = {}
        for rel, path in sources.items():
            try:
                with open(path, encoding="utf-8") as fh:
                    self.text[rel] = fh.read()
            except (UnicodeDecodeError, OSError):
                pass
        targets, _ = bbf.load_build_files(root)
        self.targets = set(targets)
        self.packages = {pkg for _, pkg, _ in targets.values()}
        for rel, text in self.text.items():
            if os.path.basename(rel) in ("BUILD.bazel", "BUILD"):
                pkg = os.path.dirname(rel)
                self.packages.add(pkg)
                self.targets.update(f"//{pkg}:{n}" for n in re.findall(r'\bname\s*=\s*"([^"]+)"', text))
        cc = {r: t for r, t in self.text.items() if r.endswith((".h", ".cc"))}
        # Names in code (comments and string literals dropped: a stale comment proves nothing),
        # and every word of every source (CMake, shell, Python, comments) for bare names.
        self.code_words, self.words, self.cc_text = set(), set(), "\n".join(cc.values())
        for t in cc.values():
            self.code_words.update(re.findall(r"\w+", COMMENT_OR_STRING.sub(" ", t)))
        for t in self.text.values():
            self.words.update(re.findall(r"\w+", t))
        self.tests = set()
        for t in cc.values():
            prefixes = {}
            for prefix, suite in INSTANTIATE.findall(t):
                prefixes.setdefault(suite, []).append(prefix)
            for kind, suite, name in TEST_MACRO.findall(t):
                self.tests.add(f"{suite}.{name}")
                if kind.startswith("TYPED"):
                    self.tests.add(f"{suite}/0.{name}")
                for p in prefixes.get(suite, []):
                    self.tests.add(f"{p}/{suite}.{name}/0" if p else f"{suite}.{name}/0")
        # ./x's commands: the files tools/x/COMMAND.sh whose first line is '# x COMMAND ...'
        # (what `./x help` lists); their text and x's hold the flags.
        x_files = {r: t for r, t in self.text.items() if r == "x" or re.fullmatch(r"tools/x/[\w-]+\.sh", r)}
        self.x_commands = {m.group(1) for t in x_files.values() for m in [re.match(r"# x ([\w-]+)[ :]", t)] if m}
        self.x_text = "\n".join(x_files.values())

    def has_label(self, repo, pkg, name):
        if repo not in (None, "@libtorch_fsdp") or pkg.startswith("visibility") or pkg.startswith("conditions"):
            return True
        if pkg == "..." or pkg.endswith("/..."):
            base = pkg[:-4].rstrip("/")
            return not base or base in self.dirs and any(p == base or p.startswith(base + "/") for p in self.packages)
        if not pkg and name is None:
            return True  # a C++ comment in a fence, or `//` alone
        if name is None or name == "*":  # `//pkg` may name the package (`//tools`), `//pkg:*` all of it
            return pkg in self.packages
        return (f"//{pkg}:{name}" in self.targets
                or pkg in self.packages and f"{pkg + '/' if pkg else ''}{name}" in self.files)

    def has_path(self, path):
        path = path.rstrip(".,;:")
        stripped = path.rstrip("/")
        if "/" not in stripped:
            return True  # `dir/` alone: a directory of something else as often as of the tree
        if any(c in path for c in "*?["):
            return bool(glob.glob(os.path.join(self.root, path))) or any(
                fnmatch.fnmatch(f, "*/" + path) for f in self.files)
        if stripped in self.files or stripped in self.dirs:
            return True
        if stripped.split("/", 1)[0] in self.dirs or stripped.split("/", 1)[0] in self.files:
            return False
        return any(f.endswith("/" + stripped) for f in self.files | self.dirs)


def check_claim(tree, text, fenced):
    """Returns the problems of one span or fenced line."""
    out = []
    for m in LABEL.finditer(text):
        repo, pkg, name = m.group(1), m.group(2).rstrip("/"), m.group(3)
        if not tree.has_label(repo, pkg, name):
            out.append(f"no Bazel target {m.group(0)}")
    for m in GTEST_FILTER.finditer(text):
        positive = m.group(2).split("-", 1)[0]
        for pattern in filter(None, positive.split(":")):
            if not any(fnmatch.fnmatchcase(t, pattern) for t in tree.tests):
                out.append(f"--gtest_filter pattern {pattern} matches no test")
    for m in X_COMMAND.finditer(text):
        if m.group(1) not in tree.x_commands:
            out.append(f"./x has no command {m.group(1)}")
        elif m.group(1) in ("bench", "setup", "golden", "check", "demo"):
            for flag in re.findall(r"--[\w-]+", m.group(2)):
                if flag not in tree.x_text:
                    out.append(f"./x {m.group(1)} has no flag {flag}")
    for m in TOOL_FLAGS.finditer(text):
        tool = m.group(1)
        srcs = [t for r, t in tree.text.items() if r == tool or re.fullmatch(re.escape(tool) + r"\w*\.(cc|h)", r)]
        for flag in re.findall(r"--[\w-]+", m.group(2)):
            if srcs and not any(flag in t for t in srcs):
                out.append(f"{tool} has no flag {flag}")
    if fenced:
        return out
    for var in FSDP_VAR.findall(text):
        if not any(var in t for t in tree.text.values()):
            out.append(f"no source reads or sets {var}")
    m = CPP_NAME.match(text)
    if (m and text.split("::")[0].lstrip("~") not in FOREIGN_NS and m.group(1) not in tree.code_words
            and f'"{text}"' not in tree.cc_text):  # or a string: a profiler range's name
        out.append(f"{m.group(1)} is in the code of no .h/.cc file")
    m = CALL.match(text)  # `Name(...)`: C++, or PyTorch's Python the code's comments cite
    if m and m.group(1) not in tree.words:
        out.append(f"{m.group(1)} is in no source file")
    if BARE_NAME.match(text) and text not in tree.words:
        out.append(f"{text} is in no source file")
    if GLOB_NAME.match(text) and not any(fnmatch.fnmatchcase(n, text) for n in tree.tests | tree.code_words):
        out.append(f"{text} matches no test and no name in code")
    for word in ([] if text.startswith("-") else text.split()):  # a flag's paths: a command line's
        word = word.strip("()[],;'\"")
        if (PATH.match(word) and (word.endswith("/") or EXT.search(word)) and "//" not in word
                and not word.startswith(OUTSIDE) and "<" not in word and not tree.has_path(word)):
            out.append(f"no file or directory {word}")
    return out


def check(root):
    tree = Tree(root)
    problems, checked = [], 0
    for doc in documents(root):
        if not os.path.isfile(doc):
            continue
        rel = os.path.relpath(doc, root)
        for number, text, fenced in claims(doc):
            if any(k in text for k in ALLOW):
                continue
            checked += 1
            problems += [f"{rel}:{number}: {p}" for p in check_claim(tree, text, fenced)]
    return problems, checked


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems, checked = check(root)
    for p in problems:
        print(p)
    print(f"doc claims: {len(problems)} false claim(s) of {checked} checked")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
