"""What the serving engines need from the rest of the runtime, in one place: the cached decoder
(compiled with the plain decoding branch, see ``load``; row_engine.py ``engine_for`` picks the engine
that serves it), token choice, the tokenizer and the errors.

Why one module: the engine and the server import the runtime only through here, so the runtime can
be reorganised by changing these imports alone.
"""

from __future__ import annotations

from pathlib import Path

from tessera.runtime.errors import UsageError  # noqa: F401  (re-exported)

# re-exported, imported on first use (PEP 562) so that `tessera serve --help` and `tessera --help`,
# which import the serving commands, do not import onnxruntime, onnx and the compiler
LAZY = {"CachedModel": ("tessera.runtime.generation.cached", "CachedModel"),
        "Sampling": ("tessera.runtime.generation.sampling", "Sampling"),
        "choose": ("tessera.runtime.generation.sampling", "choose"),
        "Step": ("tessera.runtime.generation.sampling", "Step"),
        "token_logprobs": ("tessera.runtime.generation.sampling", "token_logprobs"),
        "TextStopper": ("tessera.runtime.generation.cached", "TextStopper"),
        "encode_prompts": ("tessera.runtime.generation.cached", "encode_prompts"),
        "stop_token_ids": ("tessera.runtime.generation.cached", "stop_token_ids"),
        "check_cache_fits": ("tessera.runtime.generation.cached", "check_cache_fits"),
        "CachedDecoder": ("tessera.runtime.generation.cached", "CachedDecoder"),
        "Stats": ("tessera.runtime.generation.cached", "Stats"),
        "NO_CONTEXT_CAP": ("tessera.runtime.generation.cached", "NO_CONTEXT_CAP"),
        "NgramDrafter": ("tessera.runtime.generation.drafting", "NgramDrafter"),
        "ort_message": ("tessera.runtime.session", "ort_message"),
        "RunError": ("tessera.runtime.session", "RunError"),
        "load_tokenizer": ("tessera.runtime.io.text", "load_tokenizer"),
        "ChatTemplate": ("tessera.runtime.io.chat_template", "ChatTemplate"),
        "ChatTemplateError": ("tessera.runtime.io.chat_template", "ChatTemplateError")}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        module, attr = LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# The engine's decoding kernel, measured (bench/serve_decode.py: one engine step at 16 rows of uneven
# lengths, the Llama shape, alternating rounds): GroupQueryAttention with per-row lengths was
# faster than the plain branch in 11 of 12 rounds over two runs (medians 1.08x and 1.25x, under load;
# docs/BENCHMARKS.md S3).
DECODE = "auto"  # GroupQueryAttention where every cached site takes it, else the plain branch
DECODE_REASONS = {
    "gqa": ("decode (T = 1): onnxruntime's GroupQueryAttention over the shared cache buffer with per-row "
            "seqlens_k (cache_length [B]): each row attends over its own filled slots and the kernel writes "
            "its new column at its own slot, in place (the buffer bound as past and present), so rows of any "
            "lengths share a step. Chosen over the plain MatMul/Softmax branch with a per-row mask: faster in "
            "11 of 12 rounds of bench/serve_decode.py (one step at 16 rows of uneven lengths; docs/BENCHMARKS.md)."),
    "plain": ("decode (T = 1): plain MatMul/Softmax over the cache buffer with a per-row slot mask and per-row "
              "positions, so every row of one step has its own length; the engine writes each row's new "
              "column at that row's own slot. (GroupQueryAttention with per-row lengths, faster where it "
              "fits, is used when every cached attention takes it: head sizes that are multiples of 8, and "
              "no feature it lacks.)"),
}


# The combined call (compiler/backends/onnx/mixed_attention.py): measured by bench/prefill_mix_cost.py
# (docs/BENCHMARKS.md S7, under load): an iteration of 16 decoding rows and a 16-token chunk as one call
# costs about 1.2 of the engine's decoding step, against 1.6-1.7 as two calls.
COMBINED_REASONS = {
    True: ("iteration: the decoding rows and a prompt chunk in ONE onnxruntime call (the combined call: the tokens "
           "packed [1, rows + chunk], every weight read once; each attention site runs the decoding rows' "
           "GroupQueryAttention in place and the chunk's attention as one block over its row's filled columns); "
           "a prompt with no decoding row beside it, or a decoding step with no prompt waiting, runs alone"),
    False: ("iteration: a prompt chunk and the decoding step in two onnxruntime calls (this model has no combined "
            "call: it needs GroupQueryAttention decoding at every site, last-position logits, and no speculation)"),
}


def has_combined_call(model) -> bool:
    """Whether the loaded decoder has the engine's combined call (its metadata says so,
    compiler/backends/onnx/mixed_attention.py: ``load`` builds it for every GroupQueryAttention decoder)."""
    from tessera.compiler.backends.onnx.mixed_attention import COMBINED_KEY

    session = getattr(model, "session", None)
    return session is not None and session.get_modelmeta().custom_metadata_map.get(COMBINED_KEY) == "1"


def weights_line(model) -> str:
    """The --explain line on the served weights: float, or the quantisation the file records
    (compiler/build.py's ``tessera.quantize`` metadata, read as untrusted input by runtime/metadata.py)."""
    from tessera.compiler.reference.quant import ROWS
    from tessera.runtime import metadata

    session = getattr(model, "session", None)
    meta = session.get_modelmeta().custom_metadata_map if session is not None else {}
    if metadata.QUANTIZE_KEY not in meta:
        return "weights: float (no --quantize)"
    q = metadata.quantization(meta[metadata.QUANTIZE_KEY], "the served model")
    how = "one scale per output row, each activation row quantised at run time" if q["block_size"] == ROWS \
        else f"one scale per {q['block_size']} input features, activations {q['activations']} in the product"
    return f"weights: {q['scheme']} ({how}; the output head {'quantised' if q['head'] else 'in float'})"


def decode_kernel(info) -> str:
    """The decoding kernel a loaded model runs: "gqa" when its steps write the buffer in place."""
    return "gqa" if info.length_input else "plain"


def load(spec: str, variant: str | None = None, sets: list[str] | None = None, weights: str | None = None,
         seed: int = 0, threads: int | None = None, decode: str | None = None,
         last_only: bool = True, quantize=None) -> "CachedModel":
    """The model for the engine (row_engine.py ``engine_for`` picks it): a .tsr spec (or a bundled spec's name) compiled
    now with the plain decoding branch in buffer mode, or an .onnx file compiled with ``--kv-cache
    --decode plain``; a decoder with recurrent state compiled with its state as cache state, and an
    encoder-decoder as generation/loop.py's EncoderDecoder (both for the RowEngine, row_engine.py).
    ``last_only=False``: the logits of every position (serve --speculative checks drafts with them).
    ``quantize``: a QuantConfig (options.QuantOptions.quant_config), applied by the pipeline's first pass."""
    from tessera.runtime import pipeline as _pipeline
    from tessera.runtime.generation import cached as _gen
    from tessera.runtime.generation.cached import CachedModel
    from tessera.runtime.io import checkpoint

    spec = checkpoint.local(checkpoint.unshadowed(spec))  # a folder merely named like a bundled spec: that spec;
    weights = checkpoint.local(weights)                    # a GGUF file: its checkpoint folder
    if checkpoint.is_checkpoint(spec):  # a Hugging Face checkpoint folder: its bundled spec, its own weights
        if weights and Path(weights).resolve() != Path(spec).resolve():
            raise UsageError(f"{spec} is a checkpoint folder, its own weights; give it without --weights")
        spec, weights = checkpoint.spec_for(Path(spec)), str(spec)
    path = Path(spec)
    if path.suffix == ".onnx" or path.is_dir():
        if variant or sets or weights or quantize:
            raise UsageError("--variant, --set, --weights and --quantize apply to .tsr specs; an .onnx file is "
                             "already compiled (compile it with --kv-cache --quantize ...)")
        model = CachedModel.from_onnx(path, threads=threads)
    else:
        built = _pipeline.build(spec, variant, sets or [], weights)
        from tessera.runtime.generation.loop import target_input

        w = _pipeline.weights_for(built, weights, seed)
        target = target_input(built.graph)
        if target is not None:  # served by the RowEngine (row_engine.py), one decoder per row
            return _encoder_decoder(built, w, target, threads, quantize)
        if _carries_state(built.graph):  # the RowEngine's per-slot state; no buffer cache to fit
            with _pipeline.compiler_errors():
                proto, info = _gen.compile_cached(built, w, quantize=quantize)
            return CachedModel(proto.SerializeToString(), info, threads=threads)
        try:
            # the engine's variant: with the combined call (last-position logits only: not for speculation)
            proto, info = _gen.compile_cached(built, w, mode="buffer", decode=decode or DECODE,
                                             last_only=last_only, mixed=last_only, quantize=quantize)
            if info.length_input and not all(layer.buffer_key for layer in info.layers):
                # mixed kernels would read one attention mask two ways (see check_fit): all plain
                proto, info = _gen.compile_cached(built, w, mode="buffer", decode="plain", last_only=last_only,
                                                 quantize=quantize)
        except UsageError as e:  # e.g. a sliding window: no buffer-mode cache
            raise UsageError(f"{e}; `tessera serve` needs the buffer cache (one row per slot), so it cannot serve "
                             f"this model") from None
        model = CachedModel(proto.SerializeToString(), info, threads=threads)
    check_fit(model)
    return model


def _carries_state(graph) -> bool:
    """Whether a decoder-only graph carries recurrent state over time (a scan or causal conv1d over the
    tokens: compiler/passes/recurrent_state.py), which the KV-cache Engine has no slot for."""
    from tessera.compiler.ir import dims
    from tessera.compiler.passes.recurrent_state import carries_state

    logits = graph.type_of(graph.outputs[0])
    return logits.rank == 3 and carries_state(graph, dims.dim(logits.shape[1]))


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


def _encoder_decoder(built, weights, target: str, threads: int | None, quantize=None):
    """An encoder-decoder for the RowEngine (generation/loop.py's EncoderDecoder: the encoder part and
    the cached decoder), its sources checked first: float features cannot come over HTTP."""
    from tessera.compiler.ir.signature import input_limits, specs_from_graph
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime.generation.loop import EncoderDecoder

    class Sources:  # what served_sources reads, before anything is compiled
        specs = [s for s in specs_from_graph(built.graph) if s.name != target]
        sources = [s.name for s in specs]
        limits = input_limits(built.graph)

    served_sources(Sources)
    return EncoderDecoder(built, weights, target, threads, PipelineOptions(quantize=quantize))


def check_fit(model: CachedModel) -> None:
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


def tokenizer_path(tokenizer, spec) -> str | None:
    """--tokenizer as given, else a checkpoint folder's tokenizer.json (the model given as a folder)."""
    from tessera.runtime.io import checkpoint

    from tessera.runtime.io.text import tokenizer_file

    found = checkpoint.tokenizer_in(spec) if not tokenizer else None
    if found is not None:
        return str(found)
    return str(tokenizer_file(tokenizer)) if tokenizer else tokenizer  # a folder: its tokenizer.json


def tokenizer_folder_file(tokenizer_path: str | Path, name: str) -> Path | None:
    """A file next to tokenizer.json (tokenizer_config.json, generation_config.json), if present."""
    p = Path(tokenizer_path).parent / name
    return p if p.is_file() else None



def eos_ids(tokenizer, tokenizer_path: str | Path | None, spec=None, weights=None) -> list[int]:
    """The end-of-sequence tokens: ``eos_token_id`` of generation_config.json / config.json in the
    model's, the weights' or the tokenizer's folder (runtime/io/generation_config.py, the reader
    ``tessera generate`` uses), and ``eos_token`` of tokenizer_config.json beside the tokenizer (a
    request stops there unless it says ignore_eos). None found: no end-of-sequence token."""
    import json

    from tessera.runtime.io import generation_config

    spec_folder = spec if spec is not None and Path(spec).is_dir() else None
    out = list(generation_config.read(generation_config.folders_for(spec_folder, weights, tokenizer_path)).eos)
    f = tokenizer_folder_file(tokenizer_path, "tokenizer_config.json") if tokenizer is not None and \
        tokenizer_path is not None else None
    if f is not None:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        tok = data.get("eos_token") if isinstance(data, dict) else None
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tokenizer.token_to_id(tok) is not None:
            out.append(int(tokenizer.token_to_id(tok)))
    return sorted(set(out))


def decoder_start(tokenizer_path, spec=None, weights=None) -> int | None:
    """An encoder-decoder's decoder start token from the checkpoint (``decoder_start_token_id`` of
    generation_config.json / config.json: runtime/io/generation_config.py, as ``tessera generate``)."""
    from tessera.runtime.io import generation_config

    spec_folder = spec if spec is not None and Path(spec).is_dir() else None
    return generation_config.read(generation_config.folders_for(spec_folder, weights, tokenizer_path)).start
