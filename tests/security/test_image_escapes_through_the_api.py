"""The reproduced attack, through the API: an image whose members run through one-letter
symlinks into 247-character directories, then a link that climbs out to the host's /tmp,
uploaded with `POST /v1/boxes/images` and a box created from it. The box's operations fail
with a clear error naming the refused member; nothing lands on the host; the host and its
other boxes go on."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import uuid
from pathlib import Path

import pytest
from api_harness import ApiEnv
from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.client.boxes import BoxError, Boxes


def _escape_image(target_dir: Path, marker: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        prefix = ""
        for i in range(20):
            long_dir = tarfile.TarInfo(prefix + chr(ord("a") + i) * 247)
            long_dir.type, long_dir.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(long_dir)
            link = tarfile.TarInfo(prefix + chr(ord("A") + i))
            link.type, link.linkname = tarfile.SYMTYPE, chr(ord("a") + i) * 247
            tar.addfile(link)
            prefix += chr(ord("A") + i) + "/"
        up = tarfile.TarInfo(prefix + "up")
        up.type, up.linkname = tarfile.SYMTYPE, "../" * 60 + str(target_dir).lstrip("/")
        tar.addfile(up)
        payload = b"planted by a tenant"
        planted = tarfile.TarInfo(prefix + "up/" + marker)
        planted.size = len(payload)
        tar.addfile(planted, io.BytesIO(payload))
    return buf.getvalue()


def _found_under(root: Path, name: str) -> list[str]:
    """Every path under `root` named `name`. Other tests create and remove their temporary
    directories under the same /tmp while this walks it, so a directory that vanishes
    mid-walk is skipped (os.walk ignores it) rather than failing the search."""
    return [os.path.join(top, name) for top, dirs, files in os.walk(root)
            if name in files or name in dirs]


def test_an_image_cannot_write_on_the_host(box_env: ApiEnv, box_host: BoxHostProc,
                                           boxes: Boxes) -> None:
    marker = f"planted-{uuid.uuid4().hex[:8]}"
    host_tmp = Path(tempfile.gettempdir())
    neighbour = boxes.create()
    image = boxes.request("POST", "/images", content=_escape_image(host_tmp, marker),
                          headers={"Content-Type": "application/octet-stream"}).json()["id"]
    box = boxes.create(image_id=image)
    with pytest.raises(BoxError) as err:
        box.exec("echo never runs")
    assert err.value.status == 400 and err.value.code == "invalid_archive", err.value
    assert "a symlink is never followed" in err.value.message
    assert not (host_tmp / marker).exists()
    assert not _found_under(host_tmp, marker)
    box.delete()
    assert_healthy(neighbour, boxes.create())
