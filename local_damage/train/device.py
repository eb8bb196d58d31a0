"""Where training runs: the device, mixed precision (autocast) and peak memory of an epoch."""

from __future__ import annotations

import contextlib
import resource
import sys

import torch


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a torch device: ``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name!r} but CUDA is not available on this machine")
    return device


def autocast_context(amp: str, device: torch.device):
    """The autocast context for ``train.amp`` on ``device`` (a null context when off)."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return contextlib.nullcontext()
    if amp == "auto":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA peak allocated since the last reset, or the process's peak resident set size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024.0
