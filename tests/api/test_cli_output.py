"""What the `minimill` command prints is for people: help that reads at 80 columns with every
option name whole, errors as one line (the request id named), tracebacks only with --verbose,
a header on every table, "no agents" for an empty list."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from api_harness import ApiEnv

from minimill.control.keys import create_key

pytestmark = pytest.mark.parametrize("env", ["sqlite"], indirect=True)


def minimill(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "80", **env})


def test_help_at_80_columns_keeps_every_option_name(env: ApiEnv) -> None:
    for command in (["serve"], ["worker"], ["box", "exec"], ["sites", "list"]):
        shown = minimill(*command, "--help")
        assert shown.returncode == 0, shown.stderr
        assert max(len(line) for line in shown.stdout.splitlines()) <= 80
        assert "…" not in shown.stdout  # nothing cut
    serve_help = minimill("serve", "--help").stdout
    assert "--insecure-no-sandbox" in serve_help and "--box-max-processes" in serve_help
    # Descriptions wrap between words, not mid-sentence at a hard line end of the source.
    assert re.search(r"Let the local worker run boxes and agents'\s+harnesses", serve_help)


def test_errors_are_one_line_and_empty_lists_say_so(env: ApiEnv, tmp_path: Path) -> None:
    fresh = create_key(env.store, "first-hour")  # a tenant with nothing yet
    api = {"MINIMILL_BASE_URL": env.v1, "MINIMILL_API_KEY": fresh}
    empty = minimill("agent", "list", **api)
    assert (empty.returncode, empty.stdout) == (0, "no agents\n"), empty.stderr
    assert minimill("box", "list", **api).stdout == "no boxes\n"
    bogus = minimill("agent", "list", "--status", "bogus", **api)
    assert bogus.returncode == 1
    [line] = bogus.stderr.splitlines()
    assert line.startswith("error: ") and "(None)" not in line and "request req_" in line, line
    # An error minimill did not expect: one line, the traceback only with --verbose.
    broken = tmp_path / "broken.yaml"
    broken.write_text("sites: 3\n")  # a number where a list of sites belongs
    short = minimill("sim", str(broken))
    assert short.returncode != 0 and "Traceback" not in short.stderr, short.stderr
    assert len(short.stderr.strip().splitlines()) == 1, short.stderr
    assert short.stderr.startswith("error: ") and "--verbose" in short.stderr
    long = minimill("--verbose", "sim", str(broken))
    assert "Traceback" in long.stderr
