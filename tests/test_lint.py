"""ruff, with the rule set of pyproject.toml ([tool.ruff]), finds nothing in the checkout."""

import subprocess
import sys

from tests.support.processes import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
