"""Every Python package in the tree ships: a subpackage missing from pyproject's list
works from the checkout and breaks in the images."""

import shutil
import subprocess
import sys
import tomllib
import zipfile

from tests.support.processes import ROOT


def test_pyproject_lists_every_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"effectmq": ROOT / "effectmq", **{k: ROOT / v for k, v in config.get("package-dir", {}).items()}}
    found = set()
    for name, path in roots.items():
        for init in path.rglob("__init__.py"):
            rel = init.parent.relative_to(path)
            found.add(".".join([name, *rel.parts]))
    assert set(config["packages"]) == found


def test_the_wheel_ships_every_data_file(tmp_path):
    """The Lua scripts and the dashboard's files are data, not packages: a wheel without
    them imports fine and fails at the first script call or page."""
    source = tmp_path / "src"
    for part in ("effectmq", "operator"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "absent from the `packages` configuration" not in built.stderr
    (wheel,) = (tmp_path / "dist").glob("effectmq-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(path.relative_to(ROOT)) for path in (ROOT / "effectmq").rglob("*")
                if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert len(expected) > 20
    assert expected <= shipped, sorted(expected - shipped)
    # The license's text travels with the package (PEP 639: License-File in the metadata).
    (license_file,) = [name for name in shipped if name.endswith(".dist-info/licenses/LICENSE")]
    metadata = zipfile.ZipFile(wheel).read(license_file.replace("licenses/LICENSE", "METADATA")).decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
