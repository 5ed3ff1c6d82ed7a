"""The steps every command shares: load a spec, elaborate it, get weights, export."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.frontend.elaborate import ModelInfo, elaborate
from tessera.compiler.ir.graph import Graph
from tessera.compiler.frontend.values import BlockRef
from tessera.spec import Program, SpecError, load_program

from .weights import init_weights, load_weights, name_map_for


class UsageError(Exception):
    """A bad command-line value (not a spec error)."""


@dataclass
class Built:
    program: Program
    graph: Graph
    info: ModelInfo
    spec_path: Path
    attention_sites: list | None = None


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


def build(spec: str | Path, variant: str | None = None, sets: list[str] | None = None) -> Built:
    program = load_program(spec)
    overrides = parse_set(sets or [], program)
    graph, info = elaborate(program, variant, overrides)
    return Built(program, graph, info, Path(spec))


def weights_for(built: Built, weights: str | None, seed: int) -> dict[str, np.ndarray]:
    if weights:
        return load_weights(built.graph, Path(weights), name_map_for(built.spec_path))
    return init_weights(built.graph, seed)


def optimise(built: Built, args) -> None:
    """Fuse attention and choose kernels as the command-line flags say; print --explain's listing."""
    from tessera.compiler.passes.pipeline import explain, optimize
    from tessera.compiler.passes import PassError
    from tessera.compiler.passes.attention_kernels import Target

    attention = "unfused" if getattr(args, "no_fuse", False) else getattr(args, "attention", "auto")
    if getattr(args, "no_fuse", False) and getattr(args, "attention", "auto") not in ("auto", "unfused"):
        raise UsageError(f"--no-fuse contradicts --attention {args.attention}")
    dtype = getattr(args, "dtype", "fp32")
    try:
        sites = optimize(built.graph, Target(getattr(args, "target", "cpu"), dtype), attention, lower_precision=True)
    except PassError as e:
        raise UsageError(str(e)) from None
    built.attention_sites = sites
    if getattr(args, "explain", False):
        import sys

        print(explain(sites), file=sys.stderr)


def export(built: Built, weights: dict[str, np.ndarray], out: str | Path, check: bool = True) -> list[Path]:
    meta = {"tessera.model": built.info.model, "tessera.variant": built.info.variant or "",
            "tessera.hyperparams": {k: _jsonable(v) for k, v in built.info.hyperparams.items()}}
    model = onnx_export.to_onnx(built.graph, weights, meta)
    files = onnx_export.save(model, out)
    if check:
        onnx_export.check(out)
    return files


def _jsonable(v):
    if isinstance(v, BlockRef):
        return v.block.name
    return v


__all__ = ["Built", "build", "weights_for", "export", "parse_set", "UsageError", "SpecError"]
