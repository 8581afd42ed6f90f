"""A seccomp filter that forbids starting processes (threads stay allowed), for bubblewrap's
`--seccomp FD`.

A harness (agents/harness_process.py) runs Python that has no business starting programs: its
commands run in its box. Without new processes a fork bomb is impossible, even for a runner
running as root, whose processes RLIMIT_NPROC does not count. The program is classic BPF over
`struct seccomp_data` (nr at offset 0, arch at 4, args[0] at 16), built here because the
filter is small and fixed; only x86-64 is described, elsewhere `no_fork_filter` returns None.
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_NR_CLONE, _NR_FORK, _NR_VFORK, _NR_CLONE3 = 56, 57, 58, 435
_CLONE_THREAD = 0x00010000

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000


def _errno(code: int) -> int:
    return 0x00050000 | code  # SECCOMP_RET_ERRNO


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def no_fork_filter() -> bytes | None:
    """fork, vfork and a clone without CLONE_THREAD fail with EPERM; clone3 with ENOSYS (so
    that the C library falls back to clone, whose flags a filter can read); any other
    architecture's or x32's system calls kill the process. None where the machine is not
    x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    program = [
        _op(_LD_W_ABS, 4),  # 0: arch
        _op(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1),  # 1: x86-64 -> 3
        _op(_RET_K, _KILL_PROCESS),  # 2
        _op(_LD_W_ABS, 0),  # 3: nr
        _op(_JGE_K, _X32_SYSCALL_BIT, jt=10),  # 4: x32 -> 15
        _op(_JEQ_K, _NR_FORK, jt=8),  # 5: -> 14
        _op(_JEQ_K, _NR_VFORK, jt=7),  # 6: -> 14
        _op(_JEQ_K, _NR_CLONE3, jt=5),  # 7: -> 13
        _op(_JEQ_K, _NR_CLONE, jt=1),  # 8: -> 10
        _op(_RET_K, _ALLOW),  # 9
        _op(_LD_W_ABS, 16),  # 10: clone's flags (low word)
        _op(_JSET_K, _CLONE_THREAD, jf=2),  # 11: a thread -> 12, else -> 14
        _op(_RET_K, _ALLOW),  # 12
        _op(_RET_K, _errno(errno.ENOSYS)),  # 13
        _op(_RET_K, _errno(errno.EPERM)),  # 14
        _op(_RET_K, _KILL_PROCESS),  # 15
    ]
    return b"".join(program)
