"""Start-up time of the ``tessera`` command: wall and CPU time of a few commands, each a fresh process,
which heavy modules the command line imports before it does any work, and which ones each command
imports in all (``ir`` and ``report`` need sympy, networkx and numpy, never onnx; lark only when a spec file
is not in the AST cache, spec/ast_cache.py).

The rows run with the user's cache folder, warm after the first run; the "cold cache" row gives each
run a new empty TESSERA_CACHE_DIR, so it parses the spec files and builds lark's tables every time.
CPU time (user + system, of the child) is the figure to compare on a loaded machine.

Why measured here and not in a test: times depend on the machine and its load (docs/benchmarks/log.md
records them); tests/project/test_cli_help.py checks only what cannot vary, that building the parsers
imports neither onnx nor the compiler.

    python bench/startup.py [--repeat 5] [--root DIR]

``--root`` imports ``tessera`` from another checkout (a folder holding a ``tessera`` link to the
repository root), to compare a commit before a change with the working tree.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "import cli": [sys.executable, "-c", "from tessera.runtime.cli import main"],
    "tessera --help": [sys.executable, "-m", "tessera.runtime.cli", "--help"],
    "tessera ir gpt2 (1 layer)": [sys.executable, "-m", "tessera.runtime.cli", "ir", "gpt2", "--set", "layers=1"],
    "  the same, cold cache": [sys.executable, "-m", "tessera.runtime.cli", "ir", "gpt2", "--set", "layers=1"],
    "tessera report gpt2 -V large": [sys.executable, "-m", "tessera.runtime.cli", "report", "gpt2", "-V", "large"],
    "tessera report gpt2 -V gpt3": [sys.executable, "-m", "tessera.runtime.cli", "report", "gpt2", "-V", "gpt3"],
}
HEAVY = ("onnx", "onnxruntime", "sympy", "networkx", "numpy", "lark", "ml_dtypes")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--root", help="import tessera from this folder (PYTHONPATH) instead of the installed one")
    a = ap.parse_args()
    env = dict(os.environ)
    if a.root:
        env["PYTHONPATH"] = a.root + os.pathsep + env.get("PYTHONPATH", "")
    probe = ("import sys; from tessera.runtime.cli import make_parser; make_parser(); "
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules) or '-')")
    loaded = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    print(f"modules imported by building the parsers: {loaded.stdout.strip()}")
    for name, cmd in COMMANDS.items():
        if cmd[1:3] == ["-m", "tessera.runtime.cli"] and "--help" not in cmd:
            with tempfile.TemporaryDirectory() as cold:
                run_env = {**env, "TESSERA_CACHE_DIR": cold} if "cold cache" in name else env
                print(f"  imported by {name.strip()}: {_modules_of(cmd[3:], run_env)}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, cmd in COMMANDS.items():
        walls, cpus = [], []
        for _ in range(a.repeat):
            with tempfile.TemporaryDirectory() as cold:
                run_env = {**env, "TESSERA_CACHE_DIR": cold} if "cold cache" in name else env
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                subprocess.run(cmd, env=run_env, capture_output=True, check=True)
                walls.append(time.perf_counter() - t0)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        print(f"{name:32s} wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f})"
              f"  CPU median {statistics.median(cpus):.2f} s (min {min(cpus):.2f})  {a.repeat} runs")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _modules_of(argv: list[str], env: dict) -> str:
    """The heavy modules loaded once the command ``tessera ARGV`` has run (its output discarded)."""
    code = ("import contextlib, io, sys; from tessera.runtime.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()): main({argv!r})\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules) or '-')")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


if __name__ == "__main__":
    main()
