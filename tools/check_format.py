"""Checks that every C++ source in the tree is as clang-format leaves it (.clang-format).

Usage: check_format.py [--fix] [ROOT]   (exit status 1 and one line per differing file when any)
--fix rewrites the differing files in place.

The sources are the tracked and untracked-but-not-ignored *.cc, *.h and *.cu files (git
ls-files), so build outputs and third-party trees outside git are never judged.
"""
import concurrent.futures
import os
import subprocess
import sys

SUFFIXES = (".cc", ".h", ".cu")


def sources(root):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f.endswith(SUFFIXES) and os.path.isfile(os.path.join(root, f)))


def main():
    args = sys.argv[1:]
    fix = "--fix" in args
    args = [a for a in args if a != "--fix"]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    differ = []
    files = sources(root)

    def formatted_of(f):
        return subprocess.run(["clang-format", "--style=file", os.path.join(root, f)], cwd=root, check=True,
                              capture_output=True).stdout

    # One clang-format process per file, as many at once as there are cores (it is most of
    # this check's time).
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(formatted_of, files))
    for f, formatted in zip(files, results):
        path = os.path.join(root, f)
        with open(path, "rb") as fh:
            if fh.read() == formatted:
                continue
        differ.append(f)
        if fix:
            with open(path, "wb") as fh:
                fh.write(formatted)
    for f in differ:
        print(f"{f}: differs from clang-format --style=file" + (" (rewritten)" if fix else ""))
    print(f"format: {len(differ)} file(s) differ" + ("" if fix or not differ else
                                                      " (python3 tools/check_format.py --fix rewrites them)"))
    return 0 if fix or not differ else 1


if __name__ == "__main__":
    sys.exit(main())
