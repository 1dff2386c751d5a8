"""Test and benchmark support: tiny deterministic checkpoints and the Hugging Face oracle.

This package may import `transformers`; the engine (`infer`) must not.
"""

from reference.checkpoints import build_bench_checkpoint, build_checkpoint
from reference.oracle import Oracle

__all__ = ["Oracle", "build_bench_checkpoint", "build_checkpoint"]
