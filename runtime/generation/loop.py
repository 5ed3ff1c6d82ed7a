"""The decoding loop's driver side: load the cached model, turn the request into prompts, run the steps.

Why here and not in the command: the command line, the Python API and the server all generate
from the same request (runtime/options.GenerateOptions): prompts as text or token ids, a
decoder-only model or an encoder-decoder (its source inputs encoded once), stop texts and ids.
``prepare`` checks all of it before the first step and returns a ``Generation`` whose ``steps()``
the caller drives (printing as it goes, collecting, or streaming to a client).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tessera.compiler.ir import dims
from tessera.compiler.ir.signature import bind_inputs, input_limits, specs_from_graph
from tessera.runtime import compile_cache, pipeline
from tessera.runtime.generation import cached as gen
from tessera.runtime.generation import drafting, speculative
from tessera.runtime.generation.constraints import Grammar, GrammarCompiler, TokenMask
from tessera.runtime.generation.stops import TextStopper
from tessera.runtime.io import text as text_io
from tessera.runtime.io.chat_template import ChatTemplate
from tessera.runtime.io.inputs import named_token_rows, parse_value, split_named, to_array
from tessera.runtime.pipeline import UsageError


# ------------------------------------------------------------------ the model
def target_input(graph) -> str | None:
    """An encoder-decoder's target input: the integer [B, T] input whose T is the logits' sequence
    axis (the other inputs are the source). None for a decoder-only model (a single input). The
    logits are the first output; outputs after it must be per target step too (RNNsearch's alignment
    [B, T, S]), which the cached form keeps beside the logits."""
    if len(graph.inputs) < 2 or graph.type_of(graph.outputs[0]).rank != 3:
        return None
    t = graph.type_of(graph.outputs[0]).shape[1]
    if any(graph.type_of(o).rank < 2 or not dims.equal(graph.type_of(o).shape[1], t) for o in graph.outputs[1:]):
        return None
    hits = [i for i in graph.inputs if graph.type_of(i).dtype in ("i64", "i32") and graph.type_of(i).rank == 2
            and dims.equal(graph.type_of(i).shape[1], t)]
    # a source laid over the target's own positions is no source: a decoder's extra per-token input (which
    # the cached decoder refuses, naming it, unless it is a key padding mask: compiler/passes/spec_mask.py)
    if len(hits) != 1 or any(dims.equal(d, t) for i in graph.inputs if i != hits[0] for d in graph.type_of(i).shape):
        return None
    return hits[0]


class EncoderDecoder:
    """An encoder-decoder spec compiled for generation: the encoder part (run once per source batch, with
    every layer's cross-attention keys and values), the cached decoder, and the names of the target
    input (the prompt the cache extends) and of the source inputs (any element type: token ids and
    their mask for BART or T5, float log-mel features for Whisper)."""

    def __init__(self, built, weights, target: str, threads: int | None, options=None, provider: str = "cpu"):
        self.target = target
        self.sources = [i for i in built.graph.inputs if i != target]
        self.specs = [s for s in specs_from_graph(built.graph) if s.name in self.sources]  # before compiling
        self.limits = input_limits(built.graph)
        enc, dec, info, boundary = gen.compile_seq2seq(built, weights, target, options=options)
        decoder = gen.CachedModel(dec.SerializeToString(), info, provider=provider, threads=threads)
        self.s2s = gen.Seq2Seq(enc.SerializeToString(), decoder, boundary, provider=provider)

    def source_arrays(self, texts: dict[str, str], arrays: dict | None) -> dict:
        """The source inputs as arrays: ``texts`` from --input NAME=VALUE (a JSON array or a .npy file,
        parsed as ``tessera run`` parses them: runtime/io/inputs.py) and ``arrays`` from the API's
        ``inputs=`` (arrays or nested lists)."""
        by_name = {s.name: s for s in self.specs}
        out = {name: parse_value(name, text, by_name[name], RAGGED) for name, text in texts.items()}
        for name, value in (arrays or {}).items():
            if name in by_name and isinstance(value, (str, Path)):  # a .npy file, as --input takes it
                out[name] = parse_value(name, str(value), by_name[name])
            else:  # an unknown name: InputError listing the source inputs
                out[name] = to_array(name, value, self.specs)
        return out

    def fixed_feeds(self, given: dict, rows: int) -> dict:
        """The decoder's fixed inputs (the encoder's outputs) for the source arrays given, one row per
        target prompt, checked against the source inputs' declared types and tables."""
        missing = [s for s in self.sources if s not in given]
        if missing:
            raise UsageError(f"an encoder-decoder needs its source inputs: give --input {missing[0]}=[[...]] "
                             f"(the model's source inputs: {', '.join(self.sources)})")
        for spec in self.specs:
            arr = given[spec.name]
            if arr.ndim >= 1 and arr.shape[0] != rows:
                raise UsageError(f"--input {spec.name} has {arr.shape[0]} rows but there are {rows} target prompts")
            for axis, d in enumerate(spec.dims[1:], 1):  # every free length but the batch's
                if isinstance(d, str) and arr.ndim > axis and arr.shape[axis] > MAX_SOURCE_TOKENS:
                    what = "tokens per row" if arr.dtype.kind in "iu" else f"positions on axis {axis}"
                    raise UsageError(f"--input {spec.name} has {arr.shape[axis]:,} {what}; an encoder-decoder's "
                                     f"source is capped at {MAX_SOURCE_TOKENS:,} (MAX_SOURCE_TOKENS)")
        bind_inputs(self.specs, {s: given[s] for s in self.sources}, self.limits)  # types, shapes, id ranges
        return self.s2s.encode({s: given[s] for s in self.sources})


RAGGED = " (the rows must have one length, at least 1: pad them, and mark the padding in the source mask)"
"""--input's hint for a source whose rows differ in length (prompts may; sources are one array)."""


MAX_SOURCE_TOKENS = 16_384
"""Source tokens per row an encoder-decoder takes: its encoder's attention is quadratic in them (a
100,000-token source ran for hours); the bundled ones were trained on 512 (T5) or fewer."""


def load_model(ref, o, weights=None, models: dict | None = None, progress=None):
    """A CachedModel (decoder-only) or an EncoderDecoder, from a .tsr spec or a compiled .onnx file;
    ``models`` (a dict the caller keeps) holds those already compiled, by the options that shape them.
    ``progress(done, total, stage)`` is told as each stage of a compile starts (runtime/progress.py)."""
    step = progress or (lambda done, total, stage=None: None)
    path = Path(ref.spec)
    if path.suffix == ".onnx" or path.is_dir():
        if ref.variant or ref.sets or ref.weights or o.build_given():
            raise UsageError("--variant, --set, --weights and --quantize apply to .tsr specs; an .onnx file is "
                             "already compiled")
        return gen.CachedModel.from_onnx(path, provider=o.provider, threads=o.threads)
    options = o.pipeline_options()  # quantised by the pipeline's first pass
    key = (o.threads, o.cache, o.build_key(), o.device, o.dtype,
           o.speculative is None,  # speculative decoding's target keeps every position's logits
           options.prefix_keys)  # a draft model's rollback cache keeps the decoding step's mask
    if models is not None and key in models:
        return models[key]
    step(0, 4, "graph")
    built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)
    target = target_input(built.graph)
    if target is not None and o.dtype == "bf16" and o.device != "cuda":
        raise UsageError("--dtype bf16: an encoder-decoder on onnxruntime's CPU provider cannot run it (the CPU "
                         "provider has no bfloat16 kernel for MatMul or attention); use --provider cuda on a "
                         "machine with a GPU, or --dtype fp32 or fp16")
    if target is not None:
        step(1, 4, "weights")
        if weights is None:
            weights = pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large)
        step(2, 4, "passes and ONNX")
        loaded = EncoderDecoder(built, weights, target, o.threads, seq2seq_options(o), provider=o.device)
    else:
        loaded = compile_decoder(built, ref, o, options, "cached decoder", o.device, o.threads, weights, step)
        if o.explain:
            print(loaded.compile_cache.explain(), file=sys.stderr)
            if options.quantize is not None:
                print(f"quantisation: {options.quantize.describe()}", file=sys.stderr)
    step(4, 4)
    if models is not None:
        models[key] = loaded
    return loaded


def seq2seq_options(o):
    """The encoder_decoder pipeline's options for generate's ``o``: compiled for o.device at --dtype (fp16 on the CPU too:
    compiler/passes/pipeline.py encoder_decoder), its decoding step keeping its mask (no prefix_keys: CachedDecoder
    runs an encoder-decoder's targets left-padded, as a batch, the source mask read by every step)."""
    return dataclasses.replace(o.pipeline_options(), prefix_keys=False)


def compile_decoder(built, ref, o, options, what: str, provider: str, threads: int | None, weights=None,
                    progress=None) -> gen.CachedModel:
    """A decoder-only model's cached decoder in an onnxruntime session, through the compile cache
    (runtime/compile_cache.py: ``o``'s --compile-cache / --no-compile-cache): loaded from its entry on
    a hit; else the weights read (``weights``: the caller's, already loaded, or a function reading them),
    compiled with ``options`` and stored. The model's ``compile_cache`` (a compile_cache.Lookup) says
    which, and why."""
    step = progress or (lambda done, total, stage=None: None)
    lookup = compile_cache.Lookup.start(o, what, built, ref.weights, ref.seed, options)
    hit = lookup.hit()
    lookup.say_notes()
    if hit is not None:
        pipeline.check_memory(built, ref.allow_large)  # the session holds the weights as a compile would
        step(2, 4, "compile cache hit: checked")
        step(3, 4, "onnxruntime session")
        model = gen.CachedModel.from_onnx(hit, provider=provider, threads=threads)
    else:
        step(1, 4, "weights")
        if weights is None:
            weights = pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large)
        elif callable(weights):
            weights = weights()
        step(2, 4, "passes and ONNX" + (" (compile cache miss)" if lookup.on else ""))
        proto, info = gen.compile_cached(built, weights, options)
        if lookup.on:
            step(3, 4, "storing in the compile cache")
        stored = lookup.store(lambda folder: _save(proto, folder / compile_cache.MODEL))
        lookup.say_notes()
        step(3, 4, "onnxruntime session")
        # a stored model is opened from its file (onnxruntime maps the weights from its .data file)
        model = gen.CachedModel(str(stored) if stored else proto.SerializeToString(), info, provider=provider,
                                threads=threads)
    model.compile_cache = lookup
    return model


def _save(proto, path: Path) -> list[Path]:
    from tessera.compiler.backends.onnx import export as onnx_export  # imports onnx: only when storing

    # external data always, as `compile --kv-cache` writes it: onnxruntime maps the weights from the file
    return onnx_export.save(proto, path, external=True)


# ------------------------------------------------------------------ the request
@dataclass
class Generation:
    """A checked request on a loaded model: ``steps()`` yields each step's new token per prompt
    (None once a prompt has stopped); ``stats`` fills as it runs; ``text(tokens)`` decodes a row."""

    model: gen.CachedModel
    prompts: list[list[int]]
    max_new_tokens: int
    sampling: gen.Sampling
    stop_ids: list[int]
    tokenizer: object = None
    stopper: TextStopper | None = None
    fixed: dict | None = None       # an encoder-decoder's encoder outputs, fed to every step (on CUDA device OrtValues)
    stats: gen.Stats = field(default_factory=gen.Stats)
    # per prompt, each new token's log-probabilities (sampling.token_logprobs), filled by steps() when
    # sampling.logprobs is set
    logprobs: list[list[dict]] = field(default_factory=list)
    drafter: object = None          # speculative decoding's (generation/drafting.py), else None
    draft_tokens: int = 0
    masks: list | None = None       # structured output: one generation/constraints.TokenMask per prompt

    def steps(self):
        if self.drafter is not None:
            return speculative.steps(self.model, self.prompts, self.max_new_tokens, self.sampling, self.drafter,
                                     self.draft_tokens, self.stop_ids, self.stats, self.stopper)
        self.logprobs = [[] for _ in self.prompts]
        return gen.stream(self.model, self.prompts, self.max_new_tokens, self.sampling, self.stop_ids,
                          stats=self.stats, should_stop=self.stopper, extra_feeds=self.fixed,
                          logprobs=self.logprobs if self.sampling.logprobs is not None else None,
                          masks=self.masks)

    def explain(self) -> str | None:
        """--explain's line on speculative decoding once the steps have run (None without it)."""
        if self.drafter is None:
            return None
        return speculative.explain(self.stats, self.drafter.name, self.draft_tokens)

    def text(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return self.stopper.trim(text) if self.stopper is not None else text

    def rows(self, new: list[list[int]]) -> list[dict]:
        """What was generated, one dict per prompt (``tessera generate --format json``'s outputs and
        the API's result with logprobs): prompt_tokens, tokens, text (with a tokenizer) and logprobs
        (with sampling.logprobs: per new token, its log-probability and the top alternatives')."""
        out = []
        for r, p in enumerate(self.prompts):
            row = {"prompt_tokens": p, "tokens": new[r]}
            if self.tokenizer is not None:
                row["text"] = self.text(new[r])
            if self.sampling.logprobs is not None:
                row["logprobs"] = self.logprobs[r] if r < len(self.logprobs) else []
            out.append(row)
        return out


def prepare(ref, o, prompt_ids: list[list[int]] | None = None, weights=None, models: dict | None = None,
            tokenizer=None, source_arrays: dict | None = None, progress=None, draft_ref=None) -> Generation:
    """Load the model and check the request (``o`` already checked): the prompts from --prompt texts,
    --input token ids or ``prompt_ids`` (the API's), and an encoder-decoder's source inputs (--input
    NAME=VALUE, or ``source_arrays``: the API's ``inputs=``)."""
    if not o.prompts and not o.inputs and prompt_ids is None and not source_arrays:
        raise UsageError("no prompt: give --prompt TEXT (with --tokenizer) or --input 'tokens=[[...]]'")
    if o.prompts and prompt_ids is not None:
        raise UsageError("give the prompts either as text or as token ids, not both")
    if tokenizer is None and o.tokenizer:
        tokenizer = text_io.load_tokenizer(o.tokenizer)
    sampling = o.sampling(ref.seed)
    chat = _chat_template(o) if o.chat else None
    stop_tokens = list(o.stop_tokens) + gen.stop_token_ids(tokenizer, o.stops)
    stopper = TextStopper(tokenizer, o.stops) if tokenizer is not None and o.stops else None

    loaded = load_model(ref, o, weights, models, progress)
    fixed = None
    if isinstance(loaded, EncoderDecoder):
        model, target = loaded.s2s.decoder, loaded.target
        stop_tokens = _with_eos(stop_tokens, o, model)
        texts = split_named(o.inputs, [target] + loaded.sources)
        given = named_token_rows([f"{target}={texts.pop(target)}"] if target in texts else [], [target])
        sources = loaded.source_arrays(texts, source_arrays)
        if prompt_ids is not None:
            given[target] = prompt_ids
        if o.prompts and target in given:
            raise UsageError(f"give the target prompts either as --prompt text or as --input {target}, not both")
        if o.prompts:
            prompts = gen.encode_prompts(tokenizer, o.prompts, chat)
        elif target in given:
            prompts = given[target]
        elif o.start_token is not None or o.start_default is not None:  # given, else the checkpoint's
            first = next(iter(sources.values()), None)
            rows = first.shape[0] if first is not None and first.ndim else 1  # a wrong rank: bind_inputs says so
            start = o.start_token if o.start_token is not None else o.start_default
            prompts = [[start] for _ in range(rows)]
        else:
            raise UsageError(f"an encoder-decoder needs the target's first tokens: --start-token ID (the decoder's "
                             f"start token; a checkpoint's decoder_start_token_id is taken when it has one) or "
                             f"--input {target}=[[...]]")
        if o.start_token is not None and (o.prompts or target in given):
            raise UsageError(f"--start-token and a target prompt (--prompt or --input {target}) exclude each other")
        gen.check_request(model, prompts, o.max_new_tokens, sampling, stop_tokens)
        fixed = loaded.fixed_feeds(sources, len(prompts))
    else:
        model = loaded
        stop_tokens = _with_eos(stop_tokens, o, model)
        if o.start_token is not None:
            raise UsageError("--start-token applies to encoder-decoders; a decoder-only model starts from its prompt")
        if source_arrays:
            raise UsageError("inputs= gives an encoder-decoder's source inputs; a decoder-only model takes only "
                             "its prompt")
        if o.prompts and o.inputs:
            raise UsageError("give the prompts either as --prompt text or as --input tokens, not both")
        if o.prompts:
            prompts = gen.encode_prompts(tokenizer, o.prompts, chat)
        elif prompt_ids is not None:
            prompts = prompt_ids
        else:
            prompts = named_token_rows(o.inputs, [model.info.tokens])[model.info.tokens]
    prompts = gen.check_request(model, prompts, o.max_new_tokens, sampling, stop_tokens)
    drafter = None
    if o.speculative is not None:
        if fixed is not None:
            raise UsageError("speculative decoding is for decoder-only models; an encoder-decoder is not supported")
        speculative.check_target(model)
        _check_speculative_sampling(o, sampling)
        drafter = load_drafter(o, draft_ref, model)
    masks = None
    grammar = constraint_of(o)
    if grammar is not None:
        if sampling.min_new_tokens or sampling.no_repeat_ngram_size:
            raise UsageError("min_new_tokens and no_repeat_ngram_size cannot be combined with structured output "
                             "(--json-schema, --regex, --grammar): they could forbid every token the grammar allows")
        eos = [t for t in getattr(o, "eos_tokens", ()) if model.vocab is None or t < model.vocab]
        compiler = GrammarCompiler(tokenizer, model.vocab, eos)
        text = compiler.compile(grammar)  # GrammarError (a UsageError) saying what is wrong
        masks = [TokenMask(compiler, text) for _ in prompts]
    return Generation(model, prompts, o.max_new_tokens, sampling, stop_tokens, tokenizer, stopper, fixed,
                      drafter=drafter, draft_tokens=o.k, masks=masks)


def constraint_of(o):
    """The Grammar the options ask for (--json-schema, --regex, --grammar: generation/constraints.py),
    files read; None without one."""
    def read(path, what):
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read the {what} {path}: {e}") from None

    if o.json_schema is not None:
        src = o.json_schema if isinstance(o.json_schema, dict) else read(o.json_schema, "JSON schema")
        return Grammar.json_schema(src)
    if o.regex is not None:
        return Grammar.regex(o.regex)
    if o.grammar is not None:
        return Grammar.lark(read(o.grammar, "Lark grammar"))
    return None


def _check_speculative_sampling(o, sampling) -> None:
    """The verify loop (generation/speculative.py) chooses each position's token from its scores and
    the repetition penalty; the processors that look back at the row (no-repeat n-grams, min_new_tokens)
    and log-probabilities are not computed there, so they are refused, never dropped. Checked here, on
    the final settings: generation_config.json may have set them (BART's sets no_repeat_ngram_size)."""
    wanted = [(flag, given) for flag, given in (("no_repeat_ngram_size", sampling.no_repeat_ngram_size),
                                                ("min_new_tokens", sampling.min_new_tokens))
              if given] + ([("logprobs", sampling.logprobs)] if sampling.logprobs is not None else [])
    if wanted:
        named = ", ".join(f"{o.flag(flag)} {given}" for flag, given in wanted)
        raise UsageError(f"{o.flag('speculative')} does not apply {named} (the verify loop chooses from the scores "
                         f"and the repetition penalty only); drop {'them' if len(wanted) > 1 else 'it'} or "
                         f"{o.flag('speculative')} (to override a value of generation_config.json, give 0)")


def load_drafter(o, draft_ref, target: gen.CachedModel):
    """--speculative's drafter: prompt lookup ("ngram"), or a draft model (``draft_ref``, the driver's
    ModelRef of --speculative's spec, checkpoint folder or compiled .onnx file, seeded with the
    target's seed when it has no weights; or the API's loaded Model), compiled without quantisation,
    the logits of the last position only."""
    spec = o.speculative
    if isinstance(spec, str) and spec == "ngram":
        return drafting.NgramDrafter()
    plain = dataclasses.replace(o, speculative=None, draft_tokens=None, quantize="none", quantize_block=None,
                                quantize_head="auto", quantize_activations=None,
                                quantize_embedding="auto")
    plain.api = o.api
    plain.drafting = True  # its rollback cache (generation/rollback.py) feeds the mask: no prefix_keys
    if hasattr(spec, "ref"):  # the API's tessera.Model: its compiled decoders and weights are kept
        label, model = str(spec.spec), load_model(spec.ref, plain, spec.weights, spec._models)
    else:
        label = str(spec)
        try:
            model = load_model(draft_ref, plain)
        except (UsageError, pipeline.SpecError) as e:
            why = str(e).removeprefix("error: ")
            raise UsageError(f"{o.flag('speculative')} {spec}: not 'ngram', and no draft model: {why}") from None
    if isinstance(model, EncoderDecoder):
        raise UsageError(f"the draft model {label} is an encoder-decoder; a draft model must be decoder-only")
    drafter = drafting.ModelDrafter(model, label)
    drafter.check(target)
    return drafter


def _chat_template(o):
    """--chat's template: the tokenizer folder's (io/chat_template.py), or an error saying it has none."""
    return ChatTemplate.required(o.tokenizer, o.flag("chat") + ("=True" if o.api else ""))


def _with_eos(stop_tokens: list[int], o, model) -> list[int]:
    """The stop tokens and the checkpoint's end-of-sequence ids (options.GenerateOptions.with_defaults),
    those the model's vocabulary holds: a tokenizer folder's EOS (50256 for GPT-2's) may lie past a
    small seeded model's vocabulary, where it can never be generated and is no error."""
    vocab = model.vocab
    eos = [t for t in o.eos_tokens if vocab is None or t < vocab]
    if o.explain and len(eos) < len(o.eos_tokens):
        print(f"note: end-of-sequence id(s) {sorted(set(o.eos_tokens) - set(eos))} are past the model's vocabulary "
              f"({vocab}): not stop tokens", file=sys.stderr)
    return list(stop_tokens) + [t for t in eos if t not in stop_tokens]
