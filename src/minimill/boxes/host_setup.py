"""Starting a box host: where workspaces live, and whether isolation works here.

Boxes run only under bubblewrap unless the operator opts out (`--insecure-no-sandbox`); a host
that cannot isolate them refuses to offer them, with a message that says what to install or
enable. A host running as root runs each box as an unprivileged uid of its own (uids.py),
which must be able to reach its workspace: every directory above it must let others through
(o+x).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from minimill.boxes import sandbox
from minimill.boxes.host import BoxHost
from minimill.boxes.host_client import BoxHostClient
from minimill.boxes.uids import UidPool
from minimill.transport.box_protocol import BoxLimits

log = logging.getLogger("minimill.boxes")


class BoxHostStartError(RuntimeError):
    """Boxes cannot be offered here; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class BoxOptions:
    slots: int = 0  # boxes this site holds at once; 0: it offers none
    # Where workspaces live (default: under the system temp dir, one directory per process);
    # whatever is in it when the host starts is removed.
    box_dir: Path | None = None
    insecure_no_sandbox: bool = False
    snapshot_interval_s: float = 30.0
    # The operator's caps on every box limit (None: the protocol's own bounds).
    caps: BoxLimits | None = None


def default_box_dir(site: str) -> Path:
    """A directory of this process's own (two hosts of one site name may share a machine)."""
    return Path(tempfile.gettempdir()) / f"minimill-boxes-{os.geteuid()}" / f"{site}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path, default: bool) -> None:
    """Workspaces a dead host left behind (their boxes come back from snapshots): everything
    in an operator's --box-dir, and default directories of processes that are gone."""
    if not default:
        for child in root.iterdir():
            shutil.rmtree(child, ignore_errors=True)
        return
    for sibling in root.parent.iterdir():
        pid = sibling.name.rsplit("-", 1)[-1]
        if sibling != root and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def _check_reachable(path: Path) -> None:
    """A root host's boxes run as other uids: they must be able to traverse to `path`."""
    for parent in [path, *path.parents]:
        if not parent.exists():
            continue
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise BoxHostStartError(
                f"boxes run as uids of their own, which cannot reach {path}: {parent} "
                "is not searchable by others (chmod o+x, or pick --box-dir elsewhere)")


def open_box_host(server: str, token: str, site: str, options: BoxOptions) -> BoxHost:
    if options.insecure_no_sandbox:
        log.warning("boxes run WITHOUT isolation (--insecure-no-sandbox): their commands can "
                    "read whatever this host's box user can read")
    else:
        try:
            sandbox.check_isolation()
        except sandbox.IsolationUnavailable as exc:
            raise BoxHostStartError(f"cannot offer boxes: {exc}") from None
    root = options.box_dir or default_box_dir(site)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root, default=options.box_dir is None)
    if os.geteuid() == 0:
        root.chmod(0o711)  # others may pass through to a workspace, never list them
        _check_reachable(root)
    client = BoxHostClient(server, token)
    log.info("offering %d boxes (workspaces in %s, %s)", options.slots, root,
             "no isolation" if options.insecure_no_sandbox else "bubblewrap")
    # Machine-wide, so that hosts sharing the machine never share a uid.
    uids = UidPool(default_box_dir(site).parent / "uids.json") if os.geteuid() == 0 else None
    return BoxHost(client, root, options.slots, insecure=options.insecure_no_sandbox,
                   snapshot_interval_s=options.snapshot_interval_s, uids=uids,
                   caps=options.caps)
