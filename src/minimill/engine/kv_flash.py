"""The flash tier of the KV cache: one file per KV block in a directory, size-bounded, LRU.

A file is named by its block's chained hash and holds, in order:
    MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON) | payload | digest
The header says which KV layout the payload belongs to (model, dtype, block size, layers, kv
heads, elements per block), the block's token ids and the payload's length; the digest is a
BLAKE2b of header and payload. A file that is truncated, corrupt, written for another layout
or for other tokens is a miss, never used (and removed, so it cannot be read again). Files
outlive the process: a restarted engine finds them by scanning the directory.

Writes happen on a background thread, encoding and digest included, so that the step loop
never waits on the disk or the hash; a block waiting to be written is still found (its copy is
held until the write ends).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"MMKVBLK1"
SUFFIX = ".kvb"
_DIGEST_BYTES = 32
_LEN = struct.Struct("<I")
# A partial file older than this was cut short (another process sharing the directory may be
# writing a newer one).
_STALE_TMP_S = 600.0


def _digest(header: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(header)
    h.update(payload)
    return h.digest()


def encode_block(layout: dict[str, object], key: int, token_ids: tuple[int, ...],
                 block: torch.Tensor) -> bytes:
    """A block's file contents; `block` is its KV (any dtype, contiguous on the CPU)."""
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({"layout": layout, "key": f"{key:032x}", "tokens": list(token_ids),
                         "nbytes": len(payload)}, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(header)) + header + payload + _digest(header, payload)


def decode_block(data: bytes, layout: dict[str, object], key: int,
                 token_ids: tuple[int, ...]) -> bytes | None:
    """The payload of a block file, or None when it is not a sound file of this block."""
    start = len(MAGIC) + _LEN.size
    if len(data) < start + _DIGEST_BYTES or not data.startswith(MAGIC):
        return None
    (header_len,) = _LEN.unpack_from(data, len(MAGIC))
    body_end = len(data) - _DIGEST_BYTES
    if start + header_len > body_end:
        return None
    header = data[start:start + header_len]
    payload = memoryview(data)[start + header_len:body_end]
    if _digest(header, payload) != data[body_end:]:
        return None
    try:
        meta = json.loads(header)
    except ValueError:
        return None
    if (meta.get("layout") != layout or meta.get("key") != f"{key:032x}"
            or tuple(meta.get("tokens", ())) != token_ids or meta.get("nbytes") != len(payload)):
        return None
    return bytes(payload)


class FlashTier:
    """Block files under `directory`, at most `max_bytes` of them, least recently used out."""

    def __init__(self, directory: str | Path, max_bytes: int, layout: dict[str, object]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.layout = layout
        self._lock = threading.Lock()
        # key -> file size, least recently used first; what the directory held at start
        # (oldest modification first), then what this process wrote.
        self._files: OrderedDict[int, int] = OrderedDict()
        self._bytes = 0
        # key -> (token ids, a copy of the block's KV): not written yet.
        self._pending: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._queue: queue.Queue[int | None] = queue.Queue()
        self.num_bad_files = 0  # corrupt, truncated or foreign files met (and removed)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="minimill-kv-flash",
                                        daemon=True)
        self._writer.start()

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def path(self, key: int) -> Path:
        return self.directory / f"{key:032x}{SUFFIX}"

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self._files or key in self._pending

    def put(self, key: int, token_ids: tuple[int, ...], block: torch.Tensor) -> None:
        """Write a block (in the background); a block already held is only refreshed. `block`
        is the caller's copy on the CPU: it is kept, not copied again, until written."""
        with self._lock:
            if key in self._files or key in self._pending:
                if key in self._files:
                    self._files.move_to_end(key)
                return
            self._pending[key] = (token_ids, block)
        self._queue.put(key)

    def get(self, key: int, token_ids: tuple[int, ...]) -> bytes | None:
        """The block's payload, or None (missing, or a file that is not sound: removed)."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None and key not in self._files:
                return None
            if key in self._files:
                self._files.move_to_end(key)
        if pending is not None:  # still on its way to the disk: the held copy is the block
            held_tokens, block = pending
            return block.contiguous().view(torch.uint8).numpy().tobytes() \
                if held_tokens == token_ids else None
        try:
            data = self.path(key).read_bytes()
        except OSError:
            data = b""
        payload = decode_block(data, self.layout, key, token_ids)
        if payload is None:
            self.num_bad_files += 1
            log.warning("KV flash tier: %s is not a sound block of this model: ignored",
                        self.path(key).name)
            self._drop(key)
        return payload

    def close(self) -> None:
        """Finish the writes under way (so the files survive the process), stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout=60)

    def _scan(self) -> None:
        for partial in self.directory.glob("*.tmp"):  # a write cut short by a kill
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > _STALE_TMP_S:
                    partial.unlink()
        found: list[tuple[float, int, int]] = []
        for entry in self.directory.glob(f"*{SUFFIX}"):
            try:
                key = int(entry.name[:-len(SUFFIX)], 16)
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        self._shrink()

    def _write_loop(self) -> None:
        while (key := self._queue.get()) is not None:
            with self._lock:
                pending = self._pending.get(key)
            if pending is None:
                continue
            data = encode_block(self.layout, key, *pending)
            path = self.path(key)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)  # readers never see half a file under the real name
            except OSError as exc:
                log.warning("KV flash tier: cannot write %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    tmp.unlink()
                with self._lock:
                    self._pending.pop(key, None)
                continue
            with self._lock:
                self._pending.pop(key, None)
                self._files[key] = len(data)
                self._bytes += len(data)
                self._shrink()

    def _shrink(self) -> None:
        """Remove least recently used files beyond the size bound (lock held)."""
        while self._bytes > self.max_bytes and self._files:
            key, size = self._files.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def _drop(self, key: int) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            self._pending.pop(key, None)
            if size is not None:
                self._bytes -= size
        with contextlib.suppress(OSError):
            self.path(key).unlink()
