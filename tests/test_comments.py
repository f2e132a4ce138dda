"""Tests and code say what they check or do, not which issue asked for it: a reader
outside the project's tracker cannot look up "issue 12, must-show 2" or "defect 8"."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("tests", "bench", "tooling", "effectmq", "operator")
SUFFIXES = {".py", ".lua", ".sh"}
TRACKER_REFERENCE = re.compile(
    r"\b[Ii]ssue ?#?\d+"  # issue 36, Issue 35's, issue #12
    r"|\bMust[- ]show\b|\bmust[- ]show \d"  # an issue's numbered must-show items
    r"|\b(?:[Dd]efect|[Ff]inding)s? \d+"  # an issue's numbered defects and findings
)


def tracker_references(root: Path) -> list[str]:
    found = []
    for top in CHECKED:
        for path in sorted((root / top).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file() or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if TRACKER_REFERENCE.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_tests_and_code_cite_no_issue_numbers():
    found = tracker_references(ROOT)
    assert found == [], "say the behaviour instead of the issue, defect or must-show number:\n" + "\n".join(found)


def test_the_check_finds_each_form_of_reference(tmp_path):
    forms = ['"""Bounded calls (issue 12, must-show 2 and 8)."""', "# -- defect 7: huge options",
             "# Issue 35's defects", "Bound (Must show 3): a worker", "(issue 36, findings 3 and 13)"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("\n".join(forms + ["# a broken extension must show, not vanish"]))
    assert len(tracker_references(tmp_path)) == len(forms)
