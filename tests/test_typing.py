"""The runtime package ships py.typed: its annotations, and the operator's, are checked by mypy
in the default run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_runtime_and_the_operator_type_check():
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # settings: [tool.mypy] in pyproject.toml
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert (ROOT / "effectmq" / "py.typed").exists()
