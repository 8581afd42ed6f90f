"""`minimill box ...` against a real control plane and box host, and a host that refuses
to offer boxes it cannot isolate."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from api_harness import ApiEnv
from box_harness import BoxHostProc

from minimill.boxes.client import Boxes
from minimill.control.records import SiteScope
from minimill.control.sites import create_site


def _box(env: ApiEnv, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", "box", *args], input=stdin,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MINIMILL_BASE_URL": env.v1,
                               "MINIMILL_API_KEY": env.key})


def test_box_cli(box_env: ApiEnv, box_host: BoxHostProc, tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "greet.sh").write_text("echo hello from $1\n")
    created = _box(box_env, "create", "--image", str(tmp_path / "img"))
    assert created.returncode == 0, created.stderr
    box_id = next(line.split('"')[3] for line in created.stdout.splitlines()
                  if line.strip().startswith('"id"'))

    ran = _box(box_env, "exec", box_id, "sh", "greet.sh", "cli")
    assert (ran.returncode, ran.stdout) == (0, "hello from cli\n")
    failed = _box(box_env, "exec", box_id, "sh", "-c", "echo oops >&2; exit 7")
    assert (failed.returncode, failed.stderr) == (7, "oops\n")

    assert _box(box_env, "write", box_id, "in/data.txt", stdin="piped").returncode == 0
    assert _box(box_env, "read", box_id, "in/data.txt").stdout == "piped"
    assert "data.txt" in _box(box_env, "ls", box_id, "in").stdout
    snap = _box(box_env, "snapshot", box_id).stdout.strip()
    assert snap.startswith("snap_")
    assert box_id in _box(box_env, "list").stdout

    escape = _box(box_env, "read", box_id, "../etc/passwd")
    assert escape.returncode == 1 and "path_escape" in escape.stderr
    assert _box(box_env, "rm", box_id).returncode == 0
    gone = _box(box_env, "exec", box_id, "true")
    assert gone.returncode == 1 and "box_not_found" in gone.stderr


def test_box_cli_stream(box_env: ApiEnv, box_host: BoxHostProc) -> None:
    """`box exec --stream` prints each line as the command prints it."""
    assert "as it comes" in _box(box_env, "exec", "--help").stdout
    with Boxes(box_env.v1, box_env.key) as client:
        box_id = client.create().id
    proc = subprocess.Popen(
        [sys.executable, "-m", "minimill.cli", "box", "exec", "--stream", box_id, "sh", "-c",
         "echo first; sleep 1.5; echo second; echo problem >&2; exit 4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MINIMILL_BASE_URL": box_env.v1, "MINIMILL_API_KEY": box_env.key})
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    first_at = time.monotonic()
    rest, errors = proc.communicate(timeout=120)
    ended_at = time.monotonic()
    assert (first, rest, errors) == ("first\n", "second\n", "problem\n")
    assert proc.returncode == 4
    assert ended_at - first_at >= 1.0  # the first line came while the command slept
    gone = _box(box_env, "exec", "--stream", "box_doesnotexist", "true")
    assert gone.returncode == 1 and "box_not_found" in gone.stderr


def test_host_refuses_boxes_without_isolation(box_env: ApiEnv, tmp_path: Path) -> None:
    token = create_site(box_env.store, "no-bwrap-site", 0.1, "cpu",
                        serves=frozenset({SiteScope.BOXES}))
    # No bubblewrap on its PATH: it must refuse, saying what to install or how to opt out.
    proc = subprocess.run(
        [sys.executable, "-m", "minimill.cli", "worker", "--server", box_env.base_url,
         "--site", "no-bwrap-site", "--engine", "none", "--boxes", "2",
         "--box-dir", str(tmp_path / "boxes")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": str(tmp_path), "MINIMILL_SITE_TOKEN": token})
    assert proc.returncode == 2
    assert "bubblewrap" in proc.stderr and "--insecure-no-sandbox" in proc.stderr


def test_box_exec_takes_a_shell_line_or_argv(box_env: ApiEnv, box_host: BoxHostProc) -> None:
    """One argument is a shell command line; several, or any after `--`, are argv; a
    program that is not there is said so in minimill's words, with a shell's exit code."""
    with Boxes(box_env.v1, box_env.key) as client:
        box_id = client.create().id
    shell = _box(box_env, "exec", box_id, "echo hi && echo there")
    assert (shell.returncode, shell.stdout) == (0, "hi\nthere\n"), shell.stderr
    argv = _box(box_env, "exec", box_id, "--", "echo", "a && b")
    assert (argv.returncode, argv.stdout) == (0, "a && b\n"), argv.stderr
    one = _box(box_env, "exec", box_id, "--", "pwd")
    assert (one.returncode, one.stdout) == (0, "/workspace\n"), one.stderr
    for words in (["--", "no-such-program"], ["no-such-program", "--flag"]):
        missing = _box(box_env, "exec", box_id, *words)
        assert (missing.returncode, missing.stderr) == (
            127, "minimill: no-such-program: command not found\n")
        assert "bwrap" not in missing.stdout + missing.stderr
    bare = _box(box_env, "exec", box_id, "--")
    assert bare.returncode == 2 and "no command after --" in bare.stderr
    _box(box_env, "rm", box_id)
