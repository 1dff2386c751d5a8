"""Fuzzing the public API with hostile values: every call either succeeds with a sane result or raises one
project error / ValueError / TypeError / FileNotFoundError whose message names the culprit; after any error
the model's weights and every cache's contents are unchanged, and the caller's inputs are never mutated.

Categories (the loader's broken files live in test_checkpoint_validation.py, tampered snapshot files and
interrupted forwards in test_all_or_nothing.py): SamplingParams, generate / stream_generate arguments,
Tokenizer, create_cache arguments and sizes, cache operations of every kind, the paged pool."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infer
from infer.cache import CACHE_KINDS, KVCache, create_cache
from infer.cache.paged import PagedKVPool
from infer.errors import InferError
from infer.generation import generate, stream_generate
from infer.sampling import SamplingParams, process_logits
from infer.tokenizer import Tokenizer
from reference import build_checkpoint

CLEAN_ERRORS = (InferError, ValueError, TypeError, FileNotFoundError)
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: the profile's


class Opaque:
    """An object of no type any API expects."""

    def __repr__(self) -> str:
        return "<Opaque>"


# Anything a careless or hostile caller might pass. Sizes are either small or far beyond any machine's
# memory, so a value that is (wrongly) accepted can never make the suite allocate gigabytes.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 4096),
    st.integers(10**11, 10**15),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.lists(st.integers(-3, 600), max_size=5),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 5), max_size=2),
    st.just(Opaque()),
    st.just(torch.ones(2, dtype=torch.complex64)),
)


def outcome(call: Callable[[], Any], culprits: tuple[str, ...]) -> tuple[str, Any]:
    """("ok", result) or ("error", exception) for a clean error naming one of `culprits`; anything else fails."""
    try:
        return "ok", call()
    except CLEAN_ERRORS as e:
        message = str(e)
        assert any(c in message for c in culprits), f"{type(e).__name__}: {message!r} names none of {culprits}"
        assert "\n" not in message.strip() or len(message) < 2000, "one clear message, not a dump"
        return "error", e


def weights(model: infer.Transformer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


def same_weights(model: infer.Transformer, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


_MODELS: dict[str, tuple[infer.Transformer, Tokenizer, dict[str, torch.Tensor]]] = {}


def model_and_tokenizer(arch: str = "llama") -> tuple[infer.Transformer, Tokenizer, dict[str, torch.Tensor]]:
    if arch not in _MODELS:
        path = build_checkpoint(arch)
        model = infer.load_model(path)
        _MODELS[arch] = (model, Tokenizer(path), weights(model))
    return _MODELS[arch]


# --- SamplingParams ---------------------------------------------------------------------------------------

PARAM_FIELDS = ["max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
                "stop", "stop_token_ids", "ignore_eos"]


@pytest.mark.parametrize("name", PARAM_FIELDS)
@FUZZ
@given(value=JUNK)
def test_sampling_params_field(name: str, value: Any) -> None:
    before = repr(value)
    kind, params = outcome(lambda: SamplingParams(**{name: value}), (name,))
    assert repr(value) == before, "the caller's value changed"
    if kind == "ok":  # accepted: it must generate sanely
        model, tok, _ = model_and_tokenizer()
        small = SamplingParams(**{**params.__dict__, "max_new_tokens": min(params.max_new_tokens, 3)})
        result = generate(model, tok, [1, 2, 3], small)
        assert len(result.token_ids) <= small.max_new_tokens
        assert all(0 <= t < model.config.vocab_size for t in result.token_ids)


# The documented ranges, at their edges: (field, value accepted exactly at the edge, value just past it).
PARAM_EDGES = [("max_new_tokens", 0, -1), ("temperature", 0.0, -1e-9), ("top_k", 0, -1), ("top_p", 1.0, 1.0 + 1e-9),
               ("top_p", 1e-9, 0.0), ("min_p", 0.0, -1e-9), ("min_p", 1.0, 1.0 + 1e-9),
               ("repetition_penalty", 1e-30, 0.0), ("repetition_penalty", 1e30, 1.0001e30),
               ("stop_token_ids", [0], [-1]), ("stop", ["x"], [""])]


@pytest.mark.parametrize(("name", "edge", "past"), PARAM_EDGES, ids=lambda v: repr(v))
def test_sampling_params_ranges_hold_at_their_edges(name: str, edge: Any, past: Any) -> None:
    """Each field takes its documented range up to the edge and refuses a value just outside, by name."""
    assert getattr(SamplingParams(**{name: edge}), name) == (tuple(edge) if isinstance(edge, list) else edge)
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: past})


def test_default_sampling_params_turn_everything_off() -> None:
    """The defaults are plain greedy decoding: no temperature, truncation or penalty, stopping at EOS."""
    params = SamplingParams()
    assert params.is_greedy and not params.ignore_eos and params.stop == () and params.stop_token_ids is None
    logits = torch.randn(2, 50)
    seen = torch.randint(0, 50, (2, 7))
    assert torch.equal(process_logits(logits, params, seen), logits), "the defaults changed the logits"


@given(top_k=st.integers(1, 20), seed=st.integers(0, 2**31))
@FUZZ
def test_extreme_but_finite_temperature_keeps_the_top_k(top_k: int, seed: int) -> None:
    """temperature=inf is refused; a huge finite one flattens the distribution but never leaves the top k."""
    model, _, _ = model_and_tokenizer()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"), top_k=top_k)
    params = SamplingParams(temperature=1e30, top_k=top_k, seed=seed, max_new_tokens=1, ignore_eos=True)
    prompt = [5, 6, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    allowed = set(torch.topk(logits, top_k).indices.tolist())
    assert generate(model, None, prompt, params).token_ids[0] in allowed


# --- generate / stream_generate ---------------------------------------------------------------------------

GENERATE_ARGS = {
    "prompt": ("prompt", "token id", "chat", "messages", "tokenizer"),
    "params": ("params",),
    "cache": ("cache",),
    "use_kv_cache": ("use_kv_cache",),
    "cache_options": ("cache_options", "keyword", "argument", "residual", "block", "pool", "got"),
    "prefix": ("prefix",),
    "tokenizer": ("tokenizer",),
}


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream_generate"])
@pytest.mark.parametrize("name", sorted(GENERATE_ARGS))
@FUZZ
@given(value=JUNK)
def test_generate_argument(name: str, stream: bool, value: Any) -> None:
    model, tok, before = model_and_tokenizer()
    kwargs: dict[str, Any] = {"tokenizer": tok, "prompt": [1, 2, 3],
                              "params": SamplingParams(max_new_tokens=2, ignore_eos=True)}
    kwargs[name] = value
    value_before = repr(value)
    positional = (kwargs.pop("tokenizer"), kwargs.pop("prompt"), kwargs.pop("params"))

    def call() -> Any:
        if stream:
            return list(stream_generate(model, *positional, **kwargs))[-1]
        return generate(model, *positional, **kwargs)

    kind, result = outcome(call, GENERATE_ARGS[name])
    if kind == "ok":
        limit = positional[2].max_new_tokens if positional[2] is not None else SamplingParams().max_new_tokens
        assert len(result.token_ids) <= limit and all(0 <= t < model.config.vocab_size for t in result.token_ids)
    assert same_weights(model, before), "a generate call changed the model"
    assert repr(value) == value_before, "generate mutated the caller's argument"


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"\x01\x02"), [], [[1, 2]], [1.0, 2.0], [True],
                                    [{"role": "user"}, 5], torch.tensor([1, 2]), 7, [-1], [10**9]])
def test_prompts_that_are_not_prompts(prompt: Any) -> None:
    model, tok, _ = model_and_tokenizer()
    with pytest.raises(CLEAN_ERRORS, match="prompt|token|chat|content"):
        generate(model, tok, prompt, SamplingParams(max_new_tokens=1))


def test_chat_messages_are_not_mutated() -> None:
    model, tok, _ = model_and_tokenizer()
    messages = [{"role": "system", "content": "Be brief.", "name": None},
                {"role": "user", "content": "Hi", "reasoning": "x"}]
    before = copy.deepcopy(messages)
    generate(model, tok, messages, SamplingParams(max_new_tokens=2))
    infer.snapshot_prefix(model, tok, messages[:1])
    assert messages == before


# --- Tokenizer --------------------------------------------------------------------------------------------

@FUZZ
@given(value=JUNK)
def test_tokenizer_encode(value: Any) -> None:
    _, tok, _ = model_and_tokenizer()
    kind, ids = outcome(lambda: tok.encode(value), ("encode", "str"))
    if kind == "ok":
        assert tok.decode(ids, skip_special_tokens=True) == value


@FUZZ
@given(value=st.one_of(JUNK, st.lists(st.integers(-(2**40), 2**40), max_size=6)))
def test_tokenizer_decode(value: Any) -> None:
    _, tok, _ = model_and_tokenizer()
    kind, text = outcome(lambda: tok.decode(value), ("token id", "decode"))
    if kind == "ok":
        assert isinstance(text, str)
        assert all(0 <= i < tok.vocab_size for i in value), "an unknown id was decoded silently"


MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "name", "reasoning", "tool_calls"]), JUNK,
                          max_size=4)


@FUZZ
@given(messages=st.one_of(JUNK, st.lists(MESSAGE, max_size=3)), extra=st.dictionaries(
    st.sampled_from(["add_generation_prompt", "continue_final_message", "tools", "documents"]), JUNK, max_size=2))
def test_apply_chat_template(messages: Any, extra: dict[str, Any]) -> None:
    _, tok, _ = model_and_tokenizer()
    before = repr((messages, extra))
    kind, ids = outcome(lambda: tok.apply_chat_template(messages, **extra),
                        ("messages", "conversation", "template", "continue", "tool", "document", "generation",
                         "content", "role", "message"))
    if kind == "ok":
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert repr((messages, extra)) == before, "apply_chat_template mutated its input"


# --- create_cache -----------------------------------------------------------------------------------------

CACHE_ARGS = {"max_seq_len": ("max_seq_len",), "batch_size": ("batch_size",), "dtype": ("dtype",),
              "device": ("device",)}


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
@pytest.mark.parametrize("name", sorted(CACHE_ARGS))
@FUZZ
@given(value=JUNK)
def test_create_cache_argument(kind: str, name: str, value: Any) -> None:
    model, _, _ = model_and_tokenizer()
    kwargs: dict[str, Any] = {"max_seq_len": 16, "batch_size": 1, "dtype": torch.float32, "device": "cpu"}
    kwargs[name] = value
    result_kind, cache = outcome(lambda: create_cache(kind, model.config, **kwargs),
                                 (*CACHE_ARGS[name], "GiB", "device"))
    if result_kind == "ok":
        assert cache.offset == 0 and cache.max_seq_len == kwargs["max_seq_len"]


@pytest.mark.parametrize(("make", "match"), [
    (lambda c: create_cache("paged", c, max_seq_len=10**12), "GiB"),
    (lambda c: create_cache("contiguous", c, max_seq_len=10**9, batch_size=10**3), "GiB"),
    (lambda c: create_cache("int4", c, max_seq_len=10**12), "GiB"),
    (lambda c: create_cache("sliding", c, max_seq_len=10**12), "GiB"),
    (lambda c: PagedKVPool(c, num_blocks=10**9), "GiB"),
    (lambda c: PagedKVPool(c, num_blocks=0), "num_blocks"),
    (lambda c: PagedKVPool(c, num_blocks=4, block_size="16"), "block_size"),
    (lambda c: create_cache("nope", c, max_seq_len=4), "unknown cache kind"),
], ids=["paged 1e12", "contiguous 1e12", "int4 1e12", "sliding 1e12", "pool 1e9 blocks", "pool 0 blocks",
        "block size str", "unknown kind"])
def test_impossible_sizes_fail_before_allocating(make: Callable[[Any], Any], match: str) -> None:
    """Refused at once, before any tensor or per-block object exists (these would exhaust memory)."""
    model, _, _ = model_and_tokenizer()
    with pytest.raises((ValueError, TypeError), match=match):
        make(model.config)


# --- cache operations -------------------------------------------------------------------------------------

def filled_cache(kind: str) -> tuple[infer.Transformer, KVCache]:
    model, _, _ = model_and_tokenizer("gemma3_text")
    cache = create_cache(kind, model.config, max_seq_len=24)
    with torch.no_grad():
        model(torch.tensor([[3, 1, 4, 1, 5, 9]]), cache)
    return model, cache


def state_of(cache: KVCache) -> tuple[int, dict[str, torch.Tensor]]:
    snap = cache.snapshot()
    return snap.offset, {k: t.clone() for k, t in snap.tensors.items()}


def unchanged(cache: KVCache, before: tuple[int, dict[str, torch.Tensor]]) -> bool:
    offset, tensors = state_of(cache)
    return offset == before[0] and tensors.keys() == before[1].keys() and all(
        torch.equal(tensors[k], before[1][k]) for k in tensors)


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
@FUZZ
@given(op=st.sampled_from(["update", "advance", "restore"]), a=JUNK, b=JUNK)
def test_cache_operation_with_junk_changes_nothing(kind: str, op: str, a: Any, b: Any) -> None:
    model, cache = filled_cache(kind)
    before = state_of(cache)
    k = torch.zeros(1, model.config.num_key_value_heads, 1, model.config.head_dim)
    calls = {
        "update": (lambda: cache.update(a, k if isinstance(b, bool) else b, k), ("layer", "k", "v", "tensor")),
        "advance": (lambda: cache.advance(a), ("advance", "n", "int", "token", "capacity", "hold")),
        "restore": (lambda: cache.restore(a), ("restore", "CacheSnapshot", "snapshot")),
    }
    call, culprits = calls[op]
    kind_of_outcome, _ = outcome(call, culprits)
    if kind_of_outcome == "error":
        assert unchanged(cache, before), f"a failed {op} changed the {kind} cache"
        cache.discard_step()
        with torch.no_grad():  # and the cache still works
            model(torch.tensor([[2, 7]]), cache)


# --- the paged pool ---------------------------------------------------------------------------------------

@FUZZ
@given(prompt=JUNK, max_seq_len=JUNK, extend=JUNK)
def test_paged_pool_operations_with_junk(prompt: Any, max_seq_len: Any, extend: Any) -> None:
    model, _, _ = model_and_tokenizer()
    pool = PagedKVPool(model.config, num_blocks=8, block_size=4)
    free_before = pool.manager.num_free
    kind, cache = outcome(lambda: pool.new_sequence(prompt, max_seq_len=max_seq_len),
                          ("prompt", "token", "max_seq_len", "iterable", "int", "pool"))
    if kind == "error":
        assert pool.manager.num_free == free_before and pool.manager.seq_ids == (), "a failed new_sequence leaked"
        return
    tokens = cache.token_ids
    if outcome(lambda: cache.extend_token_ids(extend), ("token_ids", "token"))[0] == "error":
        assert cache.token_ids == tokens
    cache.release()
    assert pool.manager.num_free == free_before
    with pytest.raises(CLEAN_ERRORS, match="released"):
        cache.extend_token_ids([1])
    with pytest.raises(CLEAN_ERRORS, match="released"):
        cache.fork()


# --- the model call, create_cache's kind and config, snapshot files, Tokenizer paths ----------------------

@FUZZ
@given(input_ids=st.one_of(JUNK, st.lists(st.lists(st.integers(-5, 600), max_size=3), max_size=2).map(
    lambda rows: torch.tensor(rows) if rows and len({len(r) for r in rows}) == 1 else rows)), cache=JUNK)
def test_model_call(input_ids: Any, cache: Any) -> None:
    model, _, before = model_and_tokenizer()
    kind, logits = outcome(lambda: model(input_ids, cache), ("input_ids", "kv_cache", "token ids", "batch"))
    if kind == "ok":
        assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
    assert same_weights(model, before)


@FUZZ
@given(kind=JUNK.filter(lambda v: not (isinstance(v, str) and v in CACHE_KINDS)), config=JUNK)  # "int4" is text
def test_create_cache_kind_and_config(kind: Any, config: Any) -> None:
    model, _, _ = model_and_tokenizer()
    for k, c, culprits in ((kind, model.config, ("kind",)), ("contiguous", config, ("config",))):
        assert outcome(lambda k=k, c=c: create_cache(k, c, max_seq_len=8), culprits)[0] == "error"


@FUZZ
@given(path=JUNK, snapshot=JUNK)
def test_snapshot_file_api(tmp_path_factory: pytest.TempPathFactory, path: Any, snapshot: Any) -> None:
    from infer.cache.snapshot import load_snapshot, save_snapshot

    model, _, _ = model_and_tokenizer()
    good = infer.snapshot_prefix(model, None, [1, 2, 3])
    target = tmp_path_factory.mktemp("snap") / "s.safetensors"
    assert outcome(lambda: save_snapshot(snapshot, target), ("CacheSnapshot",))[0] == "error"
    assert not target.exists(), "a refused save wrote a file"
    if isinstance(path, str):  # never write outside the temporary directory
        path = str(target.parent / path)
    outcome(lambda: save_snapshot(good, path), ("path", "cache snapshot"))
    kind, loaded = outcome(lambda: load_snapshot(path), ("path", "cache snapshot"))
    if kind == "ok":
        assert loaded.offset == good.offset


@FUZZ
@given(path=JUNK)
def test_tokenizer_path(path: Any) -> None:
    kind, _ = outcome(lambda: Tokenizer(path), ("Tokenizer takes", "tokenizer.json", "not found"))
    assert kind == "error"


# --- the last hostile values: out of range for torch, invalid text, a cache of another dtype, broken indexes -----


@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_refused_by_name(seed: int) -> None:
    with pytest.raises(ValueError, match="seed=.*64 bits"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2**64 - 1), SamplingParams(seed=-(2**63))  # the generator's whole range is taken


@pytest.mark.parametrize("penalty", [1e-45, 1e-300, 1e31, 1e300])
def test_a_repetition_penalty_that_would_overflow_fp32_is_refused(penalty: float) -> None:
    """Logits divided by 1e-45 (or times 1e300) are inf in fp32 and sampling turns them into NaN."""
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


@pytest.mark.parametrize("at", [0, 3])
def test_text_with_a_lone_surrogate_is_refused_with_its_position(at: int) -> None:
    model, tok, _ = model_and_tokenizer()
    text = "abc"[:at] + "\ud800" + "def"
    for call in (lambda: tok.encode(text), lambda: generate(model, tok, text, SamplingParams(max_new_tokens=1))):
        with pytest.raises(ValueError, match=f"lone surrogate .* at index {at}"):
            call()
    assert tok.encode("abc\U0001f642") == tok.encode("abc\U0001f642")  # a real astral character is fine


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
def test_a_cache_of_another_dtype_is_refused_and_left_as_it_was(kind: str) -> None:
    """An fp32 model given a float16 cache: one error naming both dtypes, the cache unchanged and still usable by a
    model of its dtype."""
    model, _, before_weights = model_and_tokenizer()
    cache = create_cache(kind, model.config, max_seq_len=24, dtype=torch.float16)
    before = state_of(cache)
    with pytest.raises(ValueError, match=r"cache holds K/V in torch.float16 but the model computes in torch.float32"):
        generate(model, None, [1, 2, 3], SamplingParams(max_new_tokens=2), cache=cache)
    assert unchanged(cache, before)
    assert same_weights(model, before_weights)
    half = infer.load_model(build_checkpoint("llama"), dtype="float16")
    assert generate(half, None, [1, 2, 3], SamplingParams(max_new_tokens=2), cache=cache).token_ids


@pytest.mark.parametrize("index", ["[]", '{"weight_map": 5}', '{"weight_map": {"a": 7}}',
                                   '{"weight_map": {"a": "../model.safetensors"}}', '{"weight_map": {"a": "x.bin"}}',
                                   '{"weight_map": ["model.safetensors"]}'])
def test_a_malformed_safetensors_index_names_the_file(tmp_path: Any, index: str) -> None:
    import shutil

    from infer.errors import CheckpointError

    target = tmp_path / "model"
    shutil.copytree(build_checkpoint("llama"), target)
    for gguf in target.glob("*.gguf"):  # the folder's GGUF would be read instead of the safetensors
        gguf.unlink()
    shutil.copy(target / "model.safetensors", tmp_path)  # a shard path leaving the folder would find a file
    (target / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        infer.load_model(target)
