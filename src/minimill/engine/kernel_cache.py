"""Where compiled CPU kernels are cached on disk; without torch, so that a worker can clear
stale build locks there before its engine process (which imports torch) starts."""

from __future__ import annotations

import os
from pathlib import Path


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: $MINIMILL_KERNEL_CACHE, else the user's cache directory."""
    env = os.environ.get("MINIMILL_KERNEL_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("minimill")) / "kernels"
