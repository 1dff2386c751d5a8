"""One-token decode steps without launch overhead: captured once as a CUDA graph, then replayed.

A 1B model's decode step is a few hundred small kernel launches; on a GPU their launch cost, not the
memory traffic, sets the step time unless they are replayed from a graph. A graph replays fixed shapes
and addresses, so the step it captures is `Transformer.forward_static`: the token and its position live in
tensors the graph reads, K/V go into a contiguous cache's slot at that position, and attention reads every
slot of the cache with the ones past the position masked (gpt-fast's approach). Prefill stays eager.

`GraphedDecoder(capture=False)` runs the same static step eagerly: that is how the CPU tests check it against
the ordinary step, and it is what the graph holds.
"""

from __future__ import annotations

from typing import cast

import torch

from infer.cache.contiguous import ContiguousCache
from infer.errors import CacheFullError
from infer.models import Transformer


class GraphedDecoder:
    """One-token steps of `model` into the contiguous `cache`, replayed from a CUDA graph captured on the first
    step (`capture`, default: on CUDA), else run eagerly with the same static shapes."""

    def __init__(self, model: Transformer, cache: ContiguousCache, capture: bool | None = None) -> None:
        if not isinstance(cache, ContiguousCache):
            raise TypeError(f"cache must be a ContiguousCache, got {type(cache).__name__}")
        device = cache.k_cache.device
        if capture and device.type != "cuda":
            raise ValueError(f"capturing a CUDA graph needs the model on CUDA, this cache is on {device.type}")
        self.model, self.cache = model, cache
        # The step reads every slot (masked past the position), and a masked NaN still poisons the weighted sum
        # (0 x NaN): slots nothing has written since the cache was last reset may hold any stale value.
        cache.k_cache[:, :, :, cache.offset :].zero_()
        cache.v_cache[:, :, :, cache.offset :].zero_()
        self.capture = device.type == "cuda" if capture is None else capture
        # The graph's inputs and output: written before each replay, read after it.
        self.input_ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[B, 1, vocab]` of the next position for `input_ids` `[B, 1]`; the cache advances by one.
        With a graph, the returned tensor is overwritten by the next step: copy it to keep it."""
        offset = self.cache.offset
        if offset >= self.cache.max_seq_len:
            raise CacheFullError(f"the cache holds max_seq_len={self.cache.max_seq_len} tokens; no room for one more")
        if input_ids.shape != self.input_ids.shape:
            raise ValueError(f"input_ids must be {tuple(self.input_ids.shape)}, got {tuple(input_ids.shape)}")
        self.input_ids.copy_(input_ids)
        self.position.fill_(offset)
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            logits = cast(torch.Tensor, self.logits)
        else:
            logits = self._forward()
        self.cache.advance(1)
        return logits

    def _forward(self) -> torch.Tensor:
        return self.model.forward_static(self.input_ids, self.position, self.cache.k_cache, self.cache.v_cache)

    def _capture(self) -> None:
        # Warm up on a side stream (first-call allocations and autotuning stay out of the graph), then capture.
        # Both write K/V into the slot at the current position, which the replay that follows overwrites.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward()
        self.graph = graph


def graphed_decoder(model: Transformer, cache: object) -> GraphedDecoder | None:
    """The decoder `generate` replays one-token steps from: on CUDA, for a contiguous cache, when
    `model.decode_graphs` is on; None elsewhere (the eager step)."""
    if not model.decode_graphs or type(cache) is not ContiguousCache:
        return None
    if cache.k_cache.device.type != "cuda":
        return None
    return GraphedDecoder(model, cache)
