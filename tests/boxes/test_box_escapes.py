"""Escape attempts from real bubblewrap boxes: each ends with a clear error (or a command that
failed inside the box), and the box, its neighbours and the host stay healthy."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_harness import ApiEnv
from box_harness import BoxHostProc

from minimill.boxes.uids import BOX_UID_FIRST
from minimill.client.boxes import Box, BoxError, Boxes

SECRET = "s3cret-of-box-a"


@pytest.fixture(scope="module")
def pair(box_env: ApiEnv, box_host: BoxHostProc) -> Iterator[tuple[Box, Box]]:
    """Box A holds a secret; box B belongs to another tenant."""
    with Boxes(box_env.v1, box_env.key, timeout_s=120) as a_client, \
            Boxes(box_env.v1, box_env.new_key("tenant-b"), timeout_s=120) as b_client:
        a = a_client.create(limits={"disk_mb": 4, "max_processes": 32, "memory_mb": 256,
                                    "timeout_s": 20})
        b = b_client.create()
        a.write("secret.txt", SECRET)
        yield a, b


def assert_healthy(*boxes: Box) -> None:
    for box in boxes:
        result = box.exec("echo alive")
        assert (result.exit_code, result.stdout) == (0, "alive\n")


def test_cannot_write_outside_the_workspace(pair: tuple[Box, Box]) -> None:
    a, b = pair
    for target in ("/usr/bin/planted", "/etc/planted", "/planted", "/proc/planted"):
        result = a.exec(["sh", "-c", f"echo x > {target}"])
        assert result.exit_code != 0, target
        assert not Path(target).exists()
    # /tmp is the box's own, small and private.
    assert a.exec("echo x > /tmp/t && cat /tmp/t").stdout == "x\n"
    assert b.exec("cat /tmp/t").exit_code != 0
    assert_healthy(a, b)


def test_cannot_read_another_box_or_tenant(pair: tuple[Box, Box], box_host: BoxHostProc,
                                           box_env: ApiEnv) -> None:
    a, b = pair
    host_path = box_host.box_dir / a.id / "secret.txt"
    assert host_path.read_text() == SECRET  # it is there, on the host
    result = b.exec(["sh", "-c", f"cat {host_path}; ls /; grep -rs {SECRET} /workspace /tmp"])
    assert SECRET not in result.stdout
    assert sorted(result.stdout.split()) == ["bin", "dev", "etc", "lib", "lib64", "proc",
                                             "sbin", "tmp", "usr", "workspace"]
    # Through the API, another tenant's box does not exist.
    with Boxes(box_env.v1, box_env.new_key("tenant-b"), timeout_s=30) as other:
        with pytest.raises(BoxError) as err:
            other.get(a.id).exec("cat secret.txt")
        assert err.value.status == 404
    assert_healthy(a, b)


def test_no_network_unless_asked(pair: tuple[Box, Box], box_env: ApiEnv, boxes: Boxes) -> None:
    a, _ = pair
    port = box_env.base_url.rsplit(":", 1)[1]
    probe = ("import socket\ntry:\n"
             f"    socket.create_connection(('127.0.0.1', {port}), 3)\n"
             "    print('connected')\nexcept OSError as e:\n    print('refused', e)")
    result = a.exec(["python3", "-c", probe])
    assert result.stdout.startswith("refused"), result
    ip = a.exec(["sh", "-c", "cat /proc/net/dev"]).stdout
    assert "eth" not in ip and "lo" in ip  # only its own loopback
    # With the network it has an interface of its own (pasta's), and still no way to the
    # host's loopback (tests/security/test_box_reaches_host_network.py).
    online = boxes.create(network=True)
    assert "eth0" in online.exec("cat /proc/net/dev").stdout
    assert online.exec(["python3", "-c", probe]).stdout.startswith("refused")
    online.delete()


def test_cannot_read_host_secrets(pair: tuple[Box, Box], box_host: BoxHostProc,
                                  box_env: ApiEnv) -> None:
    a, _ = pair
    db_path = box_env.db_url.removeprefix("sqlite:///")
    script = (f"env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; cat {db_path}; "
              f"ls /proc; cat /proc/1/cmdline")
    result = a.exec(["sh", "-c", script])
    assert box_host.token not in result.stdout + result.stderr
    assert "MINIMILL" not in result.stdout
    assert "SQLite format" not in result.stdout
    # Its own PID namespace: a handful of its own processes, none of the host's.
    pids = [p for p in result.stdout.split() if p.isdigit()]
    assert 0 < len(pids) < 10
    assert_healthy(a)


def test_fork_bomb_is_contained(pair: tuple[Box, Box]) -> None:
    a, b = pair
    bomb = ("import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print('stopped at', n, e.errno)")
    result = a.exec(["python3", "-c", bomb], timeout_s=15)
    assert result.stdout.startswith("stopped at"), result
    assert int(result.stdout.split()[2]) < 32  # its max_processes
    # The shell classic too: it ends (limit, then the exec's timeout) and takes nothing along.
    result = a.exec(["sh", "-c", f"f() {{ f | f & }}; f; sleep {SHELL_BOMB_SLEEP}"], timeout_s=5)
    assert result.duration_s < 15
    assert_healthy(a, b)
    assert _host_processes_of_box() == 0


# An odd duration, so the bomb's sleeper is told apart from other tests' processes (a parallel
# run has other boxes under the same uid).
SHELL_BOMB_SLEEP = "2.0625"


def _host_processes_of_box() -> int:
    """Processes of the two bombs left on the host under the boxes' uids."""
    out = subprocess.run(["ps", "-e", "-o", "uid=,args="], capture_output=True,
                         text=True).stdout
    marks = ("os.fork()", "f | f", f"sleep {SHELL_BOMB_SLEEP}")
    found = 0
    for line in out.splitlines():
        uid, _, args = line.strip().partition(" ")
        is_box = (int(uid) >= BOX_UID_FIRST if os.geteuid() == 0
                  else int(uid) == os.geteuid())
        found += is_box and any(mark in args for mark in marks)
    return found


def test_disk_quota(pair: tuple[Box, Box]) -> None:
    a, b = pair
    many = a.exec(["sh", "-c", "for i in 1 2 3 4 5 6 7 8; do head -c 1000000 /dev/zero > f$i;"
                   " sleep 0.2; done"])
    assert many.error == "disk_quota_exceeded", many
    freed = a.exec("rm -f f* && echo freed")
    assert freed.stdout == "freed\n", freed
    one_file = a.exec(["sh", "-c", "head -c 10000000 /dev/zero > big"])
    assert one_file.exit_code != 0 and "File size limit" in one_file.stderr
    with pytest.raises(BoxError) as err:
        a.write("more.bin", b"x" * 5_000_000)
    assert (err.value.status, err.value.code) == (400, "disk_quota_exceeded")
    # Freeing space makes it usable again.
    assert a.exec("rm -f big f* && echo freed").stdout == "freed\n"
    a.write("small.txt", "fits")
    assert_healthy(a, b)


def test_exec_past_its_timeout(pair: tuple[Box, Box]) -> None:
    a, _ = pair
    result = a.exec(["sh", "-c", "sleep 4321 & sleep 4321"], timeout_s=1)
    assert result.timed_out and result.error == "timeout"
    assert result.duration_s < 5
    out = subprocess.run(["pgrep", "-f", "sleep 4321"], capture_output=True, text=True)
    assert out.stdout == ""  # the whole process tree is gone
    assert_healthy(a)


def test_memory_limit(pair: tuple[Box, Box]) -> None:
    a, _ = pair
    result = a.exec(["python3", "-c", "x = bytearray(1024 * 1024 * 1024)"])
    assert result.exit_code != 0 and "MemoryError" in result.stderr
    assert_healthy(a)


def test_file_api_refuses_symlinks_and_dotdot(pair: tuple[Box, Box]) -> None:
    a, _ = pair
    assert a.exec("ln -s /etc/passwd link && ln -s / rootlink && mkdir -p d").exit_code == 0
    cases = [("read", "link", "symlink"), ("read", "rootlink/etc/passwd", "symlink"),
             ("write", "rootlink/tmp/x", "symlink"), ("write", "link", "symlink"),
             ("read", "../secret.txt", "path_escape"), ("read", "d/../../x", "path_escape"),
             ("list", "rootlink", "symlink"), ("write", "/workspace/../etc/x", "path_escape")]
    for op, path, code in cases:
        with pytest.raises(BoxError) as err:
            if op == "read":
                a.read(path)
            elif op == "write":
                a.write(path, "x")
            else:
                a.list_files(path)
        assert (err.value.status, err.value.code) == (400, code), (op, path, err.value)
    # The links themselves are listed as links, not followed.
    kinds = {e["name"]: e["type"] for e in a.list_files(".")}
    assert kinds["link"] == "symlink" and kinds["rootlink"] == "symlink"
    assert a.read_text("secret.txt") == SECRET
    assert_healthy(a)


def test_host_still_serves(pair: tuple[Box, Box], boxes: Boxes, box_host: BoxHostProc) -> None:
    assert box_host.popen is not None and box_host.popen.poll() is None
    fresh = boxes.create()
    assert fresh.exec("echo fine").stdout == "fine\n"
    fresh.delete()
