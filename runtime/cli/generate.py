"""``tessera generate``: text or token ids in, generated tokens out, with a KV cache.

Kept apart from cli.py (which only registers the subcommand and dispatches to
``cmd_generate``) so the decoding options live with the decoding loop. Every
bad value is a UsageError: a clear message and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tessera.runtime.generation import cached as gen
from tessera.runtime.pipeline import UsageError

EXAMPLES = """examples:
  tessera generate models/gpt2.tsr -V small --weights gpt2/model.safetensors \\
      --tokenizer gpt2/tokenizer.json --prompt "The quick brown fox" --max-new-tokens 40
  tessera generate models/gpt2.tsr --set layers=2 --input 'tokens=[[464, 2068], [7586]]' --max-new-tokens 8
  tessera generate models/llama.tsr -V llama3_8b --weights llama3/ --tokenizer llama3/tokenizer.json \\
      --prompt "Hello" --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1 --stop "<|eot_id|>"
"""


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text or tokens with a KV cache",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                       description="Compile a decoder-only spec with a KV cache (or load one compiled so) and "
                                   "generate: prefill the prompts once, then one token per step. Prompts of "
                                   "different lengths are left-padded and masked.")
    g.add_argument("spec", metavar="MODEL", help="a .tsr spec, or an .onnx file (or folder) compiled with a KV cache")
    g.add_argument("--variant", "-V", help="a variant defined in the spec file (e.g. small)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="override a hyperparameter (repeatable)")
    g.add_argument("--weights", metavar="FILE", help="a .safetensors file or folder of shards (else seeded weights); "
                   "a folder's config.json gives the hyperparameters the mapping file's [config] table names")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler, and of the weight initialiser without --weights (default 0)")
    g.add_argument("--tokenizer", metavar="tokenizer.json", help="a Hugging Face tokenizer.json for --prompt and "
                   "for printing text")
    g.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeatable: a batch); needs --tokenizer")
    g.add_argument("--input", "-i", dest="inputs", action="append", default=[], metavar="NAME=JSON",
                   help="token ids as JSON, a list of lists: the prompts (tokens=..., one list per prompt, of any "
                        "lengths); for an encoder-decoder also its source inputs (e.g. src=... and src_mask=..., "
                        "rows of one length) and optionally the target prompts (e.g. tgt=...)")
    g.add_argument("--start-token", type=int, metavar="ID",
                   help="an encoder-decoder's decoder start token, when no target prompt is given")
    g.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest set of tokens whose probability reaches P, in (0, 1] (default 1)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the scores of tokens already present by R (> 0; 1 is none)")
    g.add_argument("--stop", dest="stops", action="append", default=[], metavar="TEXT",
                   help="end a prompt's generation at this text (repeatable; needs --tokenizer)")
    g.add_argument("--stop-token", dest="stop_tokens", action="append", default=[], type=int, metavar="ID",
                   help="end a prompt's generation at this token id (repeatable)")
    g.add_argument("--format", choices=["text", "json"], default="text", help="output format (default text)")
    from tessera.runtime.cli.report import add_quant_arguments

    add_quant_arguments(g)
    g.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    g.add_argument("--cache", choices=["auto", "buffer", "concat"], default="auto",
                   help="buffer: preallocated cache, written in place; concat: present = past + new, fed back; "
                        "auto: buffer, or concat for sliding-window models (default)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress line on stderr")
    return g


def _json_rows(name: str, text: str) -> list[list[int]]:
    """--input NAME=JSON: one list of integer ids per row (a flat list is one row)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--input {name}: not a JSON list ({e.msg} at character {e.pos})") from None
    if isinstance(data, list) and data and all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        data = [data]
    if not isinstance(data, list) or not data or not all(isinstance(p, list) for p in data):
        raise UsageError(f"--input {name} must be a list of rows, each a list of token ids, e.g. {name}=[[464, 2068]]")
    for i, p in enumerate(data):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise UsageError(f"--input {name}: row {i} holds something other than integer token ids")
    return data


def _named_inputs(items: list[str], allowed: list[str]) -> dict[str, list[list[int]]]:
    """Every --input NAME=JSON, each NAME one of the model's inputs and given once."""
    from tessera.spec.diagnostics import did_you_mean

    out: dict[str, list[list[int]]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"--input '{item}' must be NAME=JSON, e.g. '{allowed[0]}=[[464, 2068], [7586]]'")
        if name not in allowed:
            raise UsageError(f"--input {name}: the model has no such input (its inputs: {', '.join(allowed)})"
                             + did_you_mean(name, allowed))
        if name in out:
            raise UsageError(f"--input {name} is given more than once; give every row in one list: "
                             f"'{name}=[[...], [...]]'")
        out[name] = _json_rows(name, text)
    return out


def target_input(graph) -> str | None:
    """An encoder-decoder's target input: the integer [B, T] input whose T is the logits' sequence
    axis (the other inputs are the source). None for a decoder-only model (a single input)."""
    from tessera.compiler.ir import dims

    if len(graph.inputs) < 2 or len(graph.outputs) != 1 or graph.type_of(graph.outputs[0]).rank != 3:
        return None
    t = graph.type_of(graph.outputs[0]).shape[1]
    hits = [i for i in graph.inputs if graph.type_of(i).dtype in ("i64", "i32") and graph.type_of(i).rank == 2
            and dims.equal(graph.type_of(i).shape[1], t)]
    return hits[0] if len(hits) == 1 else None


class EncoderDecoder:
    """An encoder-decoder spec compiled for generation: the encoder part (run once per source batch, with
    every layer's cross-attention keys and values), the cached decoder, and the names of the target
    input (the prompt the cache extends) and of the source inputs."""

    def __init__(self, built, weights, target: str, threads: int | None):
        from tessera.compiler.ir.signature import input_limits

        self.target = target
        self.sources = [i for i in built.graph.inputs if i != target]
        self.limits = input_limits(built.graph)
        enc, dec, info, boundary = gen.compile_seq2seq(built, weights, target)
        decoder = gen.CachedModel(dec.SerializeToString(), info, threads=threads)
        self.s2s = gen.Seq2Seq(enc.SerializeToString(), decoder, boundary)

    def fixed_feeds(self, given: dict[str, list[list[int]]], rows: int) -> dict:
        """The decoder's fixed inputs (the encoder's outputs) for the source rows given."""
        import numpy as np

        missing = [s for s in self.sources if s not in given]
        if missing:
            raise UsageError(f"an encoder-decoder needs its source inputs: give --input {missing[0]}=[[...]] "
                             f"(the model's source inputs: {', '.join(self.sources)})")
        feeds = {}
        for name in self.sources:
            data = given[name]
            if len({len(r) for r in data}) != 1 or not data[0]:
                raise UsageError(f"--input {name}: the rows must have one length, at least 1 (pad them, and mark "
                                 f"the padding in the source mask)")
            if len(data) != rows:
                raise UsageError(f"--input {name} has {len(data)} rows but there are {rows} target prompts")
            feeds[name] = np.array(data, dtype=np.int64)
        from tessera.compiler.ir.signature import check_limits

        check_limits(self.limits, feeds, {})  # ids within their tables (InputError: a clear message)
        return self.s2s.encode(feeds)


def load_model(args):
    """A CachedModel (decoder-only) or an EncoderDecoder, from a .tsr spec or a compiled .onnx file."""
    path = Path(args.spec)
    from tessera.runtime import pipeline

    config = pipeline.quant_config(args)
    if path.suffix == ".onnx" or path.is_dir():
        if args.variant or args.sets or args.weights or config is not None:
            raise UsageError("--variant, --set, --weights and --quantize apply to .tsr specs; an .onnx file is "
                             "already compiled")
        return gen.CachedModel.from_onnx(path, threads=args.threads)
    built = pipeline.build(args.spec, args.variant, args.sets, args.weights)
    weights = pipeline.weights_for(built, args.weights, args.seed)
    pipeline.quantize(built, config)
    target = target_input(built.graph)
    if target is not None:
        return EncoderDecoder(built, weights, target, args.threads)
    model, info = gen.compile_cached(built, weights, mode=args.cache)
    return gen.CachedModel(model.SerializeToString(), info, threads=args.threads)


def cmd_generate(args) -> int:
    from tessera.runtime.generation import recurrent

    if recurrent.wants(args):  # a recurrent encoder-decoder (models/rnnsearch.tsr): its own loop
        return recurrent.cmd_generate(args)
    if args.prompts and any(item.partition("=")[0] == "tokens" for item in args.inputs):
        raise UsageError("give the prompts either as --prompt text or as --input tokens, not both")
    if not args.prompts and not args.inputs:
        raise UsageError("no prompt: give --prompt TEXT (with --tokenizer) or --input 'tokens=[[...]]'")
    if args.prompts and not args.tokenizer:
        raise UsageError("--prompt needs --tokenizer tokenizer.json to turn the text into token ids")
    if args.stops and not args.tokenizer:
        raise UsageError("--stop TEXT needs --tokenizer; use --stop-token ID for token ids")
    sampling = gen.Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
    sampling.check()
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    tokenizer = None
    if args.tokenizer:
        from tessera.runtime.io import text

        tokenizer = text.load_tokenizer(args.tokenizer)
    stop_tokens = list(args.stop_tokens) + gen.stop_token_ids(tokenizer, args.stops)
    stopper = gen.TextStopper(tokenizer, args.stops) if tokenizer is not None and args.stops else None

    loaded = load_model(args)
    fixed = None
    if isinstance(loaded, EncoderDecoder):
        model, target = loaded.s2s.decoder, loaded.target
        given = _named_inputs(args.inputs, [target] + loaded.sources)
        if args.prompts and target in given:
            raise UsageError(f"give the target prompts either as --prompt text or as --input {target}, not both")
        if args.prompts:
            prompts = gen.encode_prompts(tokenizer, args.prompts)
        elif target in given:
            prompts = given[target]
        elif args.start_token is not None:
            rows = len(next(iter(given.values()))) if given else 1
            prompts = [[args.start_token] for _ in range(rows)]
        else:
            raise UsageError(f"an encoder-decoder needs the target's first tokens: --start-token ID (the decoder's "
                             f"start token) or --input {target}=[[...]]")
        if args.start_token is not None and (args.prompts or target in given):
            raise UsageError(f"--start-token and a target prompt (--prompt or --input {target}) exclude each other")
        gen.check_request(model, prompts, args.max_new_tokens, sampling, stop_tokens)
        fixed = loaded.fixed_feeds(given, len(prompts))
    else:
        model = loaded
        if args.start_token is not None:
            raise UsageError("--start-token applies to encoder-decoders; a decoder-only model starts from its prompt")
        if args.prompts and args.inputs:
            raise UsageError("give the prompts either as --prompt text or as --input tokens, not both")
        if args.prompts:
            prompts = gen.encode_prompts(tokenizer, args.prompts)
        else:
            prompts = _named_inputs(args.inputs, [model.info.tokens])[model.info.tokens]
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {i} is empty: generation needs at least one token to start from")
    gen.check_request(model, prompts, args.max_new_tokens, sampling, stop_tokens)
    stats = gen.Stats()
    out: list[list[int]] = [[] for _ in prompts]
    live = args.format == "text" and tokenizer is not None and len(prompts) == 1
    shown = ""
    if live:
        print(tokenizer.decode(prompts[0], skip_special_tokens=False), end="", flush=True)
    started, last_note = time.perf_counter(), 0.0
    show_progress = not args.quiet
    for emitted in gen.stream(model, prompts, args.max_new_tokens, sampling, stop_tokens, stats=stats,
                              should_stop=stopper, extra_feeds=fixed):
        for r, tok in enumerate(emitted):
            if tok is not None:
                out[r].append(tok)
        if live:
            now = _completion(tokenizer, out[0], stopper, args.stops)
            if now.startswith(shown):
                print(now[len(shown):], end="", flush=True)
                shown = now
        elapsed = time.perf_counter() - started
        if show_progress and elapsed > 2.0 and elapsed - last_note > 0.5 and not live:
            gen.progress(stats)
            last_note = elapsed
    if show_progress and last_note:
        print(file=sys.stderr)
    texts = [_completion(tokenizer, row, stopper, args.stops) for row in out] if tokenizer is not None else None
    if args.format == "json":
        rows = []
        for r, p in enumerate(prompts):
            row = {"prompt_tokens": p, "tokens": out[r]}
            if texts is not None:
                row["text"] = texts[r]
            rows.append(row)
        print(json.dumps({"outputs": rows, "stats": {
            "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
            "prefill_ms": round(stats.prefill_s * 1e3, 3),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2)}}))
    elif live:
        print()
    else:
        for r, p in enumerate(prompts):
            if texts is not None:
                print(tokenizer.decode(p, skip_special_tokens=False) + texts[r])
            else:
                print(" ".join(map(str, out[r])))
    if show_progress:
        print(f"{stats.new_tokens} new tokens; prefill {stats.prefill_s * 1e3:.1f} ms "
              f"({stats.prompt_tokens} prompt tokens), decode {stats.decode_tokens_per_s:.1f} steps/s",
              file=sys.stderr)
    return 0


def _completion(tokenizer, tokens: list[int], stopper, stops: list[str]) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return stopper.trim(text) if stopper is not None else text
