"""The runtime package ships py.typed: its annotations, and the operator's, are checked by mypy
in the default run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_runtime_and_the_operator_type_check():
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # settings: [tool.mypy] in pyproject.toml
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert (ROOT / "effectmq" / "py.typed").exists()


def test_a_user_module_misspelling_a_task_option_fails_type_checking(tmp_path):
    """App.task names its options, so an IDE completes them and mypy catches a typo."""
    (tmp_path / "handlers.py").write_text(
        "import effectmq\n\napp = effectmq.App('q')\n\n\n"
        "@app.task(max_retries=3, timeout=5.0)\nasync def good(payload): ...\n\n\n"
        "@app.task(max_retry=3)\nasync def typo(payload): ...\n\n\n"
        "async def produce() -> None:\n"
        "    await good.offer({'x': 1}, priority=5, delay=1.0)\n"
        "    await good.offer({'x': 1}, priorty=5)\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                           str(tmp_path / "handlers.py")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MYPYPATH": str(ROOT)})  # as a user's project sees the package
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, done.stdout
    assert 'Unexpected keyword argument "max_retry"' in errors[0] and 'did you mean "max_retries"' in errors[0]
    assert 'Unexpected keyword argument "priorty"' in errors[1]
