"""A box reaching for the kernel: new user namespaces, the keyring, ptrace, bpf, perf events,
mounts, kernel modules. Each is refused by the box's seccomp filter (EPERM), and the box
goes on. Inside, `id` shows no account of the host: the box has its own passwd and group."""

from __future__ import annotations

import platform
import pwd

import pytest
from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.client.boxes import Boxes

# Each system call made directly (ctypes), so that no wrapper's own check answers first.
SYSCALLS = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
nr = {"unshare": 272, "add_key": 248, "keyctl": 250, "request_key": 249, "ptrace": 101,
      "bpf": 321, "perf_event_open": 298, "mount": 165, "init_module": 175,
      "finit_module": 313, "kexec_load": 246, "setns": 308, "process_vm_readv": 310,
      "userfaultfd": 323, "clone3": 435}
args = {"unshare": (0x10000000,), "ptrace": (16, 1, 0, 0),
        "mount": (b"none", b"/tmp", b"tmpfs", 0, 0), "add_key": (b"user", b"k", b"v", 1, -3)}
for name, number in nr.items():
    ctypes.set_errno(0)
    rc = libc.syscall(number, *args.get(name, ()))
    print(name, rc, os.strerror(ctypes.get_errno()) if rc == -1 else "ok")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 system call numbers")
def test_refused_system_calls(boxes: Boxes, box_host: BoxHostProc) -> None:
    box = boxes.create()
    result = box.exec(["python3", "-c", SYSCALLS])
    assert result.exit_code == 0, result
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    for name, outcome in lines.items():
        expected = "-1 Function not implemented" if name == "clone3" else \
            "-1 Operation not permitted"
        assert outcome == expected, (name, outcome)
    # The tools too; and a plain fork, a thread and a subprocess still work.
    tools = box.exec("unshare -U true; echo unshare=$?; (sleep 0.1 &) ; "
                     "python3 -c 'import threading, subprocess; "
                     "t = threading.Thread(target=print); t.start(); t.join(); "
                     "print(subprocess.run([\"echo\", \"child\"], capture_output=True)"
                     ".stdout.decode().strip())'")
    assert "unshare=1" in tools.stdout and "child" in tools.stdout, tools
    assert "Operation not permitted" in tools.stderr
    assert_healthy(box)
    box.delete()


def test_id_shows_no_host_account(boxes: Boxes, box_host: BoxHostProc) -> None:
    box = boxes.create()
    result = box.exec("id; id -un 0; stat -c %U:%G /usr")
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == ["uid=1000(box) gid=1000(box) groups=1000(box)",
                                          "root", "nobody:nogroup"]
    users = box.exec("cut -d: -f1 /etc/passwd").stdout.split()
    groups = box.exec("cut -d: -f1 /etc/group").stdout.split()
    assert (users, groups) == (["root", "box", "nobody"], ["root", "box", "nogroup"])
    host_accounts = {p.pw_name for p in pwd.getpwall()} - {"root", "nobody"}
    assert host_accounts and not host_accounts & set(users + groups)
    box.delete()
