"""Command line: `python -m infer generate PROMPT` (and `bench`, see `infer.bench`).

Every error ends the program with one line on stderr and a non-zero exit, never a traceback: 2 for bad
arguments or inputs, 1 for anything else, 130 for Ctrl-C (what was generated stays printed), 141 when the
reader of stdout goes away (a closed pipe). Arguments are all checked before the model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

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

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    path = check_model_args(args) or DEFAULT_MODEL_DIR
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(path, dtype=args.dtype, device=args.device, compute_dtype=args.compute_dtype)
    tokenizer = Tokenizer(path)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if not args.chat:
        _print_piece(args.prompt)
    result = generate(
        model,
        tokenizer,
        prompt,
        params,
        cache=args.cache,
        use_kv_cache=not args.no_kv_cache,
        on_text=_print_piece,
    )
    _finish_stdout()
    print(
        f"[{len(result.prompt_ids)} prompt tokens, {len(result.token_ids)} generated ({result.finish_reason}), "
        f"time to first token {result.time_to_first_token_s * 1000:.1f} ms, "
        f"decode {result.decode_tokens_per_s:.1f} tok/s, cache {'off' if args.no_kv_cache else args.cache}]",
        file=sys.stderr,
    )
    return 0


def check_model_args(args: argparse.Namespace) -> Path | None:
    """Check --model, --dtype, --compute-dtype, --device and --threads before anything loads; the model's path."""
    from infer.errors import CheckpointError
    from infer.loader import resolve_dtype
    from infer.memory import resolve_device

    resolve_dtype(args.dtype)
    if args.compute_dtype not in ("auto", "exact"):
        resolve_dtype(args.compute_dtype)
    resolve_device(args.device)
    if getattr(args, "threads", 0) < 0:
        raise ValueError(f"--threads must be >= 0 (0: PyTorch's default), got {args.threads}")
    if args.model is None:
        return None
    path = Path(args.model)
    if path.is_file():
        raise CheckpointError(f"--model {path} is a file; pass the checkpoint directory that holds it")
    if not path.is_dir():
        hub = "/" in args.model and not Path(args.model.split("/")[0]).exists()
        raise CheckpointError(
            f"--model {args.model}: no such directory"
            + ("; only local checkpoint directories are read (download hub models first)" if hub else "")
        )
    return path


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage dump) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m infer`."""
    parser = _Parser(prog="python -m infer", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
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


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m infer` and the `infer` script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        _finish_stdout()
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("error: stdout was closed; stopped", file=sys.stderr)
        return 141
    except (ValueError, TypeError, FileNotFoundError) as e:
        _finish_stdout()
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (the CLI's contract: one line, never a traceback)
        _finish_stdout()
        print(f"error: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return 1


_line_open = False  # whether stdout holds generated text not yet ended by a newline


def _print_piece(piece: str) -> None:
    global _line_open
    print(piece, end="", flush=True)
    _line_open = _line_open or bool(piece)


def _finish_stdout() -> None:
    """End the partly printed line of generated text (so an error does not run into it)."""
    global _line_open
    if _line_open:
        _line_open = False
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    sys.exit(main())
