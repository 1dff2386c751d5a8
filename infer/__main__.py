"""Command line: `python -m infer generate PROMPT` (and `bench`, see `infer.bench`).

Every error ends the program with one line on stderr and a non-zero exit, never a traceback: 2 for bad
arguments or inputs, 1 for anything else, 130 for Ctrl-C (what was generated stays printed), 141 when the
reader of stdout goes away (a closed pipe). Arguments are all checked before the model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from infer.bench import add_bench_parser
from infer.cache import CACHE_KINDS
from infer.cli_args import add_model_args, check_model_args, load_with_args
from infer.sampling import SamplingParams

FROM_CHECKPOINT = "the checkpoint's generation_config.json, else transformers' default"


def _sampling_params(args: argparse.Namespace, path: Path) -> SamplingParams:
    """Flags given on the command line win; the rest come from generation_config.json as transformers reads
    it (greedy unless it sets do_sample), then from SamplingParams' defaults."""
    from infer.loader import generation_defaults

    values = generation_defaults(path)
    values.setdefault("max_new_tokens", 64)
    sampling_flag_given = False
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
            sampling_flag_given |= name in ("top_k", "top_p", "min_p")
    if sampling_flag_given and args.temperature is None and values.get("temperature", 0.0) == 0.0:
        values["temperature"] = 1.0  # a sampling filter asked for on a greedy checkpoint: sample, as HF would warn
    return SamplingParams(**values, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise ValueError("give the prompt either as an argument or with --prompt-file, not both")
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompt-file {args.prompt_file}: cannot read it as UTF-8 text ({e})") from e
    if args.prompt is None:
        raise ValueError("no prompt: pass it as an argument, '-' to read standard input, or --prompt-file PATH")
    return sys.stdin.read() if args.prompt == "-" else str(args.prompt)


def _generate(args: argparse.Namespace) -> int:

    from infer.generation import generate
    from infer.model_store import default_model_path
    from infer.tokenizer import Tokenizer
    from infer.tuning import choose_threads

    path = check_model_args(args)
    # The default model is a chat model: its prompts go through its chat template unless --no-chat.
    chat = args.chat or args.system is not None or (path is None and not args.no_chat)
    if path is None:
        path = default_model_path()
    params = _sampling_params(args, path)
    text = _read_prompt(args)
    model = load_with_args(path, args)
    choose_threads(model, forced=args.threads)
    tokenizer = Tokenizer(path)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompt = [*system, {"role": "user", "content": text}] if chat else text
    if not chat:
        _print_piece(text)
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


def _quality(args: argparse.Namespace) -> int:
    from infer.cache import CACHE_KINDS
    from infer.model_store import default_model_path
    from infer.quality import as_json, format_quality, load_text, measure, text_ids
    from infer.tokenizer import Tokenizer
    from infer.tuning import choose_threads

    path = check_model_args(args) or default_model_path()
    kinds = [k for k in args.kinds.split(",") if k] if args.kinds else list(CACHE_KINDS)
    unknown = [k for k in kinds if k not in CACHE_KINDS]
    if unknown:
        raise ValueError(f"--kinds: unknown cache kind(s) {', '.join(unknown)}; "
                         f"available: {', '.join(sorted(CACHE_KINDS))}")
    if args.tokens < 2 or not 1 <= args.prefill < args.tokens:
        raise ValueError(f"--prefill must lie in [1, --tokens - 1] and --tokens be >= 2, got --prefill "
                         f"{args.prefill}, --tokens {args.tokens}")
    forms = [w for w in (args.compare_weights or "").split(",") if w]
    bad = [w for w in forms if w not in ("int8", "int4", "stored", "dense")]
    if bad:
        raise ValueError(f"--compare-weights: unknown weight storage(s) {', '.join(bad)}; choose from int8, int4, "
                         "stored, dense")
    text = load_text(args.text)
    model = load_with_args(path, args)
    choose_threads(model, forced=args.threads)
    ids = text_ids(Tokenizer(path), text, args.tokens)
    if forms:
        from infer.loader import load_model
        from infer.quality import measure_weights

        dense = load_model(path, dtype=args.dtype, weights="dense")
        models = {f"{w} weights": load_model(path, dtype=args.dtype, weights=w, group_size=args.group_size)
                  for w in forms}
        rows = measure_weights(dense, models, ids, args.prefill, progress=True)
        against = "the dense (dequantized) weights, exact caches"
    else:
        rows = measure(model, ids, kinds, args.prefill, progress=True)
        against = "the exact contiguous cache"
    print(f"model {path}, {args.dtype}, text {args.text!r}: {len(ids)} tokens, {args.prefill} prefilled, "
          f"{len(ids) - args.prefill} next-token predictions per row, each against {against}")
    print(format_quality(rows))
    if args.json:
        import json

        report = {"model": str(path), "dtype": args.dtype, "text": args.text, "tokens": len(ids),
                  "prefill": args.prefill, "kinds": as_json(rows)}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from infer.model_store import DEFAULT_MODEL, fetch

    path = fetch(DEFAULT_MODEL)
    print(f"{DEFAULT_MODEL.name}: {path}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage dump) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m infer`."""
    parser = _Parser(prog="python -m infer", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt text ('-' reads standard input)")
    gen.add_argument("--prompt-file", default=None, metavar="PATH", help="read the prompt from this file")
    add_model_args(gen, dtype="float32")
    gen.add_argument("--max-new-tokens", type=int, default=None, help=f"64, or {FROM_CHECKPOINT}")
    gen.add_argument("--temperature", type=float, default=None, help=f"0 = greedy; {FROM_CHECKPOINT}")
    gen.add_argument("--top-k", type=int, default=None, help=f"0 = off; {FROM_CHECKPOINT}")
    gen.add_argument("--top-p", type=float, default=None, help=f"1 = off; {FROM_CHECKPOINT}")
    gen.add_argument("--min-p", type=float, default=None, help=f"0 = off; {FROM_CHECKPOINT}")
    gen.add_argument("--repetition-penalty", type=float, default=None, help=f"1 = off; {FROM_CHECKPOINT}")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate all --max-new-tokens even past an end-of-sequence token")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template (the default model: always, unless --no-chat)")
    gen.add_argument("--no-chat", action="store_true", help="the default model continues the raw prompt text")
    gen.add_argument("--system", default=None, help="a system message (implies --chat)")
    gen.add_argument("--cache", default="contiguous", choices=sorted(CACHE_KINDS), help="KV-cache kind")
    gen.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    gen.set_defaults(run=_generate)
    add_bench_parser(sub)
    qual = sub.add_parser("quality", help="how much each KV-cache kind changes the model's predictions on real text",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(qual, dtype="float32")
    qual.add_argument("--kinds", default=None, help="comma-separated cache kinds (default: every kind)")
    qual.add_argument("--text", default="prose", help="prose | code (shipped texts) or a UTF-8 file")
    qual.add_argument("--tokens", type=int, default=512, help="tokens of the text to read")
    qual.add_argument("--prefill", type=int, default=16, help="tokens prefilled before the one-token steps")
    qual.add_argument("--compare-weights", default=None, metavar="FORMS",
                      help="instead of cache kinds: comma-separated weight storages (int8, int4, stored) against the "
                           "dense weights")
    qual.add_argument("--json", default=None, help="write the figures here")
    qual.set_defaults(run=_quality)
    fetch = sub.add_parser("fetch", help="fetch the default model (SmolLM2-135M-Instruct) into the local store once")
    fetch.set_defaults(run=_fetch)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m infer` and the `infer` script."""
    code = _run(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, end without the interpreter's teardown: gloo's worker threads can still hold tensors
        # then and abort the process (SIGABRT, "terminate called without an active exception") after a clean run.
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _rank_zero_prints():
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
        print(f"{_error_prefix}error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (the CLI's contract: one line, never a traceback)
        _finish_stdout()
        print(f"{_error_prefix}error: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _rank_zero_prints() -> Iterator[None]:
    """Under `torchrun` only rank 0 prints: the other ranks run the same steps with stdout and stderr silenced,
    except for an error, which each rank reports on its own line, naming itself."""
    from infer.tensor_parallel import shutdown

    global _error_prefix
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with contextlib.ExitStack() as stack:
        if rank != 0 and world > 1:
            _error_prefix = f"rank {rank}: "  # the error line is printed whole, in one write (ranks share stderr)
            quiet = stack.enter_context(open(os.devnull, "w"))
            stack.enter_context(contextlib.redirect_stdout(quiet))
            stack.enter_context(contextlib.redirect_stderr(quiet))
        try:
            yield
        except BaseException:
            shutdown(finished=False)  # another rank may never reach a barrier
            raise
        shutdown()


_error_prefix = ""  # "rank N: " on the silent ranks of a torchrun
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
