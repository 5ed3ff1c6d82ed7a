"""The driver: what ``compile``, ``run``, ``report`` and ``generate`` do, and the model ``serve``,
``batch`` and the Ray deployment put on the engine (``serve_model``), for every entry point.

Why one module: the command line (runtime/cli/), the Python API (runtime/api.py) and the server
(runtime/serving/: serve, batch, Ray) are three ways to ask for the same work. Each fills the same option objects
(runtime/options.py) and calls these functions, which check the options, do the work and return
what was made; printing belongs to the caller. So an option added here reaches every entry point,
and a rule checked here holds for all of them.

``weights`` (a mapping by parameter path) lets a caller that keeps a model loaded (the API's
``Model``, the server) skip reading or drawing them again.
"""

from __future__ import annotations

import dataclasses
import os
import stat as stat_
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

# onnx (with ml_dtypes, ~0.6 s of start-up) and the modules that import it -- the ONNX exporter,
# runtime/session.py, loop_bounds.py, packaging/genai.py -- are imported in the functions that export or
# run: `tessera report` and `tessera ir` work on the graph alone and never load it
# (tests/project/test_cli_help.py); every other import is here.
from tessera.compiler.ir import dims
from tessera.compiler.ir.signature import bind_inputs, input_limits, specs_from_graph
from tessera.compiler.passes.pipeline import explain
from tessera.compiler.passes.recurrent_state import carries_state
from tessera.runtime import compile_cache, embedding as embeddings, pipeline
from tessera.runtime.files import stat_or_raise
from tessera.runtime.generation import cached as gen, loop
from tessera.runtime.generation.loop import EncoderDecoder, compile_decoder, target_input
from tessera.runtime.io import (checkpoint, generation_config, gguf_file, image, inputs as inputs_mod, mxfp4,
                                outputs as outputs_mod, text, text as text_mod)
from tessera.runtime.io.inputs import to_array
from tessera.runtime.io.weights import Checkpoint, WeightsError
from tessera.runtime.onnx_skeleton import skeleton_of
from tessera.runtime.report import alignment, alignment_plot, measure
from tessera.runtime.report.build import build_report
from tessera.runtime.options import (CompileOptions, EngineOptions, GenerateOptions, ModelRef, ReportOptions,
                                     RunOptions)
from tessera.runtime.pipeline import UsageError


# ------------------------------------------------------------------ the model
def from_checkpoint(ref: ModelRef, o=None, wants_tokenizer: bool = False):
    """A Hugging Face checkpoint folder as the model (runtime/io/checkpoint.py): its bundled spec with
    the folder as the weights, and its tokenizer.json when the options need one and name none."""


    tokenizer = checkpoint.tokenizer_in(ref.spec)
    if getattr(o, "explain", False):  # a GGUF file: which tensors were dequantised from which type
        mode = getattr(o, "gguf_weights", "codes")
        for line in filter(None, (gguf_file.explain(ref.spec, mode), gguf_file.explain(ref.weights, mode))):
            print(line, file=sys.stderr)
    ref = checkpoint.resolve(ref)
    if getattr(o, "explain", False):  # a folder of MXFP4 experts (gpt-oss): which tensors are dequantised
        line = mxfp4_explain(ref.weights)
        if line:
            print(line, file=sys.stderr)
    if o is not None and wants_tokenizer and tokenizer is not None and not getattr(o, "tokenizer", None):
        api = o.api
        o = replace(o, tokenizer=str(tokenizer))
        o.api = api
    return ref, o


def mxfp4_explain(weights) -> str | None:
    """--explain's line for a checkpoint folder of MXFP4 tensors (None otherwise, or when its headers do
    not read: the load then says why)."""
    if not weights or mxfp4.quant_method(weights) != mxfp4.QUANT_METHOD:
        return None
    try:
        packed = Checkpoint(Path(weights)).packed
    except WeightsError:
        return None
    return mxfp4.explain(Path(weights), sorted(packed))


# ------------------------------------------------------------------ compile
@dataclass
class Compiled:
    files: list[Path]
    built: pipeline.Built
    params: int            # parameters before quantisation packed them
    seconds: float


def compile(ref: ModelRef, o: CompileOptions, weights=None, progress=None) -> Compiled:
    """Build the spec, fill its weights and write the ONNX file (or the cached decoder, or the
    onnxruntime-genai folder), the weights streamed one tensor at a time; ``progress(bytes done,
    bytes in all)`` after each (the command line's bar, runtime/progress.py)."""
    t0 = time.perf_counter()
    ref.check()
    ref, o = from_checkpoint(ref, o, wants_tokenizer=o.genai)
    o.check()
    if o.genai:
        from tessera.runtime.packaging import genai

        genai.Tokenizer(Path(o.tokenizer))  # a tokenizer genai cannot read is refused before the compile
    built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)
    params = built.graph.param_count()  # before quantisation packs them
    pipeline.check_disk(built, o.output, ref.allow_large)
    if weights is None:
        weights = pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large, streaming=True)
    if o.kv_cache or o.genai:
        files = _compile_cached(built, weights, ref, o, progress)
    else:
        sites = o.attention_probs
        pipeline.optimize(built, o.pipeline_options([s for s in sites if s != "all"], "all" in sites), o.explain)
        files = pipeline.export(built, weights, o.output, check=o.check_model, progress=progress)
    return Compiled(files, built, params, time.perf_counter() - t0)


def _compile_cached(built, weights, ref: ModelRef, o: CompileOptions, progress=None) -> list[Path]:
    """--kv-cache: the cached decoder (compiler/passes/kv_cache.py), its kernels chosen per phase."""
    from tessera.compiler.backends.onnx import export as onnx_export


    if o.genai and len(built.graph.inputs) != 1:
        raise UsageError(f"--genai writes decoder-only models (one input, the token ids) for onnxruntime-genai's "
                         f"decoder state; {built.graph.name} takes {', '.join(built.graph.inputs)} "
                         f"(encoder-decoders are not supported)")
    model, info = gen.compile_cached(built, weights, o.cached_pipeline_options())
    if o.combined_call:
        _check_combined(model, info)
    if o.explain:
        print(explain(built.attention_sites) + "\n" + info.explain(), file=sys.stderr)
    verify = onnx_export.check if o.check_model else None
    if o.genai:
        from tessera.runtime.packaging import genai

        return genai.write_folder(o.output, built.graph, info, model, str(o.tokenizer), ref.weights, verify,
                                  context=o.context_length)
    # external data always: onnxruntime maps the weights from the .data file instead of copying them out of
    # the parsed model, so the generating process holds them once (docs/generate.md)
    return onnx_export.save(model, o.output, verify=verify, external=True, progress=progress)


def _check_combined(model, info) -> None:
    """--combined-call: refused when the decoder did not get it (its metadata says whether it did,
    compiler/backends/onnx/mixed_attention.py), with the kernels' reasons, rather than written without it."""
    from tessera.compiler.backends.onnx.mixed_attention import COMBINED_KEY

    if any(p.key == COMBINED_KEY and p.value == "1" for p in model.metadata_props):
        return
    why = "; ".join(sorted({k.reason for k in info.kernels if getattr(k, "reason", "")})) or "no attention site"
    raise UsageError(f"--combined-call needs GroupQueryAttention decoding at every attention site, and this model's "
                     f"decoding step does not have it ({why}); compile without --combined-call")


# ------------------------------------------------------------------ run
@dataclass
class Runnable:
    """A model ready to run: its ONNX (bytes or a file), input signature, the attention outputs
    exposed only to be drawn, and its onnxruntime session once opened."""

    source: str | bytes
    specs: list
    limits: object
    exposed: list = field(default_factory=list)
    session: object = None
    recurrences: object = None  # the graph without weights when it has Scan/RNN/GRU/LSTM (runtime/loop_bounds.py)
    compile_cache: object = None  # how the compile cache served it (runtime/compile_cache.Lookup), for a spec

    def open(self, provider: str):
        from tessera.runtime import session

        if self.session is None:
            self.session = session.open_session(self.source, provider)
            if isinstance(self.source, bytes):  # onnxruntime holds its own copy of the weights now: keep the
                self.source = b""                # serialised model (as large as the weights) no longer
        return self.session


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    provider: str
    feeds: dict[str, np.ndarray]
    alignment: object = None   # runtime/report/alignment.Alignment, when one was asked for
    written: list[Path] = field(default_factory=list)


def prepare_run(ref: ModelRef, o: RunOptions, weights=None) -> Runnable:
    """The model to run: an .onnx file as it is, or a spec built, optimised and exported to bytes."""
    from tessera.runtime import loop_bounds
    from tessera.runtime.session import load_model_proto, onnx_signature

    ref, _ = from_checkpoint(ref)
    path = Path(ref.spec)
    if ref.compiled:
        if ref.variant or ref.sets or ref.weights:
            raise UsageError("--variant, --set and --weights apply to .tsr specs; an .onnx file is already compiled")
        if not path.exists():
            raise UsageError(f"model file not found: {path}")
        model = load_model_proto(path)
        specs, limits = onnx_signature(path, model)
        return Runnable(str(path), specs, limits,
                        recurrences=loop_bounds.without_weights(model) if loop_bounds.has_recurrence(model) else None)
    from tessera.compiler.backends.onnx import export as onnx_export


    built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)
    specs, limits = specs_from_graph(built.graph), input_limits(built.graph)
    probs = [o.layer] if o.wants_alignment and o.layer is not None else None
    options = o.pipeline_options(probs or ())
    # the compile cache keeps the model as run takes it; not with attention probabilities exposed to be
    # drawn (which outputs they became is the compile's note, not the file's)
    lookup = compile_cache.Lookup.start(o, "full model", built, ref.weights, ref.seed, options,
                                        off=o.wants_alignment)
    hit = lookup.hit()
    lookup.say_notes()
    if hit is not None:
        pipeline.check_memory(built, ref.allow_large)
        if o.explain:
            print(lookup.explain(), file=sys.stderr)
        model = load_model_proto(hit)  # the structure only
        recurrences = loop_bounds.without_weights(model) if loop_bounds.has_recurrence(model) else None
        return Runnable(str(hit), specs, limits, recurrences=recurrences, compile_cache=lookup)
    if weights is None:
        weights = pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large)
    exposed = pipeline.optimize(built, options, o.explain)
    source = onnx_export.to_bytes(built.graph, weights, pipeline.metadata(built))
    if lookup.store(lambda folder: _write_bytes(folder / compile_cache.MODEL, source)) is not None:
        source_or_file = str(lookup.entry / compile_cache.MODEL)
    else:
        source_or_file = source
    lookup.say_notes()
    if o.explain and lookup.on:
        print(lookup.explain(), file=sys.stderr)
    recurrences = None
    if any(n.op == "scan" for n in built.graph.nodes.values()):
        import onnx


        # the structure only: parsing the serialised weights once more would hold them twice
        recurrences = loop_bounds.without_weights(onnx.ModelProto.FromString(skeleton_of(source)))
    return Runnable(source_or_file, specs, limits, exposed, recurrences=recurrences, compile_cache=lookup)


def _write_bytes(path: Path, data: bytes) -> list[Path]:
    """A serialised model into the compile cache's new entry (its folder is renamed into place after)."""

    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return [path]


def run(ref: ModelRef, o: RunOptions, arrays: dict | None = None, weights=None,
        runnable: Runnable | None = None) -> RunResult:
    """Run the model on the inputs (--input texts, --text, --image, and ``arrays``: named arrays or
    nested lists, from the API); compute the alignment, pool and save as the options say."""
    from tessera.runtime.session import run_session

    ref.check()
    ref, o = from_checkpoint(ref, o, wants_tokenizer=bool(o.texts))
    o.check()
    if o.save is not None:
        outputs_mod.check_folder(str(o.save))
    if o.plot_attention is not None:

        alignment_plot.check_path(str(o.plot_attention))  # before the model is built or run
    runnable = runnable or prepare_run(ref, o, weights)
    feeds = inputs_mod.parse_inputs(o.inputs, runnable.specs)
    _add_arrays(arrays or {}, runnable.specs, feeds)
    text_mask = _add_text_and_image_inputs(o, runnable.specs, feeds)
    bind_inputs(runnable.specs, feeds, runnable.limits)
    if runnable.recurrences is not None:
        from tessera.runtime.loop_bounds import check_steps

        check_steps(runnable.recurrences, feeds, str(ref.spec))
    sess = runnable.open(o.provider)
    outputs = run_session(sess, feeds)
    result = RunResult(outputs, sess.get_providers()[0], feeds)
    if o.wants_alignment:
        result.alignment = _alignment(o, sess, outputs, runnable, feeds, model=str(ref.spec))
        for e in runnable.exposed:  # exposed only to be drawn: the outputs returned are the model's own
            outputs.pop(e.output, None)
    if o.pool:
        result.outputs = _pool(outputs, feeds.get("mask", text_mask))
    if o.save is not None:
        result.written = outputs_mod.save_npy(result.outputs, str(o.save))
    return result


def _add_arrays(arrays: dict, specs, feeds: dict[str, np.ndarray]) -> None:
    """Named arrays (or nested lists), checked and converted like --input's (runtime/io/inputs.py)."""

    for name, value in arrays.items():
        if name in feeds:
            raise UsageError(f"input '{name}' is given twice")
        feeds[name] = to_array(name, value, specs)


def _alignment(o: RunOptions, sess, outputs, runnable: Runnable, feeds, model: str):
    """Choose the weights, compute the alignment (runtime/report/alignment.py) and draw it if asked."""

    tokenizer = None
    if o.tokenizer:

        tokenizer = text.load_tokenizer(o.tokenizer)
    al = alignment.from_run(sess, outputs, runnable.specs, feeds, runnable.limits, o.attention_output, o.layer,
                            o.batch_index or 0, o.head, tokenizer, model)
    if o.plot_attention is not None:
        lo, hi = float(al.matrix.min(initial=0.0)), float(al.matrix.max(initial=0.0))
        if lo < -1e-6 or hi > 1 + 1e-6:
            print(f"note: {al.output} holds values from {lo:.4g} to {hi:.4g}, not attention weights in [0, 1]; the "
                  f"grey scale clips them to [0, 1]", file=sys.stderr)
        written = alignment_plot.draw(al, str(o.plot_attention))
        print(f"wrote {written}: alignment of {al.output} ({al.what}), {al.matrix.shape[0]} x {al.matrix.shape[1]}",
              file=sys.stderr)
    return al


def _add_text_and_image_inputs(o: RunOptions, specs, feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """Fill inputs from --tokenizer/--text and --image; returns the text batch's mask (None without text)."""
    new: dict[str, np.ndarray] = {}
    mask = None
    if o.texts:

        enc = text.encode(text.load_tokenizer(o.tokenizer), o.texts)
        new.update(text.text_feeds(enc, specs))
        mask = enc.mask
        if "mask" not in new and len(set(enc.lengths)) > 1:
            print(f"note: the texts have {', '.join(map(str, enc.lengths))} tokens and are right-padded to "
                  f"{max(enc.lengths)}; the model has no mask input, so outputs past each text's length are "
                  f"padding", file=sys.stderr)
    if o.images:

        new.update(image.image_feeds(o.images, specs))
    for name, value in new.items():
        if name in feeds:
            source = "--image" if o.images and value.ndim == 4 else "--text"
            raise UsageError(f"input '{name}' is given both by --input and by {source}")
        feeds[name] = value
    return mask


def _pool(outputs: dict[str, np.ndarray], mask: np.ndarray | None) -> dict[str, np.ndarray]:

    hidden = outputs[text.hidden_output(outputs)]
    if mask is None:
        print("note: --pool mean without --text or a mask input averages over every position", file=sys.stderr)
    emb = text.mean_pool(hidden, mask)
    return {"embedding": emb, "similarity": (emb @ emb.T).astype(np.float32)}


# ------------------------------------------------------------------ report
def report(ref: ModelRef, o: ReportOptions) -> dict:
    """Elaborate the spec and compute its cost report (a JSON-able dict); draw --plot if asked; with
    --measure, time the model through ``time_phase`` (compiled as run and generate compile it)."""

    ref.check()
    ref, o = from_checkpoint(ref, o)
    o.check()
    return build_report(ref, o, timer=time_phase)


def time_phase(phase: str, ref: ModelRef, o: ReportOptions, token_input: str, vocab: int):
    """report --measure: one phase timed on this machine's CPU (runtime/report/measure.py says how),
    a measure.Timing. Here because it compiles as ``run`` (prefill) and ``generate`` (decode) do."""
    return _time_prefill(ref, o, token_input, vocab) if phase == "prefill" else _time_decode(ref, o, vocab)


def _time_prefill(ref: ModelRef, o: ReportOptions, token_input: str, vocab: int):
    """The full model (``run``'s compile, CPU provider) on B x N random token ids."""
    from tessera.runtime.session import run_session

    run_o = RunOptions(provider="cpu", quantize=o.quantize, quantize_block=o.quantize_block,
                       quantize_head=o.quantize_head, quantize_activations=o.quantize_activations,
                       quantize_embedding=o.quantize_embedding,
                       sparse_moe=o.sparse_moe, gguf_weights=o.gguf_weights)
    runnable = prepare_run(ref, run_o)
    feeds = {token_input: measure.tokens(o.batches[0], o.seqs[0], vocab)}
    bind_inputs(runnable.specs, feeds, runnable.limits)  # N past the model's positions: a clear InputError
    sess = runnable.open("cpu")
    runs = []
    for i in range(measure.PREFILL_WARMUP + o.repeats):
        t = time.perf_counter()
        run_session(sess, feeds)
        if i >= measure.PREFILL_WARMUP:
            runs.append(time.perf_counter() - t)
    return measure.Timing(runs)


def _time_decode(ref: ModelRef, o: ReportOptions, vocab: int):
    """Single-token steps of the KV-cached decoder (``generate``'s compile) after a prompt of N - s
    tokens, s = measure.decode_steps(o): each timed step is one token for each of the B sequences."""

    steps = measure.decode_steps(o)
    gen_o = GenerateOptions(quantize=o.quantize, quantize_block=o.quantize_block, quantize_head=o.quantize_head,
                            quantize_activations=o.quantize_activations, quantize_embedding=o.quantize_embedding,
                            gguf_weights=o.gguf_weights)
    model = loop.load_model(ref, gen_o)
    prompts = measure.tokens(o.batches[0], o.seqs[0] - steps, vocab).tolist()
    prompts = gen.check_request(model, prompts, steps, gen.Sampling())  # the context, the cache's memory
    decoder = gen.CachedDecoder(model, prompts, steps, 0, gen.Stats())
    last = decoder.step(None).argmax(axis=-1)
    runs = []
    for i in range(steps):
        t = time.perf_counter()
        logits = decoder.step(last)
        if i >= measure.DECODE_WARMUP:
            runs.append(time.perf_counter() - t)
        last = logits.argmax(axis=-1)
    return measure.Timing(runs)


# ------------------------------------------------------------------ generate
def generate(ref: ModelRef, o: GenerateOptions, prompt_ids: list[list[int]] | None = None, weights=None,
             models: dict | None = None, tokenizer=None, source_arrays: dict | None = None, progress=None):
    """Prepare a generation: the model loaded (or taken from ``models``, a cache the caller keeps),
    the prompts encoded (``tokenizer``: one the caller has loaded already) and every request rule
    checked (``source_arrays``: an encoder-decoder's source inputs as arrays, the API's); returns a
    generation.loop.Generation whose steps the caller drives (every kind of model, recurrent ones and
    RNNsearch included, runs the one cached form). ``progress``:
    told the stages of compiling a spec's cached decoder (the command line's bar, runtime/progress.py)."""

    ref.check()
    structured = o.json_schema is not None or o.regex is not None or o.grammar is not None
    ref, o = from_checkpoint(ref, o, wants_tokenizer=bool(o.prompts or o.stops or structured))
    o.check()
    o = with_model_defaults(ref, o)
    draft_ref = None
    if isinstance(o.speculative, (str, Path)) and o.speculative != "ngram":  # a draft model named by its path
        draft_ref, _ = from_checkpoint(ModelRef(spec=str(o.speculative), seed=ref.seed))
    return loop.prepare(ref, o, prompt_ids, weights, models, tokenizer, source_arrays, progress, draft_ref)


def with_model_defaults(ref: ModelRef, o: GenerateOptions) -> GenerateOptions:
    """The options with the checkpoint's end-of-sequence ids and decoding defaults
    (runtime/io/generation_config.py) filled in; --explain prints where each value came from."""

    spec = Path(ref.spec)
    folders = generation_config.folders_for(spec if spec.is_dir() else None, ref.weights, o.tokenizer)
    o, lines = o.with_defaults(generation_config.read(folders))
    if o.explain:
        print("generation settings:\n" + "\n".join("  " + line for line in lines), file=sys.stderr)
    return o


# ------------------------------------------------------------------ serve, batch, Ray: the engine's model
# The engine's decoding kernel, measured (bench/serve_decode.py: one engine step at 16 rows of uneven
# lengths, the Llama shape, alternating rounds): GroupQueryAttention with per-row lengths was
# faster than the plain branch in 11 of 12 rounds over two runs (medians 1.08x and 1.25x, under load;
# docs/benchmarks/table.md S3).
DECODE = "auto"  # GroupQueryAttention where every cached site takes it, else the plain branch


def serve_model(ref: ModelRef, o: EngineOptions, decode: str = DECODE, last_only: bool = True,
                prefix_keys: bool | None = None, check_tokens: int = 0):
    """The model for the serving engine (serving/row_engine.py ``engine_for`` picks the engine): a .tsr
    spec (or a bundled spec's name, or a checkpoint folder) compiled now with ``o``'s compile options in
    buffer mode (``EngineOptions.engine_pipeline_options``: ``decode``'s kernels, the combined call with
    last-position logits; ``last_only=False``: every position's, for serve --speculative; ``prefix_keys``: the
    gqa decoding step without its mask, default on CUDA: EngineOptions.engine_pipeline_options; ``check_tokens``:
    serve --speculative's drafts + 1, the calls that give every position's logits, the combined call kept where
    it is built: EngineOptions.engine_pipeline_options), or an .onnx
    file compiled with ``--kv-cache``; a decoder with recurrent state compiled with its state as cache
    state, and an encoder-decoder as generation/loop.py's EncoderDecoder (both for the RowEngine)."""

    ref.check()
    o.check()
    ref, _ = from_checkpoint(ref)  # a Hugging Face checkpoint folder: its bundled spec, its own weights
    path = Path(ref.spec)
    device = o.device  # cuda or cpu (--provider; auto: CUDA where usable)
    if ref.compiled or path.is_dir():
        if ref.variant or ref.sets or ref.weights or o.build_given() or o.dtype != "fp32":
            raise UsageError("--variant, --set, --weights, --dtype and --quantize apply to .tsr specs; an .onnx "
                             "file is already compiled (compile it with --kv-cache --target --dtype --quantize ...)")
        model = gen.CachedModel.from_onnx(path, provider=device, threads=o.threads)
    else:
        built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)

        if embeddings.is_encoder(built.graph) or target_input(built.graph) is not None:
            weights = pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large)
        if device == "cuda" and (embeddings.is_encoder(built.graph) or target_input(built.graph) is not None
                                 or _carries_state(built.graph)):
            if o.provider == "auto":  # served on the CPU, compiled for it
                return serve_model(ref, dataclasses.replace(o, provider="cpu"), decode, last_only, prefix_keys,
                                   check_tokens)
            raise UsageError("on CUDA `tessera serve` and `tessera batch` run the KV-cache engine (decoder-only "
                             "attention models); this model is an encoder, an encoder-decoder or carries recurrent "
                             "state, which they serve on the CPU only: use --provider cpu")
        if embeddings.is_encoder(built.graph):  # hidden states, no logits: served for /v1/embeddings
            folder = Path(ref.weights) if ref.weights else None
            folder = folder.parent if folder is not None and folder.is_file() else folder
            return embeddings.load(built, weights, o.threads, folder, Path(ref.spec).stem)
        target = target_input(built.graph)
        if target is not None:  # served by the RowEngine (row_engine.py), one decoder per row
            served_sources(_Sources(built, target))  # float features cannot come over HTTP: before compiling
            return EncoderDecoder(built, weights, target, o.threads, o.engine_pipeline_options(state=True))
        # the cached decoders below go through the compile cache (generation/loop.compile_decoder): a hit
        # loads the compiled model without reading the weights; a miss reads them (once) and compiles
        read: list = []

        def read_weights():  # once, on the first miss
            if not read:
                read.append(pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large))
            return read[0]

        if _carries_state(built.graph):  # the RowEngine's per-slot state; no buffer cache to fit
            return compile_decoder(built, ref, o, o.engine_pipeline_options(state=True, check_tokens=check_tokens),
                                   "row engine's decoder", "cpu", o.threads, read_weights)
        try:
            # the engine's variant: with the combined call (last-position logits, and every position's in the short
            # calls that check drafts: check_tokens)
            model = compile_decoder(built, ref, o, o.engine_pipeline_options(decode, last_only, prefix_keys=prefix_keys,
                                                                             check_tokens=check_tokens),
                                    "serving engine's decoder", device, o.threads, read_weights)
            info = model.info
            if info.length_input and not all(layer.buffer_key for layer in info.layers):
                # mixed kernels would read one attention mask two ways (see check_fit): all plain
                built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)  # the compile rewrote it
                model = compile_decoder(built, ref, o, o.engine_pipeline_options("plain", last_only, mixed=False,
                                                                                 check_tokens=check_tokens),
                                        "serving engine's decoder", device, o.threads, read_weights)
        except UsageError as e:  # e.g. a sliding window: no buffer-mode cache
            raise UsageError(f"{e}; `tessera serve` needs the buffer cache (one row per slot), so it cannot serve "
                             f"this model") from None
    check_fit(model)
    return model


def _carries_state(graph) -> bool:
    """Whether a decoder-only graph carries recurrent state over time (a scan or causal conv1d over the
    tokens: compiler/passes/recurrent_state.py), which the KV-cache Engine has no slot for."""

    logits = graph.type_of(graph.outputs[0])
    return logits.rank == 3 and carries_state(graph, dims.dim(logits.shape[1]))


class _Sources:
    """What served_sources reads of an encoder-decoder, before anything is compiled."""

    def __init__(self, built, target: str):

        self.specs = [s for s in specs_from_graph(built.graph) if s.name != target]
        self.sources = [s.name for s in self.specs]
        self.limits = input_limits(built.graph)


def served_sources(model) -> tuple[str, list[str]]:
    """An encoder-decoder's (prompt source, mask sources): the one integer source that indexes an
    embedding table takes the prompt's ids; integer sources of the same shape are its mask (all ones:
    a request is one unpadded row). Anything else (float features) cannot come over HTTP."""
    specs = {s.name: s for s in model.specs}
    floats = [s for s in model.specs if not s.dtype.startswith(("i", "u"))]
    if floats:
        s = floats[0]
        raise UsageError(f"the encoder's input '{s.name}' is {s} (float features, as Whisper's log-mel "
                         f"spectrogram); the server's HTTP API carries text or token prompts only, so this model "
                         f"cannot be served: generate it with `tessera generate --input {s.name}=FILE.npy`")
    ids = [name for name in model.sources if name in model.limits.ids]
    if len(ids) != 1:
        raise UsageError(f"the server takes the prompt as the encoder's token ids: the model needs exactly one "
                         f"source of token ids, it has {len(ids)} ({', '.join(model.sources)})")
    prompt = ids[0]
    masks = [n for n in model.sources if n != prompt]
    for n in masks:
        if specs[n].dims != specs[prompt].dims:
            raise UsageError(f"the encoder's input '{n}' ({specs[n]}) is neither the prompt's token ids nor their "
                             f"mask; the server cannot fill it from a prompt")
    return prompt, masks


def check_fit(model) -> None:
    """The engine needs buffer mode (a preallocated cache, one row per slot) and per-row lengths:
    the plain decoding branch, or GroupQueryAttention at every cached site with a cache_length of one
    length per row ([B]; files compiled before it had [1]). Say how to recompile otherwise."""
    info = model.info
    if info.mode != "buffer":
        raise UsageError("the engine needs a buffer-mode cache (sliding-window models compile to concat mode, "
                         "which the engine does not serve); recompile with --kv-cache --cache buffer")
    if info.length_input:
        shape = next((i.shape for i in model.session.get_inputs() if i.name == info.length_input), None)
        if shape == [1]:
            raise UsageError("this file decodes with GroupQueryAttention over one cache length for every row "
                             "(compiled by an older Tessera), so rows of different lengths cannot share a step; "
                             "recompile it (`tessera compile --kv-cache`, or `--decode plain`), or serve the .tsr "
                             "spec")
        if not all(layer.buffer_key for layer in info.layers):
            raise UsageError("this file decodes some attention layers with GroupQueryAttention and others with "
                             "the plain branch, which read the engine's mask differently; recompile it with "
                             "`tessera compile --kv-cache --decode plain`, or serve the .tsr spec")
    if model.vocab is None:
        raise UsageError("the model's vocabulary size is not static; the engine needs it")
# ------------------------------------------------------------------ perplexity
@dataclass
class PerplexityResult:
    """``perplexity``'s figure and how it was reached (``as_dict``: ``--format json``)."""

    perplexity: float
    uncertainty: float       # llama.cpp's ±: the standard error of the mean NLL, times the perplexity
    mean_nll: float          # nats per scored token
    scored: int              # tokens scored
    windows: int
    text_tokens: int
    context: int
    stride: int | None
    convention: str          # "llama.cpp" or "sliding"
    provider: str
    seconds: float
    compile_cache: str = "off"  # hit, miss or off (runtime/compile_cache.py)

    def as_dict(self) -> dict:

        return asdict(self)

    def line(self) -> str:
        how = (f"{self.windows} windows of {self.context} tokens, each scoring its second half "
               f"(llama.cpp's llama-perplexity)" if self.convention == "llama.cpp" else
               f"{self.windows} windows of at most {self.context} tokens every {self.stride}, each scoring the "
               f"tokens no earlier window scored (transformers' sliding window)")
        return (f"perplexity {self.perplexity:.4f} ± {self.uncertainty:.4f} over {self.scored:,} tokens of "
                f"{self.text_tokens:,} ({how}; {self.seconds:.1f} s, {self.provider}; compile cache "
                f"{self.compile_cache})")


def perplexity_windows(n_tokens: int, context: int, stride: int | None) -> list[tuple[int, int, int]]:
    """The windows as (start, end, first scored position): each window's tokens are [start, end) and it
    scores the tokens at [first, end), each predicted from the ones before it in the window.

    stride None (llama.cpp's ``llama-perplexity``): non-overlapping windows of ``context`` tokens, the
    tokens past the last whole window left out; each scores the last context - context // 2 - 1 tokens
    (positions context // 2 + 1 ... context - 1), whose predictions all see at least half a window.
    stride S (transformers' "perplexity of fixed-length models"): a window of up to ``context`` tokens
    starting every S tokens, scoring the tokens no earlier window scored (the first window every token
    but its first), to the end of the text."""
    if stride is None:
        first = context // 2 + 1
        return [(k * context, (k + 1) * context, k * context + first) for k in range(n_tokens // context)]
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        if end - begin >= 2:
            out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _leading_special(tokenizer) -> int | None:
    """The token the tokenizer puts before every text (a BOS), if it adds one."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a").ids
    return full[0] if len(full) == len(plain) + 1 and full[1:] == plain else None


def perplexity(ref: ModelRef, o, weights=None, progress=None) -> PerplexityResult:
    """The perplexity of a causal language model (one token input, a ``logits`` output) on the text
    file ``o.text``: exp of the mean negative log-likelihood of the scored tokens (perplexity_windows).
    In llama.cpp's convention the text is tokenized with the BOS the tokenizer adds (if any) and no
    other special token, and each window's first token is replaced by that BOS, as llama-perplexity
    does; in the sliding
    convention the text is tokenized as transformers' tokenizer(text) does (its BOS once, first).
    ``progress(windows done, windows)``: the command line's bar."""
    from tessera.runtime.session import run_session

    t0 = time.perf_counter()
    ref.check()
    ref, o = from_checkpoint(ref, o, wants_tokenizer=True)
    o.check()
    if not o.tokenizer:
        raise UsageError(o.say("perplexity needs a tokenizer: --tokenizer tokenizer.json (a checkpoint folder or a "
                               "GGUF file as the model brings its own)", "perplexity needs tokenizer=... (a "
                               "checkpoint folder or a GGUF file as the model brings its own)"))

    st = stat_or_raise(Path(o.text), "text file", UsageError)
    if not stat_.S_ISREG(st.st_mode):
        raise UsageError(f"text file {o.text} is not a regular file")
    try:
        body = Path(o.text).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"text file {o.text} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    tokenizer = text_mod.load_tokenizer(o.tokenizer)
    if o.stride is None:
        bos = _leading_special(tokenizer)  # llama-perplexity: the text with the vocabulary's BOS (if it adds
        ids = ([bos] if bos is not None else []) + list(tokenizer.encode(body, add_special_tokens=False).ids)
    else:
        ids, bos = list(tokenizer.encode(body).ids), None
    windows = perplexity_windows(len(ids), o.context, o.stride)
    if not windows:
        raise UsageError(f"{o.text} has {len(ids):,} tokens; {o.flag('context')} {o.context} needs at least "
                         f"{o.context if o.stride is None else 2} (give a longer text or a shorter context)")
    run_o = RunOptions(provider=o.provider, quantize=o.quantize, quantize_block=o.quantize_block,
                       quantize_head=o.quantize_head, quantize_activations=o.quantize_activations,
                       quantize_embedding=o.quantize_embedding,
                       gguf_weights=o.gguf_weights, compile_cache=o.compile_cache, no_compile_cache=o.no_compile_cache)
    runnable = prepare_run(ref, run_o, weights)
    ints = [s for s in runnable.specs if s.dtype.startswith(("i", "u"))]
    if len(runnable.specs) != 1 or len(ints) != 1:
        raise UsageError(f"perplexity needs a causal language model with one token input; {ref.spec} takes "
                         f"{', '.join(f'{s.name}: {s}' for s in runnable.specs)}")
    name = ints[0].name
    sess = runnable.open(o.provider)
    if "logits" not in [x.name for x in sess.get_outputs()]:
        raise UsageError(f"perplexity needs a model with a logits output; {ref.spec} has "
                         f"{', '.join(x.name for x in sess.get_outputs())}")
    total = total2 = 0.0
    count = 0
    for k, (start, end, first) in enumerate(windows):
        window = np.asarray(ids[start:end], dtype=np.int64)[None]
        if bos is not None:
            window[0, 0] = bos
        feeds = {name: window}
        bind_inputs(runnable.specs, feeds, runnable.limits)  # a context past the model's: a clear InputError
        logits = run_session(sess, feeds)["logits"][0, first - start - 1:end - start - 1].astype(np.float64)
        targets = window[0, first - start:end - start]
        top = logits.max(axis=-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
        nll = logz - logits[np.arange(len(targets)), targets]
        total += float(nll.sum())
        total2 += float((nll ** 2).sum())
        count += len(targets)
        if progress is not None:
            progress(k + 1, len(windows))
    mean = total / count
    ppl = float(np.exp(mean))
    spread = max(total2 / count - mean * mean, 0.0)
    err = float(np.sqrt(spread / (count - 1)) * ppl) if count > 1 else 0.0
    return PerplexityResult(ppl, err, mean, count, len(windows), len(ids), o.context, o.stride,
                            "llama.cpp" if o.stride is None else "sliding", sess.get_providers()[0],
                            time.perf_counter() - t0,
                            runnable.compile_cache.state if runnable.compile_cache is not None else "off")


# ------------------------------------------------------------------ the compile cache
def cache(o) -> dict:
    """``tessera cache list|clear`` (options.CacheOptions): the compile cache's folder (as the commands that
    load a model choose it: --compile-cache, TESSERA_COMPILE_CACHE, Tessera's cache folder) and its
    entries, most recently used first; ``clear`` removes them and says how many and how large."""

    o.check()
    folder, source = compile_cache.folder_for(o.compile_cache)
    out = {"folder": str(folder) if folder is not None else None, "source": source,
           "max_bytes": compile_cache.max_bytes()}
    if folder is None:
        out["entries"] = []
        return out
    if o.action == "clear":
        removed, freed = compile_cache.clear(folder)
        out.update(removed=removed, freed_bytes=freed)
    out["entries"] = [e.as_dict() for e in compile_cache.entries(folder)]
    return out
