"""KV tiers below the device pool: host RAM (size-bounded, LRU), then flash (kv_flash.py).

A block the pool evicts (a free block with a prefix hash, handed out again) is copied down
here, keyed by its chained hash, instead of being lost: into host RAM, and through to flash
when there is a flash tier (so what a session computed survives a restart of the process). A
prefix lookup that misses the pool asks `fetch`: a block found in host RAM, or in a sound
flash file (promoted to host RAM), is copied back into a pool block instead of recomputed.

One block is the pool's `kv_cache[block_id]`: every layer's K and V of `block_size` tokens,
one contiguous run of bytes (attention.py), so a tier holds plain bytes and the round trip is
exact whatever the KV dtype.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from minimill.engine.kv_flash import FlashTier


@dataclass(slots=True)
class TierStats:
    """Counts since start, for benchmarks and logs."""

    saved_blocks: int = 0  # blocks copied down from the pool
    host_hits: int = 0  # blocks fetched back from host RAM
    flash_hits: int = 0  # blocks fetched back from flash
    restored_blocks: int = 0  # blocks copied back into the pool
    restore_s: float = 0.0  # time spent fetching and copying blocks back


class KvTiers:
    """Host RAM then flash under one device pool; `layout` names what the bytes mean."""

    def __init__(self, layout: dict[str, object], block_shape: tuple[int, ...],
                 dtype: torch.dtype, host_bytes: int, flash_dir: str | Path | None = None,
                 flash_bytes: int = 0) -> None:
        self.layout = layout
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_nbytes = dtype.itemsize * int(torch.Size(block_shape).numel())
        self.max_host_blocks = host_bytes // self.block_nbytes
        # key -> (token ids, block on the CPU), least recently used first.
        self._host: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.flash = (FlashTier(flash_dir, flash_bytes, layout)
                      if flash_dir is not None and flash_bytes >= self.block_nbytes else None)
        self.stats = TierStats()

    @property
    def enabled(self) -> bool:
        return self.max_host_blocks > 0 or self.flash is not None

    def __contains__(self, key: int) -> bool:
        return key in self._host or (self.flash is not None and key in self.flash)

    def put(self, key: int, token_ids: tuple[int, ...], block: torch.Tensor) -> None:
        """Keep a copy of a pool block's KV (`block` may live on any device)."""
        self.stats.saved_blocks += 1
        if key in self._host:
            self._host.move_to_end(key)
            if self.flash is not None:
                self.flash.put(key, token_ids, self._host[key][1])
            return
        copy = block.detach().to("cpu", copy=True).contiguous()
        if self.max_host_blocks > 0:
            self._host[key] = (token_ids, copy)
            while len(self._host) > self.max_host_blocks:
                self._host.popitem(last=False)
        if self.flash is not None:
            self.flash.put(key, token_ids, copy)

    def fetch(self, key: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's KV on the CPU when a tier holds a sound copy for these tokens."""
        started = time.perf_counter()
        found = self._host.get(key)
        if found is not None and found[0] == token_ids:
            self._host.move_to_end(key)
            self.stats.host_hits += 1
            self.stats.restore_s += time.perf_counter() - started
            return found[1]
        if self.flash is None:
            return None
        payload = self.flash.get(key, token_ids)
        if payload is None or len(payload) != self.block_nbytes:
            return None
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
            self.dtype).view(self.block_shape)
        if self.max_host_blocks > 0:
            self._host[key] = (token_ids, block)
            while len(self._host) > self.max_host_blocks:
                self._host.popitem(last=False)
        self.stats.flash_hits += 1
        self.stats.restore_s += time.perf_counter() - started
        return block

    def persist(self, key: int, token_ids: tuple[int, ...], block: torch.Tensor) -> None:
        """Write a block to flash (when there is a flash tier), leaving host RAM as it is."""
        if self.flash is not None and key not in self.flash:
            self.flash.put(key, token_ids, block.detach().to("cpu", copy=True))

    def close(self) -> None:
        if self.flash is not None:
            self.flash.close()
