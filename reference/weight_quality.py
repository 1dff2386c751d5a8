"""Quantized weights on a real model, ours beside llama.cpp's, on the same text in one run.

From SmolLM2-135M-Instruct's GGUF (Q4_1 blocks, a Q8_0 embedding) the dense weights are taken as the reference
(their dequantization, fp32). From them: our int8 and int4 (load_model(weights=...)), and llama.cpp's own
quantizer (llama_model_quantize, from an F32 GGUF of those dense weights) writes Q8_0, Q4_0, Q4_1 and Q4_K_M
files, which we run as stored and llama.cpp runs with its kernels. Every row is teacher-forced over the text
through exact caches and scored against its own engine's dense run: top-1 agreement, mean KL, perplexity ratio.

    python -m reference.weight_quality [--text prose,code] [--tokens 512]

Needs llama-cpp-python (`pip install -e ".[llamacpp]"`).
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch

import infer
from infer.model_store import default_model_path
from infer.quality import KindQuality, compare, load_text, measure_weights, text_ids, weight_bytes
from reference.gguf_convert import hf_to_gguf
from reference.llamacpp_quality import llamacpp_logits

# llama.cpp's file types (llama_ftype) by the name its tools print.
LLAMACPP_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                   "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def llamacpp_quantize(source: Path, out: Path, ftype: str, threads: int) -> Path:
    """`source` (an F32 GGUF) written by llama.cpp's own quantizer as `ftype` (a key of LLAMACPP_FTYPES)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMACPP_FTYPES[ftype])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table: ours (int8, int4, each llama.cpp file as stored) and llama.cpp on the same files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct from the store)")
    parser.add_argument("--text", default="prose,code")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--threads", type=int, default=max(torch.get_num_threads(), 1))
    args = parser.parse_args(argv)
    source = Path(args.model) if args.model else default_model_path()
    work = Path(tempfile.mkdtemp(prefix="weight-quality-"))
    dense = infer.load_model(source, dtype="float32", weights="dense")
    checkpoint = infer.save_quantized(dense, work / "dense")  # the dequantized weights as a checkpoint folder
    f32 = hf_to_gguf(checkpoint, work / "f32.gguf", "F32")
    files = {kind: llamacpp_quantize(f32, work / f"{kind}.gguf", kind, args.threads) for kind in LLAMACPP_FTYPES}
    tokenizer = infer.Tokenizer(source)
    ours = {"int8": infer.load_model(checkpoint, weights="int8"), "int4 (g32)": infer.load_model(
        checkpoint, weights="int4", group_size=32), "int4 (g64)": infer.load_model(checkpoint, weights="int4",
                                                                                  group_size=64)}
    ours.update({f"{kind} file": infer.load_model(file) for kind, file in files.items()})
    sizes = {label: weight_bytes(model) / 2**20 for label, model in ours.items()}
    print(f"dense weights {weight_bytes(dense) / 2**20:.0f} MiB (fp32); each row against its engine's dense run")
    print("| text | weights | MiB | ours top-1 | ours KL | ours ppl ratio | llama.cpp top-1 | llama.cpp KL | "
          "llama.cpp ppl ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for text in [t for t in args.text.split(",") if t]:
        ids = text_ids(tokenizer, load_text(text), args.tokens)
        rows = {r.kind: r for r in measure_weights(dense, ours, ids, args.prefill, progress=True)}
        targets = torch.tensor(ids[args.prefill:])
        theirs_dense = llamacpp_logits(f32, ids, args.prefill, "f16", args.threads)
        theirs: dict[str, KindQuality] = {}
        for kind, file in files.items():
            logits = llamacpp_logits(file, ids, args.prefill, "f16", args.threads)
            theirs[f"{kind} file"] = compare(kind, theirs_dense, logits, targets, 0, 1)
        for label, row in rows.items():
            other = theirs.get(label)
            tail = (f"{other.top1_agreement:.3f} | {other.mean_kl:.2e} | {other.perplexity_ratio:.4f}" if other
                    else "| |")
            print(f"| {text} | {label} | {sizes[label]:.0f} | {row.top1_agreement:.3f} | {row.mean_kl:.2e} | "
                  f"{row.perplexity_ratio:.4f} | {tail} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
