"""A pytest fork server for mutation runs: torch, transformers and Hypothesis are imported once, and each run
is a fork that imports the project afresh from disk (so it sees the mutant mutmut just wrote) and runs pytest.

A run costs the tests' own time instead of the tests' time plus three to four seconds of imports, which is most
of a mutant's cost in the pure-Python core. Not collected by pytest; tests/mutmut_core.py starts one per lane.

  python tests/pytest_forkserver.py serve SOCKET            # imports the heavy libraries, then waits
  python tests/pytest_forkserver.py run SOCKET -- ARGS...   # pytest ARGS in a fork; its output and exit code
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

RC_MARK = b"\n\x00pytest-exit-code="
RUN_LIMIT_S = 180  # a mutant that loops forever: the client has been killed by mutmut's timeout long before


def serve(path: str) -> None:
    """Import the heavy third-party libraries (never the project), then fork one pytest run per connection."""
    sys.dont_write_bytecode = True  # a mutant rewritten within the same second must not meet a stale .pyc
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    Path(path).unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    print(f"pytest fork server ready on {path}", flush=True)
    while True:
        conn, _ = server.accept()
        request = json.loads(conn.makefile("rb").readline())
        if os.fork() == 0:
            server.close()
            run_in_child(conn, request["cwd"], request["args"])
        conn.close()


def run_in_child(conn: socket.socket, cwd: str, args: list[str]) -> None:
    """The forked child: pytest with its output on the connection, then the exit code after a marker."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.alarm(RUN_LIMIT_S)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    os.dup2(conn.fileno(), 1)
    os.dup2(conn.fileno(), 2)
    import pytest

    try:
        rc = int(pytest.main(args))
    except BaseException:  # noqa: BLE001 - whatever happened, the client must get an exit code
        rc = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, RC_MARK + str(rc).encode() + b"\n")
    os._exit(0)


def run(path: str, args: list[str]) -> int:
    """Send one pytest run to the server; echo its output and return 0 if it passed, 5 if it collected nothing,
    else 1: mutmut 2 counts only exit code 1 as a kill, so a mutant that breaks an import or collection (pytest's
    2-4) or kills the run would otherwise count as surviving."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.sendall(json.dumps({"cwd": os.getcwd(), "args": args}).encode() + b"\n")
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    out, mark, rc = data.partition(RC_MARK)
    sys.stdout.write(out.decode(errors="replace"))
    code = int(rc.strip() or 1) if mark else 1
    return code if code in (0, 5) else 1


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
        return 0
    if len(sys.argv) >= 4 and sys.argv[1] == "run" and sys.argv[3] == "--":
        return run(sys.argv[2], sys.argv[4:])
    print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
