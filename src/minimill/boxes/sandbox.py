"""One exec in a box: layers of isolation, each assumed to fail, plus per-exec limits.

- bubblewrap: the box sees a read-only system (/usr and the few /etc files programs need),
  its workspace at /workspace (writable), a small private /tmp, a fresh /proc of its own PID
  namespace, and minimal /etc/passwd and /etc/group of its own (root, the box user, nobody):
  no account of the host. Nothing else of the host is mounted: not the store, not
  MINIMILL_HOME, not the worker's environment (the sandbox starts from an empty one).
- seccomp (seccomp.py, libseccomp): no new user namespaces, no keyring, no ptrace, no bpf,
  no mounts, no kernel modules, and the rest container runtimes refuse.
- A host uid per box (uids.py) on root hosts: a box owns nothing of the host's or of another
  box's, and its processes count against its own process limit only.
- Limits: CPU seconds, address space, process count and the largest file it may write (what
  is left of the disk quota) as rlimits, always; where the host has a delegated cgroup v2
  (cgroups.py), memory, processes and CPU seconds of the exec as a whole too. A wall clock
  after which the whole process tree dies with bubblewrap's PID namespace.
- Network: none (only its own loopback) unless the box asked for it; then a user-mode network
  stack (pasta, Debian's `passt`) in a network namespace of its own, whose routes make the
  private, link-local and carrier ranges unreachable, with no route to the host's loopback
  (NET_SETUP): the box reaches the internet where the host can, never the control plane, the
  store or a metadata service. DNS goes to the host's resolver through pasta.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minimill.box_protocol import MAX_EXEC_OUTPUT_BYTES
from minimill.boxes import seccomp
from minimill.boxes.layers import (
    IsolationUnavailable,
    box_files,
    exec_group,
    in_group,
    net_prefix,
)

# What a box sees of the host's /etc: enough for the dynamic linker and certificates. Its users
# and groups are its own (BOX_PASSWD, BOX_GROUP), never the host's accounts; so is its
# resolv.conf, with network (BOX_DNS).
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "hosts", "ssl",
              "ca-certificates", "alternatives", "localtime")
# The uid a root host runs an exec as where no box's uid is given (its isolation probe; boxes
# have uids of their own: uids.py); every box sees itself as SANDBOX_UID inside.
UNPRIVILEGED_UID = 65534
SANDBOX_UID = 1000
WORKSPACE_MOUNT = "/workspace"
TMP_BYTES = 64 * 1024 * 1024
# A box's output beyond this is cut (its process keeps running; the rest is discarded).
MAX_OUTPUT_BYTES = MAX_EXEC_OUTPUT_BYTES
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
SETUP_RETRIES = 3
# How bubblewrap's own messages start (on stderr).
_BWRAP_PREFIX = b"bwrap: "
_BWRAP_EXECVP = b"bwrap: execvp "  # the sandbox is set up; the program could not start
log = logging.getLogger("minimill.boxes")
# Called with ("stdout" | "stderr", bytes) as output comes, from the threads reading the pipes.
OnOutput = Callable[[str, bytes], None]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-exec limits of a box (the box's settings; an exec may only lower its timeout)."""

    cpu_s: int = 60  # CPU seconds per exec
    memory_mb: int = 1024  # address space per process
    max_processes: int = 64  # processes and threads at once
    disk_mb: int = 1024  # the workspace's quota
    timeout_s: float = 60.0  # wall clock per exec


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int  # 128 + signal number when killed by a signal, as a shell reports it
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False
    # Set when a limit ended or spoiled the exec: "timeout" | "disk_quota_exceeded" |
    # "cpu_limit" | "memory_limit" (the last two where a cgroup holds the exec); or
    # "cancelled" when its host stopped it.
    error: str | None = None
    output_truncated: bool = False


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _runs_as_root() -> bool:
    return os.geteuid() == 0


def box_uid() -> int:
    """The host uid a box's processes and files belong to."""
    return UNPRIVILEGED_UID if _runs_as_root() else os.geteuid()


def bwrap_args(workspace: Path | None, network: bool,
                extra: Sequence[str] = ()) -> list[str]:
    """bubblewrap's arguments up to the command's, ending with "--". With no `workspace` the
    sandbox starts in /tmp; `extra` adds mounts (bubblewrap options)."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise IsolationUnavailable("bubblewrap (bwrap) is not installed")
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "box",
            "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--clearenv"]
    if workspace is not None:
        args += ["--bind", str(workspace), WORKSPACE_MOUNT, "--chdir", WORKSPACE_MOUNT]
    else:
        args += ["--chdir", "/tmp"]
    args += extra
    if network:
        args.append("--share-net")  # pasta's namespace (never the host's: see _net_prefix)
    # Merged-/usr systems have /bin -> usr/bin; others have real directories.
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{top}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{top}"]
    for name in _ETC_FILES:
        path = Path("/etc") / name
        if path.exists():
            args += ["--ro-bind", str(path), str(path)]
    # The root bubblewrap builds its mount points in is read-only too: a box writes only to
    # /workspace and /tmp.
    return [*args, "--remount-ro", "/", "--"]


def _prlimit_args(limits: Limits, fsize_bytes: int) -> list[str]:
    memory = limits.memory_mb * 1024 * 1024
    # RLIMIT_FSIZE of 0 means "no file may grow", which is what a full quota wants.
    return ["prlimit", f"--cpu={limits.cpu_s}", f"--as={memory}",
            f"--nproc={limits.max_processes}", f"--fsize={max(fsize_bytes, 0)}", "--core=0",
            "--"]


def check_isolation() -> None:
    """Raise IsolationUnavailable unless an exec in a sandbox works on this host."""
    if bwrap_path() is None:
        raise IsolationUnavailable(
            "bubblewrap (bwrap) is not installed: install the Debian package 'bubblewrap' "
            "(apt-get install bubblewrap), or pass --insecure-no-sandbox to run boxes "
            "without isolation")
    if not seccomp.available():
        raise IsolationUnavailable(
            "libseccomp is not installed: install the Debian package 'libseccomp2', or pass "
            "--insecure-no-sandbox to run boxes without isolation")
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"minimill-box-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        if _runs_as_root():
            os.chown(probe, box_uid(), box_uid())
        result = run_exec(probe, ["/bin/sh", "-c", "echo ok > probe && cat probe"],
                          limits=Limits(timeout_s=30.0))
    except (OSError, IsolationUnavailable) as exc:
        raise IsolationUnavailable(f"bubblewrap cannot start a sandbox here ({exc})") from exc
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if result.exit_code != 0 or result.stdout.strip() != b"ok":
        detail = result.stderr.decode(errors="replace").strip()[:300]
        raise IsolationUnavailable(
            f"bubblewrap cannot create namespaces here ({detail or result.exit_code}): user "
            "namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0); or pass --insecure-no-sandbox")


class _Capped:
    """Reads a pipe to the end, keeping at most MAX_OUTPUT_BYTES (a box may print forever);
    what it keeps also goes to `on_output` as it comes."""

    def __init__(self, pipe: object, stream: str, on_output: OnOutput | None = None) -> None:
        self.data = bytearray()
        self.truncated = False
        self._stream = stream
        self._on_output = on_output
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: object) -> None:
        # read1: what is there now, not a full buffer (output is passed on as it comes).
        read = getattr(pipe, "read1", None) or pipe.read  # type: ignore[attr-defined]
        while chunk := read(65536):
            room = MAX_OUTPUT_BYTES - len(self.data)
            if room > 0:
                kept = chunk[:room]
                self.data += kept
                if self._on_output is not None:
                    self._on_output(self._stream, kept)
            if len(chunk) > room:
                self.truncated = True

    def join(self, timeout: float) -> bytes:
        self._thread.join(timeout)
        return bytes(self.data)


def _feed(pipe: object, data: bytes) -> None:
    try:
        pipe.write(data)  # type: ignore[attr-defined]
    except (BrokenPipeError, OSError):
        pass  # the command did not read all of its stdin: that is its business
    finally:
        try:
            pipe.close()  # type: ignore[attr-defined]
        except OSError:
            pass


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    # bwrap leads its own session; its PID namespace's init dies with it, and every process
    # of the box with that.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _setup_failed(result: ExecResult) -> bool:
    """bubblewrap itself failed before the command ran (it says so on stderr, exit 1): under
    heavy load creating namespaces can fail for a moment."""
    return (result.exit_code == 1 and not result.stdout and result.error is None
            and result.stderr.startswith(_BWRAP_PREFIX))


class _SetupGate:
    """Passes an attempt's output on, except what may still be bubblewrap's own complaint that
    it could not set up (an attempt that is tried again must not show it): output is held
    while there is no stdout and stderr so far starts like "bwrap: ", and released once it
    cannot be that (or the attempt ended otherwise)."""

    def __init__(self, on_output: OnOutput) -> None:
        self._on_output = on_output
        self._held: list[tuple[str, bytes]] = []
        self._stderr = b""
        self._open = False
        self._lock = threading.Lock()

    def __call__(self, stream: str, data: bytes) -> None:
        with self._lock:
            if not self._open:
                self._held.append((stream, data))
                if stream == "stderr":
                    self._stderr = (self._stderr + data)[:len(_BWRAP_PREFIX)]
                if stream == "stdout" or not _BWRAP_PREFIX.startswith(self._stderr):
                    self._release()
                return
            self._on_output(stream, data)

    def _release(self) -> None:
        self._open = True
        for stream, data in self._held:
            self._on_output(stream, data)
        self._held.clear()

    def end(self, setup_failed: bool, stderr: bytes | None = None) -> None:
        """`stderr`: what to pass on instead of held stderr (bubblewrap's words, translated)."""
        with self._lock:
            if setup_failed:
                self._held.clear()
            else:
                if stderr is not None:
                    self._held = [(k, d) for k, d in self._held if k != "stderr"]
                    self._held.append(("stderr", stderr))
                self._release()


def translate_bwrap_error(result: ExecResult) -> ExecResult:
    """bubblewrap's own failures in minimill's words, with a shell's exit codes: a program
    that is not there (127) or cannot be run (126). Others keep bubblewrap's message, named
    as the sandbox's."""
    if not _setup_failed(result):
        return result
    text = result.stderr.decode(errors="replace").strip()
    match = re.match(r"bwrap: execvp (.+): (No such file or directory|Permission denied)$",
                     text)
    if match is None:
        message, code = "minimill: the box's sandbox failed: " + text.removeprefix("bwrap: "), 1
    elif match.group(2).startswith("No such"):
        message, code = f"minimill: {match.group(1)}: command not found", 127
    else:
        message, code = f"minimill: {match.group(1)}: permission denied", 126
    return dataclasses.replace(result, exit_code=code, stderr=(message + "\n").encode())


def run_exec(workspace: Path, command: list[str], *, on_output: OnOutput | None = None,
             **kwargs: Any) -> ExecResult:
    """`_run_exec_once`, tried again a few times when bubblewrap could not set up.
    `on_output` gets the output as it comes (not that of an attempt tried again)."""
    retries = 0 if kwargs.get("insecure") else SETUP_RETRIES
    for attempt in range(retries + 1):
        gate = _SetupGate(on_output) if on_output is not None and retries else None
        result = _run_exec_once(workspace, command, on_output=gate or on_output, **kwargs)
        # A program that is not there stays so: only a failure to set up is tried again.
        failed = (_setup_failed(result) and not result.stderr.startswith(_BWRAP_EXECVP)
                  and attempt < retries)
        if not failed:
            translated = translate_bwrap_error(result)
            if gate is not None:
                gate.end(False, translated.stderr if translated is not result else None)
            return translated
        if gate is not None:
            gate.end(True)
        log.warning("bubblewrap could not set up (%s); trying again",
                    result.stderr.decode(errors="replace").strip()[:200])
        time.sleep(0.1 * 2**attempt)
    return result


def _run_exec_once(workspace: Path, command: list[str], *, stdin: bytes = b"",
             env: Mapping[str, str] | None = None, limits: Limits = Limits(),
             network: bool = False, insecure: bool = False, disk_free_bytes: int | None = None,
             over_quota: Callable[[], bool] | None = None,
             cancel: threading.Event | None = None,
             on_output: OnOutput | None = None, uid: int | None = None) -> ExecResult:
    """Run `command` in the box whose workspace is `workspace` and wait for it.

    `disk_free_bytes` caps the size of any file the exec writes; `over_quota`, polled while
    it runs, kills it once the workspace holds more than its quota; setting `cancel` kills it
    (its host lost the box). `insecure` runs it without
    bubblewrap (namespaces), with the same limits: only where the operator opted out.
    `uid` is the host uid it runs as (a root host's uid of the box; default: box_uid()).
    """
    fsize = disk_free_bytes if disk_free_bytes is not None else limits.disk_mb * 1024 * 1024
    box_env = {"PATH": DEFAULT_PATH, "HOME": WORKSPACE_MOUNT, "LANG": "C.UTF-8",
               **(env or {})}
    fds: list[int] = []
    if insecure:
        box_env["HOME"] = str(workspace)
        argv = [*_prlimit_args(limits, fsize), *command]
    else:
        env_args = [a for k, v in box_env.items() for a in ("--setenv", k, v)]
        files, fds = box_files(network)
        bwrap = bwrap_args(workspace, network, extra=files)
        argv = [*_prlimit_args(limits, fsize), *net_prefix(network), *bwrap[:-1], *env_args,
                "--", *command]
    root = _runs_as_root()
    run_as = (uid if uid is not None else box_uid()) if root else None
    group = exec_group(limits.memory_mb, limits.max_processes) if not insecure else None
    if group is not None:
        argv = in_group(group, argv, run_as)
        run_as = None  # the wrapper drops to the box's uid once it is in the group
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workspace, env=box_env if insecure else {"PATH": DEFAULT_PATH},
            start_new_session=True, close_fds=True, pass_fds=fds,
            user=run_as, group=run_as, extra_groups=[] if run_as is not None else None)
    except BaseException:
        if group is not None:
            group.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    out = _Capped(proc.stdout, "stdout", on_output)
    err = _Capped(proc.stderr, "stderr", on_output)
    threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    deadline = started + limits.timeout_s
    error: str | None = None
    while proc.poll() is None:
        if cancel is not None and cancel.is_set():
            error = "cancelled"
        elif time.monotonic() >= deadline:
            error = "timeout"
        elif over_quota is not None and over_quota():
            error = "disk_quota_exceeded"
        elif group is not None and group.cpu_seconds() > limits.cpu_s:
            error = "cpu_limit"  # all of its processes together
        if error is not None:
            _kill_tree(proc)
            break
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    code = proc.wait()
    _kill_tree(proc)  # anything it left behind in its session
    if group is not None:
        if error is None and group.oom_killed():
            error = "memory_limit"
        group.close()  # and anything that left the session
    stdout, stderr = out.join(5.0), err.join(5.0)
    return ExecResult(exit_code=128 - code if code < 0 else code, stdout=stdout, stderr=stderr,
                      duration_s=time.monotonic() - started, timed_out=error == "timeout",
                      error=error, output_truncated=out.truncated or err.truncated)
