"""onnxruntime-gpu's real CUDA provider on a machine without a GPU, for the tests (issue 37).

``tests/cuda_stub/`` holds the stub CUDA libraries' sources (a copy of the workplace's
shared/tools/cuda-stub, README.md there says what they tell and what they cannot) and ``check.py``,
which opens one or more ONNX files on the CUDA provider and reports placement, Memcpy nodes, the
attention kernel chosen, whether one run completed its host-side checks and the copies counted.
The provider resolves libcudart when it loads, so every check runs in a subprocess whose
LD_LIBRARY_PATH holds the built stub. ``why_unavailable`` names what is missing (gcc, the CUDA
headers, onnxruntime-gpu's CUDA provider library); the fixture ``cuda_stub`` (conftest.py) skips
with that reason, so a plain checkout still passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "cuda_stub"
CHECK = SOURCES / "check.py"
CUDA_INCLUDE = Path(os.environ.get("CUDA_INCLUDE_DIR", "/usr/local/cuda/include"))


def provider_library() -> Path | None:
    """onnxruntime-gpu's CUDA provider library, found without importing onnxruntime."""
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(list(spec.submodule_search_locations)[0]) / "capi" / "libonnxruntime_providers_cuda.so"
    return lib if lib.exists() else None


def why_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the CUDA stub builds Linux shared libraries"
    if shutil.which("gcc") is None:
        return "gcc is not installed (it builds the stub CUDA libraries)"
    if not (CUDA_INCLUDE / "cuda_runtime_api.h").exists():
        return f"no CUDA headers at {CUDA_INCLUDE} (set CUDA_INCLUDE_DIR)"
    if provider_library() is None:
        return "onnxruntime-gpu's CUDA provider library is not installed (onnxruntime CPU only)"
    return None


class Stub:
    """The built stub libraries in ``folder``; ``check`` runs tests/cuda_stub/check.py under them."""

    def __init__(self, folder: Path):
        self.folder = folder

    def env(self, **extra) -> dict:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(self.folder)] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
        env["ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO"] = "1"
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, args: list[str], timeout: float = 120, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout)

    def check(self, *models, seq: int = 4, batch: int = 1, past: int = 0, timeout: float = 120) -> list[dict]:
        """One report per model (check.py's JSON), all in one process (the provider loads once)."""
        p = self.run([str(CHECK), *map(str, models), "--seq", str(seq), "--batch", str(batch), "--past", str(past)],
                     timeout=timeout)
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        assert p.returncode == 0 and len(lines) == len(models), (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
        return lines


def build(folder: Path) -> Stub:
    """Build the stub libraries into ``folder`` (under a second: nine small C files)."""
    folder.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["bash", str(SOURCES / "build.sh"), str(folder), str(CUDA_INCLUDE)], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"building the CUDA stub failed: {p.stderr[-2000:]}")
    return Stub(folder)


def placement_problems(report: dict) -> list[str]:
    """What the issue's checks refuse in one check.py report: a node on the CPU that onnxruntime did not
    move there as shape arithmetic, a CUDA kernel missing, a Memcpy inside a Loop or If body, a run
    that did not complete its host-side checks."""
    problems = []
    if report["providers"][:1] != ["CUDAExecutionProvider"]:
        problems.append(f"session providers {report['providers']}")
    if report["cpu_unforced"]:
        problems.append(f"compute nodes on the CPU: {report['cpu_unforced']}")
    if report["not_found"]:
        problems.append(f"no CUDA kernel: {report['not_found']}")
    if report.get("memcpy_subgraph"):
        problems.append(f"{report['memcpy_subgraph']} Memcpy inside Loop/If bodies")
    if not report["ran"]:
        problems.append(f"the run failed: {report['error']}")
    return problems
