#!/usr/bin/env python3
"""Checks the user-facing documents: every relative link of README.md and docs/**/*.md names
a file or directory that exists, README.md stays within README_MAX_BYTES, and
docs/reference/environment.md lists every environment variable the library reads
(env/environment.h's Variable constants).

  python3 tools/check_doc_links.py [ROOT]

Links are Markdown inline links `[text](target)` and reference definitions `[id]: target`,
outside fenced code blocks; a target with a scheme (https:, mailto:) or only an #anchor is
not checked; a `#fragment` after a path is dropped. Prints each broken link as
FILE:LINE: target, and exits 1 when there is one (or a document is missing).
"""
import os
import re
import sys

# The README is for users: what it is, the commands, one example, how to depend on it; the
# rest is in docs/ (the project's rule for it: 16 KiB).
README_MAX_BYTES = 16 * 1024

INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents(root):
    yield os.path.join(root, "README.md")
    for base, dirs, files in os.walk(os.path.join(root, "docs")):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".md"):
                yield os.path.join(base, f)


def markdown_lines(path):
    """Yields (line number, line without its newline, whether it is inside a fenced block) for
    each line of `path` that is not a fence marker. Shared with tools/check_doc_claims.py."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            stripped = line.lstrip()
            if stripped.startswith("```") or stripped.startswith("~~~"):
                marker = stripped[:3]
                fence = None if fence == marker else (fence or marker)
                continue
            yield number, line.rstrip("\n"), bool(fence)


def links(path):
    """Yields (line number, target) for each link outside fenced code blocks."""
    for number, line, in_fence in markdown_lines(path):
        if in_fence:
            continue
        # Inline code spans are not links.
        text = re.sub(r"`[^`]*`", "", line)
        for m in INLINE.finditer(text):
            yield number, m.group(1)
        m = REFERENCE.match(text)
        if m:
            yield number, m.group(1)


def broken_links(root):
    problems = []
    for doc in documents(root):
        if not os.path.isfile(doc):
            problems.append(f"{os.path.relpath(doc, root)}: missing")
            continue
        for number, target in links(doc):
            if SCHEME.match(target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0].split("?", 1)[0]
            resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path))
            if not os.path.exists(resolved):
                problems.append(f"{os.path.relpath(doc, root)}:{number}: {target}")
    return problems


ENV_HEADER = os.path.join("env", "environment.h")
ENV_DOC = os.path.join("docs", "reference", "environment.md")
ENV_VARIABLE = re.compile(r'inline constexpr Variable k\w+\{\s*"([A-Z0-9_]+)"')


def undocumented_variables(root):
    header, doc = os.path.join(root, ENV_HEADER), os.path.join(root, ENV_DOC)
    if not os.path.isfile(header):
        return []
    with open(header) as fh:
        names = ENV_VARIABLE.findall(fh.read())
    if not names:
        return [f"{ENV_HEADER}: no Variable constants found (has their form changed?)"]
    text = open(doc).read() if os.path.isfile(doc) else ""
    return [f"{ENV_DOC}: does not list `{n}` ({ENV_HEADER} reads it)" for n in names if f"`{n}`" not in text]


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems = broken_links(root) + undocumented_variables(root)
    readme = os.path.join(root, "README.md")
    if os.path.isfile(readme) and os.path.getsize(readme) > README_MAX_BYTES:
        problems.append(f"README.md: {os.path.getsize(readme)} bytes, more than {README_MAX_BYTES}")
    checked = sum(1 for _ in documents(root))
    for p in problems:
        print(p)
    print(f"{checked} documents: {'ok' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
