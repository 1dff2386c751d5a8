"""Plant the KV-cache bugs people actually hit, one at a time, and check the suite catches each.

Run from the repository root: `python tests/mutation_check.py` (a few minutes on 2 cores). Each
mutant is applied to a temporary copy of the repository; the relevant tests run there and must fail.
Prints a table; exits non-zero if any mutant survives. Not collected by pytest (no `test_` prefix).
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
           "    return tuple(int(v) for v in value)", "    return tuple(int(v) for v in value[:1])",
           ("tests/test_stopping.py",)),
    Mutant("tokenizer reads only the first id of a list eos_token_id", "infer/tokenizer.py",
           "ids.extend([value] if isinstance(value, int) else value or [])",
           "ids.extend([value] if isinstance(value, int) else value[:1] or [])",
           ("tests/test_stopping.py",)),
    Mutant("of two stop strings, the later match wins", "infer/generation.py",
           "self.text = self.text[: min(hits)]", "self.text = self.text[: max(hits)]",
           ("tests/test_stopping.py",)),
    Mutant("stop matcher holds back one character too few", "infer/generation.py",
           "self.holdback = max((len(s) for s in stops), default=1) - 1",
           "self.holdback = max((len(s) for s in stops), default=1) - 2",
           ("tests/test_stopping.py",)),
    Mutant("chat prompt built without the generation header", "infer/generation.py",
           "tokenizer.apply_chat_template(messages, add_generation_prompt=True)",
           "tokenizer.apply_chat_template(messages, add_generation_prompt=False)",
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
]


def run(mutant: Mutant, checkpoints: str) -> tuple[bool, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        skip = shutil.ignore_patterns(".git", ".venv", ".asv", "*.egg-info", ".*_cache", ".hypothesis", "bench_results")
        shutil.copytree(ROOT, copy, ignore=skip)
        target = copy / mutant.path
        text = target.read_text()
        if mutant.before not in text:
            return False, 0.0, f"mutation site not found in {mutant.path}"
        target.write_text(text.replace(mutant.before, mutant.after, 1))
        env = {**os.environ, "INFER_CHECKPOINT_DIR": checkpoints, "PYTHONPATH": str(copy)}
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:cacheprovider", *mutant.tests],
            cwd=copy, env=env, capture_output=True, text=True,
        )
        failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        caught = proc.returncode != 0 and bool(failed)  # xdist reports -x stops as "interrupted" (exit 2)
        return caught, time.perf_counter() - start, failed[0][7:90] if failed else proc.stdout[-200:]


def main() -> int:
    from reference.checkpoints import default_root

    checkpoints = os.environ.get("INFER_CHECKPOINT_DIR", str(default_root()))
    print(f"{'mutant':58} {'caught':7} {'secs':>5}  first failing test")
    survivors = 0
    # Optional arguments pick mutants by a substring of their name: `python tests/mutation_check.py top-p`.
    chosen = [m for m in MUTANTS if not sys.argv[1:] or any(word in m.name for word in sys.argv[1:])]
    for mutant in chosen:
        caught, secs, detail = run(mutant, checkpoints)
        survivors += not caught
        print(f"{mutant.name:58} {'yes' if caught else 'NO':7} {secs:5.0f}  {detail}", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
