"""The ``tessera`` command: compile, run, report, ir.

Every user error (a spec error, a bad --set, a weights file that does not
fit, a run input of the wrong shape) prints a clear message and exits with
status 2; a traceback means a bug in Tessera.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from tessera.compiler.ir.signature import InputError, input_limits, specs_from_graph
from tessera.spec import SpecError

from tessera.compiler.passes.pipeline import ATTENTION_CHOICES

from . import outputs as outputs_mod
from . import pipeline, report
from .weights import WeightsError
from tessera.compiler.backends.onnx.export import OutputError

EPILOG = """SPEC is a spec file (.tsr) or the name of a bundled spec ({bundled});
a path wins when that file exists.

examples:
  tessera report gpt2 --variant small
  tessera compile gpt2 --set layers=2 -o out/gpt2-tiny.onnx
  tessera run out/gpt2-tiny.onnx --input 'tokens=[[464, 2068, 7586]]'
  tessera run worked_example --input 'x=[[1,0],[0,1],[1,1]]'
  tessera report models/gpt2.tsr --variant small      (a spec file of your own)
  tessera run bert -V minilm_l6 --weights model.safetensors --tokenizer tokenizer.json \\
      --text "A man is eating food." --text "A man is eating a meal." --pool mean
  tessera run vit -V b16 --weights vit-b16.safetensors --image cat.png
"""


def _bundled() -> str:
    from tessera.models import bundled_names

    return ", ".join(bundled_names())


def _model_args(p: argparse.ArgumentParser, spec_help: str, metavar: str = "SPEC") -> None:
    p.add_argument("spec", metavar=metavar, help=spec_help)
    p.add_argument("--variant", "-V", help="a variant defined in the spec file (e.g. small, medium)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="override a hyperparameter (repeatable), checked like the spec's own values")


def _optimize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=["cpu", "cuda"], default="cpu",
                   help="where the model will run: picks the attention kernels and tile sizes (default cpu)")
    p.add_argument("--attention", choices=list(ATTENTION_CHOICES), default="auto",
                   help="attention lowering: auto picks a tiled kernel per site and target; gqa/mha force "
                        "onnxruntime's contrib kernels, portable Tessera's tiled Loop kernel, unfused the "
                        "primitive graph (default auto)")
    p.add_argument("--dtype", type=report.dtype_arg, choices=report.DTYPES, default="fp32",
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
    report.add_quant_arguments(p)
    p.add_argument("--explain", action="store_true",
                   help="list every attention site: fused or not and why, and the kernel chosen; and how each "
                        "recurrence (scan) is lowered")


def _weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the weight initialiser (default 0)")
    p.add_argument("--weights", metavar="FILE",
                   help="a .safetensors file or folder of shards; Hugging Face names are mapped by the "
                        "<spec>.hf.toml file beside the spec, and a folder's config.json gives the "
                        "hyperparameters its [config] table names (a value contradicting --set or the "
                        "variant is an error)")
    p.add_argument("--allow-large", action="store_true",
                   help="go ahead even when the weights look too large for the memory available (compile "
                        "streams them to the file one tensor at a time, so there only its largest tensor "
                        "and the free disk count) (by default such a model is refused before anything is "
                        "allocated or written)")


def _site_index(text: str) -> int:
    """An attention site's number (the sites over heads in graph order), for --layer and --attention-probs."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not an attention site number (0, 1, ...)")
    return int(text)


def _probs_sites(text: str) -> int | str:
    return "all" if text == "all" else _site_index(text)


def _head(text: str) -> int | str:
    if text == "mean" or text.isdigit():
        return text if text == "mean" else int(text)
    raise argparse.ArgumentTypeError(f"'{text}' is neither a head number (0, 1, ...) nor 'mean'")


def _batch_index(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not a batch row (0, 1, ...)")
    return int(text)


def _plot_args(r: argparse.ArgumentParser) -> None:
    g = r.add_argument_group("alignment plot (--plot-attention; runtime/alignment.py)")
    g.add_argument("--plot-attention", metavar="FILE.png",
                   help="also draw attention weights as an alignment heatmap (source tokens on x, target on "
                        "y, grey scale 0 to 1), as Bahdanau et al. 2015 fig. 3; needs the 'plot' extra "
                        "(matplotlib); format from the suffix; written atomically")
    g.add_argument("--attention-output", metavar="NAME",
                   help="the model output holding the weights, [B, Tq, Tk] (or [Tq, Tk], [B, H, Tq, Tk]); "
                        "default: the only output named with align, attn, attention, probs or weights")
    g.add_argument("--layer", type=_site_index, metavar="L",
                   help="plot transformer attention site L (the sites over heads numbered in graph order; "
                        "layer L of GPT-2, BERT, Llama): from a spec its probabilities are exposed as an extra output and that "
                        "site is left unfused; an .onnx file must have been compiled with --attention-probs L")
    g.add_argument("--head", type=_head, metavar="H|mean",
                   help="for weights over heads [B, H, Tq, Tk]: head H, or mean (default) over the heads")
    g.add_argument("--batch-index", type=_batch_index, metavar="N",
                   help="which batch row to plot (default 0)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG.format(bundled=_bundled()),
        description="Compile transformer specs (.tsr) to ONNX, run them in onnxruntime, and report their cost.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a spec to an ONNX file",
                       description="Elaborate a spec, fill its weights (seeded or from a checkpoint) and write "
                                   "ONNX (opset 21, IR version 10; 23 for a KV-cached decoder with rotary positions) with "
                                   "batch and sequence as dynamic dims.")
    _model_args(c, f"a spec file (.tsr) or a bundled spec's name ({_bundled()})")
    _weights_args(c)
    _optimize_args(c)
    c.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write the model")
    c.add_argument("--no-check", action="store_true", help="skip onnx.checker's full check of the result")
    c.add_argument("--kv-cache", action="store_true",
                   help="compile the KV-cached decoder that `tessera generate OUT.onnx` loads (decoder-only "
                        "models; logits of the last position only); --explain then also lists the attention "
                        "kernel chosen for prefill and decode")
    c.add_argument("--cache", choices=["auto", "buffer", "concat"], default="auto",
                   help="with --kv-cache: buffer (preallocated, written in place), concat (present = past + new), "
                        "or auto: buffer, or concat for sliding-window models (default)")
    c.add_argument("--decode", choices=["auto", "gqa", "plain"], default="auto",
                   help="with --kv-cache, the buffer cache: each decoding step's attention as onnxruntime's "
                        "GroupQueryAttention writing the cache buffer in place (gqa), or plain MatMul/Softmax "
                        "(plain); auto (default): gqa on CPU where it applies (float32, head size a multiple of "
                        "8), else plain")
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
                   type=_probs_sites, metavar="L|all",
                   help="also output the probabilities [B, heads, Tq, Tk] of attention site L (numbered in "
                        "graph order, as run --layer) as attention_probs.L, leaving that site unfused, for `tessera run "
                        "--plot-attention --layer L`; repeatable; all: every site")

    r = sub.add_parser("run", help="run a spec or an ONNX file in onnxruntime",
                       description="Run a .tsr spec (compiled on the fly) or an .onnx file and print its outputs.")
    _model_args(r, f"a .tsr spec, a bundled spec's name ({_bundled()}) or a compiled .onnx file", "MODEL")
    _weights_args(r)
    _optimize_args(r)
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
    r.add_argument("--full", action="store_true",
                   help=f"with --format json, print every value of every output; by default an output of more "
                        f"than {outputs_mod.SUMMARY_ELEMENTS:,} elements is summarised (shape, dtype, min, max, mean "
                        f"and its first {outputs_mod.HEAD_VALUES} values)")
    r.add_argument("--save", metavar="DIR",
                   help="also write each output to DIR/<name>.npy (created if missing; written atomically)")
    _plot_args(r)

    rep = sub.add_parser("report", help="print the static cost report of a spec",
                         description="Parameters, multiply-adds, FLOPs, memory and roofline times of a spec, "
                                     "exact and symbolic in B and N, from the graph alone (no weights are "
                                     "allocated). JSON keys: docs/report.md.")
    _model_args(rep, f"a spec file (.tsr) or a bundled spec's name ({_bundled()})")
    report.add_arguments(rep)

    ir = sub.add_parser("ir", help="print the elaborated IR graph of a spec")
    _model_args(ir, f"a spec file (.tsr) or a bundled spec's name ({_bundled()})")
    from . import generate_cli

    generate_cli.add_parser(sub)
    from .serving import cli as serve_cli

    serve_cli.add_parser(sub)
    from .serving import batch as batch_cli

    batch_cli.add_parser(sub)
    return parser


class _Terminated(BaseException):
    """SIGTERM, raised where the program is so that cleanup (temporary output files) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from .generate_cli import cmd_generate
        from .serving.batch import cmd_batch
        from .serving.cli import cmd_serve

        return {"compile": cmd_compile, "run": cmd_run, "report": report.cmd_report, "ir": cmd_ir,
                "generate": cmd_generate, "serve": cmd_serve, "batch": cmd_batch}[args.command](args)
    except KeyboardInterrupt:
        print("interrupted; no output was changed", file=sys.stderr)
        return 130
    except _Terminated:
        print("terminated; no output was changed", file=sys.stderr)
        return 143
    except SpecError as e:
        print(e.render(), file=sys.stderr)
    except (pipeline.UsageError, WeightsError, InputError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
    except BrokenPipeError:  # output piped into head and closed early
        sys.stderr.close()
        return 0
    except Exception as e:
        from .session import ModelFileError, ProviderError, RunError

        if isinstance(e, (ProviderError, RunError, ModelFileError)):
            print(f"error: {e}", file=sys.stderr)
        else:
            raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    return 2


def cmd_compile(args) -> int:
    t0 = time.perf_counter()
    if args.genai:
        from . import genai

        genai.check_options(args)
        if not args.tokenizer:
            raise pipeline.UsageError("--genai needs --tokenizer tokenizer.json: onnxruntime-genai reads the tokenizer "
                                      "and the end-of-sequence token from the folder")
        genai.Tokenizer(Path(args.tokenizer))  # a tokenizer genai cannot read is refused before the compile
        args.kv_cache = True
        args.cache = "concat"
    elif args.tokenizer or args.context_length is not None:
        raise pipeline.UsageError(f"{'--tokenizer' if args.tokenizer else '--context-length'} applies to --genai "
                                  f"(the folder for onnxruntime-genai)")
    built = pipeline.build(args.spec, args.variant, args.sets, args.weights)
    params = built.graph.param_count()  # before quantisation packs them
    pipeline.check_disk(built, args.output, args.allow_large)
    weights = pipeline.weights_for(built, args.weights, args.seed, args.allow_large, streaming=True)
    if args.kv_cache:
        files = _compile_cached(built, weights, args)
    else:
        if args.cache != "auto":
            raise pipeline.UsageError("--cache applies with --kv-cache")
        if args.decode != "auto":
            raise pipeline.UsageError("--decode applies with --kv-cache")
        sites = args.attention_probs
        pipeline.optimize(built, args, attention_probs=[s for s in sites if s != "all"], all_probs="all" in sites)
        files = pipeline.export(built, weights, args.output, check=not args.no_check)
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {', '.join(map(str, files))}: {built.graph.name}"
          f"{' (' + built.info.variant + ')' if built.info.variant else ''}, "
          f"{params:,} parameters{' (' + built.quantize.scheme + ')' if built.quantize else ''}, {size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s")
    return 0


def _compile_cached(built, weights, args) -> list[Path]:
    """--kv-cache: the cached decoder (compiler/passes/kv_cache.py), its kernels chosen per phase."""
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes.attention_kernels import Target
    from tessera.compiler.passes.pipeline import explain

    from . import generate as gen

    if args.attention_probs:
        raise pipeline.UsageError("--attention-probs applies to the full model, not to --kv-cache's cached decoder")
    if args.no_fuse or args.attention != "auto":
        raise pipeline.UsageError("--kv-cache chooses the attention kernels per phase itself: it takes neither "
                                  "--no-fuse nor --attention")
    if args.genai and len(built.graph.inputs) != 1:
        raise pipeline.UsageError(f"--genai writes decoder-only models (one input, the token ids) for onnxruntime-genai's "
                                  f"decoder state; {built.graph.name} takes {', '.join(built.graph.inputs)} "
                                  f"(encoder-decoders are not supported)")
    pipeline.quantize(built, pipeline.quant_config(args))  # the cached graph inherits the quantised linears
    model, info = gen.compile_cached(built, weights, mode=args.cache, target=Target(args.target, args.dtype),
                                     sparse_moe=not args.no_sparse_moe,
                                     dtype=args.dtype, decode=args.decode)
    if args.explain:
        print(explain(built.attention_sites) + "\n" + info.explain(), file=sys.stderr)
    verify = None if args.no_check else onnx_export.check
    if args.genai:
        from . import genai

        return genai.write_folder(args.output, built.graph, info, model, args.tokenizer, args.weights, verify,
                                  context=args.context_length)
    # external data always: onnxruntime maps the weights from the .data file instead of copying them out of
    # the parsed model, so the generating process holds them once (docs/generate.md)
    return onnx_export.save(model, args.output, verify=verify, external=True)


def cmd_run(args) -> int:
    from .inputs import parse_inputs
    from .session import onnx_signature, open_session, run_session

    _check_text_args(args)
    _check_plot_args(args)
    if args.full and args.format != "json":
        raise pipeline.UsageError("--full applies to --format json (the table always summarises)")
    if args.save is not None:
        outputs_mod.check_folder(args.save)
    if args.plot_attention is not None:
        from . import alignment_plot

        alignment_plot.check_path(args.plot_attention)  # before the model is built or run
    exposed: list = []
    path = Path(args.spec)
    if path.suffix == ".onnx":
        if args.variant or args.sets or args.weights:
            raise pipeline.UsageError("--variant, --set and --weights apply to .tsr specs; an .onnx file is "
                                      "already compiled")
        if not path.exists():
            raise pipeline.UsageError(f"model file not found: {path}")
        specs, limits = onnx_signature(path)
        source: str | bytes = str(path)
    else:
        built = pipeline.build(args.spec, args.variant, args.sets, args.weights)
        specs, limits = specs_from_graph(built.graph), input_limits(built.graph)
        from tessera.compiler.backends.onnx import export as onnx_export

        weights = pipeline.weights_for(built, args.weights, args.seed, args.allow_large)
        probs = [args.layer] if args.plot_attention is not None and args.layer is not None else None
        exposed = pipeline.optimize(built, args, attention_probs=probs)
        source = onnx_export.to_bytes(built.graph, weights)
    feeds = parse_inputs(args.inputs, specs)
    text_mask = _add_text_and_image_inputs(args, specs, feeds)
    from tessera.compiler.ir.signature import bind_inputs

    bind_inputs(specs, feeds, limits)
    sess = open_session(source, args.provider)
    outputs = run_session(sess, feeds)
    provider = sess.get_providers()[0]
    if args.plot_attention is not None:
        _plot_attention(args, sess, outputs, specs, feeds, limits, model=str(path))
        for e in exposed:  # exposed only to be drawn: the outputs printed are the model's own
            outputs.pop(e.output, None)
    if args.pool:
        outputs = _pool(outputs, feeds.get("mask", text_mask))
    if args.save is not None:
        for written in outputs_mod.save_npy(outputs, args.save):
            print(f"wrote {written}", file=sys.stderr)
    if args.format == "json":
        outputs_mod.print_json(outputs, provider, full=args.full, stream=sys.stdout)
    else:
        _print_outputs(outputs, provider)
    return 0


def _check_text_args(args) -> None:
    if args.texts and not args.tokenizer:
        raise pipeline.UsageError("--text needs --tokenizer tokenizer.json to turn the text into token ids")
    if args.tokenizer and not args.texts and args.plot_attention is None:
        raise pipeline.UsageError("--tokenizer is given but no --text to tokenize")


def _check_plot_args(args) -> None:
    """The alignment options need --plot-attention, and --layer and --attention-output exclude each other."""
    if args.plot_attention is None:
        given = [flag for flag, value in (("--attention-output", args.attention_output), ("--layer", args.layer),
                                          ("--head", args.head), ("--batch-index", args.batch_index))
                 if value is not None]
        if given:
            raise pipeline.UsageError(f"{given[0]} applies with --plot-attention FILE.png")
    elif args.layer is not None and args.attention_output is not None:
        raise pipeline.UsageError("--layer and --attention-output both choose the weights to plot; give one")


def _plot_attention(args, sess, outputs, specs, feeds, limits, model: str) -> None:
    """Choose the weights, compute the alignment (runtime/alignment.py) and draw it."""
    from . import alignment, alignment_plot

    tokenizer = None
    if args.tokenizer:
        from . import text

        tokenizer = text.load_tokenizer(args.tokenizer)
    al = alignment.from_run(sess, outputs, specs, feeds, limits, args.attention_output, args.layer,
                            args.batch_index or 0, args.head, tokenizer, model)
    lo, hi = float(al.matrix.min(initial=0.0)), float(al.matrix.max(initial=0.0))
    if lo < -1e-6 or hi > 1 + 1e-6:
        print(f"note: {al.output} holds values from {lo:.4g} to {hi:.4g}, not attention weights in [0, 1]; the "
              f"grey scale clips them to [0, 1]", file=sys.stderr)
    written = alignment_plot.draw(al, args.plot_attention)
    print(f"wrote {written}: alignment of {al.output} ({al.what}), {al.matrix.shape[0]} x {al.matrix.shape[1]}",
          file=sys.stderr)


def _add_text_and_image_inputs(args, specs, feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """Fill inputs from --tokenizer/--text and --image; returns the text batch's mask (None without text)."""
    new: dict[str, np.ndarray] = {}
    mask = None
    if args.texts:
        from . import text

        enc = text.encode(text.load_tokenizer(args.tokenizer), args.texts)
        new.update(text.text_feeds(enc, specs))
        mask = enc.mask
        if "mask" not in new and len(set(enc.lengths)) > 1:
            print(f"note: the texts have {', '.join(map(str, enc.lengths))} tokens and are right-padded to "
                  f"{max(enc.lengths)}; the model has no mask input, so outputs past each text's length are "
                  f"padding", file=sys.stderr)
    if args.images:
        from . import image

        new.update(image.image_feeds(args.images, specs))
    for name, value in new.items():
        if name in feeds:
            source = "--image" if args.images and value.ndim == 4 else "--text"
            raise pipeline.UsageError(f"input '{name}' is given both by --input and by {source}")
        feeds[name] = value
    return mask


def _pool(outputs: dict[str, np.ndarray], mask: np.ndarray | None) -> dict[str, np.ndarray]:
    from . import text

    hidden = outputs[text.hidden_output(outputs)]
    if mask is None:
        print("note: --pool mean without --text or a mask input averages over every position", file=sys.stderr)
    emb = text.mean_pool(hidden, mask)
    return {"embedding": emb, "similarity": (emb @ emb.T).astype(np.float32)}


def _print_outputs(outputs: dict[str, np.ndarray], provider: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"outputs (onnxruntime, {provider})")
    for col in ("name", "shape", "dtype", "min", "max", "mean"):
        table.add_column(col)
    for name, v in outputs.items():
        flat = v.reshape(-1)
        stats = ([f"{flat.min():.4g}", f"{flat.max():.4g}", f"{flat.astype(np.float64).mean():.4g}"]
                 if flat.size else ["", "", ""])
        table.add_row(name, str(list(v.shape)), str(v.dtype), *stats)
    console.print(table)
    for name, v in outputs.items():
        with np.printoptions(precision=4, suppress=True, threshold=200, edgeitems=3, linewidth=100):
            console.print(f"{name} =", np.array2string(v), markup=False, highlight=False)


def cmd_ir(args) -> int:
    built = pipeline.build(args.spec, args.variant, args.sets)
    print(built.graph.dump())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
