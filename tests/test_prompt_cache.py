"""Prompt caching: a prefix snapshot works for every cache kind and any later cache size, knows which model
it came from, never overrides the asked cache kind, and snapshots a chat conversation's start; a cache given
to `generate` must hold the prompt's first tokens where it knows them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import infer
from infer.cache import CACHE_KINDS, CacheSnapshot, create_cache
from infer.cache.paged import PagedKVPool
from infer.cache.snapshot import load_snapshot, save_snapshot
from infer.families import ARCHITECTURES
from infer.generation import generate
from infer.sampling import SamplingParams
from infer.tokenizer import Tokenizer
from reference import Oracle, build_checkpoint

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


def ids(model: infer.Transformer, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_snapshot_of_any_length_serves_longer_prompts(arch: str, kind: str) -> None:
    """The snapshot is taken in a cache exactly the prefix's size and restored into one sized for each later
    prompt (Gemma 3's sliding rings of different sizes included). Exact kinds give the oracle's greedy tokens;
    lossy kinds give what the same kind gives when the prefix is prefilled in place and generation continues."""
    path = build_checkpoint(arch)
    model = infer.load_model(path)
    oracle = Oracle(path)
    for prefix_len, rest_len in ((5, 3), (21, 4)):
        prefix = ids(model, prefix_len, seed=prefix_len)
        snapshot = infer.snapshot_prefix(model, None, prefix, cache=kind)
        prompt = prefix + ids(model, rest_len, seed=100 + rest_len)
        reused = generate(model, None, prompt, PARAMS, prefix=snapshot)
        if CACHE_KINDS[kind].is_exact:
            assert reused.token_ids == oracle.greedy(prompt, PARAMS.max_new_tokens), (arch, kind, prefix_len)
        else:
            weight = model.embed_tokens.weight
            twin = create_cache(kind, model.config, max_seq_len=len(prompt) + PARAMS.max_new_tokens,
                                dtype=weight.dtype)
            with torch.no_grad():
                model(torch.tensor([prefix]), twin)
            assert reused.token_ids == generate(model, None, prompt, PARAMS, cache=twin).token_ids, (arch, kind)


def test_prefix_from_another_model_is_refused_also_through_a_file(tmp_path: Path) -> None:
    model = infer.load_model(build_checkpoint("llama"))
    other = infer.load_model(build_checkpoint("llama", seed=1))
    assert other.config == model.config
    prefix = ids(model, 6, seed=1)
    snapshot = infer.snapshot_prefix(other, None, prefix)
    with pytest.raises(ValueError, match="taken on another model"):
        generate(model, None, prefix + [1, 2], PARAMS, prefix=snapshot)
    save_snapshot(snapshot, tmp_path / "prefix.safetensors")
    loaded = load_snapshot(tmp_path / "prefix.safetensors")
    with pytest.raises(ValueError, match="taken on another model"):
        generate(model, None, prefix + [1, 2], PARAMS, prefix=loaded)
    # on its own model the loaded file is accepted and equals the fresh snapshot's result
    assert generate(other, None, prefix + [1, 2], PARAMS, prefix=loaded).token_ids == generate(
        other, None, prefix + [1, 2], PARAMS, prefix=snapshot).token_ids


def test_a_snapshot_without_a_model_fingerprint_is_refused() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    prefix = ids(model, 6, seed=2)
    cache = create_cache("contiguous", model.config, max_seq_len=6)
    with torch.no_grad():
        model(torch.tensor([prefix]), cache)
    bare: CacheSnapshot = cache.snapshot()
    bare.token_ids = prefix
    with pytest.raises(ValueError, match="does not say which model"):
        generate(model, None, prefix + [3], PARAMS, prefix=bare)


def test_the_prefix_never_overrides_the_asked_cache_kind() -> None:
    model = infer.load_model(build_checkpoint("gemma3_text"))
    prefix = ids(model, 7, seed=3)
    snapshot = infer.snapshot_prefix(model, None, prefix, cache="sliding")
    with pytest.raises(ValueError, match="cache='int8' was asked for, but the prefix snapshot is of a 'sliding'"):
        generate(model, None, prefix + [4], PARAMS, prefix=snapshot, cache="int8")
    # unset, the snapshot's kind is used; named the same, it is accepted
    assert generate(model, None, prefix + [4], PARAMS, prefix=snapshot).token_ids == generate(
        model, None, prefix + [4], PARAMS, prefix=snapshot, cache="sliding").token_ids


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chat_conversation_start_as_a_prefix(arch: str) -> None:
    """A system prompt snapshotted without the generation header is a prefix of every chat prompt that
    starts with it; generation from it equals the oracle's greedy run on transformers' chat ids."""
    path = build_checkpoint(arch)
    model, tok = infer.load_model(path), Tokenizer(path)
    system = [{"role": "system", "content": "You answer in one short sentence."}]
    snapshot = infer.snapshot_prefix(model, tok, system)
    assert snapshot.token_ids == tok.apply_chat_template(system, add_generation_prompt=False)
    oracle = Oracle(path)
    for question in ("Why is the sky blue?", "Name a prime number."):
        messages = [*system, {"role": "user", "content": question}]
        result = generate(model, tok, messages, PARAMS, prefix=snapshot)
        assert result.prompt_ids[: snapshot.offset] == snapshot.token_ids
        assert result.token_ids == oracle.greedy(result.prompt_ids, PARAMS.max_new_tokens)


def test_a_paged_cache_holding_other_tokens_is_refused() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    pool = PagedKVPool(model.config, num_blocks=16, block_size=4)
    first = ids(model, 9, seed=4)
    cache = pool.new_sequence(first, max_seq_len=32)
    generate(model, None, first, PARAMS, cache=cache)  # fills the cache with first + generated tokens
    stale = pool.new_sequence(max_seq_len=32)
    with torch.no_grad():
        model(torch.tensor([first]), stale)
    stale.extend_token_ids(first)
    other = ids(model, 12, seed=5)
    with pytest.raises(ValueError, match="holds other tokens than the prompt's first ones"):
        generate(model, None, other, PARAMS, cache=stale)
    # the same cache with a prompt that extends what it holds is accepted
    extended = first + [7, 8]
    assert generate(model, None, extended, PARAMS, cache=stale).token_ids == Oracle(
        build_checkpoint("llama")).greedy(extended, PARAMS.max_new_tokens)


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
def test_a_cache_is_reused_only_for_the_tokens_it_holds(kind: str) -> None:
    """A cache generate filled (any kind, which keeps no token ids of its own) given again with a prompt that
    does not start with what it holds is refused before anything changes; one that extends it continues as the
    oracle does from the whole prompt (exact kinds)."""
    path = build_checkpoint("llama")
    model = infer.load_model(path)
    first = ids(model, 7, seed=2)
    cache = create_cache(kind, model.config, max_seq_len=64)
    result = generate(model, None, first, PARAMS, cache=cache)
    held = first + result.token_ids[:-1]  # the last sampled token was never fed
    assert cache.offset == len(held)
    before = cache.snapshot()
    changed = held[:3] + [(held[3] + 1) % model.config.vocab_size] + held[4:] + [5]
    with pytest.raises(ValueError, match="holds other tokens than the prompt's first ones"):
        generate(model, None, changed, PARAMS, cache=cache)
    after = cache.snapshot()
    assert after.offset == before.offset
    assert all(torch.equal(after.tensors[name], t) for name, t in before.tensors.items())
    extended = held + [5, 6]
    again = generate(model, None, extended, PARAMS, cache=cache)
    if CACHE_KINDS[kind].is_exact:
        assert again.token_ids == Oracle(path).greedy(extended, PARAMS.max_new_tokens)


def test_a_paged_cache_told_only_its_first_tokens_is_checked_on_what_generate_fed_it() -> None:
    """The paged cache's own record may stop short of its offset (ids given through extend_token_ids for part of
    what was fed); what generate fed it fills the rest, so a prompt that differs past the told part is refused."""
    model = infer.load_model(build_checkpoint("llama"))
    pool = PagedKVPool(model.config, num_blocks=16, block_size=4)
    first = ids(model, 9, seed=4)
    cache = pool.new_batch(1, max_seq_len=48)
    result = generate(model, None, first, PARAMS, cache=cache)
    cache.extend_token_ids(first[:2])
    held = first + result.token_ids[:-1]
    changed = held[:-1] + [(held[-1] + 1) % model.config.vocab_size, 3]
    with pytest.raises(ValueError, match="holds other tokens than the prompt's first ones"):
        generate(model, None, changed, PARAMS, cache=cache)
