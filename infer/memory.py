"""How much memory a device has left, and refusing an allocation that would not fit before it is tried
(a failed multi-GB allocation is slow, and a huge count of small objects can exhaust memory first)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def resolve_device(device: torch.device | str, *, allow_meta: bool = False) -> torch.device:
    """A torch.device from a name or device, refused with a clear error if this machine cannot use it.
    `allow_meta` admits the meta device (caches built there to measure their sizes)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        target = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from e
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but this machine has no CUDA device; use 'cpu'")
    if target.type not in ("cpu", "cuda", "mps") and not (allow_meta and target.type == "meta"):
        raise ValueError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return target


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (None where it cannot be told)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse, before allocating, what would not fit in the memory `device` has left."""
    free = available_memory(device)
    if free is not None and nbytes > free:
        raise ValueError(
            f"{what} needs {nbytes / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB is free on {device}; "
            "use a smaller size or dtype"
        )
