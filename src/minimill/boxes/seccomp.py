"""Seccomp filters for bubblewrap's `--seccomp FD`, built with libseccomp (pyseccomp).

`box_filter()`, on every box exec, refuses (EPERM) what container runtimes' default profiles
refuse and what matters here: new user namespaces (unshare or clone with CLONE_NEWUSER, and
clone3, whose flags a filter cannot read: ENOSYS makes the C library fall back to clone), the
kernel keyring, ptrace and reading or writing other processes' memory, bpf, perf events,
mounts, kexec, kernel modules, swap, reboot, clock and system settings, userfaultfd and
handle-based opens. Everything else is allowed. System calls of another architecture (x32,
or i386 through int 0x80) kill the process: libseccomp's filter holds the native one only.

`no_fork_filter()`, for an agent's harness (agents/harness_process.py), adds that starting a
process fails (fork, vfork, a clone without CLONE_THREAD): a harness runs its commands in its
box, and without new processes a fork bomb is impossible even for a runner running as root.

Both are exported as the classic BPF program bubblewrap loads; None where libseccomp is not
installed (Debian's libseccomp2): a box host then refuses to offer boxes unless its operator
opts out of isolation.
"""

from __future__ import annotations

import errno
import functools
import logging
import tempfile
from typing import Any

log = logging.getLogger("minimill.boxes")

# Refused outright (EPERM), as Docker's and Podman's default profiles refuse them.
REFUSED = (
    "add_key", "keyctl", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr", "setns",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "iopl", "ioperm", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl",
    "vm86", "vm86old", "create_module", "get_kernel_syms", "query_module",
)
CLONE_NEWUSER = 0x10000000
CLONE_THREAD = 0x00010000


def _seccomp() -> Any:
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError):  # RuntimeError: no libseccomp on the host
        return None
    return pyseccomp


def available() -> bool:
    return _seccomp() is not None


def _add(sc: Any, flt: Any, action: int, name: str, *args: Any) -> None:
    try:
        flt.add_rule(action, name, *args)
    except (OSError, ValueError):
        # Not a system call of this architecture, or unknown to this libseccomp: nothing
        # can call it here.
        log.debug("seccomp: no %s on this architecture", name)


def _build(no_fork: bool) -> bytes | None:
    sc = _seccomp()
    if sc is None:
        return None
    flt = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in REFUSED:
        _add(sc, flt, deny, name)
    new_user = sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
    _add(sc, flt, deny, "unshare", new_user)
    _add(sc, flt, deny, "clone", new_user)
    _add(sc, flt, sc.ERRNO(errno.ENOSYS), "clone3")
    if no_fork:
        _add(sc, flt, deny, "fork")
        _add(sc, flt, deny, "vfork")
        _add(sc, flt, deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


@functools.cache
def box_filter() -> bytes | None:
    """The filter of every box exec; None without libseccomp."""
    return _build(no_fork=False)


@functools.cache
def no_fork_filter() -> bytes | None:
    """The filter of a harness: the box filter, and no new processes (threads stay allowed).
    None without libseccomp."""
    return _build(no_fork=True)
