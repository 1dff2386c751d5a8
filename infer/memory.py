"""How much memory a device has left, and refusing an allocation that would not fit before it is tried
(a failed multi-GB allocation is slow, and a huge count of small objects can exhaust memory first); tensors on
transparent huge pages; the Python collector kept off the process's old objects while generating."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import mmap
import os
from collections.abc import Iterator
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


HUGE_PAGE = 2 * 2**20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_mode(setting: str = THP_SETTING) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None where it has none."""
    try:
        text = Path(setting).read_text()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor `tensor` on transparent huge pages (`empty_on_huge_pages`), or `tensor`
    itself where it is not on the CPU or would get none.

    Why: a decode step streams every weight once. On 4 KiB pages it takes a TLB miss every 4 KiB and the
    hardware prefetchers stop at every page edge; on 2 MiB pages both happen 512x less often (the native
    GEMV read weights 8% faster on a 2-core Xeon). Linux's default THP mode, "madvise", gives them only to
    memory that asks, which torch's allocator does not."""
    if tensor.device.type != "cpu" or not huge_pages_fit(tensor.numel() * tensor.element_size()):
        return tensor
    return empty_on_huge_pages(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def huge_pages_fit(nbytes: int) -> bool:
    """Whether `nbytes` of CPU memory can be put on transparent huge pages here (one huge page or more)."""
    return nbytes >= HUGE_PAGE and huge_pages_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor in an anonymous map advised for transparent huge pages and
    starting on a huge-page boundary (an ordinary tensor where `huge_pages_fit` says no)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_fit(nbytes):
        return torch.empty(shape, dtype=dtype)
    buffer, start = _huge_page_map(nbytes)
    # The tensor keeps the map alive (torch.frombuffer holds a reference to its buffer).
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)


def layers_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor `shape` in an anonymous map advised for transparent huge pages, each index of its
    first dimension (a pool's layer) starting on a huge-page boundary: rows of the inner dimensions contiguous, the
    first dimension's stride rounded up to whole huge pages (the gap never touched, so never resident). A pool of
    `[L, N, ...]` blocks filled from block 0 then faults each layer's first 2 MiB page once; laid out contiguously, a
    layer that starts inside a page has its first blocks straddle two (at 16 requests of a 150M Llama, 8 pages faulted
    in one decode step, ~6 ms each on a 2-core EPYC VM whose host backs them on first touch). A contiguous tensor
    where there is one layer or `huge_pages_fit` says no."""
    inner = math.prod(shape[1:]) * dtype.itemsize
    if len(shape) < 2 or shape[0] < 2 or not huge_pages_fit(inner):
        return empty_on_huge_pages(shape, dtype)
    stride = -(-inner // HUGE_PAGE) * HUGE_PAGE
    nbytes = (shape[0] - 1) * stride + inner
    buffer, start = _huge_page_map(nbytes)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start).view(dtype)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    strides[0] = stride // dtype.itemsize
    return flat.as_strided(shape, strides)


def _huge_page_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh map of `nbytes` (and a huge page's room to align) advised for transparent huge pages, and the offset
    of its first huge-page boundary."""
    # Private: anonymous shared maps are shmem, which THP serves only under its own (usually off) setting.
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer, -_address(buffer) % HUGE_PAGE


def _address(buffer: mmap.mmap) -> int:
    """The address of a writable map's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def release_freed_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's `malloc_trim`; nothing elsewhere). A load makes
    many short-lived temporaries between long-lived weights: their freed space stays in the process (the 1B Q4_K_M
    file: 1.88 GB resident after loading 1.13 GB of weights, 1.50 GB after the trim)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): before reading a timer."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block Python's cyclic collector skips every object that existed on entry (`gc.freeze`), and takes
    them back after (`gc.unfreeze`): a full collection inside a step would scan the whole heap, with PyTorch imported
    165-187 thousand objects, 75-180 ms on a 2-core EPYC (a dozen 16-request decode steps), where a step's own garbage
    is a few hundred objects. Objects made inside are collected as before; cyclic garbage among the old ones waits for
    the block's end. A no-op where the heap is frozen already (the caller's freeze, as a server's after start-up,
    stays theirs) or with INFER_GC_FREEZE=0."""
    if gc.get_freeze_count() or os.environ.get("INFER_GC_FREEZE") == "0":
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
