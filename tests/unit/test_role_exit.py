"""A role process that ends on anything but a return says why, last in its log, and exits
non-zero (``verl_async.runtime.report_exit``); its log holds the run's lines, not a line
per HTTP request of a library (``setup_logging``). Each case is a small real process:
logging's set-up and an interpreter's exit are what is tested."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROLOGUE = """
import logging, signal, sys
from verl_async.config_base import ConfigError
from verl_async.lifetime import Stopped
from verl_async.runtime import report_exit, setup_logging

log = setup_logging("testrole")

def deep(exc):
    raise exc
"""


def run_role(body: str) -> subprocess.CompletedProcess:
    """``body`` (indented under ``with report_exit(log):``) in a fresh interpreter."""
    code = PROLOGUE + "with report_exit(log):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.mark.parametrize(
    ("body", "code", "ended_by"),
    [
        ("deep(SystemExit(2))", 2, "SystemExit: 2, raised at <string>:10 in deep (exit code 2)"),
        ("deep(SystemExit('gave up'))", 1, "SystemExit: gave up, raised at <string>:10 in deep"),
        ("deep(KeyboardInterrupt())", 130, "KeyboardInterrupt, raised at <string>:10 in deep"),
        ("deep(RecursionError('too deep'))", 1, "RecursionError: too deep, raised at <string>"),
        (
            """
            try:
                deep(ValueError("first"))
            finally:
                deep(OSError("raised in the finally"))
            """,
            1,
            "OSError: raised in the finally, raised at <string>:10 in deep (exit code 1)",
        ),
    ],
)
def test_an_exception_ends_the_role_with_its_traceback_then_one_line_naming_it(
    body, code, ended_by
):
    res = run_role(body)
    assert res.returncode == code, res.stderr
    last = last_line(res.stderr)
    assert "testrole ERROR verl_async.testrole: ended by " in last, res.stderr
    assert ended_by in last, last
    assert "Traceback (most recent call last)" in res.stderr  # before it, at ERROR
    assert res.stderr.index("Traceback") < res.stderr.index(last)


def test_a_config_error_is_one_line_without_a_traceback():
    res = run_role("deep(ConfigError(\"bad value for 'algo.loss_mode': no such loss\"))")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert "ERROR" in res.stderr and "ended by ConfigError: bad value for 'algo.loss_mode'" in (
        res.stderr
    )


def test_a_stop_asked_for_is_one_info_line_with_its_code():
    res = run_role("raise Stopped(128 + signal.SIGTERM, 'SIGTERM')")
    assert res.returncode == 143
    assert res.stderr.count("\n") == 1, res.stderr
    assert "testrole INFO verl_async.testrole: stopped: SIGTERM (exit code 143)" in res.stderr


@pytest.mark.parametrize("body", ["pass", "sys.exit(0)", "sys.exit()"])
def test_a_normal_end_adds_nothing(body):
    res = run_role(body)
    assert res.returncode == 0 and res.stderr == ""


def test_http_libraries_log_warnings_only():
    """One INFO line per agent call (httpx under the openai client) would bury the run's
    own lines; their warnings still come through."""
    code = """
        import logging
        from verl_async.runtime import setup_logging
        setup_logging("generator0")
        for name in ("httpx", "httpcore", "openai", "aiohttp.access", "urllib3", "filelock"):
            logging.getLogger(name).info("%s: HTTP Request: POST /v1/chat 200 OK", name)
            logging.getLogger(name).warning("%s: retrying", name)
        logging.getLogger("verl_async.generator0").info("the run's own line")
    """
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "HTTP Request" not in res.stderr
    assert res.stderr.count("retrying") == 6
    assert "the run's own line" in res.stderr
