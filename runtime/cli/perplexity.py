"""``tessera perplexity``: a causal language model's perplexity on a text file.

The flags fill runtime/options.PerplexityOptions; runtime/driver.perplexity does the work (its
docstring and perplexity_windows say which tokens are scored); this module prints the figure.
"""

from __future__ import annotations

import argparse
import json
import sys

from tessera.runtime import options
from tessera.runtime.cli import args
from tessera.runtime.options import PERPLEXITY_FORMATS, PROVIDERS, CompileCacheOptions, ModelRef, PerplexityOptions


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("perplexity", help="a language model's perplexity on a text file",
                       description="The perplexity of a causal language model (a spec, a checkpoint folder or a "
                                   "GGUF file) on a text file: by default llama.cpp's llama-perplexity figure "
                                   "(non-overlapping windows of --context tokens, each scoring the second half "
                                   "of its tokens); with --stride, transformers' sliding window. The model is "
                                   "compiled as `tessera run` compiles it (--quantize ... as there).")
    args.model_args(p, "a .tsr spec, a bundled spec's name, a Hugging Face checkpoint folder or a .gguf file",
                    "MODEL")
    args.weights_args(p)
    p.add_argument("--text", required=True, metavar="FILE", help="the text file (UTF-8) to score")
    p.add_argument("--tokenizer", metavar="tokenizer.json",
                   help="a Hugging Face tokenizer.json (or its folder); a checkpoint folder or a GGUF file as the "
                        "model brings its own")
    p.add_argument("--context", type=int, default=512, metavar="N",
                   help="tokens per window (default 512, llama-perplexity's -c default)")
    p.add_argument("--stride", type=int, metavar="S",
                   help="overlapping windows every S tokens (at most --context), each scoring the tokens no "
                        "earlier window scored, over the whole text: transformers' sliding-window perplexity "
                        "(by default non-overlapping windows scoring their second half: llama.cpp's)")
    args.add_quant_arguments(p)
    options.add_arguments(p, CompileCacheOptions)  # --compile-cache DIR, --no-compile-cache
    options.add_arguments(p, PerplexityOptions, only=("gguf_weights",))
    p.add_argument("--provider", choices=list(PROVIDERS), default="auto",
                   help="execution provider; auto takes CUDA when usable, else CPU (default auto)")
    p.add_argument("--format", choices=list(PERPLEXITY_FORMATS), default="text",
                   help="text: one line; json: the figure with its windows, tokens and convention (default text)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar on stderr")
    return p


def cmd_perplexity(ns: argparse.Namespace) -> int:
    from tessera.runtime import driver
    from tessera.runtime.progress import Progress

    o = PerplexityOptions.from_args(ns)
    with Progress("perplexity", "windows", quiet=o.quiet) as progress:
        result = driver.perplexity(ModelRef.from_args(ns), o, progress=progress)
    if o.format == "json":
        json.dump(result.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(result.line())
    return 0
