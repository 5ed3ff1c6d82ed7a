"""``tessera compile``: a spec to an ONNX file, a KV-cached decoder or an onnxruntime-genai folder.

The flags fill runtime/options.CompileOptions; runtime/driver.compile does the work.
"""

from __future__ import annotations

import argparse

from tessera.runtime.cli import args
from tessera.runtime.options import CompileOptions, ModelRef


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("compile", help="compile a spec to an ONNX file",
                       description="Elaborate a spec, fill its weights (seeded or from a checkpoint) and write "
                                   "ONNX (opset 21, IR version 10; 23 for a KV-cached decoder with rotary positions) with "
                                   "batch and sequence as dynamic dims.")
    args.model_args(c, f"a spec file (.tsr) or a bundled spec's name ({args.bundled()})")
    args.weights_args(c)
    args.optimize_args(c)
    c.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write the model")
    c.add_argument("--no-check", action="store_true", help="skip onnx.checker's full check of the result")
    c.add_argument("--quiet", "-q", action="store_true",
                   help="no progress on stderr (by default a bar while the weights are written when stderr is a "
                        "terminal, else one summary line)")
    c.add_argument("--kv-cache", action="store_true",
                   help="compile the KV-cached decoder that `tessera generate OUT.onnx` loads (decoder-only "
                        "models; logits of the last position only); --explain then also lists the attention "
                        "kernel chosen for prefill and decode")
    c.add_argument("--cache", choices=["auto", "buffer", "concat"], default="auto",
                   help="with --kv-cache: buffer (preallocated, written in place), concat (present = past + new), "
                        "or auto: buffer, or concat for sliding-window models (default)")
    c.add_argument("--decode", choices=["auto", "gqa", "gqa-unpacked", "plain"], default="auto",
                   help="with --kv-cache, the buffer cache: each decoding step's attention as onnxruntime's "
                        "GroupQueryAttention writing the cache buffer in place (gqa), or plain MatMul/Softmax "
                        "(plain); auto (default): gqa on CPU where it applies (float32, head size a multiple of "
                        "8), else plain; gqa-unpacked: gqa fed split, rotated q/k/v rather than the packed "
                        "q+k+v projection with rotary inside the kernel (for before/after comparisons)")
    c.add_argument("--combined-call", action="store_true",
                   help="with --kv-cache: also build the serving engine's combined call, so that `tessera serve "
                        "OUT.onnx` runs each iteration's decoding rows and prompt chunk in one onnxruntime call "
                        "(as it does when it compiles a spec itself); generate's decoding step is unchanged, its "
                        "prompt runs one more If per attention site. Needs GroupQueryAttention decoding (not "
                        "--decode plain)")
    c.add_argument("--genai", action="store_true",
                   help="write an onnxruntime-genai model folder at -o FOLDER: the KV-cached decoder (implies "
                        "--kv-cache; the concat cache) as model.onnx, its genai_config.json and the tokenizer "
                        "files (needs --tokenizer); written atomically")
    c.add_argument("--tokenizer", metavar="tokenizer.json",
                   help="with --genai: the Hugging Face tokenizer.json copied into the folder (with the "
                        "tokenizer_config.json and chat template beside it, if any); with the configs beside it "
                        "or in a --weights folder it gives the end-of-sequence, start and padding token ids")
    c.add_argument("--context-length", type=int, metavar="N",
                   help="with --genai: the context length written to genai_config.json (also its default max_length); "
                        "by default the model's own (its position table's rows or rotary rope_max_ctx), and needed "
                        "when it has none")
    c.add_argument("--attention-probs", dest="attention_probs", action="append", default=[],
                   type=args.probs_sites, metavar="L|all",
                   help="also output the probabilities [B, heads, Tq, Tk] of attention site L (numbered in "
                        "graph order, as run --layer) as attention_probs.L, leaving that site unfused, for `tessera run "
                        "--plot-attention --layer L`; repeatable; all: every site")

    return c


def cmd_compile(ns: argparse.Namespace) -> int:
    from tessera.runtime import driver

    from tessera.runtime.progress import Progress

    o = CompileOptions.from_args(ns)
    with Progress("writing the weights", "bytes", quiet=o.quiet) as progress:
        done = driver.compile(ModelRef.from_args(ns), o, progress=progress)
    built, files = done.built, done.files
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {', '.join(map(str, files))}: {built.graph.name}"
          f"{' (' + built.info.variant + ')' if built.info.variant else ''}, "
          f"{done.params:,} parameters{' (' + built.quantize.scheme + ')' if built.quantize else ''}, "
          f"{size / 1e6:.1f} MB, {done.seconds:.1f} s")
    return 0
