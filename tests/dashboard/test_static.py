"""The vendored chart library is the recorded npm release, unchanged, with its license;
and the page script writes text only as text (names and ids are user data)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "effectmq" / "dashboard" / "static"


def test_vendored_uplot_matches_its_record():
    record = (STATIC / "vendor" / "uplot" / "VENDORED.md").read_text()
    hashes = dict(re.findall(r"`([\w.]+\.(?:js|css))`\s+sha256 ([0-9a-f]{64})", record))
    assert set(hashes) == {"uPlot.iife.min.js", "uPlot.min.css"}
    for name, digest in hashes.items():
        assert hashlib.sha256((STATIC / "vendor" / "uplot" / name).read_bytes()).hexdigest() == digest, name
    assert "MIT License" in (STATIC / "vendor" / "uplot" / "LICENSE").read_text()
    version = re.search(r"version \*\*([\d.]+)\*\*", record).group(1)
    assert f"(v{version})" in (STATIC / "vendor" / "uplot" / "uPlot.iife.min.js").read_text()[:100]


def test_the_page_script_never_writes_html():
    script = (STATIC / "app.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script)


def test_package_data_ships_templates_and_static_files():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["effectmq.dashboard"]
    shipped = {p for pattern in patterns for p in (ROOT / "effectmq" / "dashboard").glob(pattern)}
    wanted = {p for p in (ROOT / "effectmq" / "dashboard").rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert wanted <= shipped, sorted(str(p) for p in wanted - shipped)
