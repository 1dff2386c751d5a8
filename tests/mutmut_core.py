"""Mechanical mutation testing of the pure-Python core with mutmut, module by module, each against the tests that
own it: `make mutation` (not collected by pytest; CI does not run it). Works in scratch copies of the tree (mutmut
edits files in place), two lanes at once by default (one per core), each lane's pytest runs forked from a server
that imported torch, transformers and Hypothesis once (tests/pytest_forkserver.py). Prints a table of mutants,
scores and survivors per module; `--survivors WORD` prints the surviving mutants' diffs from the saved caches.

  python tests/mutmut_core.py                 # every module below
  python tests/mutmut_core.py scheduler       # the modules whose path contains a word
  python tests/mutmut_core.py --jobs 1        # one lane
  python tests/mutmut_core.py --own-only      # the owning tests alone (no second stage)
  python tests/mutmut_core.py --survivors sampling   # what survived, as diffs
  python tests/mutmut_core.py --work DIR      # where scratch trees and saved caches live (default: tmp/infer-mutmut)

Each module runs in two stages: its owning tests against every mutant, then the wider suite that also reaches the
module against the survivors; the table gives both scores. Caches are kept between runs: a mutant once killed
stays killed, and survivors are tried again (after a test is added, only they run).

Needs `pip install mutmut==2.4.5` (the 2.x command line). Complements tests/mutation_check.py, whose planted bugs
are realistic ones written by hand; mutmut's are mechanical (operators, constants, strings), so some survivors are
equivalent (an enum's value, a message's wording): say why when leaving one.
"""

from __future__ import annotations

import ast
import os
import queue
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# module -> (the tests that own it, run against every mutant; the wider suite that also reaches it, run against the
# mutants the owners let through). Two stages keep a module to minutes while the score is the suite's.
CORE = {
    "infer/scheduler.py": ("tests/test_scheduler.py",
                           "tests/test_engine.py tests/property/test_engine_properties.py tests/test_paged.py"),
    "infer/cache/block_manager.py": ("tests/test_block_manager_machine.py tests/test_scheduler.py tests/test_paged.py",
                                     "tests/test_engine.py tests/test_prompt_cache.py tests/test_quantized_pool.py"),
    "infer/sampling.py": ("tests/test_sampling_oracle.py tests/test_bad_inputs.py",
                          "tests/test_generate.py tests/test_engine.py tests/test_stopping.py"),
    # The config oracle's logits test builds a model per example (a minute a run): the parsing checks own it.
    "infer/config.py": ("tests/test_config_oracle.py::test_real_configs_parse_as_transformers_parses_them "
                        "tests/test_checkpoint_validation.py tests/test_sliding.py tests/test_bad_inputs.py",
                        "tests/test_config_oracle.py tests/test_models.py tests/test_loader.py"),
    "infer/chat_tools.py": ("tests/test_chat.py", "tests/test_tokenizer.py tests/test_cli.py"),
    "infer/tokenizer.py": ("tests/test_tokenizer.py tests/test_stopping.py",
                           "tests/test_chat.py tests/test_generate.py tests/test_engine.py"),
    "infer/bench_common.py": ("tests/test_bench_statistics.py", "tests/test_bench.py"),
    "infer/bench_batched.py": ("tests/test_bench_statistics.py", "tests/test_bench.py"),
}
# Modules mutated only in part: the named top-level classes or functions (the tokenizer's stream decoder; the
# benches' statistics and the report a person reads, not their machine probes, plugins or workload runners).
ONLY = {"infer/tokenizer.py": ("StreamDecoder",),
        "infer/bench_common.py": ("Trial", "percentile", "format_table", "speed_ratio"),
        "infer/bench_batched.py": ("run_one_by_one", "summarize_batched")}
# mutmut's statuses that count as caught: killed, killed but slowly ("suspicious": the tests failed after taking
# much longer than unmutated, e.g. Hypothesis shrinking), and timed out (a hang is noticed).
KILLED = ("ok_killed", "ok_suspicious", "bad_timeout")
PYTEST_ARGS = "-x -q -p no:cacheprovider -p no:xdist -W ignore::pytest.PytestAssertRewriteWarning"


def line_ranges(path: Path, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """0-based inclusive line ranges of the named top-level definitions (mutmut counts lines from 0)."""
    tree = ast.parse(path.read_text())
    return [(node.lineno - 1, (node.end_lineno or node.lineno) - 1) for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names]


def mutmut(scratch: Path, module: str, tests: str, socket: Path) -> None:
    """One `mutmut run` over the module with the given tests as the runner (mutants already killed are kept)."""
    runner = f"{sys.executable} tests/pytest_forkserver.py run {socket} -- {PYTEST_ARGS} {tests}"
    (scratch / "setup.cfg").write_text(f"[mutmut]\npaths_to_mutate={module}\ntests_dir=tests/\nrunner={runner}\n")
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--no-progress"], cwd=scratch, capture_output=True)


def counts(cache: Path) -> dict[str, int]:
    """The mutants of a mutmut cache by status."""
    rows = sqlite3.connect(cache).execute("select status, count(*) from Mutant group by status").fetchall()
    return {str(status): int(n) for status, n in rows}


def untested(saved: Path) -> int:
    """Mutants a saved run has not tried yet (a module never run: more than any)."""
    if not saved.exists():
        return 10**9
    return counts(saved).get("untested", 0)


def run(module: str, own: str, wider: str, scratch: Path, socket: Path, caches: Path) -> dict[str, int]:
    """Both stages over one module in a lane's scratch tree, resuming from its saved cache (a mutant killed
    before stays killed; survivors are tried again whenever the tests changed); the counts of the results."""
    ranges = line_ranges(scratch / module, ONLY[module]) if module in ONLY else None
    (scratch / "mutmut_config.py").write_text(
        f"RANGES = {ranges!r}\n\n\ndef pre_mutation(context):\n"
        "    if RANGES is not None and not any(a <= context.current_line_index <= b for a, b in RANGES):\n"
        "        context.skip = True\n")
    cache, saved = scratch / ".mutmut-cache", caches / f"{Path(module).stem}.sqlite"
    cache.unlink(missing_ok=True)
    if saved.exists():
        shutil.copy(saved, cache)
    mutmut(scratch, module, own, socket)
    after_own = counts(cache)
    if wider:
        with sqlite3.connect(cache) as db:  # survivors: untested again, for the wider suite
            db.execute("update Mutant set tested_against_hash = 'stage-2' where status = 'bad_survived'")
        mutmut(scratch, module, f"{own} {wider}", socket)
    shutil.copy(cache, saved)
    final = counts(cache)
    return {"total": sum(final.values()), "skipped": final.get("skipped", 0),
            "killed_own": sum(after_own.get(s, 0) for s in KILLED), "killed": sum(final.get(s, 0) for s in KILLED),
            "survived": final.get("bad_survived", 0),
            "untested": final.get("untested", 0)}


def lane(todo: queue.Queue[str], results: dict[str, dict[str, int]], n: int, work: Path, own_only: bool) -> None:
    """One scratch tree and one fork server; modules from the queue until it is empty."""
    scratch = work / f"lane{n}"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(ROOT, scratch, ignore=shutil.ignore_patterns(".venv", ".git", "*.pyc", "__pycache__",
                                                                  ".mutmut-cache*", "bench_results"))
    socket = work / f"lane{n}.sock"
    # The CI profile: derandomized (every mutant meets the same examples, the ones CI runs) and no example
    # database, where an example one mutant failed on would be replayed against every later mutant.
    env = {**os.environ, "INFER_HYPOTHESIS_PROFILE": "ci"}
    server = subprocess.Popen([sys.executable, "tests/pytest_forkserver.py", "serve", str(socket)], cwd=scratch,
                              stdout=subprocess.PIPE, text=True, env=env)
    if server.stdout is None or "ready" not in server.stdout.readline():
        raise RuntimeError(f"lane {n}: the pytest fork server did not start")
    try:
        while True:
            try:
                module = todo.get_nowait()
            except queue.Empty:
                return
            start = time.monotonic()
            own, wider = CORE[module]
            results[module] = c = run(module, own, "" if own_only else wider, scratch, socket, work / "caches")
            tested = c["total"] - c["skipped"]
            print(f"{module:30} {tested:7} {c['killed_own'] / tested:6.0%} {c['killed'] / tested:6.0%} "
                  f"{c['survived']:8} {c['untested']:8} {time.monotonic() - start:6.0f} s", flush=True)
    finally:
        server.kill()


def kind_of(diff: list[str]) -> str:
    """What a surviving mutant changed: only a string's text (mutmut wraps it in XX: a message's wording), only
    a type annotation (`|` to `&`: annotations are never evaluated here), or anything else (to be read)."""
    removed = [line[1:] for line in diff if line.startswith("-")]
    added = [line[1:] for line in diff if line.startswith("+")]
    if len(removed) == len(added) == 1:
        if "XX" in added[0] and added[0].replace("XX", "") == removed[0]:
            return "string"
        if added[0] == removed[0].replace(" | ", " & ", 1):
            return "annotation"
    return "other"


def show_survivors(work: Path, module: str) -> None:
    """Print each surviving mutant of a module as mutmut's diff, from its saved cache (in a scratch tree)."""
    saved = work / "caches" / f"{Path(module).stem}.sqlite"
    if not saved.exists():
        print(f"{module}: no saved run in {work}")
        return
    scratch = work / "show"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(ROOT / "infer", scratch / "infer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(saved, scratch / ".mutmut-cache")
    ids = [i for (i,) in sqlite3.connect(saved).execute(
        "select id from Mutant where status = 'bad_survived' order by id")]
    kinds: dict[str, int] = {}
    out = []
    for i in ids:
        diff = subprocess.run([sys.executable, "-m", "mutmut", "show", str(i)], cwd=scratch, capture_output=True,
                              text=True).stdout
        changed = [line for line in diff.splitlines() if line[:1] in ("-", "+") and line[:3] not in ("---", "+++")]
        kind = kind_of(changed)
        kinds[kind] = kinds.get(kind, 0) + 1
        out.append(f"#{i} ({kind})\n" + "\n".join(changed))
    print(f"# {module}: {len(ids)} survivors: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    print(*out, sep="\n")


def main() -> int:
    """Run the chosen modules (all by default) in lanes; print one table row per module as it finishes."""
    args = sys.argv[1:]
    jobs, work, survivors = 2, Path(tempfile.gettempdir()) / "infer-mutmut", False
    for flag in ("--jobs", "--work"):
        if flag in args:
            i = args.index(flag)
            jobs, work = (int(args[i + 1]), work) if flag == "--jobs" else (jobs, Path(args[i + 1]))
            del args[i:i + 2]
    own_only = "--own-only" in args  # the first stage alone (quicker; the score is then the owners')
    if own_only:
        args.remove("--own-only")
    if "--survivors" in args:
        args.remove("--survivors")
        survivors = True
    (work / "caches").mkdir(parents=True, exist_ok=True)
    chosen = [module for module in CORE if not args or any(w in module for w in args)]
    if survivors:
        for module in chosen:
            show_survivors(work, module)
        return 0
    todo: queue.Queue[str] = queue.Queue()
    for module in sorted(chosen, key=lambda m: -untested(work / "caches" / f"{Path(m).stem}.sqlite")):
        todo.put(module)  # the most work first: a rerun only retries survivors
    print(f"work directory (scratch trees, saved mutmut caches): {work}")
    print(f"{'module':30} {'mutants':>7} {'own':>6} {'suite':>6} {'survived':>8} {'untested':>8} {'time':>8}")
    results: dict[str, dict[str, int]] = {}
    threads = [threading.Thread(target=lane, args=(todo, results, n, work, own_only)) for n in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
