"""Plant realistic bugs, one at a time, and check the test suite catches each: the suite's own measure.

Run from the repository root: `python tests/mutation_check.py` (about 15 minutes on 2 cores). First the
whole suite runs unmutated (`pytest -n auto`; it must pass, and its time is printed); then each mutant is
applied to a temporary copy of the repository and the tests that own that code run there and must fail.
Prints a table and the kill rate; exits non-zero if any mutant survives.

  python tests/mutation_check.py top-p chat   # only mutants whose name contains a word
  python tests/mutation_check.py --full       # run the whole suite against every mutant (slow)
  python tests/mutation_check.py --no-baseline

Not collected by pytest (no `test_` prefix). Every new feature adds its own planted bugs here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANT_TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    before: str
    after: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("sliding window off by one (W+1 keys)", "infer/attention.py",
           "visible &= k > q - sliding_window", "visible &= k >= q - sliding_window",
           ("tests/property", "tests/test_models.py")),
    Mutant("RoPE position not offset by the cache length", "infer/models/transformer.py",
           "positions = torch.arange(offset, offset + T, device=device)", "positions = torch.arange(T, device=device)",
           ("tests/property", "tests/test_generate.py")),
    Mutant("chunk mask ignores the cached length", "infer/models/transformer.py",
           "return attention_mask(positions, key_positions, window)",
           "return attention_mask(positions - offset, key_positions - offset, window)",
           ("tests/property", "tests/test_cache_conformance.py")),
    Mutant("wrong GQA head mapping (tiled instead of grouped)", "infer/attention.py",
           "return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)",
           "groups = q.shape[1] // k.shape[1]\n    k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)\n"
           "    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)",
           ("tests/property", "tests/test_models.py")),
    Mutant("freed block still read by another sequence (ref count ignored)", "infer/cache/block_manager.py",
           "            if block.ref_count == 0:\n                self._free.append(block_id)",
           "            if block.ref_count >= 0:\n                self._free.append(block_id)",
           ("tests/test_paged.py",)),
    Mutant("newest key read before it is written (stale slot)", "infer/cache/contiguous.py",
           "self.k_cache[layer, :, :, self._offset : end] = k",
           "self.k_cache[layer, :, :, self._offset : end - 1] = k[:, :, :-1]",
           ("tests/property", "tests/test_generate.py")),
    Mutant("ring buffer decode reads a stale slot", "infer/cache/sliding.py",
           "            slot = self._offset % W\n", "            slot = (self._offset + 1) % W\n",
           ("tests/test_sliding.py", "tests/test_cache_conformance.py")),
    Mutant("RoPE frequencies without llama3 scaling", "infer/rope.py",
           "        return _llama3_scaling(inv_freq, rope)", "        return inv_freq",
           ("tests/test_models.py",)),
    Mutant("top-p keeps the token that crosses the threshold out", "infer/sampling.py",
           "remove_sorted = cumulative <= 1 - params.top_p", "remove_sorted = cumulative < 1 - params.top_p",
           ("tests/test_sampling_oracle.py",)),
    Mutant("temperature applied after top-p and min-p", "infer/sampling.py",
           "    logits = logits / params.temperature\n    if params.top_k",
           "    if params.top_k",
           ("tests/test_sampling_oracle.py",)),
    Mutant("repetition penalty divides negative logits (raises them)", "infer/sampling.py",
           "picked = torch.where(picked < 0, picked * penalty, picked / penalty)",
           "picked = picked / penalty",
           ("tests/test_sampling_oracle.py",)),
    Mutant("min-p threshold on logits instead of probabilities", "infer/sampling.py",
           "logits = logits.masked_fill(probs < threshold, float(\"-inf\"))",
           "logits = logits.masked_fill(logits < threshold, float(\"-inf\"))",
           ("tests/test_sampling_oracle.py",)),
    Mutant("top-k keeps k+1 tokens", "infer/sampling.py",
           "kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]",
           "kth = torch.topk(logits, min(params.top_k + 1, logits.shape[-1]), dim=-1).values[..., -1:]",
           ("tests/test_sampling_oracle.py",)),
    Mutant("repetition penalty skipped in greedy decoding", "infer/sampling.py",
           "if params.repetition_penalty != 1.0 and seen_ids is not None",
           "if params.repetition_penalty != 1.0 and params.temperature and seen_ids is not None",
           ("tests/test_sampling_oracle.py",)),
    Mutant("generation_config.json's EOS ids ignored without a tokenizer", "infer/generation.py",
           "stop_ids = set(model.eos_token_ids)", "stop_ids = set(model.config.eos_token_ids)",
           ("tests/test_stopping.py",)),
    Mutant("only the first id of a list eos_token_id stops", "infer/config.py",
           "    return tuple(dict.fromkeys(values))\n\n\ndef _from_hf_dict",
           "    return tuple(dict.fromkeys(values[:1]))\n\n\ndef _from_hf_dict",
           ("tests/test_stopping.py",)),
    Mutant("tokenizer reads only the first id of a list eos_token_id", "infer/tokenizer.py",
           "        ids.extend(found[0] or found[1])\n",
           "        ids.extend(found[0][:1] or found[1][:1])\n",
           ("tests/test_stopping.py",)),
    Mutant("of two stop strings, the later match wins", "infer/generation.py",
           "self.text = self.text[: min(hits)]", "self.text = self.text[: max(hits)]",
           ("tests/test_stopping.py",)),
    Mutant("stop matcher holds back one character too few", "infer/generation.py",
           "self.holdback = max((len(s) for s in stops), default=1) - 1",
           "self.holdback = max((len(s) for s in stops), default=1) - 2",
           ("tests/test_stopping.py",)),
    Mutant("chat prompt built without the generation header", "infer/generation.py",
           "def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt, *, add_generation_prompt: bool = True)",
           "def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt, *, add_generation_prompt: bool = False)",
           ("tests/test_chat.py",)),
    Mutant("continue_final_message leaves the template's end-of-turn", "infer/tokenizer.py",
           "            text = _cut_at_continue_tag(text, final)", "            text = text.replace(_CONTINUE_TAG, '')",
           ("tests/test_chat.py",)),
    Mutant("reasoning / thinking not aliased to reasoning_content", "infer/tokenizer.py",
           "chat = [_alias_reasoning({k: v", "chat = [({k: v",
           ("tests/test_chat.py",)),
    Mutant("tool schema: Optional argument not marked nullable", "infer/chat_tools.py",
           '            out["nullable"] = True', "            pass",
           ("tests/test_chat.py",)),
    Mutant("tool docstring: continuation lines of an argument dropped", "infer/chat_tools.py",
           'args = {name: re.sub(r"\\s*\\n+\\s*", " ", text.strip())',
           'args = {name: text.strip().split("\\n")[0]',
           ("tests/test_chat.py",)),
    # --- config parsing and model math -----------------------------------------------------------
    Mutant("legacy rope_local_base_freq ignored", "infer/config.py",
           'rope_local = RopeConfig(theta=_number(raw, "rope_local_base_freq", 10000.0))',
           "rope_local = RopeConfig(theta=10000.0)",
           ("tests/test_config_oracle.py",)),
    Mutant("rope_parameters: sliding layers take the full layers' RoPE", "infer/config.py",
           "rope_local = _rope_from_params(rope_params.get(SLIDING_ATTENTION), 10000.0,",
           "rope_local = _rope_from_params(rope_params.get(FULL_ATTENTION), 10000.0,",
           ("tests/test_config_oracle.py", "tests/test_models.py")),
    Mutant("sliding_window_pattern counted from layer 0", "infer/config.py",
           "SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION",
           "SLIDING_ATTENTION if i % pattern else FULL_ATTENTION",
           ("tests/test_config_oracle.py",)),
    Mutant("explicit head_dim ignored (hidden / heads)", "infer/config.py",
           'head_dim = _int(raw, "head_dim", family.head_dim or max(hidden // num_heads, 1))',
           "head_dim = family.head_dim or max(hidden // num_heads, 1)",
           ("tests/test_config_oracle.py",)),
    Mutant("rms_norm_eps read as the default", "infer/config.py",
           'rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6)', "rms_norm_eps=1e-6",
           ("tests/test_config_oracle.py",)),
    Mutant("query_pre_attn_scalar ignored (head_dim scales)", "infer/models/transformer.py",
           "scalar = config.query_pre_attn_scalar or self.head_dim", "scalar = self.head_dim",
           ("tests/test_config_oracle.py",)),
    Mutant("final logit softcap without the division", "infer/models/transformer.py",
           "logits = torch.tanh(logits / cap) * cap", "logits = torch.tanh(logits) * cap",
           ("tests/test_config_oracle.py",)),
    Mutant("attention softcap applied after the mask", "infer/attention.py",
           "    if softcap is not None:\n        scores = torch.tanh(scores / softcap) * softcap\n"
           "    if mask is not None:\n        scores = scores.masked_fill(~mask, float(\"-inf\"))\n",
           "    if mask is not None:\n        scores = scores.masked_fill(~mask, float(\"-inf\"))\n"
           "    if softcap is not None:\n        scores = torch.tanh(scores / softcap) * softcap\n",
           ("tests/test_config_oracle.py",)),
    Mutant("Gemma embedding scale not rounded to the weights' dtype", "infer/models/transformer.py",
           "x = x * torch.tensor(self.embed_scale, dtype=x.dtype)", "x = x * self.embed_scale",
           ("tests/test_config_oracle.py",)),
    Mutant("llama3 RoPE: band edges from the wrong factors", "infer/rope.py",
           "low_freq_wavelen = old_context / rope.low_freq_factor",
           "low_freq_wavelen = old_context / rope.high_freq_factor",
           ("tests/test_config_oracle.py",)),
    # --- Qwen 2 ------------------------------------------------------------------------------------
    Mutant("Qwen 2 q/k/v biases dropped", "infer/families.py",
           'Family("qwen2", qkv_bias=True, sliding_layers="upper")', 'Family("qwen2", sliding_layers="upper")',
           ("tests/test_models.py",)),
    Mutant("Qwen 2 o_proj given a bias", "infer/models/transformer.py",
           "o_bias = config.attention_bias and not family.qkv_bias",
           "o_bias = config.attention_bias or family.qkv_bias",
           ("tests/test_models.py",)),
    Mutant("Qwen 2 sliding layers by Gemma's period rule", "infer/families.py",
           'Family("qwen2", qkv_bias=True, sliding_layers="upper")',
           'Family("qwen2", qkv_bias=True, sliding_layers="period")',
           ("tests/test_models.py",)),
    Mutant("Qwen sliding layers without use_sliding_window", "infer/config.py",
           'elif family.sliding_layers == "upper" and _bool(raw, "use_sliding_window", False):',
           'elif family.sliding_layers == "upper":',
           ("tests/test_config_oracle.py",)),
    Mutant("Qwen sliding layers counted from the wrong end", "infer/config.py",
           "SLIDING_ATTENTION if slides and i >= max_window_layers else FULL_ATTENTION",
           "SLIDING_ATTENTION if slides and i < max_window_layers else FULL_ATTENTION",
           ("tests/test_models.py",)),
    Mutant("Qwen sliding window left out: no window instead of transformers' 4096", "infer/config.py",
           'raw = {"sliding_window": UPPER_DEFAULT_SLIDING_WINDOW, **raw}', 'raw = {"sliding_window": None, **raw}',
           ("tests/test_config_oracle.py",)),
    Mutant("Qwen 3 head_dim left out: hidden / heads instead of transformers' 128", "infer/families.py",
           'Family("qwen3", qk_norm=True, sliding_layers="upper", head_dim=128)',
           'Family("qwen3", qk_norm=True, sliding_layers="upper")',
           ("tests/test_config_oracle.py",)),
    # --- caches ------------------------------------------------------------------------------------
    Mutant("contiguous snapshot is a view of the cache", "infer/cache/contiguous.py",
           'tensors={"k": self.k_cache[:, :, :, :n].clone(), "v": self.v_cache[:, :, :, :n].clone()}',
           'tensors={"k": self.k_cache[:, :, :, :n], "v": self.v_cache[:, :, :, :n]}',
           ("tests/test_cache_conformance.py",)),
    Mutant("sliding snapshot stores ring slots in storage order", "infer/cache/sliding.py",
           "        slots = self._ring_slots(n, min(n, self.ring_size))\n",
           "        slots = torch.arange(min(n, self.ring_size))\n",
           ("tests/test_cache_conformance.py", "tests/test_prompt_cache.py")),
    Mutant("quantized snapshot is a view of the codes", "infer/cache/quantized.py",
           '"k_data": self.k_data[:, :, :, :q].clone(),', '"k_data": self.k_data[:, :, :, :q],',
           ("tests/test_cache_conformance.py",)),
    Mutant("prefix match trusts the hash (tokens not compared)", "infer/cache/block_manager.py",
           "            if block.token_ids != tokens or block.parent != parent:\n                break",
           "            if False:\n                break",
           ("tests/test_paged.py",)),
    Mutant("prefix match ignores the block's parent", "infer/cache/block_manager.py",
           "            if block.token_ids != tokens or block.parent != parent:\n                break",
           "            if block.token_ids != tokens:\n                break",
           ("tests/test_paged.py",)),
    Mutant("copy-on-write copies the wrong way", "infer/cache/paged.py",
           "self.k_blocks[:, dst] = self.k_blocks[:, src]", "self.k_blocks[:, src] = self.k_blocks[:, dst]",
           ("tests/test_paged.py",)),
    # --- quantization ------------------------------------------------------------------------------
    Mutant("int4 nibbles packed high-first, unpacked low-first", "infer/cache/quant.py",
           "return codes[..., 0::2] | (codes[..., 1::2] << 4)", "return codes[..., 1::2] | (codes[..., 0::2] << 4)",
           ("tests/test_quantized.py",)),
    Mutant("int4 codes not sign-extended", "infer/cache/quant.py",
           "codes = (nibbles ^ 0x08) - 0x08", "codes = nibbles",
           ("tests/test_quantized.py",)),
    Mutant("row scale rounded to nearest (clips the row maximum)", "infer/cache/quant.py",
           "    return torch.where(too_small, torch.nextafter(scale, torch.full_like(scale, float(\"inf\"))), scale)",
           "    return scale",
           ("tests/test_quantized.py",)),
    Mutant("fp4 ties round up", "infer/cache/quant.py",
           "magnitude_code = torch.bucketize(v.float().abs(), midpoints, right=False)",
           "magnitude_code = torch.bucketize(v.float().abs(), midpoints, right=True)",
           ("tests/test_quantized.py",)),
    # --- all-or-nothing ----------------------------------------------------------------------------
    Mutant("a stopped forward's ring writes are not undone", "infer/cache/base.py",
           "        for target, index, old in reversed(self._undo):\n            target[:, :, index] = old\n",
           "        pass\n",
           ("tests/test_all_or_nothing.py",)),
    Mutant("the model does not discard a stopped step", "infer/models/transformer.py",
           "                kv_cache.discard_step()", "                pass",
           ("tests/test_all_or_nothing.py",)),
    Mutant("snapshot tensor dtypes not checked", "infer/cache/base.py",
           "ok = t.dtype.is_floating_point if dtype is FLOAT else t.dtype == dtype", "ok = True",
           ("tests/test_all_or_nothing.py",)),
    Mutant("truncated blocks go to the back of the free list", "infer/cache/block_manager.py",
           "self._free.extendleft(released)", "self._free.extend(released)",
           ("tests/test_paged.py", "tests/test_all_or_nothing.py")),
    Mutant("negative layer index wraps around", "infer/cache/base.py",
           "if not 0 <= layer < num_layers:", "if not -num_layers <= layer < num_layers:",
           ("tests/test_all_or_nothing.py",)),
    Mutant("input on another device not refused", "infer/models/transformer.py",
           "if input_ids.device != weights:", "if False:",
           ("tests/test_all_or_nothing.py",)),
    # --- tokenizer, loader, generation -------------------------------------------------------------
    Mutant("decode skips special tokens by default", "infer/tokenizer.py",
           "def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:",
           "def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:",
           ("tests/test_tokenizer.py",)),
    Mutant("stream decoder emits half a UTF-8 character", "infer/tokenizer.py",
           "if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):",
           "if len(full_text) <= len(prefix_text):",
           ("tests/test_tokenizer.py",)),
    Mutant("only the first shard of an index is read", "infer/loader.py",
           "        return files\n", "        return files[:1]\n",
           ("tests/test_loader.py",)),
    Mutant("lm_head tied although config.json unties it", "infer/loader.py",
           "    if config.tie_word_embeddings:\n        model.lm_head.weight = model.embed_tokens.weight",
           "    if True:\n        model.lm_head.weight = model.embed_tokens.weight",
           ("tests/test_models.py", "tests/test_config_oracle.py")),
    Mutant("config.json's eos stops although generation_config.json replaces it", "infer/loader.py",
           "    return tuple(dict.fromkeys(values))", "    return tuple(dict.fromkeys([*values, *config_eos]))",
           ("tests/test_stopping.py",)),
    Mutant("sampling seed ignored", "infer/generation.py",
           "generator = torch.Generator(device=device).manual_seed(params.seed)",
           "generator = torch.Generator(device=device)",
           ("tests/test_generate.py", "tests/test_sampling_oracle.py")),
    Mutant("cached prefix prefilled again", "infer/generation.py",
           "next_input = all_ids[:, kv_cache.offset if kv_cache is not None else 0 : length]",
           "next_input = all_ids[:, 0:length]",
           ("tests/test_generate.py",)),
    # --- validated inputs, prompt caching ---------------------------------------------------------
    Mutant("config.json layer count not checked against the tensors", "infer/loader.py",
           "    _check_layer_count(path, config, headers)\n", "",
           ("tests/test_checkpoint_validation.py",)),
    Mutant("non-finite weights load", "infer/loader.py",
           "    check_finite: bool = True,", "    check_finite: bool = False,",
           ("tests/test_checkpoint_validation.py",)),
    Mutant("a zero or negative config number accepted", "infer/config.py",
           "or not math.isfinite(value) or value <= 0:", "or not math.isfinite(value):",
           ("tests/test_checkpoint_validation.py",)),
    Mutant("integer weights cast silently", "infer/loader.py",
           "        if dtype not in FLOAT_DTYPES:", "        if False:",
           ("tests/test_checkpoint_validation.py",)),
    Mutant("decode drops unknown ids", "infer/tokenizer.py",
           "        _check_ids(ids, self.vocab_size)\n", "",
           ("tests/test_tokenizer.py",)),
    Mutant("stream decoder releases text at a cut inside a character", "infer/tokenizer.py",
           "if len(text) > len(prefix_text) and full_text.startswith(text):", "if len(text) > len(prefix_text):",
           ("tests/test_tokenizer.py",)),
    Mutant("chat template renders without a time bound", "infer/tokenizer.py",
           "# noqa: N807 (jinja's name)\n        _check_deadline()\n",
           "# noqa: N807 (jinja's name)\n",
           ("tests/test_tokenizer.py",)),
    Mutant("infinite temperature accepted", "infer/sampling.py",
           "            if not math.isfinite(value):", "            if False:",
           ("tests/test_bad_inputs.py",)),
    Mutant("bytes prompt read as token ids", "infer/generation.py",
           "    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):",
           "    if not isinstance(prompt, Sequence):",
           ("tests/test_bad_inputs.py",)),
    Mutant("cache sizes not checked against free memory", "infer/cache/base.py",
           "    check_fits(nbytes, target, what)\n", "",
           ("tests/test_bad_inputs.py",)),
    Mutant("prefix snapshot from another model accepted", "infer/generation.py",
           "    if taken_on != model_fingerprint(model):", "    if False:",
           ("tests/test_prompt_cache.py",)),
    Mutant("a paged cache holding other tokens reused", "infer/generation.py",
           "        if held is not None and list(held[:n]) != prompt_ids[: min(n, len(held))]:",
           "        if False:",
           ("tests/test_prompt_cache.py",)),
    Mutant("the prefix's cache kind overrides the asked one", "infer/generation.py",
           "    if isinstance(cache, str) and cache != prefix.kind:", "    if False:",
           ("tests/test_prompt_cache.py",)),
    Mutant("chat prefix snapshot keeps the generation header", "infer/generation.py",
           "    ids = encode_prompt(tokenizer, prefix, add_generation_prompt=False)",
           "    ids = encode_prompt(tokenizer, prefix)",
           ("tests/test_prompt_cache.py",)),
    Mutant("CLI: Ctrl-C ends in a traceback", "infer/__main__.py",
           "    except KeyboardInterrupt:\n", "    except ZeroDivisionError:\n",
           ("tests/test_cli.py",)),
    Mutant("CLI: device checked only when the model loads", "infer/__main__.py",
           "    resolve_device(args.device)\n", "",
           ("tests/test_cli.py",)),
    Mutant("generation_config's do_sample ignored (always samples)", "infer/loader.py",
           "    if not do_sample:\n", "    if False:\n",
           ("tests/test_cli.py",)),
    Mutant("the engine imports the oracle package", "infer/bench.py",
           "import torch\n\nfrom infer.bench_batched import",
           "import torch\n\nimport reference  # noqa: F401\nfrom infer.bench_batched import",
           ("tests/test_layering.py",)),
    Mutant("auto prefill dtype ignores the CPU's bf16 units", "infer/tuning.py",
           "    if units:\n", "    if False:\n",
           ("tests/test_tuning.py",)),
    Mutant("mv decode form drops the bias", "infer/models/transformer.py",
           "                out = out if self.bias is None else out + self.bias", "                out = out",
           ("tests/test_tuning.py",)),
    Mutant("one-row decode forms taken for a batch of one-token rows", "infer/models/transformer.py",
           "return x.numel() == self.in_features and not x.requires_grad",
           "return x.shape[-2] == 1 and not x.requires_grad",
           ("tests/test_tuning.py",)),
    Mutant("native decode: fused projections used for prefill too", "infer/models/transformer.py",
           "return self.all_rows or (self.gemv == \"native\" and self.one_row(x))",
           "return self.all_rows or self.gemv == \"native\"",
           ("tests/test_tuning.py",)),
    Mutant("native GEMV: the bf16 tail mask drops the last value", "infer/kernels/cpu_decode.c",
           "__mmask32 m = (__mmask32)((1u << (k - i)) - 1);", "__mmask32 m = (__mmask32)((1u << (k - i - 1)) - 1);",
           ("tests/test_native_kernels.py",)),
    Mutant("native GEMV: rows past the last whole 16-row block dropped", "infer/kernels/cpu_decode.c",
           "int64_t blocks = (n + 15) / 16;", "int64_t blocks = n / 16;",
           ("tests/test_native_kernels.py",)),
    Mutant("native GEMV: bf16 outputs truncated, not rounded to nearest", "infer/kernels/cpu_decode.c",
           "    u += 0x7fffu + ((u >> 16) & 1u);\n", "\n",
           ("tests/test_native_kernels.py",)),
    Mutant("native GEMV: each thread adds the bias of its own first rows", "infer/kernels/cpu_decode.c",
           "if (bias) v += load_scalar(dtype, bias, r);", "if (bias) v += load_scalar(dtype, bias, r - r0);",
           ("tests/test_native_kernels.py",)),
    Mutant("native GEMV: the AVX2 path drops its last value", "infer/kernels/cpu_decode.c",
           "    for (; i < k; i++) sum += load_scalar(dtype, w, i) * x[i];",
           "    for (; i + 1 < k; i++) sum += load_scalar(dtype, w, i) * x[i];",
           ("tests/test_native_kernels.py",)),
    Mutant("native step ops: RoPE rotates the wrong way", "infer/kernels/cpu_decode.c",
           "round_to(dtype, -b * load_scalar(dtype, sin, i))", "round_to(dtype, b * load_scalar(dtype, sin, i))",
           ("tests/test_native_kernels.py",)),
    Mutant("native step ops: Gemma's (1 + weight) norm read as Llama's", "infer/kernels/cpu_decode.c",
           "gemma ? h * (1.0f + w) : w * round_to(dtype, h)", "w * round_to(dtype, h)",
           ("tests/test_native_kernels.py",)),
    Mutant("native step ops: RMSNorm's mean over d - 1 values", "infer/kernels/cpu_decode.c",
           "squares / (float)d + eps", "squares / (float)(d - 1) + eps",
           ("tests/test_native_kernels.py",)),
    Mutant("native step ops: gate and up swapped", "infer/kernels/cpu_decode.c",
           "float g = load_scalar(dtype, gate_up, i), up = load_scalar(dtype, gate_up, n + i), act;",
           "float g = load_scalar(dtype, gate_up, n + i), up = load_scalar(dtype, gate_up, i), act;",
           ("tests/test_native_kernels.py",)),
    Mutant("native step ops taken for a batch of one-token rows", "infer/models/transformer.py",
           "and input_ids.numel() == 1):", "and input_ids.shape[1] == 1):",
           ("tests/test_native_kernels.py",)),
    Mutant("huge pages: the copy starts off a 2 MiB boundary", "infer/memory.py",
           "start = -_address(buffer) % HUGE_PAGE", "start = _address(buffer) % HUGE_PAGE",
           ("tests/test_huge_pages.py",)),
    Mutant("huge pages: load_model(huge_pages=False) ignored", "infer/loader.py",
           "        if direct and huge_pages:", "        if direct:",
           ("tests/test_huge_pages.py",)),
    Mutant("bench: the read bound is the slower read", "infer/bench.py",
           "return max(rates.values()), rates", "return min(rates.values()), rates",
           ("tests/test_bench.py",)),
    Mutant("fused q/k/v split with k and v swapped", "infer/models/transformer.py",
           "q, k, v = fused(x).split(", "q, v, k = fused(x).split(",
           ("tests/test_tuning.py",)),
    Mutant("batch: slot mapping off by one", "infer/ragged.py",
           "slot_offsets.extend(p % block_size for p in span)",
           "slot_offsets.extend((p + 1) % block_size for p in span)",
           ("tests/property/test_engine_properties.py",)),
    Mutant("batch: a request reads another's blocks", "infer/engine.py",
           "manager.block_table(c.request_id)) for c in plan.chunks]",
           "manager.block_table(plan.chunks[0].request_id)) for c in plan.chunks]",
           ("tests/property/test_engine_properties.py",)),
    Mutant("batch: preemption does not free the blocks", "infer/scheduler.py",
           "    def _preempt(self, request: Request, out: SchedulerOutput) -> None:\n"
           "        self.blocks.free(request.request_id)\n",
           "    def _preempt(self, request: Request, out: SchedulerOutput) -> None:\n",
           ("tests/test_scheduler.py", "tests/property/test_engine_properties.py")),
    Mutant("batch: one generator shared across requests", "infer/engine.py",
           "live = _Live(request, params, stream, generator, time.perf_counter())",
           "live = _Live(request, params, stream, next(iter(self._live.values())).generator if self._live else "
           "generator, time.perf_counter())",
           ("tests/property/test_engine_properties.py",)),
    Mutant("batch: logits taken at a chunk's first token", "infer/ragged.py",
           "sample_rows.append(row + chunk.num_tokens - 1)", "sample_rows.append(row)",
           ("tests/property/test_engine_properties.py",)),
    Mutant("batch: admission past max_num_seqs", "infer/scheduler.py",
           "len(self.running) < self.max_num_seqs", "len(self.running) <= self.max_num_seqs",
           ("tests/test_scheduler.py",)),
    Mutant("batch: running requests ignore the token budget", "infer/scheduler.py",
           "            n = min(request.num_tokens - request.num_computed, budget)\n",
           "            n = request.num_tokens - request.num_computed\n",
           ("tests/test_scheduler.py",)),
    Mutant("batch: decode steps ignore the sliding window", "infer/ragged.py",
           "w: None if chunk.num_tokens == 1 and w is None else", "w: None if chunk.num_tokens == 1 else",
           ("tests/property/test_engine_properties.py",)),
    Mutant("batch: a started block keeps its previous owner's values", "infer/ragged.py",
           "    k_blocks.index_fill_(0, batch.fresh_blocks, 0)\n    v_blocks.index_fill_(0, batch.fresh_blocks, 0)\n",
           "",
           ("tests/test_engine.py",)),
    Mutant("batch: decode rows padded with another sequence's block", "infer/ragged.py",
           "tables.append(own + own[:1] * (nb - len(own)))", "tables.append(own + [0] * (nb - len(own)))",
           ("tests/test_engine.py", "tests/property/test_engine_properties.py")),
    Mutant("batch: matmul decode attention ignores the per-row mask", "infer/attention.py",
           "probs = _probabilities((packed @ k.transpose(-1, -2)) * scale, mask, softcap, q.dtype)",
           "probs = _probabilities((packed @ k.transpose(-1, -2)) * scale, None, softcap, q.dtype)",
           ("tests/property/test_attention_properties.py", "tests/property/test_engine_properties.py")),
    Mutant("triton: the paged kernel's sliding window off by one", "infer/kernels/paged_attention.py",
           "visible = visible & (pos > length - 1 - window)", "visible = visible & (pos >= length - 1 - window)",
           ("tests/test_triton_kernels.py",)),
    Mutant("triton: earlier blocks not rescaled by the new running max", "infer/kernels/paged_attention.py",
           "alpha = tl.exp(m_i - m_safe)", "alpha = tl.exp(m_i - m_i)",
           ("tests/test_triton_kernels.py",)),
    Mutant("triton: query heads mapped to the wrong KV head", "infer/kernels/paged_attention.py",
           "heads = kvh * GROUP + offs_g", "heads = kvh + offs_g * GROUP",
           ("tests/test_triton_kernels.py", "tests/property/test_engine_properties.py")),
    Mutant("causal prefill attends future keys", "infer/attention.py",
           "return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)",
           "return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)",
           ("tests/test_models.py", "tests/property")),
    Mutant("static step: sliding windows ignored", "infer/models/transformer.py",
           "windows = {lt: self.config.sliding_window if lt == SLIDING_ATTENTION else None for lt in self.inv_freq}",
           "windows = {lt: None for lt in self.inv_freq}",
           ("tests/test_graphs.py",)),
    Mutant("static step: K written one slot late", "infer/models/transformer.py",
           "self.k_cache[layer].index_copy_(2, self.position, k)",
           "self.k_cache[layer].index_copy_(2, self.position + 1, k)",
           ("tests/test_graphs.py",)),
    Mutant("graph decoder: stale values past the position kept", "infer/graphs.py",
           "        cache.v_cache[:, :, :, cache.offset :].zero_()\n", "\n",
           ("tests/test_graphs.py",)),
    Mutant("truncation gives back the last registered block (block size 1)", "infer/cache/block_manager.py",
           "lowest = max(registered * size - 1, (registered - 1) * size + 1) if registered else 0",
           "lowest = max(registered * size - 1, 0)",
           ("tests/test_paged.py",)),
    Mutant("truncation refused below the registered blocks' last token", "infer/cache/block_manager.py",
           "lowest = max(registered * size - 1, (registered - 1) * size + 1) if registered else 0",
           "lowest = registered * size",
           ("tests/test_paged.py", "tests/test_all_or_nothing.py")),
    Mutant("triton: int4 codes not sign-extended", "infer/kernels/quantized_attention.py",
           "return (nibble - ((nibble & 0x8) << 1)).to(tl.float32)", "return nibble.to(tl.float32)",
           ("tests/test_triton_kernels.py",)),
    Mutant("triton: fp4 subnormal code read as 1.0", "infer/kernels/quantized_attention.py",
           "tl.where(exponent == 0, mantissa * 0.5,", "tl.where(exponent == 0, mantissa,",
           ("tests/test_triton_kernels.py",)),
    Mutant("triton: 4-bit codes read from the wrong nibble", "infer/kernels/quantized_attention.py",
           "tl.where(odd, 4, 0)", "tl.where(odd, 0, 4)",
           ("tests/test_triton_kernels.py",)),
    Mutant("triton: values not scaled by their row scale", "infer/kernels/quantized_attention.py",
           "            v = v * v_scale[:, None]\n", "\n",
           ("tests/test_triton_kernels.py",)),
    Mutant("triton: the quantized cache's ring read one slot late", "infer/kernels/quantized_attention.py",
           "row = tl.where(ring > 0, pos % tl.maximum(ring, 1), pos)",
           "row = tl.where(ring > 0, (pos + 1) % tl.maximum(ring, 1), pos)",
           ("tests/test_triton_kernels.py",)),
    Mutant("batch: the sliding layers' ring one block short", "infer/engine.py",
           "per_ring = -(-(window + chunk - 1) // block_size) + 1", "per_ring = -(-(window + chunk - 1) // block_size)",
           ("tests/test_engine.py", "tests/property/test_engine_properties.py")),
    Mutant("batch: window trimming skips the window's first key", "infer/ragged.py",
           "firsts = [0 if reach is None else max(0, n - reach) // block_size for n in lengths]",
           "firsts = [0 if reach is None else max(0, n - reach + 1) // block_size for n in lengths]",
           ("tests/test_engine.py", "tests/property/test_engine_properties.py")),
    Mutant("batch: the youngest request is not the one preempted", "infer/scheduler.py",
           "victim = victims[-1]", "victim = victims[0]",
           ("tests/test_scheduler.py",)),
    Mutant("padded decode: padding rows write a managed block", "infer/engine.py",
           "[k.shape[1] - 1 for k, *_ in self._table_sets]", "[k.shape[1] - 2 for k, *_ in self._table_sets]",
           ("tests/test_graphs.py",)),
    Mutant("padded decode: every row's block zeroed, not only started ones", "infer/graphs.py",
           "*[b if o == 0 else spare for b, o in zip(blocks, offsets, strict=True)]",
           "*[b for b, o in zip(blocks, offsets, strict=True)]",
           ("tests/test_graphs.py",)),
    Mutant("padded decode: lengths miss this step's key", "infer/graphs.py",
           "values += [*[c.start + 1 for c in chunks], *[1] * pad]",
           "values += [*[c.start for c in chunks], *[1] * pad]",
           ("tests/test_graphs.py",)),
    Mutant("padded decode: prompt chunks take the padded path", "infer/graphs.py",
           "if not chunks or any(c.num_tokens != 1 for c in chunks):", "if not chunks:",
           ("tests/test_graphs.py",)),
    Mutant("padded decode: table narrower than the longest sequence", "infer/graphs.py",
           "width = table_width(max(c.start // self.block_size + 1 for c in chunks), self.max_blocks)",
           "width = table_width(max(c.start // self.block_size for c in chunks), self.max_blocks)",
           ("tests/test_graphs.py",)),
    Mutant("padded decode: batch bucket one size too small", "infer/graphs.py",
           "return next((min(size, max_batch) for size in BATCH_BUCKETS if size >= n), None)",
           "return next((min(size, max_batch) for size in BATCH_BUCKETS if size >= n - 1), None)",
           ("tests/test_graphs.py",)),
    Mutant("triton: a window's splits counted from block 0", "infer/kernels/paged_attention.py",
           "lo = first + split * per_split", "lo = split * per_split",
           ("tests/test_triton_kernels.py",)),
    Mutant("bench: the compiled HF contender steps with the eager model", "reference/hf_bench.py",
           "step = model if decode is None else decode", "step = model",
           ("tests/test_bench.py",)),
]


def run(mutant: Mutant, checkpoints: str, full: bool) -> tuple[bool, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        skip = shutil.ignore_patterns(".git", ".venv", ".asv", "*.egg-info", ".*_cache", ".hypothesis", "bench_results")
        shutil.copytree(ROOT, copy, ignore=skip)
        target = copy / mutant.path
        text = target.read_text()
        if text.count(mutant.before) != 1:
            # An ambiguous site would plant the bug somewhere other than the name says.
            return False, 0.0, f"mutation site found {text.count(mutant.before)} times in {mutant.path}, not once"
        target.write_text(text.replace(mutant.before, mutant.after, 1))
        env = {**os.environ, "INFER_CHECKPOINT_DIR": checkpoints, "PYTHONPATH": str(copy)}
        start = time.perf_counter()
        tests = () if full else mutant.tests
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-n", "auto", "-p", "no:cacheprovider", *tests],
                cwd=copy, env=env, capture_output=True, text=True, timeout=MUTANT_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            # A planted bug that makes the tests hang would stall CI until its limit: caught, but the tests
            # should have failed fast (see tests.helpers.time_limit); the table says so.
            return True, time.perf_counter() - start, f"tests hung past {MUTANT_TIMEOUT_S} s (should fail fast)"
        failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        caught = proc.returncode != 0 and bool(failed)  # xdist reports -x stops as "interrupted" (exit 2)
        return caught, time.perf_counter() - start, failed[0][7:90] if failed else proc.stdout[-200:]


def baseline(checkpoints: str) -> float:
    """The whole suite, unmutated: it must pass for a caught mutant to mean anything. Returns seconds."""
    env = {**os.environ, "INFER_CHECKPOINT_DIR": checkpoints}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "auto", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:])
        raise SystemExit("the unmutated suite fails; fix it before measuring mutants")
    return time.perf_counter() - start


def main() -> int:
    from reference.checkpoints import default_root

    checkpoints = os.environ.get("INFER_CHECKPOINT_DIR", str(default_root()))
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    words = [a for a in sys.argv[1:] if not a.startswith("--")]
    if flags - {"--full", "--no-baseline"}:
        raise SystemExit(f"unknown option {sorted(flags - {'--full', '--no-baseline'})}; see the docstring")
    suite_secs = None if "--no-baseline" in flags else baseline(checkpoints)
    if suite_secs is not None:
        print(f"unmutated suite (pytest -n auto): passed in {suite_secs:.0f} s on {os.cpu_count()} cores\n")
    # Optional words pick mutants by a substring of their name: `python tests/mutation_check.py top-p`.
    chosen = [m for m in MUTANTS if not words or any(word in m.name for word in words)]
    print(f"{'mutant':58} {'caught':7} {'secs':>5}  first failing test")
    survivors = []
    start = time.perf_counter()
    for mutant in chosen:
        caught, secs, detail = run(mutant, checkpoints, full="--full" in flags)
        if not caught:
            survivors.append(mutant.name)
        print(f"{mutant.name:58} {'yes' if caught else 'NO':7} {secs:5.0f}  {detail}", flush=True)
    killed = len(chosen) - len(survivors)
    print(f"\nkill rate: {killed}/{len(chosen)} ({100 * killed / max(len(chosen), 1):.0f}%) "
          f"in {time.perf_counter() - start:.0f} s" + (f"; suite time {suite_secs:.0f} s" if suite_secs else ""))
    for name in survivors:
        print(f"SURVIVED: {name}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
