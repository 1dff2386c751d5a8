"""Train the tiny default checkpoint that ships in ``infer/default_model``.

``python -m infer generate "Once upon a time"`` has to work on a fresh machine with no network and no
model argument, so the project ships a very small Llama-architecture checkpoint in Hugging Face format.
This script is how that checkpoint was made; rerun it with::

    apt-get install r-cran-janeaustenr          # the corpus (see below)
    python -m reference.train_default_model --out infer/default_model --minutes 12

Corpus
    Jane Austen's six completed novels (Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma,
    Northanger Abbey, Persuasion), about 4 MB of English prose. The texts are in the public domain (Austen
    died in 1817; these are the Project Gutenberg transcriptions). They come from the Debian package
    ``r-cran-janeaustenr`` (the CRAN package ``janeaustenr`` by Julia Silge, whose packaging code is MIT
    licensed). R itself is *not* needed: this script reads the package's lazy-load data base
    (``data/Rdata.rdb`` / ``Rdata.rdx``) with a small built-in reader of R's serialization format. To get
    the files without installing R's dependencies::

        apt-get download r-cran-janeaustenr
        dpkg-deb -x r-cran-janeaustenr_*.deb /tmp/janeausten
        python -m reference.train_default_model \\
            --corpus-dir /tmp/janeausten/usr/lib/R/site-library/janeaustenr ...

Pipeline
    1. Read the novels, join wrapped lines into paragraphs, drop chapter/volume headings and Gutenberg's
       ``_italic_`` underscores.
    2. Train a byte-level BPE tokenizer (``tokenizers``) with Llama 3 style special tokens; a
       ``TemplateProcessing`` post-processor prepends ``<|begin_of_text|>``.
    3. Train a small ``LlamaForCausalLM`` (tied embeddings, grouped-query attention) with AdamW and a
       warm-up + cosine learning-rate schedule on the CPU, for a wall-clock budget (``--minutes``) or a
       fixed number of steps (``--steps``, fully deterministic). Every training window starts at a
       paragraph boundary right after ``<|begin_of_text|>``, which is what a fresh prompt looks like.
    4. Save ``config.json``, ``model.safetensors`` (bfloat16), ``tokenizer.json``,
       ``tokenizer_config.json`` (with a Llama 3 header-style chat template), ``generation_config.json``
       and a ``README.md`` describing the run; nothing else is left in the output directory.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import platform
import random
import re
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT]

# Llama 3 header-style chat template. The tokenizer's post-processor already adds BOS when encoding plain
# text; `apply_chat_template` encodes without special tokens, so the template writes BOS itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

DEFAULT_CORPUS_DIR = Path("/usr/lib/R/site-library/janeaustenr")
# Object names in janeaustenr's data base, in publication order.
NOVELS = [
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
]
KEEP_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
}


# --------------------------------------------------------------------------------------------------------
# Corpus: a minimal reader for R's XDR serialization format (enough for janeaustenr's character vectors).
# --------------------------------------------------------------------------------------------------------

_NILVALUE_SXP = 254
_REFSXP = 255
_ENV_LIKE_SXPS = {253, 252, 251, 250, 242, 241}  # global/unbound/missing/base namespace/empty/base env
_ALTREP_SXP = 238
_ATTRLISTSXP = 239
_ATTRLANGSXP = 240
_SYMSXP = 1
_LISTSXP = 2
_LANGSXP = 6
_CHARSXP = 9
_LGLSXP = 10
_INTSXP = 13
_REALSXP = 14
_STRSXP = 16
_VECSXP = 19
_NA_INTEGER = -(2**31)


@dataclass
class RPairList:
    """An R pairlist, flattened to parallel lists of tags and values."""

    tags: list[str | None]
    values: list[Any]


class _RUnserializer:
    """Decodes one object serialized by R's ``serialize(xdr = TRUE)``."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return int(value)

    def _bytes(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def read(self) -> Any:
        if self._bytes(2) != b"X\n":
            raise ValueError("not an R XDR serialization stream")
        version = self._int()
        self._int()  # R version that wrote it
        self._int()  # minimal R version to read it
        if version == 3:
            self._bytes(self._int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")
        return self._item()

    def _attributes(self, flags: int) -> Any:
        return self._item() if flags & (1 << 9) else None

    def _item(self) -> Any:
        flags = self._int()
        sxp = flags & 0xFF
        if sxp == _NILVALUE_SXP or sxp in _ENV_LIKE_SXPS:
            return None
        if sxp == _REFSXP:
            index = flags >> 8
            return self.refs[(index if index else self._int()) - 1]
        if sxp == _SYMSXP:
            name = self._item()
            self.refs.append(name)
            return name
        if sxp in (_LISTSXP, _LANGSXP, _ATTRLISTSXP, _ATTRLANGSXP):
            tags: list[str | None] = []
            values: list[Any] = []
            while True:
                self._attributes(flags)
                tags.append(self._item() if flags & (1 << 10) else None)
                values.append(self._item())
                flags = self._int()
                if flags & 0xFF not in (_LISTSXP, _LANGSXP, _ATTRLISTSXP, _ATTRLANGSXP):
                    # The tail is NULL for a proper pairlist; anything else is not produced here.
                    if flags & 0xFF != _NILVALUE_SXP:
                        raise ValueError("improper pairlist")
                    return RPairList(tags, values)
        if sxp == _CHARSXP:
            length = self._int()
            return None if length == -1 else self._bytes(length).decode("utf-8")
        if sxp in (_LGLSXP, _INTSXP):
            n = self._int()
            ints = [int(v) for v in struct.unpack_from(f">{n}i", self.data, self.pos)]
            self.pos += 4 * n
            self._attributes(flags)
            return [None if v == _NA_INTEGER else v for v in ints]
        if sxp == _REALSXP:
            n = self._int()
            reals = [float(v) for v in struct.unpack_from(f">{n}d", self.data, self.pos)]
            self.pos += 8 * n
            self._attributes(flags)
            return reals
        if sxp in (_STRSXP, _VECSXP):
            n = self._int()
            items = [self._item() for _ in range(n)]
            attributes = self._attributes(flags)
            if sxp == _VECSXP and isinstance(attributes, RPairList) and "names" in attributes.tags:
                names = attributes.values[attributes.tags.index("names")]
                return dict(zip(names, items, strict=True))
            return items
        if sxp == _ALTREP_SXP:
            raise ValueError("ALTREP objects are not supported by this reader")
        raise ValueError(f"unsupported R object type {sxp}")


def read_lazyload_db(package_dir: Path) -> dict[str, Any]:
    """Read every object of an installed R package's lazy-load data base (``data/Rdata.rd[bx]``)."""
    index = _RUnserializer(gzip.decompress((package_dir / "data" / "Rdata.rdx").read_bytes())).read()
    blob = (package_dir / "data" / "Rdata.rdb").read_bytes()
    objects: dict[str, Any] = {}
    for name, (offset, length) in index["variables"].items():
        record = blob[offset : offset + length]
        # Each record is a 4-byte big-endian uncompressed length followed by a zlib stream.
        objects[name] = _RUnserializer(zlib.decompress(record[4:])).read()
    return objects


_HEADING = re.compile(r"^(CHAPTER|Chapter|VOLUME|Volume)\b[\w .]*$")
_END = re.compile(r"^(THE END|FINIS|Finis|A NOTE ON THE TEXT)\.?$")


def novel_paragraphs(lines: list[str | None]) -> list[str]:
    """Join a novel's wrapped lines into paragraphs.

    Keeps the story only: from the first chapter heading up to "THE END"/"FINIS" (dropping the title page,
    a preface, an editor's note and footnotes), without chapter/volume headings and ``_`` italics marks.
    """
    paragraphs: list[str] = []
    current: list[str] = []
    started = False
    for raw in [*lines, ""]:
        line = (raw or "").strip()
        if line:
            current.append(line)
            continue
        if not current:
            continue
        text = re.sub(r"\s+", " ", " ".join(current).replace("_", "")).strip()
        current = []
        if _END.match(text):
            break
        if _HEADING.match(text):
            started = True
        elif started and not text.startswith("*"):
            paragraphs.append(text)
    return paragraphs


def load_corpus(corpus_dir: Path) -> list[list[str]]:
    """Return the six novels as lists of paragraphs."""
    if not (corpus_dir / "data" / "Rdata.rdb").is_file():
        sys.exit(
            f"janeaustenr data not found under {corpus_dir}.\n"
            "Install it with `apt-get install r-cran-janeaustenr`, or unpack the .deb "
            "(`apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb DIR`) and pass "
            "--corpus-dir DIR/usr/lib/R/site-library/janeaustenr."
        )
    objects = read_lazyload_db(corpus_dir)
    return [novel_paragraphs(objects[name]) for name in NOVELS]


# --------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------


def special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise KeyError(f"{token} is not in the vocabulary")
    return int(token_id)


def train_tokenizer(novels: list[list[str]], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose post-processor prepends BOS, like Llama 3's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(("\n\n".join(novel) for novel in novels), trainer=trainer)
    bos_id = special_id(tokenizer, BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A:0",
        pair=f"{BOS} $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


@dataclass
class EncodedCorpus:
    """The corpus as one token stream plus the offsets where paragraphs start."""

    ids: torch.Tensor
    paragraph_starts: np.ndarray


def encode_corpus(tokenizer: Tokenizer, novels: list[list[str]]) -> EncodedCorpus:
    """Encode paragraphs one by one (each starts like a prompt), joined by "\\n\\n"; novels end in EOS."""
    separator = tokenizer.encode("\n\n", add_special_tokens=False).ids
    eos_id = special_id(tokenizer, EOS)
    ids: list[int] = []
    starts: list[int] = []
    for novel in novels:
        encodings = tokenizer.encode_batch(novel, add_special_tokens=False)
        for i, encoding in enumerate(encodings):
            starts.append(len(ids))
            ids.extend(encoding.ids)
            ids.extend(separator if i + 1 < len(encodings) else [eos_id])
    return EncodedCorpus(torch.tensor(ids, dtype=torch.long), np.asarray(starts, dtype=np.int64))


# --------------------------------------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, tokenizer: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=special_id(tokenizer, BOS),
        eos_token_id=special_id(tokenizer, EOS),
        initializer_range=0.02,
    )
    return LlamaForCausalLM(config)


def make_batch(
    corpus: EncodedCorpus,
    starts: np.ndarray,
    batch_size: int,
    seq_len: int,
    bos_id: int,
    rng: np.random.Generator,
) -> torch.Tensor:
    """Sample `batch_size` windows, each BOS followed by `seq_len - 1` tokens from a paragraph start."""
    picks = rng.choice(starts, size=batch_size)
    bos = torch.full((1,), bos_id, dtype=torch.long)
    rows = [torch.cat([bos, corpus.ids[int(s) : int(s) + seq_len - 1]]) for s in picks]
    return torch.stack(rows)


def learning_rate(progress: float, peak: float, warmup_fraction: float, floor: float) -> float:
    """Linear warm-up then cosine decay to `floor * peak`, as a function of training progress in [0, 1]."""
    if progress < warmup_fraction:
        return peak * progress / warmup_fraction
    decay = min(1.0, (progress - warmup_fraction) / (1.0 - warmup_fraction))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * decay)))


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM,
    corpus: EncodedCorpus,
    starts: np.ndarray,
    args: argparse.Namespace,
    bos_id: int,
) -> float:
    """Mean loss on a fixed set of held-out windows."""
    model.eval()
    rng = np.random.default_rng(args.seed + 1)
    losses = []
    for _ in range(args.eval_batches):
        batch = make_batch(corpus, starts, args.batch_size, args.seq_len, bos_id, rng)
        losses.append(float(model(input_ids=batch, labels=batch).loss))
    model.train()
    return sum(losses) / len(losses)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    train_loss: float
    val_loss: float
    tokens_seen: int


def train(
    model: LlamaForCausalLM, corpus: EncodedCorpus, args: argparse.Namespace, bos_id: int
) -> TrainResult:
    # Hold out the last paragraphs (the end of Persuasion) for validation; keep a gap of one window.
    n_val = max(1, int(len(corpus.paragraph_starts) * args.val_fraction))
    val_starts = corpus.paragraph_starts[-n_val:]
    val_starts = val_starts[val_starts + args.seq_len <= len(corpus.ids)]
    limit = int(val_starts[0]) - args.seq_len
    train_starts = corpus.paragraph_starts[corpus.paragraph_starts < limit]

    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60.0
    start = time.monotonic()
    ema: float | None = None
    step = 0
    model.train()
    total = args.steps if args.steps else None
    with tqdm(total=total or int(budget), unit="step" if total else "s", dynamic_ncols=True) as bar:
        while True:
            elapsed = time.monotonic() - start
            progress = step / args.steps if args.steps else elapsed / budget
            if progress >= 1.0:
                break
            lr = learning_rate(progress, args.lr, args.warmup_fraction, args.min_lr_fraction)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = make_batch(corpus, train_starts, args.batch_size, args.seq_len, bos_id, rng)
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            value = loss.detach().item()
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            if total:
                bar.update(1)
            else:
                bar.n = min(int(time.monotonic() - start), int(budget))
                bar.refresh()
            bar.set_postfix(step=step, loss=f"{ema:.3f}", lr=f"{lr:.2e}")
    seconds = time.monotonic() - start
    val_loss = evaluate(model, corpus, val_starts, args, bos_id)
    assert ema is not None, "training ran zero steps"
    return TrainResult(step, seconds, ema, val_loss, step * args.batch_size * args.seq_len)


# --------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------


def save_checkpoint(
    out: Path, model: LlamaForCausalLM, tokenizer: Tokenizer, args: argparse.Namespace
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bos_id = special_id(tokenizer, BOS)
    eos_id = special_id(tokenizer, EOS)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        do_sample=True,
        temperature=0.8,
        top_k=40,
        top_p=1.0,
    )
    model.bfloat16()
    model.save_pretrained(out)  # always safetensors in transformers >= 5

    # Also spell rope_theta at the top level, as Llama 3 checkpoints on the Hub do (transformers 5 writes
    # only `rope_parameters`), so that readers of either layout find it.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = float(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(special_id(tokenizer, tok)): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    for path in out.iterdir():
        if path.is_dir():
            raise SystemExit(f"unexpected directory in output: {path}")
        if path.name in KEEP_FILES:
            path.chmod(0o644)  # transformers writes model.safetensors as 0600
        else:
            path.unlink()


def write_readme(
    out: Path,
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    corpus: EncodedCorpus,
    n_chars: int,
    result: TrainResult,
    command: str,
) -> None:
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    sizes = "\n".join(
        f"| `{p.name}` | {p.stat().st_size:,} |" for p in sorted(out.iterdir()) if p.name != "README.md"
    )
    text = f"""# Default checkpoint

A deliberately tiny Llama-architecture language model in Hugging Face format, shipped so that
`python -m infer generate "Once upon a time"` works on a fresh machine with no model argument and no
network. It writes English-looking prose in the manner of Jane Austen (words, punctuation, dialogue), not
sense: it is a smoke-test model, not a useful one.

## Corpus

Jane Austen's six completed novels (*Sense and Sensibility*, *Pride and Prejudice*, *Mansfield Park*,
*Emma*, *Northanger Abbey*, *Persuasion*): {n_chars:,} characters in {len(corpus.paragraph_starts):,}
paragraphs, {len(corpus.ids):,} tokens. The texts are in the **public domain** (Project Gutenberg
transcriptions; Austen died in 1817). They were taken from the Debian package `r-cran-janeaustenr`
(`apt-get install r-cran-janeaustenr`; the CRAN package `janeaustenr` by Julia Silge, MIT-licensed
packaging). R is not needed: the training script reads the package's data base directly. The last
{args.val_fraction:.0%} of the paragraphs (the end of *Persuasion*) are held out for validation.

## Model

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`, tied input/output embeddings |
| parameters | {n_params:,} |
| vocabulary | {tokenizer.get_vocab_size():,} (byte-level BPE; specials `{"`, `".join(SPECIAL_TOKENS)}`) |
| hidden size | {cfg.hidden_size} |
| layers | {cfg.num_hidden_layers} |
| heads / KV heads / head dim | {cfg.num_attention_heads} / {cfg.num_key_value_heads} / {cfg.head_dim} |
| MLP intermediate size | {cfg.intermediate_size} (SiLU-gated) |
| max positions | {cfg.max_position_embeddings} (RoPE, theta 10000) |
| weights dtype | bfloat16 |

The tokenizer prepends `<|begin_of_text|>` to every encoding; generation stops at `<|end_of_text|>`.
`tokenizer_config.json` carries a Llama 3 header-style chat template, although the model was never
trained on chat data. `generation_config.json` asks for sampling at temperature 0.8 with top-k 40.

## Training

| | |
| --- | --- |
| command | `{command}` |
| machine | 2-core {platform.machine()} CPU shared with other work, `torch.set_num_threads({args.threads})`, \
torch {torch.__version__} |
| wall-clock | {result.seconds / 60:.1f} minutes, {result.steps:,} steps |
| batch | {args.batch_size} x {args.seq_len} tokens; {result.tokens_seen:,} tokens seen \
({result.tokens_seen / len(corpus.ids):.1f} epochs) |
| optimizer | AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr {args.lr}, \
{args.warmup_fraction:.0%} warm-up, cosine to {args.min_lr_fraction:.0%}, gradient clip 1.0 |
| final training loss | {result.train_loss:.3f} (moving average) |
| validation loss | {result.val_loss:.3f} |
| seed | {args.seed} |

Training for a wall-clock budget (`--minutes`) is not bit-reproducible across machines; pass `--steps N`
for a run that depends only on the seed (1 and 2 threads gave the same losses in a short check). `--threads`
defaults to 2; on a 2-core machine busy with other work one thread is several times faster, because two
OpenMP threads spin-wait against the other load. `--corpus-dir` points at the unpacked
`r-cran-janeaustenr` package (see the script's docstring); once the package is installed with apt the
default path works and the flag can be left out.

## Files

| file | bytes |
| --- | --- |
{sizes}
"""
    (out / "README.md").write_text(text)


# --------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("infer/default_model"))
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS_DIR)
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget")
    parser.add_argument("--steps", type=int, default=0, help="train for exactly N steps instead")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--intermediate", type=int, default=576)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-fraction", type=float, default=0.03)
    parser.add_argument("--min-lr-fraction", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    novels = load_corpus(args.corpus_dir)
    n_chars = sum(len(p) for novel in novels for p in novel)
    print(f"corpus: {sum(map(len, novels)):,} paragraphs, {n_chars:,} characters", flush=True)

    tokenizer = train_tokenizer(novels, args.vocab_size)
    corpus = encode_corpus(tokenizer, novels)
    print(f"tokenizer: vocab {tokenizer.get_vocab_size():,}; corpus {len(corpus.ids):,} tokens", flush=True)

    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    result = train(model, corpus, args, special_id(tokenizer, BOS))
    print(
        f"done: {result.steps} steps in {result.seconds / 60:.1f} min; "
        f"train loss {result.train_loss:.3f}, val loss {result.val_loss:.3f}",
        flush=True,
    )

    save_checkpoint(args.out, model, tokenizer, args)
    command = " ".join(["python -m reference.train_default_model", *(sys.argv[1:] if argv is None else argv)])
    write_readme(args.out, args, model, tokenizer, corpus, n_chars, result, command)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
