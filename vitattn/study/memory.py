"""Peak memory of a run: the CUDA allocator's peak on GPUs, the process's peak RSS on the CPU."""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["memory_kind", "peak_memory_mb", "reset_peak_memory"]


def memory_kind(device: torch.device) -> str:
    """What :func:`peak_memory_mb` measures on ``device``: ``cuda_allocated`` or ``cpu_rss``."""
    return "cuda_allocated" if device.type == "cuda" else "cpu_rss"


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak (the CPU's peak RSS is the process's high-water mark: it cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """MiB: ``torch.cuda.max_memory_allocated`` since the last :func:`reset_peak_memory` on CUDA;
    on the CPU the process's peak resident set size so far (``getrusage``'s ``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
