"""One version, kept in pyproject.toml: the package's metadata, `effectmq.__version__`,
`effectmq --version`, the chart's version and appVersion (the default image tag) and
the changelog agree with it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import yaml

import effectmq
from tests.docs.blocks import ROOT

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_package_says_the_pyproject_version():
    assert effectmq.__version__ == VERSION, "reinstall the checkout (pip install -e .): its metadata is older"
    checkout = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])}
    shown = subprocess.run([sys.executable, "-m", "effectmq", "--version"], capture_output=True, text=True,
                           timeout=60, env=checkout)
    assert (shown.returncode, shown.stdout.strip()) == (0, f"effectmq {VERSION}"), shown.stderr


def test_the_chart_has_the_same_version():
    chart = yaml.safe_load((ROOT / "charts/effectmq/Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)


def test_the_changelog_has_the_version_and_an_unreleased_section():
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[:1] == ["Unreleased"], headings
    assert VERSION in headings, f"CHANGELOG.md has no section for {VERSION}"
