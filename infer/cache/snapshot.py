"""Saving a `CacheSnapshot` to a safetensors file and loading it back."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from infer.cache.base import CacheSnapshot
from infer.errors import CheckpointError


def save_snapshot(snapshot: CacheSnapshot, path: str | Path) -> None:
    """Write the snapshot's tensors, with its kind, offset, token ids and meta as file metadata."""
    header = {
        "kind": snapshot.kind,
        "offset": str(snapshot.offset),
        "token_ids": json.dumps(snapshot.token_ids),
        "meta": json.dumps(snapshot.meta),
    }
    save_file({name: t.contiguous() for name, t in snapshot.tensors.items()}, str(path), metadata=header)


def load_snapshot(path: str | Path, device: str = "cpu") -> CacheSnapshot:
    """Read a snapshot written by `save_snapshot`."""
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read cache snapshot {path}: {e}") from e
    if "kind" not in header or "offset" not in header:
        raise CheckpointError(f"{path} is a safetensors file but not a cache snapshot (no kind/offset metadata)")
    return CacheSnapshot(
        kind=header["kind"],
        offset=int(header["offset"]),
        tensors=tensors,
        token_ids=json.loads(header.get("token_ids", "null")),
        meta=json.loads(header.get("meta", "{}")),
    )
