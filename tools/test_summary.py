#!/usr/bin/env python3
"""Counts test cases from a `bazel test` run and prints the plain line 'N passed, N failed'.

Usage: test_summary.py BAZEL_TEST_LOG BAZEL_TESTLOGS_DIR

Every test target Bazel reported is counted by its GoogleTest cases (test.xml). A target that
failed without a readable failing case (crash, timeout, build failure) counts as one failure;
skipped cases are reported as skipped, never as passed.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET

STATUS = re.compile(r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED|TIMEOUT|NO STATUS|FLAKY|"
                    r"FAILED TO BUILD|INCOMPLETE|SKIPPED)\b")


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


def main():
    log_path, testlogs = sys.argv[1], sys.argv[2]
    targets = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = STATUS.match(line.strip())
            if m:
                targets[m.group(1)] = m.group(2)
    passed = failed = skipped = 0
    failures = []
    for target, status in sorted(targets.items()):
        pkg, _, name = target[2:].partition(":")
        xml = os.path.join(testlogs, pkg, name, "test.xml")
        counted = {"passed": 0, "failed": 0, "skipped": 0}
        if status in ("PASSED", "FAILED", "FLAKY") and os.path.exists(xml):
            try:
                for case, outcome in cases(xml):
                    counted[outcome] += 1
                    if outcome == "failed":
                        failures.append(f"{target}: {case}")
            except ET.ParseError:
                pass
        if status != "PASSED" and counted["failed"] == 0:
            counted["failed"] = 1
            failures.append(f"{target}: {status}")
        if status == "PASSED" and sum(counted.values()) == 0:
            counted["passed"] = 1  # a non-gtest test target (e.g. a shell test)
        passed += counted["passed"]
        failed += counted["failed"]
        skipped += counted["skipped"]
    for f in failures:
        print(f"FAILED: {f}")
    if not targets:
        print("no test targets were reported by bazel")
        failed += 1
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
