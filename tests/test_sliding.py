"""The sliding-window cache keeps exactly `window` positions in each local layer."""

from __future__ import annotations

import torch

import infer
from infer.cache import ContiguousCache, SlidingWindowCache
from infer.generation import generate
from infer.sampling import SamplingParams
from tests.helpers import assert_close, random_model, tiny_config


def test_local_layers_hold_exactly_window_positions_at_8x_window() -> None:
    config = tiny_config("gemma3_text", num_layers=4, sliding_window=5, sliding_pattern=2)
    model = random_model(config)
    window = 5
    total = 8 * window
    ids = torch.randint(0, config.vocab_size, (1, total), generator=torch.Generator().manual_seed(0))
    cache = infer.create_cache("sliding", config, max_seq_len=total)
    assert isinstance(cache, SlidingWindowCache)
    ring_bytes = cache.ring_k.nbytes
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :7], cache)
        for t in range(7, total):
            sliding_layer = config.layer_types.index("sliding_attention")
            positions = cache.key_positions(sliding_layer, 1)
            assert sorted(positions.tolist()) == list(range(max(0, t - window + 1), t + 1))
            logits = model(ids[:, t : t + 1], cache)
            assert_close(logits[0, 0], full[0, t], 1e-5, f"step {t}")
    assert cache.ring_k.shape[3] == window  # [Ls, B, Hkv, W, D]
    assert cache.ring_k.nbytes == ring_bytes  # never grew


def test_sliding_memory_is_bounded_and_smaller() -> None:
    config = tiny_config("gemma3_text", num_layers=6, sliding_window=16, sliding_pattern=3)
    short = infer.create_cache("sliding", config, max_seq_len=1024)
    long = infer.create_cache("sliding", config, max_seq_len=8192)
    contiguous = infer.create_cache("contiguous", config, max_seq_len=8192)
    per_token_full_layer = 2 * config.num_key_value_heads * config.head_dim * 4
    full_layers = config.layer_types.count("full_attention")
    # Only the global layers grow with max_seq_len.
    assert long.memory_bytes - short.memory_bytes == full_layers * per_token_full_layer * (8192 - 1024)
    assert long.memory_bytes < contiguous.memory_bytes / 2


def test_chunk_larger_than_window() -> None:
    config = tiny_config("gemma3_text", num_layers=2, sliding_window=3)
    model = random_model(config, seed=4)
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    cache = infer.create_cache("sliding", config, max_seq_len=30, batch_size=2)
    with torch.no_grad():
        full = model(ids)
        parts = [model(ids[:, a:b], cache, all_logits=True) for a, b in ((0, 11), (11, 12), (12, 25), (25, 30))]
    assert_close(torch.cat(parts, 1), full, 1e-5, "chunks of 11 and 13 with window 3")


def test_contiguous_kind_can_bound_sliding_layers() -> None:
    config = tiny_config("gemma3_text", num_layers=2, sliding_window=4)
    model = random_model(config, seed=2)
    bounded = infer.create_cache("contiguous", config, max_seq_len=64, bound_sliding_layers=True)
    assert isinstance(bounded, SlidingWindowCache)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = list(range(1, 14))
    plain = generate(model, None, prompt, params)
    ringed = generate(model, None, prompt, params, cache_options={"bound_sliding_layers": True})
    assert plain.token_ids == ringed.token_ids
    assert ringed.cache_memory_bytes < plain.cache_memory_bytes
    # A model without sliding layers has nothing to bound: the plain contiguous layout.
    full = tiny_config("llama", num_layers=2)
    assert type(infer.create_cache("contiguous", full, max_seq_len=64, bound_sliding_layers=True)) is ContiguousCache
