"""The builtin engine's KV cache options as `serve` and `worker` take them (`--kv-*` flags):
the cache dtype, the device pool's size and whether it is backed at start, prefix reuse, and
the KV tiers below the pool (host RAM, flash)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_GB = 1 << 30


@dataclass(frozen=True, slots=True)
class KvOptions:
    cache_gb: float | None = None  # the device pool; None: the engine's default share
    host_gb: float = 0.0  # host RAM tier; 0: none
    flash_dir: str | None = None  # flash tier directory; None: none
    flash_gb: float = 8.0  # flash tier bound (with flash_dir)
    prefix_caching: bool = True  # reuse computed prefixes (needed by the tiers)
    dtype: str = "auto"  # the KV cache dtype (auto: the engine dtype; int8; int4)
    prefault: bool = False  # back the whole pool with memory at start (CPU)

    def check(self) -> None:
        """Raise ValueError for options no engine could take."""
        for name in ("cache_gb", "host_gb", "flash_gb"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"--kv-{name.removesuffix('_gb')}-gb must be >= 0, not {value}")
        if self.cache_gb is not None and self.cache_gb <= 0:
            raise ValueError("--kv-cache-gb must be > 0")

    def engine_overrides(self) -> dict[str, Any]:
        """EngineConfig fields for these options."""
        out: dict[str, Any] = {"enable_prefix_caching": self.prefix_caching,
                               "kv_host_bytes": int(self.host_gb * _GB),
                               "kv_dtype": self.dtype, "prefault_kv": self.prefault}
        if self.cache_gb is not None:
            out["kv_cache_memory_bytes"] = int(self.cache_gb * _GB)
        if self.flash_dir:
            out["kv_flash_dir"] = self.flash_dir
            out["kv_flash_bytes"] = int(self.flash_gb * _GB)
        return out

    def argv(self) -> list[str]:
        """The `minimill worker` flags that give these options."""
        args = ["--kv-dtype", self.dtype, "--kv-host-gb", str(self.host_gb),
                "--kv-flash-gb", str(self.flash_gb)]
        if self.cache_gb is not None:
            args += ["--kv-cache-gb", str(self.cache_gb)]
        if self.flash_dir:
            args += ["--kv-flash-dir", self.flash_dir]
        if not self.prefix_caching:
            args.append("--no-prefix-caching")
        if self.prefault:
            args.append("--kv-prefault")
        return args
