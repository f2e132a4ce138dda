"""The worker's handler import puts its working directory after the standard library, not
first (a writable directory ahead of the standard library could shadow any
module the worker imports later)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_module_in_the_working_directory_does_not_shadow_the_standard_library(tmp_path):
    (tmp_path / "colorsys.py").write_text("raise SystemExit('shadowed the standard library')\n")
    (tmp_path / "handlers_mod.py").write_text("app = {'job': lambda payload: None}\n")
    script = textwrap.dedent("""
        from effectmq.cli import load_target
        target = load_target("handlers_mod:app")
        assert "job" in target
        import colorsys  # imported later by anything: must be the standard library's
        assert colorsys.__file__ != "colorsys.py" and "hsv_to_rgb" in dir(colorsys)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
