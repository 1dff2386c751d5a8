"""Config coverage against the oracle: random non-default values for every config field the engine reads,
in both config formats; the parsed `ModelConfig` equals what transformers parsed, field by field, and the
logits equal HF's in fp32 (1e-5) and bf16 (bit-identical on the reference attention path).

Gemma 3's `attn_logit_softcapping` is a field HF's Gemma 3 ignores: it is checked against HF's own eager
formula with the softcap switched on (softcap before the mask), and by causality.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig
from transformers.models.gemma3 import modeling_gemma3

import infer
from infer.config import FULL_ATTENTION, ModelConfig, RopeConfig
from infer.families import ARCHITECTURES, FAMILIES
from reference import Oracle, build_checkpoint
from reference.checkpoints import BENCH_CONFIGS, CONFIG_CLASSES, _config_kwargs, to_legacy_config
from reference.tiny_tokenizer import TokenIds
from tests.helpers import assert_close


def _rope_of(params: dict[str, Any]) -> RopeConfig:
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(params["rope_theta"]),
        rope_type=params.get("rope_type", "default"),
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def hf_model_config(path: Any) -> ModelConfig:
    """The engine's config as transformers parsed the checkpoint: every value read off HF's config object."""
    hf = AutoConfig.from_pretrained(path)
    family = FAMILIES[hf.model_type]
    per_layer_type_rope = family.local_rope_theta is not None  # Gemma 3: rope_parameters by layer type
    rope = hf.rope_parameters
    eos = hf.eos_token_id
    return ModelConfig(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        # Qwen2Config declares no head_dim: HF's Qwen 2 attention reads one if the file has it.
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
        attention_bias=getattr(hf, "attention_bias", False),  # Qwen 2's config has none (its biases are fixed)
        mlp_bias=getattr(hf, "mlp_bias", False),
        hidden_act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
        layer_types=tuple(getattr(hf, "layer_types", None) or [FULL_ATTENTION] * hf.num_hidden_layers),
        sliding_window=hf.sliding_window if "sliding_attention" in (getattr(hf, "layer_types", None) or []) else None,
        rope=_rope_of(rope["full_attention"] if per_layer_type_rope else rope),
        rope_local=_rope_of(rope["sliding_attention"]) if per_layer_type_rope else None,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar) if family.query_pre_attn_scalar is not None else None,
        final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
        attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None),
        bos_token_id=hf.bos_token_id,
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )


@st.composite
def drawn_overrides(draw: st.DrawFn, arch: str) -> dict[str, Any]:
    """Non-default values for every config field the engine reads, for one architecture."""
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    o: dict[str, Any] = {
        "num_key_value_heads": kv,
        "num_attention_heads": heads,
        "head_dim": draw(st.sampled_from([8, 16, 24, 40])),
        # 48, 72, 80, 96: square roots inexact in bf16 (Gemma scales embeddings by it). transformers
        # rejects a hidden size that is not a multiple of the head count, whatever head_dim says.
        "hidden_size": draw(st.sampled_from([h for h in (48, 64, 72, 80, 96) if h % heads == 0])),
        "intermediate_size": draw(st.sampled_from([64, 96])),
        "num_hidden_layers": draw(st.integers(1, 5)),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5, 1e-3])),
        "rope_theta": draw(st.sampled_from([100.0, 10000.0, 123456.0, 1e6])),
        "tie_word_embeddings": draw(st.booleans()),
        "eos_token_id": draw(st.one_of(st.integers(1, 500), st.lists(st.integers(1, 500), min_size=1, max_size=3,
                                                                     unique=True))),
    }
    # Llama's and Qwen 3's configs switch all four projection biases; Qwen 2's are fixed (its config has no such
    # key) and Gemma 3 has none.
    if arch in ("llama", "qwen3"):
        o["attention_bias"] = draw(st.booleans())
    sliding = FAMILIES[arch].sliding_layers
    if arch == "llama":
        low = draw(st.sampled_from([0.5, 1.0, 2.0]))
        o["rope_scaling"] = draw(st.sampled_from([
            None,
            {"rope_type": "linear", "factor": 4.0},
            {"rope_type": "llama3", "factor": draw(st.sampled_from([2.0, 8.0, 32.0])), "low_freq_factor": low,
             "high_freq_factor": low * draw(st.sampled_from([2.0, 4.0])),
             "original_max_position_embeddings": draw(st.sampled_from([16, 64]))},
        ]))
    elif sliding == "upper":  # Qwen 2 and 3: layers from max_window_layers on slide, when use_sliding_window
        o["rope_scaling"] = draw(st.sampled_from([None, {"rope_type": "linear", "factor": 2.0}]))
        o["use_sliding_window"] = draw(st.booleans())
        o["sliding_window"] = draw(st.integers(2, 12))
        o["max_window_layers"] = draw(st.integers(0, 5))
    else:
        o["rope_local_base_freq"] = draw(st.sampled_from([500.0, 10000.0, 77777.0]))
        o["rope_scaling"] = draw(st.sampled_from([None, {"rope_type": "linear", "factor": 8.0}]))
        o["sliding_window"] = draw(st.integers(2, 12))
        o["sliding_window_pattern"] = draw(st.integers(1, 4))
        o["query_pre_attn_scalar"] = draw(st.sampled_from([8, 24, 100]))  # != head_dim mostly
        o["final_logit_softcapping"] = draw(st.sampled_from([None, 3.0, 30.0]))
    return o


# Every architecture in both formats gets its own examples: legacy-only keys (sliding_window_pattern,
# rope_local_base_freq) are read only from legacy files.
@pytest.mark.parametrize("config_format", ["v5", "legacy"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=10)
@given(data=st.data())
def test_parsed_config_and_logits_equal_the_oracle(arch: str, config_format: str, data: st.DataObject) -> None:
    overrides = data.draw(drawn_overrides(arch), label="overrides")
    path = build_checkpoint(arch, config_format=config_format, **overrides)
    ours = ModelConfig.from_file(path)
    theirs = hf_model_config(path)
    differ = {f: (getattr(ours, f), getattr(theirs, f)) for f in ours.__dataclass_fields__
              if getattr(ours, f) != getattr(theirs, f)}
    assert not differ, f"parsed fields differ from transformers' (ours, HF's): {differ}"

    ids = torch.randint(0, ours.vocab_size, (1, 29), generator=torch.Generator().manual_seed(len(overrides)))
    # Random tiny configs can be ill-conditioned (HF's own eager and SDPA paths then differ by 1e-4), so
    # each of the engine's attention paths is held to the HF path that computes the same way.
    model = infer.load_model(path)
    for reference_attention, hf_attention in ((False, "sdpa"), (True, "eager")):
        model.use_reference_attention = reference_attention
        with torch.no_grad():
            logits = model(ids)
        expected = Oracle(path, attention=hf_attention).logits(ids)
        assert_close(logits, expected, 1e-5 * max(1.0, expected.abs().max().item()),
                     f"{arch} fp32 ({hf_attention}) {overrides}")

    half = infer.load_model(path, dtype=torch.bfloat16, compute_dtype="exact")
    half.use_reference_attention = True  # rounds where HF's eager attention rounds
    with torch.no_grad():
        ours_bf16 = half(ids)
    assert torch.equal(ours_bf16, Oracle(path, dtype=torch.bfloat16).logits(ids).to(torch.bfloat16)), (
        f"{arch} bf16 logits differ from HF's eager path for {overrides}"
    )


SOFTCAP_OVERRIDES: dict[str, Any] = {"attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 4}


def test_gemma_attn_softcapping_follows_hfs_eager_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's Gemma 3 never passes its `attn_logit_softcapping` to attention; its eager kernel takes a
    `softcap` (applied before the mask). With that switched on, HF is the oracle for the field."""
    path = build_checkpoint("gemma3_text", **SOFTCAP_OVERRIDES)
    model = infer.load_model(path)
    assert model.config.attn_logit_softcapping == 0.5
    ids = torch.randint(0, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(8))
    plain = Oracle(path).logits(ids)
    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward",
                        functools.partial(modeling_gemma3.eager_attention_forward, softcap=0.5))
    capped = Oracle(path).logits(ids)
    assert (capped - plain).abs().max() > 1e-3, "the softcap must matter at this size, or the test proves nothing"
    with torch.no_grad():
        ours = model(ids)
    assert_close(ours, capped, 1e-5 * max(1.0, capped.abs().max().item()), "gemma3 with attention softcap")


def test_gemma_attn_softcapping_is_causal() -> None:
    model = infer.load_model(build_checkpoint("gemma3_text", **SOFTCAP_OVERRIDES))
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(9))
    changed = ids.clone()
    changed[0, 15:] = (changed[0, 15:] + 7) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.equal(before[:, :15], after[:, :15]), "a later token changed an earlier logit"
    assert not torch.equal(before[:, 15:], after[:, 15:])


# Qwen2.5-0.5B-Instruct's config.json as published (legacy keys; transformers_version left out).
QWEN2_5_0_5B_INSTRUCT: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def bench_config_json(arch: str, directory: Path) -> Path:
    """The legacy config.json `build_bench_checkpoint` writes for `arch` (the real model's, shrunk), without
    drawing a billion weights."""
    ids = TokenIds(vocab_size=512, bos_token_id=1, eos_token_ids=[2, 3], pad_token_id=None)
    CONFIG_CLASSES[arch](**_config_kwargs(arch, BENCH_CONFIGS[arch], ids, {})).save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps(to_legacy_config(json.loads(path.read_text()))))
    return directory


OPTIONAL_KEYS = ("max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
                 "attention_bias", "mlp_bias", "hidden_act", "hidden_activation", "rope_local_base_freq",
                 "query_pre_attn_scalar", "head_dim", "sliding_window_pattern", "use_sliding_window",
                 "max_window_layers")


def v5_with(arch: str, key: str, value: Any = None, **top: Any) -> Any:
    """A case: the tiny transformers-5 config of `arch` with the dotted `key` set to `value` (left out when None)
    and top-level keys `top` added (built in the test)."""
    def edit() -> dict[str, Any]:
        raw = json.loads((build_checkpoint(arch) / "config.json").read_text())
        *parents, leaf = key.split(".")
        node = raw
        for parent in parents:
            node = node[parent]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
        return {**raw, **top}
    return edit


def bench_with(arch: str, **changes: Any) -> Any:
    """A case: the bench config of `arch` with some keys changed (`bench_config_json` writes it in the test)."""
    return ("bench", changes)


def real_config_cases() -> list[Any]:
    sliding_on = {**QWEN2_5_0_5B_INSTRUCT, "use_sliding_window": True}  # layers 21-23 would slide
    # Keys left out take transformers' defaults (a 4096-token window, from layer 28 on); a null window is none.
    no_window = {k: v for k, v in sliding_on.items() if k != "sliding_window"}
    no_start = {**{k: v for k, v in sliding_on.items() if k != "max_window_layers"}, "num_hidden_layers": 30}
    return [
        *[pytest.param(arch, None, (), id=f"bench-{arch}") for arch in ARCHITECTURES],
        # The tiny configs without head_dim: hidden / heads, or the family's own default (Qwen 3: 128, Gemma 3:
        # 256), none of which the tiny shapes have.
        *[pytest.param(arch, "tiny", ("head_dim",), id=f"tiny-{arch}-no-head_dim") for arch in ARCHITECTURES],
        # Every optional key left out: the family's defaults as transformers has them.
        *[pytest.param(arch, None, OPTIONAL_KEYS, id=f"bench-{arch}-optional-keys-left-out") for arch in ARCHITECTURES],
        pytest.param("qwen2", QWEN2_5_0_5B_INSTRUCT, (), id="Qwen2.5-0.5B-Instruct"),
        pytest.param("qwen2", sliding_on, (), id="Qwen2.5-0.5B-Instruct-sliding-on"),
        pytest.param("qwen2", no_window, (), id="sliding-on-no-window-key"),
        pytest.param("qwen2", no_start, (), id="sliding-on-no-max_window_layers"),
        pytest.param("qwen2", {**sliding_on, "sliding_window": None}, (), id="sliding-on-null-window"),
        # No use_sliding_window key: transformers' default (off), though layers 21-23 would slide if it were on.
        pytest.param("qwen2", {k: v for k, v in QWEN2_5_0_5B_INSTRUCT.items() if k != "use_sliding_window"}, (),
                     id="no-use_sliding_window-key"),
        # Token id 0 is a token (some vocabularies start with their specials there).
        pytest.param("llama", bench_with("llama", bos_token_id=0, eos_token_id=[0, 5]), (), id="token-id-0"),
        # The legacy spelling of the RoPE type ("type"), and factors llama3 would refuse on a linear scaling.
        pytest.param("llama", bench_with("llama", rope_scaling={"type": "linear", "factor": 2.0}), (),
                     id="rope_scaling-legacy-type-key"),
        pytest.param("llama", bench_with("llama", rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                                "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
                     (), id="linear-rope-with-inverted-frequency-factors"),
        pytest.param("llama", bench_with("llama", mlp_bias=True), (), id="llama-mlp-bias"),
        # transformers 5 files edited by hand: RoPE keys left out or given the other way.
        pytest.param("gemma3_text", v5_with("gemma3_text", "rope_parameters.sliding_attention.rope_theta"), (),
                     id="gemma3-sliding-rope_theta-left-out"),
        pytest.param("gemma3_text", v5_with("gemma3_text", "rope_parameters",
                                            {"rope_type": "default", "rope_theta": 1e6}), (),
                     id="gemma3-rope_parameters-not-by-layer-type"),
        pytest.param("gemma3_text", v5_with("gemma3_text", "rope_parameters.sliding_attention"), (),
                     id="gemma3-rope_parameters-full_attention-only"),
        pytest.param("llama", v5_with("llama", "rope_parameters", {"rope_type": "default"}, rope_theta=12345.0), (),
                     id="llama-rope_theta-beside-rope_parameters"),
        # Gemma 3 reads hidden_activation, whatever hidden_act says.
        pytest.param("gemma3_text", bench_with("gemma3_text", hidden_act="silu"), (), id="gemma3-hidden_act-differs"),
    ]


@pytest.mark.parametrize(("arch", "raw", "left_out"), real_config_cases())
def test_real_configs_parse_as_transformers_parses_them(arch: str, raw: Any,
                                                        left_out: tuple[str, ...], tmp_path: Path) -> None:
    """The real models' config.json (the bench shapes, and Qwen 2.5's file as published), and configs with keys
    left out: every field the engine reads equals what transformers read from the same file."""
    if raw is None:
        raw = json.loads((bench_config_json(arch, tmp_path) / "config.json").read_text())
    elif callable(raw):  # v5_with(...)
        raw = raw()
    elif isinstance(raw, tuple):  # bench_with(...)
        raw = {**json.loads((bench_config_json(arch, tmp_path) / "config.json").read_text()), **raw[1]}
    elif raw == "tiny":
        raw = json.loads((build_checkpoint(arch, config_format="legacy") / "config.json").read_text())
    assert isinstance(raw, dict)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in left_out}))
    ours, theirs = ModelConfig.from_file(tmp_path), hf_model_config(tmp_path)
    assert ours.model_type == arch
    differ = {f: (getattr(ours, f), getattr(theirs, f)) for f in ours.__dataclass_fields__
              if getattr(ours, f) != getattr(theirs, f)}
    assert not differ, f"parsed fields differ from transformers' (ours, HF's): {differ}"
    if raw.get("use_sliding_window") and raw.get("sliding_window", 1) is not None:
        assert ours.has_sliding_layers  # the cases above that turn it on all slide somewhere
