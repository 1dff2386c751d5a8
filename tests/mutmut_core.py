"""Mechanical mutation testing of the pure-Python core with mutmut, module by module, each against the tests that
own it: `make mutation` (not collected by pytest; CI does not run it: it takes about a quarter of an hour per
module on 2 cores). Works in a scratch copy of the tree (mutmut edits files in place), prints a table of killed /
survived / timed-out mutants per module, and leaves each module's mutmut cache there for `mutmut show <id>`.

  python tests/mutmut_core.py                 # every module below
  python tests/mutmut_core.py scheduler       # the modules whose path contains a word

Needs `pip install mutmut==2.4.5` (the 2.x command line). Complements tests/mutation_check.py, whose planted bugs
are realistic ones written by hand; mutmut's are mechanical (operators, constants, strings), so some survivors are
equivalent (an enum's value, a message's wording): say why when leaving one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = f"{sys.executable} -m pytest -x -q -p no:cacheprovider -p no:xdist"
# module -> the tests that own it (fast ones: mutmut runs them once per mutant)
CORE = {
    "infer/scheduler.py": "tests/test_scheduler.py",
    "infer/cache/block_manager.py": "tests/test_block_manager_machine.py tests/test_scheduler.py",
    "infer/sampling.py": "tests/test_sampling_oracle.py tests/test_bad_inputs.py",
    "infer/config.py": "tests/test_config_oracle.py",
    "infer/chat_tools.py": "tests/test_chat.py",
    "infer/bench_common.py": "tests/test_bench_statistics.py tests/test_bench.py",
}


def run(module: str, tests: str, scratch: Path) -> dict[str, int]:
    """mutmut over one module in the scratch tree; the counts of its results."""
    (scratch / "setup.cfg").write_text(f"[mutmut]\npaths_to_mutate={module}\ntests_dir=tests/\n"
                                       f"runner={PYTEST} {tests}\n")
    cache = scratch / ".mutmut-cache"
    cache.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--no-progress"], cwd=scratch, capture_output=True)
    shutil.copy(cache, scratch / f".mutmut-cache-{Path(module).stem}")
    out = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=scratch, capture_output=True, text=True)
    counts = {kind: int(n) for kind, n in re.findall(r"^(Killed|Timed out|Suspicious|Survived|Skipped) \S* \((\d+)\)",
                                                      out.stdout, re.M)}
    total = subprocess.run([sys.executable, "-c", "import sqlite3,sys; print(sqlite3.connect(sys.argv[1])"
                            ".execute('select count(*) from Mutant').fetchone()[0])", str(cache)],
                           capture_output=True, text=True)
    counts["total"] = int(total.stdout.strip() or 0)
    return counts


def main() -> int:
    words = sys.argv[1:]
    chosen = {m: t for m, t in CORE.items() if not words or any(w in m for w in words)}
    scratch = Path(tempfile.mkdtemp(prefix="mutmut-")) / "tree"
    shutil.copytree(ROOT, scratch, ignore=shutil.ignore_patterns(".venv", ".git", "*.pyc", "__pycache__",
                                                                  ".mutmut-cache*", "bench_results"))
    print(f"scratch tree: {scratch}")
    print(f"{'module':32} {'mutants':>7} {'killed':>6} {'survived':>8} {'timeout':>7} {'score':>6}")
    for module, tests in chosen.items():
        c = run(module, tests, scratch)
        survived = c.get("Survived", 0) + c.get("Suspicious", 0)
        killed = c["total"] - survived - c.get("Skipped", 0)
        score = killed / c["total"] if c["total"] else float("nan")
        print(f"{module:32} {c['total']:7} {killed:6} {survived:8} {c.get('Timed out', 0):7} {score:6.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
