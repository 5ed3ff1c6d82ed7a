"""``tessera report``: the static cost report of a spec, rendered.

The flags fill runtime/options.ReportOptions; runtime/driver.report builds the report
(runtime/report/build.py); this module prints it in the format asked (runtime/report/format.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from tessera.runtime import options
from tessera.runtime.cli import args
from tessera.runtime.options import ModelRef, ReportOptions


def add_parser(sub) -> argparse.ArgumentParser:
    rep = sub.add_parser("report", help="print the static cost report of a spec",
                         description="Parameters, multiply-adds, FLOPs, memory and roofline times of a spec, "
                                     "exact and symbolic in B and N, from the graph alone (no weights are "
                                     "allocated). JSON keys: docs/report.md.")
    args.model_args(rep, f"a spec file (.tsr) or a bundled spec's name ({args.bundled()})")
    add_arguments(rep)
    return rep


def _device_help() -> str:
    from tessera.compiler.analysis.roofline import device_names

    return f"device for the roofline estimates: {', '.join(device_names())} (cpu is measured on the spot; default h200)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", "-B", type=int, default=1, metavar="B", help="batch size B (default 1)")
    p.add_argument("--seq", "-N", type=int, default=1024, metavar="N",
                   help="sequence length N; binds every sequence symbol of the spec (T, S, ...) (default 1024)")
    p.add_argument("--dtype", type=args.dtype_arg, choices=args.DTYPES, default="fp32",
                   help="element type of weights and activations for memory and roofline; the spec "
                        "spellings f32 and f16 are accepted too (default fp32)")
    p.add_argument("--device", default="h200", metavar="NAME", help=args.LazyHelp(_device_help))
    args.add_quant_arguments(p)
    p.add_argument("--no-sparse-moe", action="store_true",
                   help="report mixtures of experts in their dense form, as compile --no-sparse-moe builds "
                        "them (by default they are counted as compile builds them: sparse, the top-k experts "
                        "of each token only, unless --quantize keeps the quantised experts dense)")
    p.add_argument("--format", choices=list(options.REPORT_FORMATS), default="table", help="output format (default table)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw MACs and memory against N, fused and unfused (needs matplotlib: "
                        "pip install 'tessera[plot]')")


def cmd_report(ns: argparse.Namespace) -> int:
    from tessera.runtime import driver

    from tessera.runtime.report import format as report_format

    o = ReportOptions.from_args(ns)
    rep = driver.report(ModelRef.from_args(ns), o)
    if o.format == "json":
        print(json.dumps(rep, indent=2))
    elif o.format == "md":
        sys.stdout.write(report_format.markdown(rep))
    elif o.format == "csv":
        sys.stdout.write(report_format.csv_text(rep))
    else:
        from rich.console import Console

        report_format.print_table(rep, Console())
    if o.plot is not None:
        print(f"wrote {o.plot}", file=sys.stderr)
    return 0
