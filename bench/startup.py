"""Start-up time of the ``tessera`` command: wall time of a few commands, each a fresh process,
which heavy modules the command line imports before it does any work, and which ones each command
imports in all (``ir`` and ``report`` need sympy, networkx and lark, never onnx).

Why measured here and not in a test: times depend on the machine and its load (docs/BENCHMARKS.md
records them); tests/test_cli_help.py checks only what cannot vary, that building the parsers
imports neither onnx nor the compiler.

    python bench/startup.py [--repeat 5] [--root DIR]

``--root`` imports ``tessera`` from another checkout (a folder holding a ``tessera`` link to the
repository root), to compare a commit before a change with the working tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import cli": [sys.executable, "-c", "from tessera.runtime.cli import main"],
    "tessera --help": [sys.executable, "-m", "tessera.runtime.cli", "--help"],
    "tessera ir gpt2 (1 layer)": [sys.executable, "-m", "tessera.runtime.cli", "ir", "gpt2", "--set", "layers=1"],
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
            print(f"  imported by {name}: {_modules_of(cmd[3:], env)}")
    for name, cmd in COMMANDS.items():
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, capture_output=True, check=True)
            times.append(time.perf_counter() - t0)
        print(f"{name:32s} median {statistics.median(times):.2f} s  (min {min(times):.2f}, max {max(times):.2f}, "
              f"{a.repeat} runs)")


def _modules_of(argv: list[str], env: dict) -> str:
    """The heavy modules loaded once the command ``tessera ARGV`` has run (its output discarded)."""
    code = ("import contextlib, io, sys; from tessera.runtime.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()): main({argv!r})\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules) or '-')")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


if __name__ == "__main__":
    main()
