"""The documentation site builds with `mkdocs build --strict`: a broken link, an anchor
that is not there, a page left out of the nav, a docstring mkdocstrings cannot read or
a missing snippet (the changelog) fails the build, and so this test."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.docs.blocks import ROOT
from tests.docs.requirements import require_module


def test_the_site_builds_strictly(tmp_path):
    require_module("mkdocs", "the docs extra: pip install -e '.[docs]'")
    require_module("mkdocstrings_handlers.python", "the docs extra: pip install -e '.[docs]'")
    require_module("material", "the docs extra: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-6000:]
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert warnings == [], "\n".join(warnings)
    api = (tmp_path / "site/api/index.html").read_text()
    for name in ("effectmq.TaskQueue", "effectmq.App", "effectmq.scheduler.Scheduler"):
        assert name in api, f"the API reference lacks {name}"
    assert "Keep a Changelog" in (tmp_path / "site/changelog/index.html").read_text()


def test_the_readme_stays_a_door():
    """The README introduces and links; the manual is the site (its pages live in docs/)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move sections into docs/"
    assert lines.index("## Quickstart") < 40, "the quickstart comes first"
