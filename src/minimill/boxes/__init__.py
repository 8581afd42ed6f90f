"""Boxes: sandboxes without a lifetime limit, run by box hosts (sites) for tenants.

- `sandbox.py`: one exec under bubblewrap (own mount, PID, network, IPC and user namespaces,
  read-only system, a writable workspace) with per-exec limits.
- `workspace.py`: a box's files on its host: paths that cannot leave the workspace, usage
  against the quota, and snapshot archives.
- `snapshots.py`: snapshot archives, full or incremental (only what changed since the
  parent), and the restore of a chain of them.
- `host.py`: the box host loop a worker runs (`minimill worker --boxes N`): pulls boxes and
  their operations from the control plane under leases with fencing epochs.
- `client.py`: the Python SDK over `/v1/boxes`.
"""
