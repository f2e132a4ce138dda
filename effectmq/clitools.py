"""Helpers shared by the `effectmq` subcommands: the parser and help format, option
types, defaults from the environment, messages and exit codes (docs/cli.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import Any, Callable, Iterator, NoReturn

from .transport.connection import URL_KINDS

PROG = "effectmq"

# Exit codes, the same for every command; docs/cli.md lists this table.
OK, FAILED, USAGE, UNAVAILABLE = 0, 1, 2, 3
EXIT_CODES = (
    (OK, "done"),
    (FAILED, "the command ran and failed: no such task or schedule, Redis refused (a wrong password, an ACL, "
             "NOPERM), a worker stopped by an error retrying cannot fix"),
    (USAGE, "bad input, nothing was done: an unknown flag or command, a value that does not parse (a flag or its "
            "environment variable), a Redis URL that is not one, an unknown queue, a missing extra"),
    (UNAVAILABLE, "Redis did not answer, or refused for now (OOM, LOADING, a Sentinel that names no primary): "
                  "try again later"),
)

# --url has no default of its own: what it leaves unsaid, effectmq.transport.connection.url_from_env
# reads when a command connects (so --help and an explicit --url never read the file).
URL_HELP = (f"Redis URL: {URL_KINDS} (redis+sentinel://h1:p1,h2:p2/<service>, redis+cluster://h1:p1,h2:p2); "
            "default: EFFECTMQ_REDIS_URL, or EFFECTMQ_REDIS_URL_FILE (a file that holds it, e.g. a mounted "
            "Secret), else redis://localhost:6379/0")

# Which module belongs to which extra: a missing one is named with what to install.
EXTRAS = {"kopf": "operator", "kubernetes": "operator", "celpy": "operator", "aiohttp": "dashboard",
          "jinja2": "dashboard", "uvloop": "uvloop"}


class CommandError(Exception):
    """What a command says on stderr as `effectmq: error: <message>`, exiting with `code`."""

    def __init__(self, message: str, code: int = USAGE):
        super().__init__(message)
        self.code = code


def say(kind: str, message: str, prog: str = PROG) -> None:
    """`effectmq: error: ...` (or warning) on stderr: the one form of every message."""
    print(f"{prog}: {kind}: {message}", file=sys.stderr, flush=True)


def missing_extra(exc: ModuleNotFoundError, what: str) -> CommandError | None:
    """The install hint for a module of an extra that is not installed, else None."""
    extra = EXTRAS.get((exc.name or "").partition(".")[0])
    if extra is None:
        return None
    return CommandError(f"{what} needs the {extra} extra: pip install 'effectmq[{extra}]' (no module named "
                        f"{exc.name!r})")


@contextlib.contextmanager
def needs_extras(what: str) -> Iterator[None]:
    """Turns the import of a missing extra's module into its install hint."""
    try:
        yield
    except ModuleNotFoundError as exc:
        hint = missing_extra(exc, what)
        if hint is None:
            raise
        raise hint from None


# -- help ---------------------------------------------------------------------------

def shown_default(action: argparse.Action) -> str | None:
    """An option's default as help and docs/cli.md show it; None when it has none to show."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or default is False or default == []:
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(str(v) for v in default)
    return str(default)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it names its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = shown_default(action)
        if shown is None or "default" in text or action.help is argparse.SUPPRESS:
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """argparse's parser with our help format, and usage errors in the one form."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        say("error", message, PROG if self.prog.startswith(PROG + " ") else self.prog)
        raise SystemExit(USAGE)


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: it still works, says what replaces it, and is left
    out of --help (docs/cli.md lists it)."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str = "", **kwargs: Any):
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        say("warning", f"{option_string} is deprecated: use {self.replacement}")
        setattr(namespace, self.dest, values)


def deprecated(parser: argparse.ArgumentParser, *old: str, replacement: str, dest: str, **kwargs: Any) -> None:
    parser.add_argument(*old, dest=dest, action=DeprecatedAlias, replacement=replacement,
                        default=argparse.SUPPRESS, **kwargs)


# -- option types -------------------------------------------------------------------

class BadSetting(argparse.ArgumentTypeError, ValueError):
    """A flag's message for argparse, a ValueError for `env`."""


CAST_KINDS: dict[Callable, str] = {int: "an integer", float: "a number"}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """--log-level: a level name of the logging module, in any case."""
    if value.strip().upper() not in LOG_LEVELS:
        raise BadSetting(f"must be one of {', '.join(LOG_LEVELS)} (any case), got {value!r}")
    return value.strip().upper()


CAST_KINDS[log_level] = f"one of {', '.join(LOG_LEVELS)}"


def port(value: str) -> int:
    """A TCP port to listen on, 1 to 65535."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 0 < number <= 65535:
        raise BadSetting(f"must be a port number (1 to 65535), got {value!r}")
    return number


def port_or_off(value: str) -> int | None:
    """A TCP port to listen on, or 0 for none (None)."""
    if value.strip() == "0":
        return None
    try:
        return port(value)
    except BadSetting:
        raise BadSetting(f"must be a port number (1 to 65535, 0: off), got {value!r}") from None


CAST_KINDS[port] = "a port number (1 to 65535)"
CAST_KINDS[port_or_off] = "a port number (1 to 65535, 0: off)"


def choice(*choices: str) -> Callable[[str], str]:
    """One of `choices` (for a default from the environment, which argparse does not check)."""
    def parse(value: str) -> str:
        if value not in choices:
            raise BadSetting(f"must be one of {', '.join(choices)}, got {value!r}")
        return value
    CAST_KINDS[parse] = f"one of {', '.join(choices)}"
    return parse


def env(name: str, default: Any = None, cast: Callable = str) -> Any:
    """An option's default from the environment (how the operator configures pods); a
    value that does not parse is a usage error (exit 2) that names the variable."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return cast(value)
    except ValueError:
        raise CommandError(f"{name} must be {CAST_KINDS.get(cast, 'valid')}, got {value!r}") from None


def env_flag(name: str) -> bool:
    """A yes/no option's default from the environment: true only for "true" (any case)."""
    return (env(name) or "").lower() == "true"


def log_level_option(parser: argparse.ArgumentParser, default: str = "INFO") -> None:
    parser.add_argument("--log-level", type=log_level, choices=LOG_LEVELS,
                        default=env("EFFECTMQ_LOG_LEVEL", default, log_level),
                        help="how much to log [EFFECTMQ_LOG_LEVEL]")


# -- output -------------------------------------------------------------------------

def emit(args, value: Any, human: Callable[[Any], str]) -> None:
    """Print JSON with --json, else the human rendering."""
    print(json.dumps(value, indent=2, default=str) if args.json else human(value), flush=True)


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, *, as_json: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if as_json
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
