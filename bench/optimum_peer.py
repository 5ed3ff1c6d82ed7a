"""optimum's ONNX export as a peer, for the benches that compare with it (bench/prefill.py's o2 case,
bench/embeddings.py).

optimum-onnx pins its own transformers, so it lives in an environment of its own, named by
``--optimum-python`` (for example ``python -m venv /work/venvs/optimum && /work/venvs/optimum/bin/pip
install 'optimum-onnx[onnxruntime]' torch``). The export runs there, once per folder, as ``optimum-cli
export onnx`` (with ``--optimize O2``: ORTOptimizer at AutoOptimizationConfig O2, onnxruntime's fused
Attention, SkipLayerNorm, FastGelu ...); the file it writes is then timed in the bench's own environment,
by the same onnxruntime as Tessera's file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HELP = ("the python of an environment with optimum-onnx[onnxruntime] (see bench/optimum_peer.py): the peer is "
        "exported there, then run here in this environment's onnxruntime")


def export(python: str, model_dir: str | Path, out_dir: str | Path, task: str, optimize: str | None = None) -> Path:
    """``optimum-cli export onnx -m model_dir --task task [--optimize optimize] out_dir`` in the environment
    of ``python``; the file ``out_dir/model.onnx`` (kept: a second call with the same folder reuses it)."""
    out = Path(out_dir) / "model.onnx"
    if out.exists():
        return out
    cmd = [python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "-m", str(model_dir), "--task", task,
           "--library-name", "transformers"] + (["--optimize", optimize] if optimize else []) + [str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode or not out.exists():
        sys.exit(f"optimum's export failed ({' '.join(cmd)}):\n{(done.stderr or done.stdout)[-3000:]}")
    return out


def version(python: str) -> str:
    """optimum-onnx's version in that environment (for the bench's header)."""
    done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('optimum-onnx'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"
