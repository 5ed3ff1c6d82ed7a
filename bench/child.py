"""One child process timed: its wall time and the CPU time it used (bench scripts that compare peers in
fresh processes: bench/gguf_llama_cpp.py, bench/openvino_peer.py). CPU ÷ wall below the thread count
says the machine was shared while it ran."""

from __future__ import annotations

import resource
import shlex
import subprocess
import sys
import time


def run_timed(cmd: list[str]) -> tuple[str, float, float]:
    """(stdout followed by stderr, wall seconds, CPU seconds of the child); exits with its stderr on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        sys.exit(f"{shlex.join(cmd[:3])} ... failed ({out.returncode}):\n{out.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out.stdout + out.stderr, wall, cpu
