"""The command line's reference page (docs/cli.md) is written from the parsers, and every
argument of every command has help and, where it has one, its default."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tests.support.processes import ROOT
from tooling import sync_cli


def test_the_reference_page_is_what_the_parsers_give():
    assert sync_cli.check() == [], "run: python tooling/sync_cli.py"


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    tool = sync_cli
    stale = tmp_path / "cli.md"
    stale.write_text(tool.render().replace("| `10` |", "| `11` |", 1))
    monkeypatch.setattr(tool, "DOC", stale)
    assert tool.check() != []


def test_every_argument_of_every_command_has_help():
    tool = sync_cli
    seen = 0
    for name, parser in tool.commands():
        for action in parser._actions:
            if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
                continue
            seen += 1
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    assert seen > 100


def test_the_page_lists_every_command_its_defaults_and_the_exit_codes():
    text = (ROOT / "docs/cli.md").read_text()
    for command in ("effectmq worker", "effectmq stats", "effectmq dead-letters", "effectmq pause",
                    "effectmq scheduler list", "effectmq scheduler add", "effectmq dashboard", "effectmq local",
                    "effectmq-operator"):
        assert f"## `{command}`" in text, command
    assert "| `--concurrency`, `-c` | `10` |" in text
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |"):
        assert code in text, code
    assert "`--redis-url`" in text and "`--namespace`, `-n`" in text  # the deprecated spellings, named as such


def test_the_check_runs_as_a_script():
    done = subprocess.run([sys.executable, "tooling/sync_cli.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
