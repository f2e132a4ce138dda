#!/usr/bin/env python3
"""Write the command line's reference page, docs/cli.md, from the parsers themselves
(`effectmq` with the commands it loads, and `effectmq-operator`).

    python tooling/sync_cli.py          # write
    python tooling/sync_cli.py --check  # exit 1 if the page differs (what the test asserts)

The parsers are built with no EFFECTMQ_* variable set, so the page shows the built-in
defaults, whatever the environment of whoever runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "operator")]

from effectmq import cli, clitools  # noqa: E402
from effectmq.scheduler import DEFAULT_NAMESPACE  # noqa: E402
from tooling import generated  # noqa: E402

DOC = ROOT / "docs/cli.md"
WIDTH = "100"  # columns of the usage lines


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    with mock.patch.dict(os.environ, {**clean, "COLUMNS": WIDTH}, clear=True):
        yield


def _parsers(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(f"{name} {sub_name}", sub)


def commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command and subcommand with its parser, in the order --help lists them."""
    from effectmq_operator.__main__ import PROG as OPERATOR, build_parser as operator_parser

    with _clean_environment():
        return [*_parsers(clitools.PROG, cli.build_parser()), *_parsers(OPERATOR, operator_parser())]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _argument(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    return f"`{action.metavar or action.dest}`"


def _meaning(action: argparse.Action) -> str:
    text = action.help or ""
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
    elif isinstance(action.metavar, str) and action.metavar.startswith("{"):
        text += " (one of " + ", ".join(f"`{c}`" for c in action.metavar.strip("{}").split(",")) + ")"
    return _cell(text)


def _visible(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS and not isinstance(
        action, (argparse._HelpAction, argparse._SubParsersAction))


def _scheduler_namespaces() -> list[str]:
    from effectmq_operator.redis_pool import SCHEDULER_NAMESPACE as OPERATOR_NAMESPACE
    from effectmq_operator.local.runner import SCHEDULER_NAMESPACE as LOCAL_NAMESPACE

    return [
        "## Scheduler namespaces",
        "",
        "Schedules live in Redis under a scheduler namespace (keys `{<prefix>-sched:<namespace>}:...`). The",
        "operator and `effectmq local` each keep their own and remove from it the schedules nothing they run asks",
        "for any more, so neither shares a namespace with schedules made by hand:",
        "",
        f"- the operator: `{OPERATOR_NAMESPACE}` (its `Schedule` resources);",
        f"- `effectmq local`: `{LOCAL_NAMESPACE}` (the manifests it runs);",
        f"- `effectmq scheduler add`, `run` and `tick`, and `Scheduler(...)` in Python: `{DEFAULT_NAMESPACE}`, unless",
        "  `--scheduler-namespace` (or `EFFECTMQ_SCHEDULER_NAMESPACE`, or `namespace=`) names another.",
        "",
        "Readers show them all: `effectmq scheduler list` and the dashboard list the schedules of every namespace",
        "that holds one (found by `SCAN`), with the namespace; `status`, `suspend`, `resume` and `remove` find a",
        "schedule in whichever namespace holds it, and ask for `--scheduler-namespace` when two hold the same id.",
        "`--scheduler-namespace` on a reader shows that namespace only. A schedule the operator keeps is changed",
        "through its `Schedule` resource: the operator puts back what the resource says.",
        "",
    ]


def render() -> str:
    found = commands()
    lines = [
        "# Command line",
        "",
        "<!-- Written by `python tooling/sync_cli.py` from the parsers (effectmq/cli.py, the commands it loads,",
        "operator/effectmq_operator/__main__.py): edit the help there. -->",
        "",
        "`effectmq` runs workers, offers tasks and inspects queues, schedules, the dashboard and local mode;",
        "`effectmq-operator` runs the Kubernetes operator. An option's environment variable is named in",
        "brackets: it gives the default (how the operator and the chart configure pods), and a flag wins over it.",
        "A Redis URL comes from `--url`, else `EFFECTMQ_REDIS_URL`, else the file `EFFECTMQ_REDIS_URL_FILE` names.",
        "",
        "Errors go to stderr as one line, `effectmq: error: <what is wrong>` (`effectmq-operator: error: ...`),",
        "never as a traceback for bad input; an old spelling of an option says `effectmq: warning: ...`.",
        "",
        "## Exit codes",
        "",
        "| code | meaning |",
        "|---|---|",
        *[f"| {code} | {_cell(meaning)} |" for code, meaning in clitools.EXIT_CODES],
        "| 130 | interrupted by SIGINT (a worker and `scheduler run` drain on SIGINT and SIGTERM, and exit 0) |",
        "",
        *_scheduler_namespaces(),
        "## Deprecated spellings",
        "",
        "They still work, and warn; `--help` leaves them out.",
        "",
        "| command | old | use |",
        "|---|---|---|",
    ]
    for name, parser in found:
        for action in parser._actions:
            if isinstance(action, clitools.DeprecatedAlias):
                lines.append(f"| `{name}` | {_argument(action)} | `{action.replacement}` |")
    lines.append("")
    for name, parser in found:
        lines += [f"## `{name}`", ""]
        if parser.description:
            lines += [_cell(parser.description), ""]
        with _clean_environment():
            usage = parser.format_usage().strip()
        lines += ["```", usage, "```", ""]
        for group in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
            lines += ["| command | meaning |", "|---|---|"]
            lines += [f"| `{name} {c.dest}` | {_cell(c.help or '')} |" for c in group._choices_actions]
            lines.append("")
        rows = [a for a in parser._actions if _visible(a)]
        if rows:
            lines += ["| argument | default | meaning |", "|---|---|---|"]
            for action in rows:
                shown = clitools.shown_default(action)
                lines.append(f"| {_argument(action)} | {f'`{shown}`' if shown else ''} | {_meaning(action)} |")
            lines.append("")
    return "\n".join(lines)


def check() -> list[str]:
    if not DOC.exists() or DOC.read_text() != render():
        return [f"{os.path.relpath(DOC, ROOT)} is not what the parsers give"]
    return []


def write() -> None:
    DOC.write_text(render())


if __name__ == "__main__":
    sys.exit(generated.main(__doc__, check, write, "python tooling/sync_cli.py"))
