"""Sampling parameters and the logits-to-token step.

Processing order follows Hugging Face: repetition penalty, temperature, top-k, top-p, min-p.
Temperature 0 is greedy (argmax), which makes token-exact oracle tests possible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from infer.kernels.native import NativeKernels, native_kernels

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the checkpoint's EOS ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"SamplingParams.max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", self.max_new_tokens, "it must be >= 0")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise bad(name, value, "it must be finite")
        if not self.temperature >= 0:
            raise bad("temperature", self.temperature, "it must be >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "it must be an int >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "it must lie in (0, 1] (1 turns it off)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "it must lie in [0, 1] (0 turns it off)")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", self.repetition_penalty, "it must be > 0 (1 turns it off)")
        if not PENALTY_RANGE[0] <= self.repetition_penalty <= PENALTY_RANGE[1]:
            # fp32 logits divided by a smaller one (or times a larger one) overflow to inf, and sampling to NaN.
            raise bad("repetition_penalty", self.repetition_penalty,
                      f"it must lie in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}] (1 turns it off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", self.seed, "it must fit in 64 bits: -2**63 <= seed < 2**64 (a generator's seed)")
        # Accept a single string or any iterable; store a tuple so the caller's list is never shared.
        if not isinstance(self.stop, (str, list, tuple)):
            raise TypeError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", self.stop, "stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (int, list, tuple)):
                raise TypeError(
                    f"SamplingParams.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
                )
            ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise bad("stop_token_ids", self.stop_token_ids, "token ids must be ints >= 0")
            object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax: temperature 0, or below GREEDY_BELOW, where dividing the
        logits would overflow to inf and NaN probabilities (vLLM draws the same line)."""
        return self.temperature < GREEDY_BELOW


PENALTY_RANGE = (1e-30, 1e30)


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's rule: logits of tokens already seen are divided by `penalty` if positive, multiplied if not."""
    picked = logits.gather(-1, seen_ids)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(-1, seen_ids, picked)


def process_logits(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None, *,
                   sort_free_top_p: bool = True) -> torch.Tensor:
    """Turn last-position logits `[B, V]` into the (masked, tempered) logits to sample from, in fp32.
    `sort_free_top_p=False` takes top-p's set by HF's rule over a stable sort (`top_p_removed_by_sort`), the check
    of the default's (`top_p_filtered`'s native form)."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen_ids is not None and seen_ids.numel():
        logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    if params.is_greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = top_p_filtered(logits, params.top_p, sort_free=sort_free_top_p)
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    seen_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token ids `[B]` for last-position logits `[B, V]`: one uniform of `generator` (None: the global
    one) a row where it samples (`draw`)."""
    processed = process_logits(logits, params, seen_ids)
    if params.is_greedy:
        return processed.argmax(dim=-1)
    return draw(processed, uniforms(processed.shape[0], generator, processed.device))


def uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """`n` float64 uniforms in [0, 1) from `generator` (None: the global one): what `draw` takes, one a token."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device)


def draw(processed: torch.Tensor, u: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """A token a row of processed logits `[B, V]` (-inf where removed), by its inverse CDF at `u` `[B]`: the first
    token whose cumulative probability exceeds u times the total. torch.multinomial draws a token from 32k by an
    exponential per entry, ~0.5 ms a row on a CPU; this is one cumulative sum (float64, so a token's share of
    the total is its probability to ~1e-16 and none is lost to rounding) and a binary search. On a CPU with the
    native kernels (`native=False` turns them off: the check) the sums go by blocks (`draw_rows`): the same token
    but where u lands within double rounding of a boundary, 0.40-0.45 -> 0.20 ms in a 16-row step at 32k."""
    probs = processed.softmax(-1)
    kernels = _native_for(probs) if native else None
    if kernels is not None:
        tokens = kernels.draw_rows(probs, u.cpu())
        if bool((tokens < 0).any()):
            raise ValueError(NOT_DRAWABLE)
        return tokens
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()):
        raise ValueError(NOT_DRAWABLE)
    # u < 1 and a total near 1 (softmax's, to fp32 rounding): u * total stays below the total, so the token found
    # has a probability above zero (a removed token adds nothing to the sum and is never the first past it)
    return torch.searchsorted(cdf, u.to(cdf.device, torch.float64)[:, None] * total, right=True)[:, 0]


NOT_DRAWABLE = ("the processed logits hold NaN or inf (a model overflowing, or logits passed in so): no token can be "
                "drawn from them")


def top_p_removed_by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's TopPLogitsWarper's removed tokens `[B, V]`: sorted ascending, those whose cumulative probability is at
    most 1 - top_p, never the most likely; tokens of equal logits in index order (a stable sort). HF's own sort is
    not stable, and torch documents the order it leaves equal elements in as not guaranteed (it differs between
    devices): where the removed run ends inside a run of equal logits (bf16 logits often do), which of them go is
    unspecified there; here the lower indices go first, as HF with a stable sort removes them."""
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1, stable=True)
    remove_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    remove_sorted[..., -1] = False
    return remove_sorted.scatter(-1, order, remove_sorted)


def top_p_filtered(logits: torch.Tensor, top_p: float, *, sort_free: bool = True) -> torch.Tensor:
    """`logits` `[B, V]` with `top_p_removed_by_sort`'s tokens at -inf. On a CPU with the native kernels, fp32,
    without sorting indices: each row's values sorted alone (numpy's vectorised sort, 0.06 ms at 32k against
    torch.sort's values and indices, 1.6-2 ms) and their softmax, then one native pass (`top_p_rows`: the
    cumulative sums, the tokens below the first kept value, the lowest-indexed of those equal to it where the
    removed run ends among them, and the -inf written; PyTorch's masked_fill alone took 0.3-0.9 ms at 16 rows of
    32k). Elsewhere, or with `sort_free=False` (the check), the sorting form."""
    kernels = _native_for(logits) if sort_free else None
    if kernels is None:
        return logits.masked_fill(top_p_removed_by_sort(logits, top_p), float("-inf"))
    ascending = torch.from_numpy(np.sort(logits.detach().numpy(), axis=-1))
    return kernels.top_p_rows(logits, ascending, ascending.softmax(-1), top_p)


def _native_for(rows: torch.Tensor) -> NativeKernels | None:
    """The native kernels where they take `rows` (fp32 `[B, V]` on the CPU) and could be built here, else None."""
    if rows.device.type != "cpu" or rows.dim() != 2 or rows.dtype != torch.float32:
        return None
    return native_kernels()
