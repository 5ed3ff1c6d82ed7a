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
from tessera.runtime.options import KV_CACHE_DTYPES, ModelRef, ReportOptions


def add_parser(sub) -> argparse.ArgumentParser:
    rep = sub.add_parser("report", help="print the static cost report of a spec",
                         description="Parameters, multiply-adds, FLOPs, memory and roofline times of a spec, "
                                     "exact and symbolic in B and N, from the graph alone (no weights are "
                                     "allocated); with a deployment plan, the figures per device of a parallel "
                                     "split, of training and of serving. JSON keys: docs/report.md.")
    args.model_args(rep, f"a spec file (.tsr) or a bundled spec's name ({args.bundled()})")
    add_arguments(rep)
    return rep


def sizes(text: str) -> int | list[int]:
    """--batch and --seq: one integer, or several separated by commas (a sweep: a list)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or integers separated by commas, got '{text}'")
    return values[0] if len(values) == 1 else values


def _device_help() -> str:
    from tessera.compiler.analysis.roofline import device_names

    return f"device for the roofline estimates: {', '.join(device_names())} (cpu is measured on the spot; default h200)"


def _plan_choices(name: str):
    """The deployment plan's choices (compiler/analysis/plan.py), read when a value is checked."""

    def load():
        from tessera.compiler.analysis import plan

        return getattr(plan, name)

    return args.LazyChoices(load)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", "-B", type=sizes, default=1, metavar="B",
                   help="batch size B, the micro-batch of one data-parallel replica; several separated by "
                        "commas sweep (default 1)")
    p.add_argument("--seq", "-N", type=sizes, default=1024, metavar="N",
                   help="sequence length N; binds every sequence symbol of the spec (T, S, ...); several "
                        "separated by commas sweep: one row per (B, N) (default 1024)")
    g = p.add_argument_group("deployment (docs/report.md, \"Parallel splits, training, serving\")")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel degree (default 1)")
    g.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline stages (default 1)")
    g.add_argument("--dp", type=int, default=1, metavar="D", help="data-parallel replicas (default 1)")
    g.add_argument("--ep", type=int, default=1, metavar="E", help="expert-parallel degree (default 1)")
    g.add_argument("--train", action="store_true",
                   help="training memory per device: states under --zero, activations under --recompute")
    g.add_argument("--zero", type=int, choices=_plan_choices("ZERO_STAGES"), metavar="{0,1,2,3}", default=0,
                   help="ZeRO stage with --train: 1 shards the optimizer over --dp, 2 also gradients, "
                        "3 also weights (default 0)")
    g.add_argument("--recompute", choices=_plan_choices("RECOMPUTE"), metavar="{none,selective,full}", default="none",
                   help="activation recomputation with --train (Korthikanti et al. 2022) (default none)")
    g.add_argument("--serve", action="store_true",
                   help="serving capacity on --device: largest batch at --context, decode tokens/s, "
                        "time to first token")
    g.add_argument("--context", type=int, metavar="N", help="tokens per sequence with --serve")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="the KV cache's precision in the memory figures and --serve's capacity: fp16 counts 2 bytes "
                        "an element on an fp32 model (generate/serve --kv-cache-dtype fp16); int8 and int4 are "
                        "refused as those commands refuse them (default auto: the model's --dtype)")
    m = p.add_argument_group("measured against estimated (docs/report.md, \"Measured and calibrated\")")
    m.add_argument("--measure", action="store_true",
                   help="with --device cpu: compile and time prefill (B, N) and decoding steps (B, at N) in "
                        "onnxruntime on this machine; print each beside its roofline estimate with the signed "
                        "error, the FLOP/s and bandwidth achieved, and record the efficiencies as this machine's "
                        "calibration")
    m.add_argument("--repeats", type=int, default=5, metavar="R",
                   help="timed runs per phase with --measure, after a warm-up; the median is reported (default 5)")
    m.add_argument("--calibrated", action="store_true",
                   help="with --device cpu: also give the roofline times divided by the efficiency that "
                        "--measure recorded on this machine (the nearest recorded shape)")
    m.add_argument("--calibration", metavar="FILE",
                   help="the calibration file --measure writes and --calibrated reads (default "
                        "$TESSERA_CALIBRATION, else ~/.cache/tessera/calibration.json)")
    p.add_argument("--dtype", type=args.dtype_arg, choices=args.DTYPES, default="fp32",
                   help="element type of weights and activations for memory and roofline; the spec "
                        "spellings f32 and f16 are accepted too (default fp32)")
    p.add_argument("--device", default="h200", metavar="NAME", help=args.LazyHelp(_device_help))
    args.add_quant_arguments(p)
    options.add_arguments(p, ReportOptions, only=("gguf_weights",), helps={"gguf_weights": (
        "a GGUF file's Q4_0, Q8_0, Q5_0, Q4_1, Q5_1, Q4_K and Q5_K matrices, as compile, run and generate read them: "
        "codes (default) and codes-fp32 keep the file's own codes (MatMulNBits), dequantize reads every tensor as "
        "fp32; the report's GGUF codes section lists the linears reading codes, the weights' bytes then, and the "
        "conversion's note (which tensors were dequantised from which type, and why)")})
    p.add_argument("--no-sparse-moe", action="store_true",
                   help="report mixtures of experts in their dense form, as compile --no-sparse-moe builds "
                        "them (by default they are counted as compile builds them: sparse, the top-k experts "
                        "of each token only, unless --quantize keeps the quantised experts dense)")
    p.add_argument("--format", choices=list(options.REPORT_FORMATS), default="table", help="output format (default table)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw MACs, memory and roofline time against N, fused and unfused, and with "
                        "--tp/--pp/--dp/--ep the largest device's memory against the device's (needs "
                        "matplotlib: pip install 'tessera[plot]')")


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
    note = device_note(o.device) if o.format == "table" else None  # JSON, md, csv name the device in their data
    if note:
        print(note, file=sys.stderr)
    return 0


def device_note(device: str) -> str | None:
    """The report's roofline and attention sections describe ``--device`` (h200 by default), which need not be
    this machine: on one without a GPU, say so rather than let "target cuda" pass for a claim about it.
    On stderr, so that the report itself (and its goldens) does not depend on the machine."""
    from tessera.runtime.machine import gpu_present

    if device == "cpu" or gpu_present():
        return None
    default = " (the default --device)" if device == ReportOptions.device else ""
    return (f"note: the roofline and attention figures are estimates for {device}{default}, not for this "
            f"machine, which has no GPU; --device cpu measures this one")
