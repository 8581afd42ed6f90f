"""What the machine is: the CPU's model and flags, and the dtype the chip is fast at."""

from __future__ import annotations

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
