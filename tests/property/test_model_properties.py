"""Model logits after any prefill / chunk / decode split equal the full-sequence logits."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from infer import CACHE_KINDS, create_cache
from infer.config import ModelConfig
from tests.helpers import assert_close, random_model
from tests.property.strategies import model_configs, splits

EXACT_KINDS = sorted(name for name, kind in CACHE_KINDS.items() if kind.is_exact)


def logits_by_split(model, ids: torch.Tensor, split: list[int], kind: str) -> torch.Tensor:
    cache = create_cache(kind, model.config, max_seq_len=ids.shape[1], batch_size=ids.shape[0])
    pieces, start = [], 0
    for n in split:
        pieces.append(model(ids[:, start : start + n], cache, all_logits=True))
        start += n
    assert cache.offset == ids.shape[1]
    return torch.cat(pieces, dim=1)


@given(
    config=model_configs(),
    split=splits(max_total=20),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(EXACT_KINDS),
)
def test_any_split_equals_full_sequence(config: ModelConfig, split, batch: int, seed: int, kind: str) -> None:
    model = random_model(config, seed=seed % 1000)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, sum(split)), generator=gen)
    with torch.no_grad():
        full = model(ids)
        cached = logits_by_split(model, ids, split, kind)
    assert_close(cached, full, 1e-5, f"{kind} split {split} vs full sequence")
