"""What the machine is: the CPU's model and flags, and the dtype the chip is fast at."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    flags: frozenset[str]

    @property
    def vector_isa(self) -> str:
        """The widest vector instruction set the kernels are built for: avx512, avx2 or none."""
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags:
            return "avx512"
        if {"avx2", "fma"} <= self.flags:
            return "avx2"
        return "none"

    @property
    def native_bf16(self) -> bool:
        """True when the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def relevant_flags(self) -> list[str]:
        wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                  "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd",
                  "sve", "bf16")
        return [f for f in wanted if f in self.flags]


def cpu_report() -> dict[str, Any]:
    """What every bench prints about the CPU it ran on: model, relevant flags, torch threads."""
    info = cpu_info()
    return {"model": info.model, "flags": info.relevant_flags(),
            "threads": torch.get_num_threads()}


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The CPU's model name and feature flags (Linux /proc/cpuinfo; elsewhere what is known)."""
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return CpuInfo(model, frozenset(flags))



def use_huge_pages_for_tensors() -> bool:
    """Ask torch to back its large CPU tensors (2 MiB and up) with transparent huge pages,
    where the kernel gives them on request (`madvise` or `always` mode). Must run before the
    process's first large tensor: torch reads its switch (THP_MEM_ALLOC_ENABLE) once, then.

    Why: a step streams every weight matrix and scattered KV blocks; with 4 KiB pages a
    135M-parameter model's ~270 MB of weights span ~66,000 pages, far past what the TLB holds,
    and each miss is a page walk (a long one in a VM). Measured on a 2-core Xeon: bf16 GEMMs
    over 30 layers' weights ran at 861 GFLOP/s with huge pages against 745 without.
    An explicit THP_MEM_ALLOC_ENABLE (e.g. 0) is left as set. True when enabled here."""
    if "THP_MEM_ALLOC_ENABLE" in os.environ:
        return os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    if "[always]" not in mode and "[madvise]" not in mode:
        return False
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return True


def auto_dtype(device: torch.device) -> tuple[str, str]:
    """The dtype `auto` means on this device, and why."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", f"{torch.cuda.get_device_name(device)} multiplies bfloat16 natively"
        return "float16", f"{torch.cuda.get_device_name(device)} has no bfloat16"
    if device.type == "cpu":
        info = cpu_info()
        if info.native_bf16:
            return "bfloat16", f"{info.model} has native bfloat16 (AVX-512 BF16 or AMX)"
        return "float32", (f"{info.model} has no native bfloat16 (no AVX-512 BF16 or AMX): "
                           "bfloat16 matmuls would be emulated, many times slower than float32")
    return "float32", f"no dtype preference known for {device.type}"
