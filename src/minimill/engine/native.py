"""Builds and loads minimill's CPU kernels (csrc/*.cpp) as torch.ops.minimill.*.

The kernels are compiled for the machine they run on (its vector extensions), once, on first
use; the shared library is cached on disk under a key made of the source, the torch version
and the CPU's flags (and where the sources and torch live), so later starts load it in well
under a second. Where no compiler is
present, or the build fails, the engine runs the portable PyTorch path and says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from minimill.engine.hardware import CpuInfo, cpu_info
from minimill.engine.kernel_cache import kernel_cache_dir

log = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_state: NativeKernels | None = None


@dataclass(frozen=True, slots=True)
class NativeKernels:
    available: bool
    reason: str  # why not, or what was built


def _build_flags(info: CpuInfo) -> list[str]:
    flags = ["-O3", "-fopenmp", "-std=c++17"]
    isa = info.vector_isa
    if isa == "avx512":
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f",
                  "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
        if "avx512_bf16" in info.flags:
            flags.append("-mavx512bf16")
        if {"amx_tile", "amx_bf16"} <= set(info.flags):
            flags += ["-mamx-tile", "-mamx-bf16"]
    elif isa == "avx2":
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return flags


def load_cpu_kernels() -> NativeKernels:
    """Build (first time) and load the CPU kernels; safe to call from any thread, many times."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
            if not _state.available:
                log.warning("CPU kernels unavailable, using the PyTorch path: %s", _state.reason)
        return _state


def _load() -> NativeKernels:
    if os.environ.get("MINIMILL_NATIVE_KERNELS", "1") == "0":
        return NativeKernels(False, "disabled by MINIMILL_NATIVE_KERNELS=0")
    if hasattr(torch.ops, "minimill") and hasattr(torch.ops.minimill, "paged_attention"):
        return NativeKernels(True, "already loaded")
    info = cpu_info()
    flags = _build_flags(info)
    files = sorted(p for p in _SOURCES.iterdir() if p.suffix in (".cpp", ".h"))
    # The build's ninja file names the sources and torch's headers by absolute path: a
    # checkout or an environment elsewhere gets a directory of its own, rather than both
    # rewriting one and rebuilding it in turn.
    key = hashlib.sha256(b"\0".join([
        *(p.name.encode() + p.read_bytes() for p in files), torch.__version__.encode(),
        " ".join(sorted(info.flags)).encode(), " ".join(flags).encode(),
        str(_SOURCES.resolve()).encode(), str(Path(torch.__file__).resolve().parent).encode(),
    ])).hexdigest()[:16]
    build_dir = kernel_cache_dir() / f"cpu-{key}"
    if not any(build_dir.glob("*.so")):
        log.info("building the CPU kernels for %s (once per machine, a minute or more; cached "
                 "in %s)", info.vector_isa, build_dir)
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=f"minimill_cpu_{key}",
                           sources=[str(p) for p in files if p.suffix == ".cpp"],
                           extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False,
                           verbose=False)
    except Exception as exc:  # no compiler, no ninja, a compile error: the PyTorch path runs
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return NativeKernels(False, f"building the kernels in {_SOURCES} failed: {first_line}")
    log.info("CPU kernels for %s loaded from %s", info.vector_isa, build_dir)
    return NativeKernels(True, f"built for {info.vector_isa} in {build_dir}")
