"""The ``tessera report`` command: the static cost report of a spec, rendered.

The numbers come from compiler/analysis/costreport.py (symbolic, from the graph alone);
this module only reads the command line, picks the device and chooses a format
(runtime/report_format.py, runtime/report_plot.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from contextlib import contextmanager

from . import pipeline

FORMATS = ["table", "json", "md", "csv"]
# --dtype names the precision as fp32/fp16/bf16; the spec language spells element types f32/f16/bf16,
# so those spellings are accepted and mean the same.
DTYPES = ["fp32", "fp16", "bf16"]
_DTYPE_ALIASES = {"f32": "fp32", "f16": "fp16"}


def dtype_arg(text: str) -> str:
    """--dtype's value in the command's spelling (f16 -> fp16); argparse checks it against DTYPES."""
    return _DTYPE_ALIASES.get(text, text)


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """--quantize, --quantize-block, --quantize-head (compile, run, generate and report share them)."""
    p.add_argument("--quantize", choices=list(pipeline.QUANTIZE_CHOICES), default="none",
                   help="quantise the weights of the linear layers to int8 or int4 with block-wise scales, "
                        "run by onnxruntime's MatMulNBits (activations are stored in float; see "
                        "--quantize-activations). The embedding tables stay float; the output head too unless "
                        "--quantize-head (default none)")
    p.add_argument("--quantize-block", type=int, metavar="N",
                   help="input features per quantisation scale: a power of two, at least 16 (default 32)")
    p.add_argument("--quantize-activations", choices=["int8", "float"],
                   help="int8: MatMulNBits quantises the activations to int8 inside each product "
                        "(accuracy_level 4, faster); float: the product runs in fp32 (accuracy_level 0) "
                        "(default int8)")
    p.add_argument("--quantize-head", action="store_true",
                   help="quantise the output head as well (by default it stays float: its errors go "
                        "straight into the logits)")


def int_list(text: str) -> list[int]:
    """--seq 128,1024 and --batch 1,8: one value, or several separated by commas (a sweep)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or integers separated by commas, got '{text}'")


def _values(x) -> list[int]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tessera.compiler.analysis.plan import RECOMPUTE
    from tessera.compiler.analysis.roofline import device_names

    p.add_argument("--batch", "-B", type=int_list, default=[1], metavar="B",
                   help="batch size B, the micro-batch of one data-parallel replica; several separated by "
                        "commas sweep (default 1)")
    p.add_argument("--seq", "-N", type=int_list, default=[1024], metavar="N",
                   help="sequence length N; binds every sequence symbol of the spec (T, S, ...); several "
                        "separated by commas sweep: one row per (B, N) (default 1024)")
    g = p.add_argument_group("deployment (docs/report.md, \"Parallel splits, training, serving\")")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel degree (default 1)")
    g.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline stages (default 1)")
    g.add_argument("--dp", type=int, default=1, metavar="D", help="data-parallel replicas (default 1)")
    g.add_argument("--ep", type=int, default=1, metavar="E", help="expert-parallel degree (default 1)")
    g.add_argument("--train", action="store_true",
                   help="training memory per device: states under --zero, activations under --recompute")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO stage with --train: 1 shards the optimizer over --dp, 2 also gradients, "
                        "3 also weights (default 0)")
    g.add_argument("--recompute", choices=list(RECOMPUTE), default="none",
                   help="activation recomputation with --train (Korthikanti et al. 2022) (default none)")
    g.add_argument("--serve", action="store_true",
                   help="serving capacity on --device: largest batch at --context, decode tokens/s, "
                        "time to first token")
    g.add_argument("--context", type=int, metavar="N", help="tokens per sequence with --serve")
    p.add_argument("--dtype", type=dtype_arg, choices=DTYPES, default="fp32",
                   help="element type of weights and activations for memory and roofline; the spec "
                        "spellings f32 and f16 are accepted too (default fp32)")
    p.add_argument("--device", default="h200", metavar="NAME",
                   help=f"device for the roofline estimates: {', '.join(device_names())} "
                        f"(cpu is measured on the spot; default h200)")
    add_quant_arguments(p)
    p.add_argument("--no-sparse-moe", action="store_true",
                   help="report mixtures of experts in their dense form, as compile --no-sparse-moe builds "
                        "them (by default they are counted as compile builds them: sparse, the top-k experts "
                        "of each token only, unless --quantize keeps the quantised experts dense)")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw MACs and memory against N, fused and unfused (needs matplotlib: "
                        "pip install 'tessera[plot]')")


@contextmanager
def _no_gc():
    """Elaboration and the report build many long-lived objects and free almost none; the cyclic
    garbage collector would rescan them over and over (half the run time for GPT-3)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build(args) -> dict:
    """Elaborate the spec and compute its report (a JSON-able dict)."""
    from tessera.compiler.analysis import costreport, deployment, roofline

    from tessera.compiler.analysis.plan import PlanError

    batches, seqs = _values(args.batch), _values(args.seq)
    for name, values in (("--batch", batches), ("--seq", seqs)):
        if any(v < 1 for v in values):
            raise pipeline.UsageError(f"{name} must be at least 1, got {min(values)}")
    if getattr(args, "plot", None) is not None:  # a bad path fails now, not after the report
        from .report_plot import check_plot_path

        check_plot_path(args.plot)
    try:
        device = roofline.get_device(args.device)
    except roofline.DeviceError as e:
        raise pipeline.UsageError(str(e)) from None
    config = pipeline.quant_config(args)
    with _no_gc():
        built = pipeline.build(args.spec, args.variant, args.sets)
        graph = built.graph
        if (not getattr(args, "no_sparse_moe", False) and config is None
                and any(n.op == "topk_gates" for n in graph.nodes.values())):
            from tessera.compiler.passes.sparse_moe import SparseExperts

            graph = graph.copy()  # as compile builds it: experts sparse (built.graph is left as written)
            SparseExperts()(graph)
        plan = deployment_plan(args)
        try:
            rep = costreport.build_report(
                graph, built.info.model, built.info.variant,
                {k: pipeline._jsonable(v) for k, v in built.info.hyperparams.items()},
                batch=batches[0], seq=seqs[0], dtype=args.dtype, device=device, plan=plan)
            if len(batches) * len(seqs) > 1:
                rep["sweep"] = deployment.sweep_rows(graph, batches, seqs, args.dtype, device, plan)
        except PlanError as e:
            raise pipeline.UsageError(str(e)) from None
    if getattr(args, "plot", None) is not None:
        from .report_plot import plot

        with _no_gc():
            plot(graph, rep, args.plot)
    from tessera.compiler.analysis.attention_report import attention_section

    with _no_gc():  # fuses a copy: built.graph is left as written
        rep["attention"] = attention_section(graph, rep["settings"]["bindings"],
                                             rep["settings"]["bytes_per_element"], device.name, args.dtype)
    if config is not None:
        from tessera.compiler.analysis.quant_report import quantization_section

        with _no_gc():  # quantises a copy
            rep["quantization"] = quantization_section(built.graph, config)
    return rep


def deployment_plan(args):
    """The --tp/--pp/--dp/--ep/--train/--zero/--recompute/--serve/--context flags as one Plan,
    or None when none of them is given (the report then has no deployment sections)."""
    from tessera.compiler.analysis.plan import Plan

    plan = Plan(tp=getattr(args, "tp", 1), pp=getattr(args, "pp", 1), dp=getattr(args, "dp", 1),
                ep=getattr(args, "ep", 1), train=getattr(args, "train", False), zero=getattr(args, "zero", 0),
                recompute=getattr(args, "recompute", "none"), serve=getattr(args, "serve", False),
                context=getattr(args, "context", None))
    return None if plan == Plan() else plan


def cmd_report(args) -> int:
    from . import report_format

    rep = build(args)
    if args.format == "json":
        print(json.dumps(rep, indent=2))
    elif args.format == "md":
        sys.stdout.write(report_format.markdown(rep))
    elif args.format == "csv":
        sys.stdout.write(report_format.csv_text(rep))
    else:
        from rich.console import Console

        report_format.print_table(rep, Console())
    if args.plot is not None:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
