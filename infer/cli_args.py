"""The command-line options `generate` and `bench` share, and their checks: one definition, so the two
subcommands take the same names with the same meaning and refuse the same bad values.

`add_model_args` adds the options, `check_model_args` refuses bad ones before anything loads (so a mistake
costs no model load), `load_with_args` loads the model as they ask. Both `infer.__main__` and the bench modules
build on this module; it imports neither of them, so they never import each other for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infer.models import Transformer


def add_model_args(p: argparse.ArgumentParser, dtype: str) -> None:
    """Add the options `generate` and `bench` share, under the same names; `dtype` is the --dtype default."""
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct, "
                   "fetched once by `python -m infer fetch`)")
    p.add_argument("--dtype", default=dtype, help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--compute-dtype", default="auto",
                   help="dtype of prefill matmuls: auto (float32 for half weights on CPU), exact, or a dtype")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0: the faster of 1 and all, timed on this model at load; bench --batched: all)")
    p.add_argument("--decode-gemv", default="auto", choices=["auto", "linear", "mv", "native", "triton"],
                   help="kernel of one-token products (auto: the fastest, timed on this model's weights at load)")
    p.add_argument("--native-prefetch", default="auto", choices=["auto", "l1", "l2"],
                   help="where the native kernels prefetch weights and KV blocks: the L1 or the L2 cache (auto: the "
                        "faster, timed on this model's weights at load)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="keep CPU weights and the batched engine's KV pool on ordinary pages (default: transparent"
                        " huge pages where the kernel has them)")
    p.add_argument("--no-native-ops", action="store_true",
                   help="run a one-token step's norms, rotations and activation, and the batched engine's norms, "
                        "rotations and K/V writes, as PyTorch ops, not native calls")
    p.add_argument("--no-native-step", action="store_true",
                   help="run a one-token step layer by layer (the per-op path), not every layer in one native call")
    p.add_argument("--no-few-row-products", action="store_true",
                   help="run bf16 products of 2-64 rows (the batched engine's decode steps) through F.linear, not "
                        "the native few-row kernel")
    p.add_argument("--weights", default="auto", choices=["auto", "int8", "int4", "stored", "dense"],
                   help="storage of the projections: int8 / int4 quantize at load, stored keeps a GGUF file's or a "
                        "quantized checkpoint's codes, dense dequantizes (auto: stored where the file is quantized)")
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128],
                   help="inputs per scale of --weights int4")
    p.add_argument("--int8-activations", action="store_true",
                   help="one request's products on 4-bit codes with their input quantized to int8 per 32 values, as "
                        "llama.cpp runs its files (lossy; integer multiply-adds: VNNI, AVX2)")
    p.add_argument("--seed", type=int, default=None, help="random seed")


def check_model_args(args: argparse.Namespace) -> Path | None:
    """Check --model, --dtype, --compute-dtype, --device, --threads and --decode-gemv before anything loads; the
    model's path."""
    from infer.errors import CheckpointError
    from infer.loader import resolve_dtype
    from infer.memory import resolve_device

    resolve_dtype(args.dtype)
    if args.compute_dtype not in ("auto", "exact"):
        resolve_dtype(args.compute_dtype)
    resolve_device(args.device)
    if getattr(args, "threads", 0) < 0:
        raise ValueError(f"--threads must be >= 0 (0: chosen by timing), got {args.threads}")
    if args.decode_gemv == "native":
        from infer.kernels.native import native_kernels, unavailable_reason

        if native_kernels() is None:
            raise ValueError(f"--decode-gemv native is unavailable here: {unavailable_reason()}; use auto")
    if args.model is None:
        return None
    path = Path(args.model)
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise CheckpointError(f"--model {path} is a file; pass the checkpoint directory that holds it (or a .gguf)")
    if not path.is_dir() and not path.is_file():
        hub = "/" in args.model and not Path(args.model.split("/")[0]).exists()
        raise CheckpointError(
            f"--model {args.model}: no such directory"
            + ("; only local checkpoint directories are read (download hub models first)" if hub else "")
        )
    return path


def load_with_args(path: Path, args: argparse.Namespace) -> Transformer:
    """The model as the shared options ask (`generate` and `bench` load it the same way)."""
    from infer.loader import load_model
    from infer.tensor_parallel import init_from_env

    weights = getattr(args, "weights", "auto")
    # (--packed-products off: nor the quantized products' codes packed at load for one request)
    unpacked = getattr(args, "no_packed_products", False) or getattr(args, "packed_products", "auto") == "off"
    # Under `torchrun --nproc-per-node N` each rank loads its shard (infer/tensor_parallel.py).
    shards = init_from_env(args.device)
    model = load_model(path, dtype=args.dtype, device=args.device, compute_dtype=args.compute_dtype,
                       decode_gemv=args.decode_gemv, native_prefetch=args.native_prefetch,
                       huge_pages=not args.no_huge_pages,
                       weights="stored" if weights == "auto" else weights, group_size=getattr(args, "group_size", 32),
                       tensor_parallel=shards is not None, packed_products=False if unpacked else None)
    if getattr(args, "int8_activations", False):
        model.quantize_activations()
    model.native_ops = not args.no_native_ops
    model.native_step = not args.no_native_step
    if getattr(args, "no_few_row_products", False):
        model.gemm_rows = 1
    return model
