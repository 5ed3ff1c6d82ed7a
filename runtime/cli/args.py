"""Argument groups more than one command shares, and the value parsers argparse uses.

Why one module: a flag that compile, run and generate all take is declared once here, so its
spelling, default and help cannot differ between them. Each group only fills fields of the
option objects (runtime/options.py); no rule about the values lives here.
"""

from __future__ import annotations

import argparse

from tessera.runtime import options

# --dtype names the precision as fp32/fp16/bf16; the spec language spells element types f32/f16/bf16,
# so those spellings are accepted and mean the same.
DTYPES = list(options.DTYPES)
_DTYPE_ALIASES = {"f32": "fp32", "f16": "fp16"}


def dtype_arg(text: str) -> str:
    """--dtype's value in the command's spelling (f16 -> fp16); argparse checks it against DTYPES."""
    return _DTYPE_ALIASES.get(text, text)


# --quantize and its details, and every other compile option all commands take: declared with their
# fields (options.QuantOptions, options.BuildOptions), since `tessera serve` and `tessera batch`
# (runtime/serving/, which does not import the command line) take them too
add_quant_arguments = options.add_quant_arguments
add_build_arguments = options.add_build_arguments


def model_args(p: argparse.ArgumentParser, spec_help: str, metavar: str = "SPEC") -> None:
    """SPEC, --variant and --set: options.ModelRef's flags (declared with its fields)."""
    options.add_arguments(p, options.ModelRef, {"spec": spec_help}, only=("spec", "variant", "sets"),
                          spec={"metavar": metavar})


class LazyChoices:
    """argparse choices read on first use: the attention kernels are the compiler's
    (compiler/passes/pipeline.py), which imports onnx, so building the parsers (every command, even
    `tessera --help`) must not read them; checking a value or printing a command's help does."""

    def __init__(self, load):
        self._load = load

    def __iter__(self):
        return iter(self._load())

    def __contains__(self, value) -> bool:
        return value in self._load()


class LazyHelp(str):
    """A help text computed when help is printed (argparse %-formats every help text then): the
    report's device names and the run command's summary limits live in modules that import the
    compiler or numpy, which building the parsers must not import. ``text`` is a function."""

    def __new__(cls, text):
        self = super().__new__(cls, "help")  # non-empty: argparse skips an empty help
        self.text = text
        return self

    def __mod__(self, params):
        return self.text() % params


def optimize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=["cpu", "cuda"], default="cpu",
                   help="where the model will run: picks the attention kernels and tile sizes (default cpu)")
    p.add_argument("--attention", choices=LazyChoices(options.attention_choices), default="auto", metavar="KERNEL",
                   help="attention lowering, one of %(choices)s: auto picks a tiled kernel per site and target; "
                        "gqa/mha force onnxruntime's contrib kernels, portable Tessera's tiled Loop kernel, unfused "
                        "the primitive graph (default auto)")
    p.add_argument("--dtype", type=dtype_arg, choices=DTYPES, default="fp32",
                   help="precision of weights and computation (the model's inputs and outputs stay fp32); "
                        "also picks the attention kernels; the spec spellings f32 and f16 are accepted too "
                        "(default fp32; bf16 is not exported yet)")
    p.add_argument("--no-fuse", action="store_true", help="do not fuse attention (same as --attention unfused)")
    p.add_argument("--no-sparse-moe", action="store_true",
                   help="keep mixtures of experts dense (every expert runs on every token, the unselected "
                        "ones weighed by zero) instead of running each token's top-k experts only")
    p.add_argument("--recurrence", choices=["auto", "scan"], default="auto",
                   help="lowering of scans (recurrent layers): auto uses onnx's RNN/GRU/LSTM op where the step "
                        "is exactly that cell, scan always an ONNX Scan of the step (default auto)")
    add_build_arguments(p)
    p.add_argument("--explain", action="store_true",
                   help="list every attention site: fused or not and why, and the kernel chosen; and how each "
                        "recurrence (scan) is lowered; for a GGUF file which tensors were dequantised from which type")


def weights_args(p: argparse.ArgumentParser) -> None:
    """--seed, --weights and --allow-large: options.ModelRef's flags (declared with its fields)."""
    options.add_arguments(p, options.ModelRef, only=("seed", "weights", "allow_large"))


def site_index(text: str) -> int:
    """An attention site's number (the sites over heads in graph order), for --layer and --attention-probs."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not an attention site number (0, 1, ...)")
    return int(text)


def probs_sites(text: str) -> int | str:
    return "all" if text == "all" else site_index(text)


def head_arg(text: str) -> int | str:
    if text == "mean" or text.isdigit():
        return text if text == "mean" else int(text)
    raise argparse.ArgumentTypeError(f"'{text}' is neither a head number (0, 1, ...) nor 'mean'")


def batch_index_arg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not a batch row (0, 1, ...)")
    return int(text)


def plot_args(r: argparse.ArgumentParser) -> None:
    g = r.add_argument_group("alignment plot (--plot-attention; runtime/report/alignment.py)")
    g.add_argument("--plot-attention", metavar="FILE.png",
                   help="also draw attention weights as an alignment heatmap (source tokens on x, target on "
                        "y, grey scale 0 to 1), as Bahdanau et al. 2015 fig. 3; needs the 'plot' extra "
                        "(matplotlib); format from the suffix; written atomically")
    g.add_argument("--attention-output", metavar="NAME",
                   help="the model output holding the weights, [B, Tq, Tk] (or [Tq, Tk], [B, H, Tq, Tk]); "
                        "default: the only output named with align, attn, attention, probs or weights")
    g.add_argument("--layer", type=site_index, metavar="L",
                   help="plot transformer attention site L (the sites over heads numbered in graph order; "
                        "layer L of GPT-2, BERT, Llama): from a spec its probabilities are exposed as an extra output and that "
                        "site is left unfused; an .onnx file must have been compiled with --attention-probs L")
    g.add_argument("--head", type=head_arg, metavar="H|mean",
                   help="for weights over heads [B, H, Tq, Tk]: head H, or mean (default) over the heads")
    g.add_argument("--batch-index", type=batch_index_arg, metavar="N",
                   help="which batch row to plot (default 0)")


def bundled() -> str:
    """The bundled specs' names, for the help texts."""
    from tessera.models import bundled_names

    return ", ".join(bundled_names())
