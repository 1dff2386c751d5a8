"""How much a lossy KV cache changes a model's predictions, teacher-forced over real text.

The model reads the same tokens through the exact cache and through the cache kind under test: a short
prefill, then one token per step, always the text's own next token, so both see the same history and every
step compares like with like. At each step the two next-token distributions are compared: top-1 agreement,
mean KL(exact || lossy), the largest logit difference, and the perplexity of the text under each (their
ratio is the headline figure). `python -m infer quality` prints the table for any model and cache kinds
and writes JSON; the test suite asserts each lossy kind's registered bounds from the same measurement.

Texts that ship with the package (`TEXTS`): English prose (the first chapters of *Pride and Prejudice*,
public domain, from Debian's `r-cran-janeaustenr`) and Python code (a frozen copy of one of this project's
modules); or any UTF-8 file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from infer.cache import CACHE_KINDS, create_cache
from infer.models import Transformer
from infer.tokenizer import Tokenizer

TEXT_DIR = Path(__file__).parent / "texts"
TEXTS = {"prose": TEXT_DIR / "pride_and_prejudice.txt", "code": TEXT_DIR / "code_sample.py.txt"}
EXACT_REFERENCE = "contiguous"


@dataclass(frozen=True)
class KindQuality:
    """One cache kind against the exact cache over the same tokens."""

    kind: str
    steps: int  # next-token predictions compared
    top1_agreement: float
    mean_kl: float  # KL(exact || kind), nats per step
    max_logit_error: float
    perplexity: float  # of the text under this kind
    perplexity_ratio: float  # over the exact cache's
    cache_bytes: int
    bytes_ratio: float  # over the exact cache's


def load_text(text: str) -> str:
    """A shipped text by name (`TEXTS`) or a UTF-8 file's contents."""
    path = TEXTS.get(text, Path(text))
    if not path.is_file():
        raise FileNotFoundError(f"text {text!r} is neither one of {', '.join(TEXTS)} nor a file")
    return path.read_text(encoding="utf-8")


def text_ids(tokenizer: Tokenizer, text: str, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of `text` (with the tokenizer's BOS, as a model reads a document)."""
    ids = tokenizer.encode(text)
    if len(ids) < num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {num_tokens} asked for; "
                         "use a longer text or fewer tokens")
    return ids[:num_tokens]


def _check_prefill(ids: Sequence[int], prefill: int) -> None:
    if not 1 <= prefill < len(ids):
        raise ValueError(f"prefill must lie in [1, {len(ids) - 1}] for {len(ids)} tokens, got {prefill}")


def teacher_forced_logits(model: Transformer, kind: str, ids: Sequence[int], prefill: int
                          ) -> tuple[torch.Tensor, int]:
    """fp32 logits `[len(ids) - prefill, vocab]` predicting `ids[prefill:]`: `prefill` tokens at once, then
    one per step through a fresh cache of `kind`; and the cache's bytes."""
    _check_prefill(ids, prefill)
    device, dtype = model.device, model.dtype
    cache = create_cache(kind, model.config, max_seq_len=len(ids), dtype=dtype, device=device)
    tokens = torch.tensor([list(ids)], device=device)
    with torch.inference_mode():
        steps = [model(tokens[:, :prefill], cache)[0, -1]]
        steps += [model(tokens[:, t : t + 1], cache)[0, -1] for t in range(prefill, len(ids) - 1)]
    return torch.stack(steps).float().cpu(), cache.memory_bytes


def one_pass_logits(model: Transformer, ids: Sequence[int], prefill: int) -> tuple[torch.Tensor, int]:
    """`teacher_forced_logits` through the exact contiguous cache in one forward pass over the text, and the cache's
    bytes. In fp32 the same logits to rounding (8e-5 of logits up to 43 over 256 tokens of SmolLM2-135M) at the cost
    of a prefill, not one weight read a token; in half precision a pass rounds otherwise than one-token steps."""
    _check_prefill(ids, prefill)
    cache = create_cache(EXACT_REFERENCE, model.config, max_seq_len=len(ids), dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids[:-1])], device=model.device), cache, all_logits=True)[0, prefill - 1:]
    return logits.float().cpu(), cache.memory_bytes


def compare(kind: str, exact: torch.Tensor, lossy: torch.Tensor, targets: torch.Tensor, cache_bytes: int,
            exact_bytes: int) -> KindQuality:
    """The figures of `lossy` logits against `exact` ones `[steps, vocab]`, both predicting `targets`."""
    exact_logp, lossy_logp = exact.log_softmax(-1), lossy.log_softmax(-1)
    kl = F.kl_div(lossy_logp, exact_logp, log_target=True, reduction="none").sum(-1)
    exact_nll = -exact_logp.gather(-1, targets[:, None]).mean().item()
    lossy_nll = -lossy_logp.gather(-1, targets[:, None]).mean().item()
    return KindQuality(
        kind=kind,
        steps=targets.shape[0],
        top1_agreement=(exact.argmax(-1) == lossy.argmax(-1)).float().mean().item(),
        mean_kl=kl.mean().item(),
        max_logit_error=(exact - lossy).abs().max().item(),
        perplexity=math.exp(lossy_nll),
        perplexity_ratio=math.exp(lossy_nll - exact_nll),
        cache_bytes=cache_bytes,
        bytes_ratio=cache_bytes / exact_bytes,
    )


def measure(model: Transformer, ids: Sequence[int], kinds: Sequence[str], prefill: int = 16,
            progress: bool = False) -> list[KindQuality]:
    """Each of `kinds` against the exact contiguous cache, teacher-forced over `ids` (`progress`: a bar on
    stderr, one step per kind)."""
    unknown = [k for k in kinds if k not in CACHE_KINDS]
    if unknown:
        raise ValueError(f"unknown cache kind(s) {', '.join(unknown)}; available: {', '.join(sorted(CACHE_KINDS))}")
    bar = tqdm(total=len(kinds) + 1, desc="quality", unit="kind", disable=not progress)
    bar.set_postfix_str(EXACT_REFERENCE)
    # Every kind runs the same per-layer step, so only the cache differs: the whole-step native call serves the
    # contiguous and sliding kinds only and sums attention in its own order (infer/models/native_step.py).
    whole_step, model.native_step = model.native_step, False
    try:
        exact, exact_bytes = teacher_forced_logits(model, EXACT_REFERENCE, ids, prefill)
        bar.update()
        targets = torch.tensor(list(ids[prefill:]))
        results = []
        for kind in kinds:
            bar.set_postfix_str(kind)
            lossy, nbytes = (exact, exact_bytes) if kind == EXACT_REFERENCE else teacher_forced_logits(
                model, kind, ids, prefill)
            results.append(compare(kind, exact, lossy, targets, nbytes, exact_bytes))
            bar.update()
    finally:
        model.native_step = whole_step
    bar.close()
    return results


def weight_bytes(model: Transformer) -> int:
    """Bytes of the weights a decode step reads: every parameter and quantized buffer, the embedding only where it
    is the tied LM head (stored once)."""
    stored = [*model.named_parameters(), *model.named_buffers()]
    tied = model.config.tie_word_embeddings
    return sum(t.nbytes for name, t in stored if tied or not name.startswith("embed_tokens"))


def measure_weights(reference: Transformer, models: dict[str, Transformer], ids: Sequence[int], prefill: int = 16,
                    progress: bool = False) -> list[KindQuality]:
    """Each of `models` (the same checkpoint with its weights stored otherwise: int8, int4, a GGUF file's types)
    against `reference` (the dense weights), teacher-forced over `ids` through exact caches; the bytes columns
    are the weights' (`weight_bytes`). An fp32 reference reads the text in one pass (`one_pass_logits`): every
    model here computes with other weights, so no row is exact to the bit in any case."""
    bar = tqdm(total=len(models) + 1, desc="quality", unit="model", disable=not progress)
    if reference.dtype == torch.float32:
        exact, _ = one_pass_logits(reference, ids, prefill)
    else:
        exact, _ = teacher_forced_logits(reference, EXACT_REFERENCE, ids, prefill)
    exact_bytes = weight_bytes(reference)
    bar.update()
    targets = torch.tensor(list(ids[prefill:]))
    rows = []
    for label, model in models.items():
        bar.set_postfix_str(label)
        lossy, _ = teacher_forced_logits(model, EXACT_REFERENCE, ids, prefill)
        rows.append(compare(label, exact, lossy, targets, weight_bytes(model), exact_bytes))
        bar.update()
    bar.close()
    return rows


def format_quality(rows: Sequence[KindQuality]) -> str:
    """The table a person reads."""
    head = f"{'cache':>10}  {'top-1':>6}  {'mean KL':>9}  {'max |dlogit|':>12}  {'ppl':>8}  {'ppl ratio':>9}  " \
           f"{'bytes':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.kind:>10}  {r.top1_agreement:6.3f}  {r.mean_kl:9.2e}  {r.max_logit_error:12.3f}  "
                     f"{r.perplexity:8.3f}  {r.perplexity_ratio:9.4f}  {r.bytes_ratio:5.2f}x")
    return "\n".join(lines)


def as_json(rows: Sequence[KindQuality]) -> list[dict[str, object]]:
    """The rows as JSON-ready dicts."""
    return [asdict(r) for r in rows]
