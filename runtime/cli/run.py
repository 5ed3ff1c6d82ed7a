"""``tessera run``: run a spec or an ONNX file in onnxruntime and print its outputs.

The flags fill runtime/options.RunOptions; runtime/driver.run does the work; this module prints.
"""

from __future__ import annotations

import argparse
import sys


from tessera.runtime.cli import args
from tessera.runtime.options import ModelRef, RunOptions


def _full_help() -> str:
    from tessera.runtime.io import outputs as outputs_mod

    return (f"with --format json, print every value of every output; by default an output of more than "
            f"{outputs_mod.SUMMARY_ELEMENTS:,} elements is summarised (shape, dtype, min, max, mean and its first "
            f"{outputs_mod.HEAD_VALUES} values)")


def add_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("run", help="run a spec or an ONNX file in onnxruntime",
                       description="Run a .tsr spec (compiled on the fly) or an .onnx file and print its outputs.")
    args.model_args(r, f"a .tsr spec, a bundled spec's name ({args.bundled()}) or a compiled .onnx file", "MODEL")
    args.weights_args(r)
    args.optimize_args(r)
    r.add_argument("--input", "-i", dest="inputs", action="append", default=[], metavar="NAME=VALUE",
                   help="an input: a JSON array (e.g. 'tokens=[[1,2,3]]') or a .npy file (repeatable)")
    r.add_argument("--tokenizer", metavar="tokenizer.json",
                   help="a Hugging Face tokenizer.json to turn --text into the inputs tokens, mask and "
                        "token_types (those the model has); needs the 'text' extra (tokenizers)")
    r.add_argument("--text", dest="texts", action="append", default=[], metavar="TEXT",
                   help="a text to tokenize with --tokenizer (repeatable: a batch, right-padded to the longest)")
    r.add_argument("--image", dest="images", action="append", default=[], metavar="FILE",
                   help="an image for the input pixels, resized and normalised as Hugging Face's "
                        "ViTImageProcessor does (repeatable: a batch); needs the 'image' extra (Pillow)")
    r.add_argument("--pool", choices=["mean"],
                   help="print sentence embeddings instead of the raw outputs: the mean of the hidden states "
                        "over the mask, L2-normalised, and their cosine similarities")
    r.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto",
                   help="execution provider; auto takes CUDA when usable, else CPU (default auto)")
    r.add_argument("--format", choices=["table", "json"], default="table", help="output format (default table)")
    r.add_argument("--full", action="store_true", help=args.LazyHelp(_full_help))
    r.add_argument("--save", metavar="DIR",
                   help="also write each output to DIR/<name>.npy (created if missing; written atomically)")
    args.plot_args(r)

    return r


def cmd_run(ns: argparse.Namespace) -> int:
    from tessera.runtime import driver
    from tessera.runtime.io import outputs as outputs_mod

    o = RunOptions.from_args(ns)
    result = driver.run(ModelRef.from_args(ns), o)
    for written in result.written:
        print(f"wrote {written}", file=sys.stderr)
    if o.format == "json":
        outputs_mod.print_json(result.outputs, result.provider, full=o.full, stream=sys.stdout)
    else:
        _print_outputs(result.outputs, result.provider)
    return 0


def _print_outputs(outputs: dict[str, np.ndarray], provider: str) -> None:
    import numpy as np

    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"outputs (onnxruntime, {provider})")
    for col in ("name", "shape", "dtype", "min", "max", "mean"):
        table.add_column(col)
    for name, v in outputs.items():
        flat = v.reshape(-1)
        stats = ([f"{flat.min():.4g}", f"{flat.max():.4g}", f"{flat.mean(dtype=np.float64):.4g}"]
                 if flat.size else ["", "", ""])
        table.add_row(name, str(list(v.shape)), str(v.dtype), *stats)
    console.print(table)
    for name, v in outputs.items():
        with np.printoptions(precision=4, suppress=True, threshold=200, edgeitems=3, linewidth=100):
            console.print(f"{name} =", np.array2string(v), markup=False, highlight=False)
