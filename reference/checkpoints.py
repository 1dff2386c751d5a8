"""Deterministic test checkpoints in real Hugging Face format, cached on disk.

`build_checkpoint` makes tiny fp32 models (milliseconds per forward on CPU) whose weights are drawn with a
larger spread than HF's init, so greedy decoding has clear winners. `build_bench_checkpoint` makes random
models with the real 1B-class shapes, for speed measurements only. Both write config.json, model.safetensors,
tokenizer.json, tokenizer_config.json and generation_config.json; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from infer.families import ARCHITECTURES, FAMILIES
from reference import tiny_tokenizer
from reference.tiny_tokenizer import TokenIds, save_tokenizer, write_json

# Keyed by `model_type`, as the engine's family table is: one list for the engine, the tests and the bench.
ARCHS = ARCHITECTURES
CONFIG_FORMATS = ("v5", "legacy")
# Pre-v5 config keys that the config classes still accept (and convert) as keyword arguments.
LEGACY_CONFIG_KEYS = ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern")
# Bump when a change alters what gets written, so stale cached checkpoints are not reused. Tiny checkpoints
# are also keyed by this package's builder source, so an edit here can never serve a stale one.
BUILDER_VERSION = 2

CONFIG_CLASSES: dict[str, type[PreTrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma3_text": Gemma3TextConfig,
}

# Tiny shapes. head_dim is explicit and, for Qwen 2, Qwen 3 and Gemma 3, deliberately != hidden_size / heads.
TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        # original_max_position_embeddings=64 puts the llama3 frequency bands inside test lengths.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    # Qwen2Config declares no head_dim; HF's Qwen 2 reads one from the config when it is there. GQA 4:1 and an
    # untied head (Qwen 2.5 7B and up; 0.5B ties it): a layout the Qwen 3 one does not cover. Sliding layers
    # are off, as in every released Qwen 2.5 (use_sliding_window, max_window_layers and sliding_window are
    # overridable).
    "qwen2": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "query_pre_attn_scalar": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "sliding_window": 8,
        "sliding_window_pattern": 2,  # layers 0, 2 slide; 1, 3 are global
        "rope_theta": 1000000.0,  # global layers
        "rope_local_base_freq": 10000.0,  # sliding layers
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # global layers only
        "tie_word_embeddings": True,
    },
}

# Real shapes: Llama-3.2-1B, Qwen2.5-0.5B-Instruct, Qwen3-1.7B, gemma-3-1b (legacy config keys, as on the hub).
BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    # Qwen2.5-0.5B-Instruct's config.json less what the builder sets itself (token ids, dtype) or transformers
    # defaults alike (hidden_act silu, attention_dropout 0, initializer_range 0.02, use_cache): no head_dim
    # there (896 / 14 = 64), sliding layers off.
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
}

# Generation defaults the released instruct models ship (sampling on). The oracle and greedy tests must not
# inherit them silently.
GENERATION_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
    # Qwen2.5-Instruct's: the only one with a repetition penalty.
    "qwen2": {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
    "qwen3": {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
    "gemma3_text": {"do_sample": True, "top_k": 64, "top_p": 0.95},
}


@dataclass(frozen=True)
class InitScale:
    """Spread of a tiny model's weights.

    HF's std 0.02 gives nearly flat logits, where greedy argmax is decided by rounding noise; these give
    top-1/top-2 logit gaps of about one unit and greedy runs that do not fall into short cycles.
    """

    linear_std: float = 0.2
    embed_std: float = 0.5  # embed_tokens and an untied lm_head
    norm_jitter: float = 0.5  # norm weights = neutral + gain - 1 + U(-jitter, jitter)
    final_norm_gain: float = 1.0
    qk_norm_gain: float = 1.0  # > 1 sharpens attention in models with q_norm / k_norm
    bias_std: float = 0.1


TINY_INIT: dict[str, InitScale] = {
    "llama": InitScale(),
    # Its q/k/v biases are drawn like every bias (bias_std): zero biases would hide a dropped one.
    "qwen2": InitScale(),
    "qwen3": InitScale(),
    # Gemma multiplies embeddings by sqrt(hidden_size): small ones keep the residual stream from being a copy
    # of the input token (tied head => argmax = input); the final norm's gain restores the logit spread.
    # Without the sharper q/k norms its greedy runs fall into 3-4 token cycles.
    "gemma3_text": InitScale(embed_std=0.05, final_norm_gain=8.0, qk_norm_gain=2.0),
}
BENCH_STD = 0.02


def default_root() -> Path:
    """$INFER_CHECKPOINT_DIR, else ~/.cache/infer/checkpoints."""
    env = os.environ.get("INFER_CHECKPOINT_DIR")
    return Path(env) if env else Path.home() / ".cache" / "infer" / "checkpoints"


def build_checkpoint(
    arch: str,
    *,
    config_format: str = "v5",
    seed: int = 0,
    root: Path | None = None,
    **overrides: Any,
) -> Path:
    """Path to a tiny fp32 checkpoint for `arch`, built on first use and cached under `root`.

    `overrides` set any config field (num_key_value_heads=1, head_dim=48, layer_types=[...],
    rope_scaling=None, ...). `config_format` "v5" keeps config.json as transformers 5 writes it
    (rope_parameters, layer_types); "legacy" rewrites it the way hub checkpoints ship (rope_theta,
    rope_scaling, and for Gemma 3 rope_local_base_freq and sliding_window_pattern).
    """
    _check_arch(arch)
    if config_format not in CONFIG_FORMATS:
        raise ValueError(f"unknown config_format {config_format!r}; expected one of {CONFIG_FORMATS}")
    _check_override_names(arch, overrides)
    key = _short_hash({"overrides": overrides, "format": config_format, "source": _builder_source_hash()})
    name = f"{arch}-{config_format}-seed{seed}-{key}"

    def write(directory: Path) -> None:
        _write_tiny(directory, arch, config_format, seed, overrides)

    return _cached_build(root or default_root(), name, write)


# A ~150M-parameter Llama (the size the Hugging Face baseline figures were taken at): the shape of
# Llama-3.2-1B scaled down, for benchmarks at long contexts that a 2-core CPU can finish; Qwen 3 and Gemma 3 at the
# same width and depth with their own traits (Qwen 3's q/k norms and wide heads; Gemma 3's one KV head of 256, its
# sliding layers' window of 512 in five of every six layers), so that the engine's paths for them can be timed too.
BENCH_SMALL_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "vocab_size": 32768},
    "qwen3": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32768},
    "gemma3_text": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 32768},
}


def build_bench_checkpoint(
    arch: str,
    *,
    root: Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    size: str = "1b",
) -> Path:
    """Path to a random checkpoint with the real 1B-class shapes of `arch` (legacy config, like the hub),
    or with `size="150m"` a scaled-down Llama, Qwen 3 or Gemma 3 (see BENCH_SMALL_OVERRIDES).

    For speed measurements only: the weights are noise. Takes a minute or so and a few GB the first time.
    """
    _check_arch(arch)
    if size not in ("1b", "150m") or (size == "150m" and arch not in BENCH_SMALL_OVERRIDES):
        raise ValueError(f"unknown bench size {size!r} for {arch}: '1b', or '150m' for {list(BENCH_SMALL_OVERRIDES)}")
    overrides = BENCH_SMALL_OVERRIDES[arch] if size == "150m" else {}
    dtype_name = str(dtype).removeprefix("torch.")
    suffix = "" if size == "1b" else f"-{size}"
    name = f"bench-{arch}{suffix}-{dtype_name}-seed{seed}-{_short_hash({'bench': True, **overrides})}"

    def write(directory: Path) -> None:
        _write_bench(directory, arch, dtype, seed, overrides)

    return _cached_build(root or default_root(), name, write)


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _check_override_names(arch: str, overrides: dict[str, Any]) -> None:
    # HF configs keep unknown keyword arguments as attributes, so a misspelt field would be ignored silently.
    # The builder's own defaults count as known (Qwen 2 reads a head_dim its config class does not declare).
    known = set(CONFIG_CLASSES[arch]().to_dict()) | set(LEGACY_CONFIG_KEYS) | set(TINY_DEFAULTS[arch])
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {arch} config field(s) {unknown}; see {CONFIG_CLASSES[arch].__name__}")


@cache
def _builder_source_hash() -> str:
    digest = hashlib.sha256()
    for module in (Path(__file__), Path(tiny_tokenizer.__file__)):
        digest.update(module.read_bytes())
    return digest.hexdigest()


def _short_hash(data: dict[str, Any]) -> str:
    # The transformers version is in the key because it decides what a v5 config.json contains.
    payload = {**data, "builder": BUILDER_VERSION, "transformers": transformers.__version__}
    try:
        text = json.dumps(payload, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"checkpoint overrides must be plain JSON values: {e}") from e
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _cached_build(root: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Build into a private temp dir, then rename it into place: readers never see a half-written dir."""
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process (an xdist worker) renamed its copy first; the builds are identical, use theirs.
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _config_kwargs(arch: str, base: dict[str, Any], ids: TokenIds, overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs = {**base, **overrides}
    # A caller giving the transformers 5 form replaces our legacy-form defaults rather than mixing with them.
    if "rope_parameters" in overrides:
        for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
            if key not in overrides:
                kwargs.pop(key, None)
    if FAMILIES[arch].sliding_layers == "period":
        pattern = kwargs.pop("sliding_window_pattern", None)
        if "layer_types" not in kwargs:
            kwargs["layer_types"] = _layer_types(kwargs["num_hidden_layers"], pattern)
    kwargs.setdefault("vocab_size", ids.vocab_size)
    if kwargs["vocab_size"] < ids.vocab_size:
        raise ValueError(f"vocab_size={kwargs['vocab_size']} is smaller than the tokenizer's {ids.vocab_size} tokens")
    kwargs.setdefault("bos_token_id", ids.bos_token_id)
    eos = ids.eos_token_ids
    # Qwen's config.json names only <|im_end|>; generation_config.json lists both.
    kwargs.setdefault("eos_token_id", eos[0] if arch in ("qwen2", "qwen3") else eos)
    kwargs.setdefault("pad_token_id", ids.pad_token_id)
    return kwargs


def _layer_types(num_layers: int, pattern: int | None) -> list[str]:
    """Gemma 3's rule: every `pattern`-th layer (1-based) is global, the rest slide."""
    if pattern is None or pattern < 1:
        raise ValueError(f"sliding_window_pattern must be a positive int, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _write_tiny(directory: Path, arch: str, config_format: str, seed: int, overrides: dict[str, Any]) -> None:
    base = TINY_DEFAULTS[arch]
    max_len = {**base, **overrides}["max_position_embeddings"]
    ids = save_tokenizer(arch, directory, model_max_length=max_len)
    config = CONFIG_CLASSES[arch](**_config_kwargs(arch, base, ids, overrides))
    with torch.random.fork_rng(devices=[]):  # seed HF's init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_tiny(model, arch, seed)
    model.save_pretrained(directory)
    _write_generation_config(directory, arch, ids)
    if config_format == "legacy":
        path = directory / "config.json"
        write_json(path, to_legacy_config(json.loads(path.read_text())))


@torch.no_grad()
def _reinit_tiny(model: torch.nn.Module, arch: str, seed: int) -> None:
    """Redraw every parameter from `seed`, in name order, so the weights do not depend on module order."""
    scale = TINY_INIT[arch]
    gen = torch.Generator().manual_seed(seed)
    neutral = _neutral_norm_weight(arch)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            gain = 1.0
            if name == "model.norm.weight":
                gain = scale.final_norm_gain
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                gain = scale.qk_norm_gain
            noise = 2 * torch.rand(param.shape, generator=gen) - 1
            param.copy_(neutral + gain - 1.0 + scale.norm_jitter * noise)
        elif name.endswith(".bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * scale.bias_std)
        else:
            is_embedding = "embed_tokens" in name or "lm_head" in name
            std = scale.embed_std if is_embedding else scale.linear_std
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def _neutral_norm_weight(arch: str) -> float:
    """Gemma's RMSNorm scales by (1 + weight), so its neutral weight is 0; the others scale by weight."""
    return 0.0 if FAMILIES[arch].norm_plus_one else 1.0


def _write_generation_config(directory: Path, arch: str, ids: TokenIds) -> None:
    config: dict[str, Any] = {"bos_token_id": ids.bos_token_id, "eos_token_id": ids.eos_token_ids}
    if ids.pad_token_id is not None:
        config["pad_token_id"] = ids.pad_token_id
    config.update(GENERATION_DEFAULTS[arch])
    config["transformers_version"] = transformers.__version__
    write_json(directory / "generation_config.json", config)


def to_legacy_config(config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers 5 config.json dict into the pre-v5 form that hub checkpoints ship."""
    out = dict(config)
    rope = out.pop("rope_parameters", None)
    if rope is None:
        raise ValueError("config has no rope_parameters: it is not in the transformers 5 format")
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    layer_types = out.pop("layer_types", None)
    family = FAMILIES[out["model_type"]]
    if family.sliding_layers == "period":
        sliding = rope["sliding_attention"]
        if sliding.get("rope_type", "default") != "default":
            raise ValueError("legacy Gemma 3 configs cannot scale RoPE on sliding layers")
        out["rope_local_base_freq"] = sliding["rope_theta"]
        rope = rope["full_attention"]
        out.pop("_sliding_window_pattern", None)
        out["sliding_window_pattern"] = _pattern_of(layer_types or [])
    elif layer_types is not None and set(layer_types) != {"full_attention"} and (
        family.sliding_layers != "upper" or layer_types != _upper_layer_types(out)
    ):
        raise ValueError(f"legacy {out.get('model_type')} configs cannot express layer_types={layer_types}")
    out["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    return out


def _upper_layer_types(config: dict[str, Any]) -> list[str]:
    """Qwen's rule: with use_sliding_window and a sliding_window, layers from max_window_layers on slide."""
    slides = bool(config.get("use_sliding_window")) and config.get("sliding_window") is not None
    start = config.get("max_window_layers", 0)
    return ["sliding_attention" if slides and i >= start else "full_attention"
            for i in range(config["num_hidden_layers"])]


def _pattern_of(layer_types: list[str]) -> int:
    # Up to len + 1: a pattern longer than the stack (every layer slides) is a valid legacy config.
    for pattern in range(1, len(layer_types) + 2):
        if _layer_types(len(layer_types), pattern) == layer_types:
            return pattern
    raise ValueError(f"layer_types {layer_types} follow no sliding_window_pattern; use config_format='v5'")


def _write_bench(directory: Path, arch: str, dtype: torch.dtype, seed: int, overrides: dict[str, Any]) -> None:
    ids = save_tokenizer(arch, directory, model_max_length=BENCH_CONFIGS[arch]["max_position_embeddings"])
    config = CONFIG_CLASSES[arch](**_config_kwargs(arch, BENCH_CONFIGS[arch], ids, overrides))
    # Build on the meta device so HF's per-module init never runs on a billion parameters; fill in place.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty allocates tied tensors separately; tie them again
    gen = torch.Generator().manual_seed(seed)
    neutral = _neutral_norm_weight(arch)
    params = sorted(model.named_parameters())
    with torch.no_grad():
        for name, param in tqdm(params, desc=f"bench {arch}: drawing weights", unit="tensor"):
            if name.endswith("norm.weight"):
                param.fill_(neutral)
            else:
                param.normal_(0.0, BENCH_STD, generator=gen)
    num_params = sum(p.numel() for _, p in params)
    tqdm.write(f"bench {arch}: saving {num_params / 1e9:.2f}B parameters ({dtype})")
    model.save_pretrained(directory)
    _write_generation_config(directory, arch, ids)
    path = directory / "config.json"
    write_json(path, to_legacy_config(json.loads(path.read_text())))
