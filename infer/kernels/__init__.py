"""Triton kernels for the GPU path (imported only where Triton is installed: `triton_available()`)."""

from __future__ import annotations

import importlib.util
import os


def triton_available(device_type: str) -> bool:
    """Whether the Triton kernels can run for tensors on `device_type`: on CUDA with Triton installed, or on
    the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, how the kernels are tested without a GPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device_type == "cuda" or (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
