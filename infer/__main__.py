"""Command line: `python -m infer generate PROMPT` (and `bench`, see `infer.bench`)."""

from __future__ import annotations

import argparse
import sys

from infer.bench import add_bench_parser
from infer.cache import CACHE_KINDS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped small model)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--compute-dtype", default="auto",
                   help="dtype of prefill matmuls: auto (float32 for half weights on CPU), exact, or a dtype")


def _generate(args: argparse.Namespace) -> int:
    import torch

    from infer.generation import generate
    from infer.loader import DEFAULT_MODEL_DIR, load_model
    from infer.sampling import SamplingParams
    from infer.tokenizer import Tokenizer

    path = args.model or DEFAULT_MODEL_DIR
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(path, dtype=args.dtype, device=args.device, compute_dtype=args.compute_dtype)
    tokenizer = Tokenizer(path)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if not args.chat:
        print(args.prompt, end="", flush=True)
    result = generate(
        model,
        tokenizer,
        prompt,
        params,
        cache=args.cache,
        use_kv_cache=not args.no_kv_cache,
        on_text=lambda piece: print(piece, end="", flush=True),
    )
    print(flush=True)
    print(
        f"[{len(result.prompt_ids)} prompt tokens, {len(result.token_ids)} generated ({result.finish_reason}), "
        f"time to first token {result.time_to_first_token_s * 1000:.1f} ms, "
        f"decode {result.decode_tokens_per_s:.1f} tok/s, cache {'off' if args.no_kv_cache else args.cache}]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m infer`."""
    parser = argparse.ArgumentParser(prog="python -m infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it")
    gen.add_argument("prompt", help="the prompt text (a user message with --chat)")
    _add_model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--cache", default="contiguous", choices=sorted(CACHE_KINDS), help="KV-cache kind")
    gen.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    gen.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    gen.set_defaults(run=_generate)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m infer` and the `infer` script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
