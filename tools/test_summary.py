#!/usr/bin/env python3
"""Counts test cases and prints the plain line 'N passed, N failed[, N skipped]'.

Usage:
  test_summary.py BAZEL_TEST_LOG BAZEL_TESTLOGS_DIR   a `bazel test` run
  test_summary.py --ctest CTEST_LOG XML_DIR [BUILD_LOG]
                                                      a `ctest` run whose tests wrote
                                                      GoogleTest XML as XML_DIR/<test>.xml;
                                                      each Ninja 'FAILED: <output>' line of
                                                      BUILD_LOG counts as one failure (a
                                                      binary that did not link is a failure
                                                      even when no test runs it)
  test_summary.py --xml XML_DIR                      the GoogleTest XML files in XML_DIR
                                                      (tools/gpu_check.sh): every case, a
                                                      file that does not parse is one failure
  test_summary.py --combine NAME=FILE ...             sums the last summary line of each
                                                      FILE (a part's output); a part with
                                                      no summary line counts as one failure

Every test target is counted by its GoogleTest cases (XML). A target that failed without a
readable failing case (crash, timeout, build failure) counts as one failure; a passing
target without XML (a shell test) counts as one pass; skipped cases are reported as
skipped, never as passed. Exit status 1 when anything failed or nothing was counted.
"""
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

BAZEL_STATUS = re.compile(r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED|TIMEOUT|NO STATUS|FLAKY|"
                          r"FAILED TO BUILD|INCOMPLETE|SKIPPED)\b")
# ctest: " 3/21 Test  #3: //comm:comm_test ......   Passed   12.34 sec" (or "...***Failed").
CTEST_STATUS = re.compile(r"^\s*\d+/\d+ Test\s+#\d+: (\S+) \.*\s*\**(\w+)")
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed(?:, (\d+) skipped)?$")


def cases(xml_path):
    """Yields (name, outcome) for each test case; outcome in {passed, failed, skipped}."""
    root = ET.parse(xml_path).getroot()
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname')}.{tc.get('name')}"
        if tc.find("failure") is not None or tc.find("error") is not None:
            yield name, "failed"
        elif tc.get("result") == "skipped" or tc.find("skipped") is not None \
                or tc.get("status") == "notrun":
            yield name, "skipped"
        else:
            yield name, "passed"


class Tally:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.failures = []

    def add_target(self, target, status, passed_status, xmls):
        """Counts one test target: `status` is the runner's word for it, `passed_status`
        whether that means it passed; `xmls` its GoogleTest XML file(s) (one per shard)."""
        if isinstance(xmls, str):
            xmls = [xmls]
        counted = {"passed": 0, "failed": 0, "skipped": 0}
        for xml in xmls or []:
            one = self.count_xml(target, xml) if os.path.exists(xml) else None
            for k, v in (one or {}).items():
                counted[k] += v
        if not passed_status and counted["failed"] == 0:
            counted["failed"] = 1
            self.failures.append(f"{target}: {status}")
        if passed_status and sum(counted.values()) == 0:
            counted["passed"] = 1  # a non-gtest test target (e.g. a shell test)
        self.add(counted)

    def count_xml(self, target, xml):
        """The case counts of one GoogleTest XML file (failed cases recorded under `target`),
        or None when it does not parse."""
        counted = {"passed": 0, "failed": 0, "skipped": 0}
        try:
            for case, outcome in cases(xml):
                counted[outcome] += 1
                if outcome == "failed":
                    self.failures.append(f"{target}: {case}")
        except ET.ParseError:
            return None
        return counted

    def add(self, counted):
        self.passed += counted["passed"]
        self.failed += counted["failed"]
        self.skipped += counted["skipped"]

    def report(self, what):
        for f in self.failures:
            print(f"FAILED: {f}")
        if self.passed + self.failed + self.skipped == 0:
            print(f"no test targets were reported by {what}")
            self.failed += 1
        line = f"{self.passed} passed, {self.failed} failed"
        if self.skipped:
            line += f", {self.skipped} skipped"
        print(line)
        return 1 if self.failed else 0


def statuses(log_path, pattern):
    found = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = pattern.match(line.strip())
            if m:
                found[m.group(1)] = m.group(2)
    return found


# A test's XML: <target>/test.xml, or one per shard and / or run (shard_count,
# --runs_per_test): <target>/shard_1_of_3/test.xml, <target>/run_2_of_3/test.xml,
# <target>/shard_1_of_3_run_2_of_3/test.xml. The group's key is its layout (the "of" counts).
XML_DIR = re.compile(r"^(?:shard_\d+_of_(\d+))?_?(?:run_\d+_of_(\d+))?$")


def latest_xmls(target_dir):
    """The XML files of the target's latest run. Earlier runs with another layout (sharded
    differently, or with --runs_per_test) leave theirs beside it, which Bazel does not delete:
    of the layouts present, the one with the newest file is this run's."""
    groups = {}
    for xml in glob.glob(os.path.join(target_dir, "*", "test.xml")) + [os.path.join(target_dir, "test.xml")]:
        layout = os.path.relpath(os.path.dirname(xml), target_dir)
        m = XML_DIR.match("" if layout == "." else layout)
        if m and os.path.exists(xml):
            groups.setdefault(m.groups(), []).append(xml)
    if not groups:
        return [os.path.join(target_dir, "test.xml")]
    return sorted(max(groups.values(), key=lambda xmls: max(os.path.getmtime(x) for x in xmls)))


def bazel(log_path, testlogs):
    tally = Tally()
    for target, status in sorted(statuses(log_path, BAZEL_STATUS).items()):
        pkg, _, name = target[2:].partition(":")
        xmls = latest_xmls(os.path.join(testlogs, pkg, name))
        usable = status in ("PASSED", "FAILED", "FLAKY")
        tally.add_target(target, status, status == "PASSED", xmls if usable else None)
    return tally.report("bazel")


NINJA_FAILED = re.compile(r"^FAILED: (.+?)\s*$")


def ctest(log_path, xml_dir, build_log=None):
    tally = Tally()
    if build_log:
        try:
            with open(build_log, errors="replace") as f:
                for line in f:
                    m = NINJA_FAILED.match(line)
                    if m:
                        tally.failed += 1
                        tally.failures.append(f"build: {m.group(1)}")
        except OSError:
            tally.failed += 1
            tally.failures.append(f"build: no build log at {build_log}")
    for target, status in sorted(statuses(log_path, CTEST_STATUS).items()):
        name = target[2:].replace("/", "_").replace(":", "_")
        tally.add_target(target, status, status == "Passed", os.path.join(xml_dir, name + ".xml"))
    return tally.report("ctest")


def xml_dir(path):
    tally = Tally()
    for xml in sorted(glob.glob(os.path.join(path, "*.xml"))):
        counted = tally.count_xml(os.path.basename(xml), xml)
        if counted is None:
            tally.failed += 1
            tally.failures.append(f"{xml}: not GoogleTest XML")
        else:
            tally.add(counted)
    return tally.report(f"the XML files in {path}")


def combine(parts):
    total = [0, 0, 0]
    for part in parts:
        name, _, path = part.partition("=")
        last = None
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    m = SUMMARY.match(line.strip())
                    if m:
                        last = m
        except OSError:
            pass
        if last is None:
            print(f"{name}: no 'N passed, N failed' line (counted as 1 failure)")
            total[1] += 1
            continue
        counts = [int(last.group(1)), int(last.group(2)), int(last.group(3) or 0)]
        print(f"{name}: {last.group(0)}")
        total = [a + b for a, b in zip(total, counts)]
    line = f"{total[0]} passed, {total[1]} failed"
    if total[2]:
        line += f", {total[2]} skipped"
    print(line)
    return 1 if total[1] or total[0] == 0 else 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "--combine":
        return combine(argv[1:])
    if len(argv) == 2 and argv[0] == "--xml":
        return xml_dir(argv[1])
    if len(argv) in (3, 4) and argv[0] == "--ctest":
        return ctest(*argv[1:])
    if len(argv) == 2 and not argv[0].startswith("--"):
        return bazel(argv[0], argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
