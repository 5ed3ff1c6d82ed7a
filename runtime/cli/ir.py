"""``tessera ir``: print the elaborated IR graph of a spec (no options beyond the model's own)."""

from __future__ import annotations

import argparse

from tessera.runtime.cli import args
from tessera.runtime.options import ModelRef


def add_parser(sub) -> argparse.ArgumentParser:
    ir = sub.add_parser("ir", help="print the elaborated IR graph of a spec")
    args.model_args(ir, f"a spec file (.tsr) or a bundled spec's name ({args.bundled()})")
    return ir


def cmd_ir(ns: argparse.Namespace) -> int:
    from tessera.runtime import pipeline

    ref = ModelRef.from_args(ns)
    ref.check()
    built = pipeline.build(ref.spec, ref.variant, ref.sets)
    print(built.graph.dump())
    return 0
