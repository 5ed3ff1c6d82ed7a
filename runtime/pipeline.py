"""The steps every command shares: load a spec, elaborate it, get weights, export."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.frontend.elaborate import ModelInfo, elaborate
from tessera.compiler.ir.graph import DTYPES, Graph
from tessera.compiler.frontend.values import BlockRef
from tessera.spec import Program, SpecError, did_you_mean, load_program

from .weights import init_weights, load_weights, name_map_for


class UsageError(Exception):
    """A bad command-line value (not a spec error)."""


@dataclass
class Built:
    program: Program
    graph: Graph
    info: ModelInfo
    spec_path: Path


def parse_set(items: list[str], program: Program) -> dict:
    """--set k=v values: ints, floats, true/false, block names, else strings."""
    out = {}
    for item in items:
        m = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", item)
        if not m:
            raise UsageError(f"--set '{item}' must be NAME=VALUE, e.g. --set layers=2")
        key, text = m.groups()
        if key in out:
            raise UsageError(f"--set {key} is given twice")
        out[key] = _parse_value(text, program)
    return out


def _parse_value(text: str, program: Program):
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?", text):
        return float(text)
    if text in ("true", "false"):
        return text == "true"
    return text  # a string; the elaborator turns it into a block where the hyperparameter is a block


def resolve_spec(spec: str | Path) -> Path:
    """The spec file a command names: a path when that file exists, else a bundled spec by name
    (``gpt2`` or ``gpt2.tsr``, shipped in ``tessera.models``). Raises SpecError for neither."""
    from tessera.models import bundled_names, bundled_spec

    path = Path(spec)
    if path.exists():
        return path  # a path wins (load_program reports a folder or an unreadable file)
    text = str(spec)
    if "/" in text or "\\" in text:  # meant as a path: keep the plain message
        raise SpecError(f"spec file not found: {text}")
    bundled = bundled_spec(text)
    if bundled is not None:
        return bundled
    names = bundled_names()
    stem = text[:-4] if text.endswith(".tsr") else text
    raise SpecError(f"no spec file or bundled spec named '{text}'{did_you_mean(stem, names)} "
                    f"(bundled specs: {', '.join(names)})")


def build(spec: str | Path, variant: str | None = None, sets: list[str] | None = None,
          weights: str | Path | None = None) -> Built:
    """Elaborate a spec. When ``weights`` is a checkpoint folder with a config.json and the
    spec's mapping file has a [config] table, its hyperparameters are taken from there too
    (checkpoint_config.py: a value contradicting ``sets`` or the variant is an error)."""
    from .checkpoint_config import config_overrides

    path = resolve_spec(spec)
    program = load_program(path)
    overrides = parse_set(sets or [], program)
    if weights:
        overrides.update(config_overrides(program, name_map_for(path), weights, variant, overrides))
    graph, info = elaborate(program, variant, overrides)
    return Built(program, graph, info, path)


# Compiling holds the weights about three times over (the arrays, the ONNX protobuf, its
# serialisation); running holds them twice (the protobuf and onnxruntime's copy).
PEAK_WEIGHT_COPIES = 3


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(built: Built, allow_large: bool = False) -> None:
    """Refuse, before allocating anything, weights that would not fit in memory."""
    need = sum(p.numel * np.dtype(DTYPES[p.dtype] or np.float32).itemsize for p in built.graph.params.values())
    avail = available_memory()
    if allow_large or avail is None or need * PEAK_WEIGHT_COPIES <= avail:
        return
    raise UsageError(f"{built.graph.name}'s weights are {need / 2**30:,.1f} GiB; holding them about "
                     f"{PEAK_WEIGHT_COPIES} times over needs more than the {avail / 2**30:,.1f} GiB of memory "
                     f"available. 'tessera report' gives its cost without weights; --allow-large tries anyway")


def weights_for(built: Built, weights: str | None, seed: int, allow_large: bool = False) -> dict[str, np.ndarray]:
    check_memory(built, allow_large)
    if weights:
        notes: list[str] = []
        loaded = load_weights(built.graph, Path(weights), name_map_for(built.spec_path), notes,
                              built.info.hyperparams)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        return loaded
    return init_weights(built.graph, seed)


def optimize(built: Built, args) -> None:
    """Fuse attention and choose kernels as the command-line flags say; print --explain's listing."""
    from tessera.compiler.passes.pipeline import explain, optimize as optimize_graph
    from tessera.compiler.passes import PassError
    from tessera.compiler.passes.attention_kernels import Target

    attention = "unfused" if getattr(args, "no_fuse", False) else getattr(args, "attention", "auto")
    if getattr(args, "no_fuse", False) and getattr(args, "attention", "auto") not in ("auto", "unfused"):
        raise UsageError(f"--no-fuse contradicts --attention {args.attention}")
    dtype = getattr(args, "dtype", "fp32")
    try:
        sites = optimize_graph(built.graph, Target(getattr(args, "target", "cpu"), dtype), attention, lower_precision=True)
    except PassError as e:
        raise UsageError(str(e)) from None
    if getattr(args, "explain", False):
        import sys

        print(explain(sites), file=sys.stderr)


def export(built: Built, weights: dict[str, np.ndarray], out: str | Path, check: bool = True) -> list[Path]:
    meta = {"tessera.model": built.info.model, "tessera.variant": built.info.variant or "",
            "tessera.hyperparams": {k: _jsonable(v) for k, v in built.info.hyperparams.items()}}
    model = onnx_export.to_onnx(built.graph, weights, meta)
    return onnx_export.save(model, out, verify=onnx_export.check if check else None)


def _jsonable(v):
    if isinstance(v, BlockRef):
        return v.block.name
    return v


__all__ = ["Built", "resolve_spec", "build", "weights_for", "optimize", "export", "parse_set", "UsageError"]
