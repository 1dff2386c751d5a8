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
    if not isinstance(snapshot, CacheSnapshot):
        raise TypeError(f"save_snapshot takes a CacheSnapshot, got {type(snapshot).__name__}")
    _check_path(path)
    header = {
        "kind": snapshot.kind,
        "offset": str(snapshot.offset),
        "token_ids": json.dumps(snapshot.token_ids),
        "meta": json.dumps(snapshot.meta),
    }
    try:
        save_file({name: t.contiguous() for name, t in snapshot.tensors.items()}, str(path), metadata=header)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot write cache snapshot {path}: {e}") from e


def _check_path(path: object) -> None:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")


def load_snapshot(path: str | Path, device: str = "cpu") -> CacheSnapshot:
    """Read a snapshot written by `save_snapshot`."""
    _check_path(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"no cache snapshot file at {path}")
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read cache snapshot {path}: {e}") from e
    if "kind" not in header or "offset" not in header:
        raise CheckpointError(f"{path} is a safetensors file but not a cache snapshot (no kind/offset metadata)")
    fields: dict[str, object] = {}
    for name, default, parse in (("offset", None, int), ("token_ids", "null", json.loads), ("meta", "{}", json.loads)):
        try:
            fields[name] = parse(header[name] if default is None else header.get(name, default))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: snapshot metadata {name}={header.get(name)!r} is unreadable ({e}); "
                                  "the file is corrupt or edited") from e
    offset, token_ids, meta = int(str(fields["offset"])), fields["token_ids"], fields["meta"]
    if offset < 0:
        raise CheckpointError(f"{path}: snapshot metadata offset={offset} must be >= 0")
    if token_ids is not None and (
        not isinstance(token_ids, list)
        or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in token_ids)
    ):
        raise CheckpointError(f"{path}: snapshot metadata token_ids must be a list of non-negative ints or null")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: snapshot metadata meta must be a JSON object, got {type(meta).__name__}")
    return CacheSnapshot(kind=header["kind"], offset=offset, tensors=tensors, token_ids=token_ids, meta=meta)
