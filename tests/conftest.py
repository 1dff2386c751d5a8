"""Shared fixtures: the tiny checkpoints (built once, cached on disk) and the Hypothesis profiles."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

# Without a GPU the Triton kernels run under Triton's interpreter on the CPU (set before any kernel module is
# imported: `triton.jit` reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reference import build_checkpoint

# One intra-op thread per test process: the models are tiny, and with xdist workers (or other load) on few
# cores, OpenMP threads waiting on each other made a 5 ms forward take 500 ms.
torch.set_num_threads(1)

# A forward pass takes longer than Hypothesis' default 200 ms deadline, so no profile has one.
settings.register_profile("dev", deadline=None, max_examples=20)
settings.register_profile("thorough", deadline=None, max_examples=200)
settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=20, print_blob=True)
settings.load_profile(os.environ.get("INFER_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def checkpoint_dir() -> Callable[..., Path]:
    """build_checkpoint itself: call it with (arch, config_format=..., seed=..., **overrides)."""

    def build(arch: str, **kwargs: Any) -> Path:
        return build_checkpoint(arch, **kwargs)

    return build


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return build_checkpoint("llama")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return build_checkpoint("qwen3")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    return build_checkpoint("gemma3_text")
