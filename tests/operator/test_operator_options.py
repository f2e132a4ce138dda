"""The operator's command line: options and their $EFFECTMQ_OPERATOR_* defaults (how the
chart configures it). A bad value is a usage error that names the option and the
variable, before the operator touches any cluster; before, a bad lease length was a
ValueError traceback from inside kopf's startup handler, a bad metrics port one at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def operator_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ,
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]),
                   **env, "KUBECONFIG": "/nonexistent"}  # it must stop before it looks for a cluster
    return subprocess.run([sys.executable, "-m", "effectmq_operator", *args], env=environment,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("env, args, message", [
    ({"EFFECTMQ_OPERATOR_LEASE_SECONDS": "abc"}, (),
     "--lease-seconds: must be a positive number of seconds, "
     "not 'abc' (from --lease-seconds or $EFFECTMQ_OPERATOR_LEASE_SECONDS)"),
    ({"EFFECTMQ_OPERATOR_LEASE_SECONDS": "0"}, (), "--lease-seconds: must be a positive number of seconds, not '0'"),
    ({}, ("--lease-seconds", "nan"), "--lease-seconds: must be a positive number of seconds, not 'nan'"),
    ({"EFFECTMQ_OPERATOR_METRICS_PORT": "http"}, (), "--metrics-port: must be a port number, not 'http' "
                                                       "(from --metrics-port or $EFFECTMQ_OPERATOR_METRICS_PORT)"),
    ({}, ("--metrics-port", "70000"), "--metrics-port: must be a port number, not '70000'"),
    ({"EFFECTMQ_OPERATOR_API_THREADS": "0"}, (), "--api-threads: must be a positive whole number, not '0'"),
    ({"EFFECTMQ_OPERATOR_RECONCILES": "many"}, (), "--reconciles: must be a positive whole number, not 'many'"),
])
def test_a_bad_value_is_a_usage_error_that_names_it(env, args, message):
    done = operator_cli(*args, **env)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_the_help_names_each_variable():
    done = operator_cli("--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for variable in ("EFFECTMQ_OPERATOR_METRICS_PORT", "EFFECTMQ_OPERATOR_LEASE_SECONDS",
                     "EFFECTMQ_OPERATOR_API_THREADS", "EFFECTMQ_OPERATOR_REDIS_CONNECTIONS",
                     "EFFECTMQ_OPERATOR_RECONCILES"):
        assert f"${variable}" in text, variable


def without(tmp_path: Path, module: str) -> str:
    """A PYTHONPATH entry that makes `import <module>` fail as it does when the package is
    not installed (the test venv has every extra)."""
    hide = tmp_path / "hide" / module
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {module!r}", name={module!r})\n')
    return str(hide.parent)


@pytest.mark.parametrize("args", [("--help",), ()])
def test_without_the_operator_extra_it_says_what_to_install(tmp_path, args):
    """Was a traceback ending in "No module named 'kopf'", even for --help."""
    hidden = without(tmp_path, "kopf")
    done = operator_cli(*args, PYTHONPATH=os.pathsep.join([hidden, str(ROOT), str(ROOT / "operator")]))
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("effectmq-operator: error: ") and "pip install 'effectmq[operator]'" in done.stderr


def test_every_option_has_help_and_its_default():
    from effectmq_operator.__main__ import build_parser

    for action in build_parser()._actions:
        assert action.help, action.option_strings
    text = " ".join(build_parser().format_help().split())
    assert "(default: 9090)" in text and "(default: http://0.0.0.0:8080/healthz)" in text
