"""Every Python package in the tree ships: a subpackage missing from pyproject's list
works from the checkout and breaks in the images."""

import tomllib

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
