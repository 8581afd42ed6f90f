"""Boxes: sandboxes without a lifetime limit, run by box hosts (sites) for tenants.

- `sandbox.py`: one exec under bubblewrap (own mount, PID, network, IPC and user namespaces,
  read-only system, a writable workspace) with per-exec limits.
- `layers.py`, `seccomp.py`, `cgroups.py`, `uids.py`: the sandbox's other layers: the box's
  own /etc, its seccomp filter (libseccomp), its network behind pasta, its cgroup v2 limits,
  and a host uid per box.
- `workspace.py`: a box's files on its host: paths that cannot leave the workspace, usage
  against the quota (logical sizes).
- `archive.py`: unpacking an image or snapshot archive, checked whole before anything is
  written, every path resolved from the workspace's descriptor.
- `snapshots.py`: snapshot archives, full or incremental (only what changed since the
  parent), and the restore of a chain of them.
- `host.py`: the box host loop a worker runs (`minimill worker --boxes N`): pulls boxes and
  their operations from the control plane under leases with fencing epochs.
- `client.py`: the Python SDK over `/v1/boxes`.
"""
