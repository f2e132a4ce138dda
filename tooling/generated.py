"""What the generators under tooling/ share (sync_settings.py, sync_cli.py,
core_schemas.py): a YAML round trip that keeps a hand-written file's layout, the folded
descriptions the CRDs use, and how `--check` reports."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def round_trip_yaml() -> Any:
    """A ruamel.yaml loader/dumper that writes the CRDs back as they are laid out."""
    try:
        from ruamel.yaml import YAML
    except ImportError:
        sys.exit("needs ruamel.yaml: pip install ruamel.yaml (the test extra has it)")
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def folded(text: str, width: int = 80) -> Any:
    """A long description as the CRD writes them by hand: `>-`, wrapped."""
    from ruamel.yaml.scalarstring import FoldedScalarString

    if len(text) <= width:
        return text
    out = FoldedScalarString(text)
    breaks, line_start = [], 0
    for i, char in enumerate(text):
        if char == " " and i - line_start > width:
            last = text.rfind(" ", line_start, i)
            at = last if last > line_start else i
            breaks.append(at)
            line_start = at + 1
    out.fold_pos = breaks  # type: ignore[attr-defined]
    return out


def check_or_write(check: bool, problems: Callable[[], list[str]], write: Callable[[], None], command: str) -> int:
    """--check: print what differs and the command that regenerates it (exit 1), else write."""
    if not check:
        write()
        return 0
    found = problems()
    for line in found:
        print(line)
    if found:
        print(f"run: {command}")
    return 1 if found else 0


def main(doc: str | None, problems: Callable[[], list[str]], write: Callable[[], None], command: str) -> int:
    """The command line of a generator whose only option is --check."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report differences (exit 1 if any)")
    return check_or_write(parser.parse_args().check, problems, write, command)
