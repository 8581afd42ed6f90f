"""Snapshots past the fleet's body limit, and past what the control plane stores at all.

A snapshot travels in parts (boxes/host_client.py), so one larger than a fleet body is
stored whole and restores whole. One larger than the control plane's file limit is refused
for good: the snapshot fails with a clear error at once (the host does not send it again
forever), and the box goes on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from api_harness import ApiEnv, start_env, stop_env
from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.client.boxes import BoxError, Boxes
from minimill.transport.box_protocol import SNAPSHOT_PART_BYTES

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, host_root: Path) -> Iterator[
        tuple[ApiEnv, BoxHostProc]]:
    """A control plane whose fleet bodies hold one part, and whose files hold 24 MiB."""
    url = f"sqlite:///{tmp_path_factory.mktemp('tightdb') / 'minimill.db'}"
    env = start_env("sqlite", url, lease_ttl_s=3.0,
                    max_fleet_body_bytes=SNAPSHOT_PART_BYTES + 64 * 1024,
                    max_file_bytes=24 * MIB)
    host = BoxHostProc(env, host_root).start_and_wait()
    yield env, host
    host.stop()
    stop_env(env)


def test_a_snapshot_larger_than_a_fleet_body_goes_in_parts(
        tight: tuple[ApiEnv, BoxHostProc]) -> None:
    env, _ = tight
    with Boxes(env.v1, env.key, timeout_s=300) as boxes:
        box = boxes.create()
        made = box.exec("head -c 18000000 /dev/urandom > big.bin && sha256sum big.bin")
        assert made.exit_code == 0, made
        snapshot = box.snapshot()
        stored = next(s for s in box.snapshots() if s["id"] == snapshot)
        assert stored["bytes"] > 2 * SNAPSHOT_PART_BYTES  # more than two fleet bodies
        twin = boxes.create(snapshot=snapshot)
        assert twin.exec("sha256sum big.bin").stdout == made.stdout
        twin.delete()
        box.delete()


def test_a_snapshot_over_the_file_limit_fails_and_the_box_goes_on(
        tight: tuple[ApiEnv, BoxHostProc]) -> None:
    env, host = tight
    with Boxes(env.v1, env.key, timeout_s=300) as boxes:
        box = boxes.create()
        assert box.exec("head -c 30000000 /dev/urandom > huge.bin").exit_code == 0
        with pytest.raises(BoxError) as err:
            box.snapshot()
        assert err.value.code == "snapshot_refused", err.value
        assert "larger than the limit" in err.value.message
        with pytest.raises(BoxError) as err:
            box.pause()
        assert err.value.code == "snapshot_refused"
        assert box.refresh().status == "running"
        assert_healthy(box)
        # Freed, it snapshots again.
        assert box.exec("rm huge.bin && echo small > s.txt").exit_code == 0
        assert box.snapshot().startswith("snap_")
        box.delete()
    assert host.popen is not None and host.popen.poll() is None
