"""The one interface every KV-cache kind implements.

A cache stores, per layer, the keys and values of the tokens seen so far (post QK-norm, post RoPE).
The model calls `update(layer, k, v)` once per layer per forward, then `advance(n)` once: the new
tokens sit at absolute positions `offset .. offset + n - 1`. A forward that stops part-way calls
`discard_step()` instead, and the cache is as it was before the forward. Every row of a batch holds the same
number of tokens.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from infer.errors import CacheFullError
from infer.memory import check_fits, huge_pages_fit, layers_on_huge_pages, resolve_device


@runtime_checkable
class KVCache(Protocol):
    """What the model needs from a cache, and nothing more."""

    batch_size: int
    max_seq_len: int

    @property
    def offset(self) -> int:
        """Number of tokens already cached (the position of the next token)."""
        ...

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Absolute positions `[S]` of the keys `update(layer, ...)` returns for a step of `q_len`
        new tokens; -1 marks a slot that holds nothing."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` `[B, Hkv, T, D]` for the next T positions of `layer`; return the keys and
        values `[B, Hkv, S, D]` the new queries attend to. Raises `CacheFullError` (changing
        nothing) when the tokens do not fit."""
        ...

    def advance(self, n: int) -> None:
        """Mark `n` more tokens as cached, after every layer has been updated."""
        ...

    def discard_step(self) -> None:
        """Undo the writes of a step that will not be advanced (a forward stopped between layers by an
        exception or Ctrl-C), leaving the cache as it was before the step. A no-op between steps."""
        ...

    def reset(self) -> None:
        """Forget every cached token (the memory stays allocated)."""
        ...

    @property
    def memory_bytes(self) -> int:
        """Bytes of the tensors the cache holds."""
        ...

    def snapshot(self) -> CacheSnapshot:
        """Copy the cached tokens' state out, so `restore` can bring it back later."""
        ...

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Replace the contents with a snapshot taken from a cache of the same kind and shape."""
        ...


class AttendsInKernel(Protocol):
    """A cache that can attend one-token steps over its own storage (the quantized caches' codes, read and
    dequantized by a kernel) instead of returning its history from `update`: the model asks
    `attends_in_kernel` (absent: False) and then calls `decode_attention` in place of `update`."""

    attends_in_kernel: bool

    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         softcap: float | None, window: int | None) -> torch.Tensor:
        """Store `k`, `v` `[B, Hkv, 1, D]` as `update` would and return the attention of `q` `[B, H, 1, D]`
        over every cached position (a sliding `window` and `softcap` as the layer has them)."""
        ...


def check_counts(**counts: object) -> None:
    """Raise a TypeError/ValueError naming the first of `counts` that is not an int >= 1."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def check_cache_size(max_seq_len: int, batch_size: int, *dtype: torch.dtype) -> None:
    """Raise a TypeError/ValueError unless a cache is asked for at least one position and one sequence of ints
    (and, when given, in a floating-point dtype)."""
    check_counts(max_seq_len=max_seq_len, batch_size=batch_size)
    for d in dtype:
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise TypeError(f"the cache dtype must be a floating-point torch.dtype, got {d!r}")


def allocate_zeros(
    what: str, device: torch.device | str, *specs: tuple[tuple[int, ...], torch.dtype], extra_bytes: int = 0,
    huge_pages: bool = False,
) -> list[torch.Tensor]:
    """Zeroed tensors of the given (shape, dtype)s on `device`, refused with a ValueError before anything is
    allocated if together (plus `extra_bytes` of bookkeeping) they would not fit in its free memory.
    Large CPU tensors are anonymous memory maps, which the kernel zeroes page by page on first touch: a
    multi-GB pool costs no start-up time and no resident memory until it fills. `huge_pages`: those maps on
    transparent huge pages where the kernel allows them (memory filled in order, as a paged pool's blocks are)."""
    target = resolve_device(device, allow_meta=True)
    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs) + extra_bytes
    check_fits(nbytes, target, what)
    return [_lazy_zeros(shape, dtype, huge_pages)
            if target.type == "cpu" and math.prod(shape) * dtype.itemsize >= LAZY_ZEROS_BYTES
            else torch.zeros(shape, dtype=dtype, device=target) for shape, dtype in specs]


LAZY_ZEROS_BYTES = 16 * 2**20  # below this, torch.zeros is as quick


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if huge_pages and huge_pages_fit(nbytes):
        # A fresh private anonymous map: zero until written, 2 MiB faulted in at a time, not 4 KiB; each index of the
        # first dimension (a pool's layer) from a page boundary.
        return layers_on_huge_pages(shape, dtype)
    # The tensor keeps the map alive (torch.frombuffer holds a reference to its buffer).
    buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def check_kv_shape(k: torch.Tensor, v: torch.Tensor, batch_size: int, num_kv_heads: int, head_dim: int,
                   device: torch.device) -> None:
    """Raise a TypeError/ValueError naming the mismatch unless `k`/`v` are real floating-point tensors
    `[batch, kv_heads, T, head_dim]` of one dtype, on the cache's `device`."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:  # complex, integer and bool K/V would be cast silently
            raise TypeError(f"{name} must be a real floating-point tensor, got {t.dtype}")
    if k.dtype != v.dtype or k.device != v.device:
        raise TypeError(f"k and v must share dtype and device, got {k.dtype}/{k.device} and {v.dtype}/{v.device}")
    if k.device != device:  # caught here, before any slot is reserved, not as a deep torch error mid-write
        raise ValueError(f"k/v are on {k.device} but the cache is on {device}: create the cache on the model's "
                         "device (device=...) or move k/v there")
    expected = (batch_size, num_kv_heads, k.shape[2] if k.dim() == 4 else -1, head_dim)
    if k.dim() != 4 or tuple(k.shape) != expected or k.shape != v.shape:
        raise ValueError(
            f"k/v must be [batch={batch_size}, kv_heads={num_kv_heads}, T, head_dim={head_dim}], "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}: was the cache built for this model and batch size?"
        )


def check_layer(layer: object, num_layers: int) -> int:
    """The layer index, or a TypeError/ValueError: an int in `0 .. num_layers-1` (no negative indexing)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must lie in [0, {num_layers}) for this {num_layers}-layer cache, got {layer}")
    return layer


def check_advance(n: object, offset: int, max_seq_len: int) -> int:
    """The count for `advance`, or an error: an int >= 0 that keeps the offset within max_seq_len."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"advance takes an int number of tokens, got {type(n).__name__} {n!r}")
    if n < 0 or offset + n > max_seq_len:
        raise CacheFullError(f"cannot advance by {n} from {offset} (max_seq_len={max_seq_len})")
    return n


class PendingWrites:
    """The in-place writes of the forward in progress, with what they overwrote.

    A ring buffer overwrites slots that still hold live tokens, so a forward stopped between layers (an
    exception, Ctrl-C) would leave the offset saying N while slots say N + T. A cache logs such writes
    here: `commit` (from `advance`) keeps them; a layer written a second time without an `advance` in
    between means the last forward stopped part-way, and its writes are undone first.
    """

    def __init__(self) -> None:
        self._undo: list[tuple[torch.Tensor, int | torch.Tensor, torch.Tensor]] = []
        self._layers: set[int] = set()

    def start_layer(self, layer: int) -> None:
        """Note that `layer` is written by the current forward, undoing a stopped one first."""
        if layer in self._layers:
            self.undo()
        self._layers.add(layer)

    def write(self, target: torch.Tensor, index: int | torch.Tensor, values: torch.Tensor) -> None:
        """`target[:, :, index] = values`, remembering the old contents."""
        self._undo.append((target, index, target[:, :, index].clone()))
        target[:, :, index] = values

    def undo(self) -> None:
        """Put back everything written since the last commit."""
        for target, index, old in reversed(self._undo):
            target[:, :, index] = old
        self.commit()

    def commit(self) -> None:
        """Keep the writes (the forward finished)."""
        self._undo.clear()
        self._layers.clear()


@dataclass
class CacheSnapshot:
    """A copy of a cache's contents after some tokens, to restore later (prompt caching).

    `tensors` are whatever the kind needs to rebuild its state (copies, never views of live
    storage); `token_ids`, when known, let a caller check that a new prompt starts with them.
    """

    kind: str
    offset: int
    tensors: dict[str, torch.Tensor]
    token_ids: list[int] | None = None
    meta: dict[str, int | float | str] = field(default_factory=dict)


def check_snapshot(snapshot: CacheSnapshot, kind: str, max_seq_len: int) -> None:
    """Raise a TypeError/ValueError when a snapshot cannot be restored into a `kind` cache of `max_seq_len`."""
    if not isinstance(snapshot, CacheSnapshot):
        raise TypeError(f"restore takes a CacheSnapshot, got {type(snapshot).__name__}")
    if snapshot.kind != kind:
        raise ValueError(f"cannot restore a '{snapshot.kind}' snapshot into a '{kind}' cache")
    if isinstance(snapshot.offset, bool) or not isinstance(snapshot.offset, int) or snapshot.offset < 0:
        raise ValueError(f"snapshot offset must be an int >= 0, got {snapshot.offset!r}")
    if snapshot.offset > max_seq_len:
        raise ValueError(
            f"the snapshot holds {snapshot.offset} tokens but the cache's max_seq_len is {max_seq_len}"
        )


FLOAT = None  # in `check_snapshot_tensors`: any real floating dtype (it is cast to the cache's dtype)


def check_snapshot_tensors(
    snapshot: CacheSnapshot, expected: dict[str, tuple[tuple[int, ...], torch.dtype | None]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Raise a ValueError unless the snapshot holds exactly the named tensors with exactly these shapes
    and dtypes (`FLOAT`: any real floating dtype); then the tensors on the cache's `device` (a snapshot read from
    disk is on the CPU, and indexed writes need their source where the cache is). Checked and moved before a
    restore writes anything."""
    names = set(snapshot.tensors)
    if names != set(expected):
        raise ValueError(
            f"a '{snapshot.kind}' snapshot must hold tensors {sorted(expected)}, got {sorted(names)}: "
            "was it written for another cache kind, or edited?"
        )
    for name, (shape, dtype) in expected.items():
        t = snapshot.tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"snapshot tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"snapshot tensor {name!r} is {tuple(t.shape)}, this cache needs {tuple(shape)}: "
                "was it taken from a cache for another model, batch size or window?"
            )
        ok = t.dtype.is_floating_point if dtype is FLOAT else t.dtype == dtype
        if not ok:
            raise ValueError(
                f"snapshot tensor {name!r} has dtype {t.dtype}, expected "
                f"{'a floating-point dtype' if dtype is FLOAT else dtype}: the file is corrupt or edited"
            )
        if t.dtype.is_floating_point and t.numel() and not bool(torch.isfinite(t).all()):
            # A cache never holds NaN or inf: restored, it would turn every later logit into NaN.
            raise ValueError(f"snapshot tensor {name!r} holds NaN or inf values: the file is corrupt or edited")
    return {name: snapshot.tensors[name].to(device) for name in expected}
