"""The layers of a box's sandbox besides bubblewrap's namespaces (sandbox.py puts them
together): its own /etc files, its seccomp filter (seccomp.py), its network namespace behind
pasta, and its cgroup (cgroups.py).

Network: a box with network gets a user-mode network stack (pasta, Debian's `passt`) in a
network namespace of its own. pasta runs as the box's uid, maps neither the host's loopback
(`--no-map-gw`, `-T none -U none`) nor any port between host and box (`-t none -u none`),
and IPv4 only. NET_SETUP, run as the namespace's root before bubblewrap, leaves one way out,
the default route: the host's subnet and gateway, the private, carrier, link-local and
reserved ranges are unreachable. DNS sent to BOX_DNS is forwarded by pasta to the host's
resolver, whatever address that has.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path

from minimill.boxes import cgroups, seccomp

log = logging.getLogger("minimill.boxes")
BOX_PASSWD = ("root:x:0:0:root:/root:/usr/sbin/nologin\n"
              "box:x:1000:1000:box:/workspace:/bin/sh\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
BOX_GROUP = "root:x:0:\nbox:x:1000:\nnogroup:x:65534:\n"
# A box with network: pasta forwards DNS sent here to the host's resolver (whatever address
# that has, a loopback or private one included), and the box's resolv.conf names it.
BOX_DNS = "198.18.0.53"
# What a box with network may not reach: private, shared (carrier), link-local and reserved
# ranges. Its loopback is its own; the host's is not mapped (pasta --no-map-gw, -T none).
BLOCKED_NETS = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "169.254.0.0/16", "172.16.0.0/12",
                "192.0.0.0/24", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
# Run by pasta as the network namespace's root before bubblewrap: no route to the host's
# own subnet or gateway except as the next hop of the default route, the blocked ranges
# unreachable, then bubblewrap. IPv4 only (pasta -4): no IPv6 route leads out.
NET_SETUP = r"""set -e
route=$(ip -4 route show default)
gw=$(echo "$route" | awk '{print $3; exit}')
dev=$(echo "$route" | awk '{print $5; exit}')
if [ -n "$gw" ]; then
  ip -4 route flush dev "$dev" proto kernel scope link
  ip -4 route replace default via "$gw" dev "$dev" onlink
  ip -4 route add unreachable "$gw/32"
fi
for net in BLOCKED; do ip -4 route add unreachable "$net"; done
exec "$@"
""".replace("BLOCKED", " ".join(BLOCKED_NETS))
PASTA_ARGS = ("--config-net", "-4", "--no-map-gw", "-t", "none", "-u", "none", "-T", "none",
              "-U", "none", "-f", "-q", "--dns-forward", BOX_DNS)


class IsolationUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; the message says what to do."""



def pasta_path() -> str | None:
    return shutil.which("pasta")


def network_problem() -> str | None:
    """Why boxes with network cannot run here (None: they can)."""
    if pasta_path() is None:
        return ("boxes with network need a user-mode network stack: install the Debian "
                "package 'passt' (pasta)")
    if shutil.which("ip") is None:
        return "boxes with network need iproute2's `ip` (Debian package 'iproute2')"
    try:
        if not os.stat("/dev/net/tun").st_mode & 0o006:
            return ("boxes with network need /dev/net/tun usable by unprivileged users "
                    "(chmod 0666 /dev/net/tun, as distributions ship it)")
    except OSError:
        return "boxes with network need /dev/net/tun (the tun module)"
    return None


def data_fd(data: bytes) -> int:
    """A pipe's read end holding `data` (bubblewrap reads it: --seccomp, --ro-bind-data)."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)  # a few KiB: never fills the pipe
    finally:
        os.close(write_fd)
    return read_fd


@functools.cache
def _etc_dir() -> Path:
    """The box's own /etc files, made once per process in a directory of its own (bound
    read-only: bubblewrap writing them into the sandbox would be refused by an exec whose
    file size limit is 0, as a full quota makes it)."""
    where = Path(tempfile.mkdtemp(prefix="minimill-box-etc-"))
    where.chmod(0o755)
    for name, text in (("passwd", BOX_PASSWD), ("group", BOX_GROUP),
                       ("resolv.conf", f"nameserver {BOX_DNS}\n")):
        (where / name).write_text(text)
        (where / name).chmod(0o644)
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return where


def box_files(network: bool) -> tuple[list[str], list[int]]:
    """bubblewrap's arguments for the box's own /etc files and seccomp filter, and the
    descriptors they name (to pass to it, and to close after it started)."""
    etc = _etc_dir()
    names = ["passwd", "group", *(["resolv.conf"] if network else [])]
    args = [a for name in names for a in ("--ro-bind", str(etc / name), f"/etc/{name}")]
    fds: list[int] = []
    program = seccomp.box_filter()
    if program is not None:
        fds.append(data_fd(program))
        args += ["--seccomp", str(fds[-1])]
    return args, fds


def net_prefix(network: bool) -> list[str]:
    """What runs bubblewrap inside a network namespace of pasta's (nothing without network:
    bubblewrap's own namespace has only a loopback)."""
    if not network:
        return []
    pasta = pasta_path()
    if pasta is None:
        raise IsolationUnavailable(network_problem() or "pasta is not installed")
    return [pasta, *PASTA_ARGS, "--", "/bin/sh", "-c", NET_SETUP, "net-setup"]


def exec_group(memory_mb: int, max_processes: int) -> cgroups.ExecGroup | None:
    root = cgroups.available()
    if root is None:
        return None
    try:
        return cgroups.ExecGroup(root, memory_mb, max_processes)
    except OSError as exc:
        log.warning("no cgroup for this exec (%s): its rlimits hold alone", exc)
        return None


def in_group(group: cgroups.ExecGroup, argv: list[str], uid: int | None) -> list[str]:
    """`argv` started inside the exec's cgroup (before it can fork), then as `uid`."""
    drop = ([] if uid is None else
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"])
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs), *drop, *argv]
