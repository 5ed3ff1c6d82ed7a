"""The Python API: ``tessera.load(spec)`` and what the commands do, as methods.

Why: notebooks and scripts want a model object, not a subprocess. Each method
fills the same option object as its command (runtime/options.py) and calls the
same driver (runtime/driver.py), so the two cannot drift apart:
tests/project/test_options_parity.py fails when a flag has no keyword here or the reverse.

    import tessera
    m = tessera.load("models/gpt2.tsr", variant="small", weights=None, seed=0, layers=2)
    m.report(batch=1, seq=128)                      # the cost report, as a dict
    m.compile("out/gpt2.onnx")                      # ONNX file(s) written
    m.compile("out/gpt2-cached.onnx", kv_cache=True)  # for `tessera generate out/gpt2-cached.onnx`
    m.compile("out/gpt2-genai", genai=True, tokenizer="tokenizer.json")  # a folder for onnxruntime-genai
    m.run(tokens=[[464, 2068, 7586]])               # {"logits": array}
    m.alignment(layer=1, head="mean", tokens=[[464, 2068, 7586]]).matrix   # layer 1's attention [T, T]
    m.generate([464, 2068], max_new_tokens=20)      # [[...new ids...]]
    for step in m.generate("Hello", tokenizer="tokenizer.json", max_new_tokens=20, stream=True):
        print(step, end="")                          # text as it is decoded

Hyperparameter overrides are keyword arguments of ``load`` (the ``--set`` values).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from tessera.runtime import driver, pipeline
from tessera.runtime.errors import UsageError
from tessera.runtime.generation import cached as gen
from tessera.runtime.generation import loop
from tessera.runtime.io import checkpoint, text
from tessera.runtime.options import (CompileOptions, GenerateOptions, ModelRef, PerplexityOptions, ReportOptions,
                                     RunOptions, split_prompt)
from tessera.runtime.report.view import Report


def _set_args(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        out.append(f"{k}={'true' if v is True else 'false' if v is False else v}")
    return out


def _as_list(v):
    """A list or tuple argument as a list; anything else (None, a str) as it is, for check() to refuse."""
    return list(v) if isinstance(v, (list, tuple)) else v


class Model:
    """A spec with a variant, overrides and weights; compiled lazily for each use."""

    def __init__(self, spec: str | Path, variant: str | None = None, weights: str | Path | None = None,
                 seed: int = 0, allow_large: bool = False, **overrides):
        self.ref = ModelRef(spec=spec, variant=variant, sets=_set_args(overrides),
                            weights=str(weights) if weights is not None else None, seed=seed,
                            allow_large=allow_large).for_api()
        self.ref.check()
        self._folder_tokenizer = checkpoint.tokenizer_in(spec)  # a checkpoint folder's, for text prompts
        self.ref, _ = driver.from_checkpoint(self.ref)  # a checkpoint folder: its bundled spec, its weights
        spec, weights = self.ref.spec, self.ref.weights
        self.spec, self.variant, self.seed, self.sets = Path(spec), variant, seed, self.ref.sets
        self.weights_path = self.ref.weights
        # spec errors surface here, at load; a checkpoint folder's config.json may supply hyperparameters
        self._built = pipeline.build(self.spec, variant, self.sets, self.weights_path)
        self._weights = pipeline.weights_for(self._built, self.weights_path, seed, allow_large)
        self._runnables: dict[tuple, driver.Runnable] = {}
        self._models: dict[tuple, object] = {}  # the compiled decoders, by the options that shape them
        self._tokenizer = None

    def __repr__(self) -> str:
        """What load() was given and what it built: the spec, variant, overrides, weights and size."""
        parts = [repr(str(self.spec))]
        if self.variant:
            parts.append(f"variant={self.variant!r}")
        parts += list(self.sets)
        parts.append(f"weights={self.weights_path!r}" if self.weights_path else f"seed={self.seed} (seeded weights)")
        return f"<tessera.Model {self._built.graph.name}: {', '.join(parts)}; {self._built.graph.param_count():,} parameters>"

    # ---------------------------------------------------------------- what the model is
    @property
    def graph(self):
        return self._built.graph

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self._weights

    def report(self, batch: int | list[int] = 1, seq: int | list[int] = 1024, dtype: str = "fp32",
               device: str = "h200", sparse_moe: bool = True, quantize: str = "none",
               quantize_block: int | None = None, quantize_head: str | bool = "auto", quantize_embedding: str = "auto",
               quantize_activations: str | None = None, plot: str | Path | None = None,
               tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, train: bool = False, zero: int = 0,
               recompute: str = "none", serve: bool = False, context: int | None = None, measure: bool = False,
               repeats: int = 5, calibrated: bool = False, calibration: str | Path | None = None,
               kv_cache_dtype: str = "auto", gguf_weights: str = "codes") -> Report:
        """The static cost report (parameters, MACs, memory, roofline) as ``tessera report --format json`` gives it,
        as a dict (a ``Report``: a one-line repr, ``print`` shows the tables, notebooks an HTML view)
        (``sparse_moe=False``: --no-sparse-moe; ``quantize``...: --quantize...; ``plot``: also draw --plot's figure).
        Lists for ``batch`` or ``seq`` sweep (the ``sweep`` rows); ``tp``, ``pp``, ``dp``, ``ep``, ``train``,
        ``zero``, ``recompute``, ``serve`` and ``context`` are --tp ... --context's deployment plan.
        ``measure=True`` (with ``device="cpu"``) times prefill and decoding on this machine and records the
        calibration (``repeats`` runs per phase; the file ``calibration``, else the user cache's);
        ``calibrated=True`` uses it: --measure, --repeats, --calibrated and --calibration. ``gguf_weights``: a GGUF
        file's codes, as --gguf-weights (the ``gguf_codes`` section counts the linears reading them)."""
        o = ReportOptions(batch=batch, seq=seq, dtype=dtype, device=device, sparse_moe=sparse_moe, quantize=quantize,
                          quantize_block=quantize_block, quantize_head=quantize_head, quantize_embedding=quantize_embedding,
                          quantize_activations=quantize_activations, plot=plot,
                          tp=tp, pp=pp, dp=dp, ep=ep, train=train, zero=zero, recompute=recompute, serve=serve,
                          context=context, measure=measure, repeats=repeats, calibrated=calibrated,
                          calibration=calibration, kv_cache_dtype=kv_cache_dtype,
                          gguf_weights=gguf_weights).for_api()
        return Report(driver.report(self.ref, o))

    # ---------------------------------------------------------------- compile and run
    def compile(self, out: str | Path, kv_cache: bool = False, attention: str = "auto", target: str = "cpu",
                dtype: str = "fp32", check: bool = True, quantize: str = "none", quantize_block: int | None = None,
                quantize_head: str | bool = "auto", quantize_embedding: str = "auto", quantize_activations: str | None = None, gguf_weights: str = "codes",
                sparse_moe: bool = True, genai: bool = False, tokenizer: str | Path | None = None,
                context_length: int | None = None, cache: str = "auto", decode: str = "auto",
                combined_call: bool = False, kv_cache_dtype: str = "auto",
                recurrence: str = "auto", attention_probs: list[int | str] = (), explain: bool = False,
                compile_cache: str | Path | None = None, no_compile_cache: bool = False) -> list[Path]:
        """Write the ONNX file (kv_cache=True: the cached decoder that ``tessera generate`` loads, with
        ``cache``, ``decode``, ``combined_call`` and ``kv_cache_dtype`` as --cache, --decode, --combined-call and
        --kv-cache-dtype); the weights are streamed to it one tensor at a
        time. ``quantize`` "int8" or "int4" (with ``quantize_block``, ``quantize_head``,
        ``quantize_activations``, ``quantize_embedding``) is --quantize's quantisation; ``sparse_moe=False`` is --no-sparse-moe;
        ``recurrence`` is --recurrence; ``attention_probs`` (site numbers or "all") --attention-probs;
        ``explain=True`` prints --explain's listing to stderr. ``genai=True`` (with ``tokenizer``, and
        ``context_length`` where the model has none) writes the folder ``out`` for onnxruntime-genai,
        as ``tessera compile --genai`` does. ``compile_cache`` and ``no_compile_cache`` are taken as every
        compiling method takes them; compile writes its output afresh, neither reading nor filling the cache."""
        o = CompileOptions(output=out, kv_cache=kv_cache, attention=attention, target=target, dtype=dtype,
                           check_model=check, quantize=quantize, quantize_block=quantize_block,
                           quantize_head=quantize_head, quantize_embedding=quantize_embedding, quantize_activations=quantize_activations,
                           gguf_weights=gguf_weights, sparse_moe=sparse_moe, genai=genai, tokenizer=tokenizer,
                           context_length=context_length,
                           cache=cache, decode=decode, combined_call=combined_call, kv_cache_dtype=kv_cache_dtype,
                           recurrence=recurrence,
                           attention_probs=list(attention_probs) if isinstance(attention_probs, (list, tuple))
                           else attention_probs, explain=explain, compile_cache=compile_cache,
                           no_compile_cache=no_compile_cache).for_api()
        return driver.compile(self.ref, o, weights=self._weights).files

    def run(self, inputs: dict | None = None, /, *, provider: str = "cpu", attention: str = "auto",
            target: str = "cpu", dtype: str = "fp32", quantize: str = "none", quantize_block: int | None = None,
            quantize_head: str | bool = "auto", quantize_embedding: str = "auto", quantize_activations: str | None = None, gguf_weights: str = "codes",
            sparse_moe: bool = True, recurrence: str = "auto", explain: bool = False,
            tokenizer: str | Path | None = None,
            texts: list[str] = (), images: list[str] = (), pool: str | None = None, kv_cache_dtype: str = "auto",
            save: str | Path | None = None, compile_cache: str | Path | None = None, no_compile_cache: bool = False,
            **named_inputs) -> dict[str, np.ndarray]:
        """Run the model in onnxruntime on named inputs (arrays or nested lists, checked like
        ``tessera run --input``); an input whose name is also a keyword here goes in ``inputs``, a dict.
        The keywords are ``tessera run``'s options (``texts`` with ``tokenizer`` is --text, ``images``
        --image, ``pool="mean"`` --pool mean, ``save`` --save DIR; ``kv_cache_dtype`` is refused unless "auto"
        (run keeps no KV cache: as --kv-cache-dtype); ``compile_cache`` --compile-cache DIR,
        ``no_compile_cache=True`` --no-compile-cache: docs/cli.md, the compile cache)."""
        o = RunOptions(provider=provider, attention=attention, target=target, dtype=dtype, quantize=quantize,
                       quantize_block=quantize_block, quantize_head=quantize_head, quantize_embedding=quantize_embedding,
                       quantize_activations=quantize_activations, gguf_weights=gguf_weights, sparse_moe=sparse_moe,
                       recurrence=recurrence, explain=explain, tokenizer=tokenizer, texts=_as_list(texts),
                       images=_as_list(images), pool=pool, kv_cache_dtype=kv_cache_dtype,
                       save=save, compile_cache=compile_cache, no_compile_cache=no_compile_cache).for_api()
        o.check()
        key = (provider, attention, target, dtype, sparse_moe, recurrence, o.build_key())
        if key not in self._runnables or explain:
            self._runnables[key] = driver.prepare_run(self.ref, o, weights=self._weights)
        arrays = {**(inputs or {}), **named_inputs}
        return driver.run(self.ref, o, arrays, runnable=self._runnables[key]).outputs

    def alignment(self, layer: int | None = None, output: str | None = None, head: int | str | None = None,
                  batch_index: int = 0, tokenizer: str | Path | None = None, plot: str | Path | None = None,
                  **inputs):
        """The attention matrix `tessera run --plot-attention` draws, as an ``Alignment`` (runtime/report/alignment.py:
        ``matrix`` [Tq, Tk], ``rows`` and ``cols`` the target and source tokens): of attention site
        ``layer`` (its probabilities exposed, that site unfused) or of the model output ``output``
        (default: the only one named as attention weights); ``head`` a head or "mean"; ``plot`` also
        draws it to that file."""
        o = RunOptions(provider="cpu", alignment=True, layer=layer, attention_output=output, head=head,
                       batch_index=batch_index, tokenizer=tokenizer, plot_attention=plot).for_api()
        return driver.run(self.ref, o, inputs, weights=self._weights).alignment

    # ---------------------------------------------------------------- generation
    def perplexity(self, text: str | Path, context: int = 512, stride: int | None = None,
                   tokenizer: str | Path | None = None, provider: str = "auto", quantize: str = "none",
                   quantize_block: int | None = None, quantize_head: str | bool = "auto", quantize_embedding: str = "auto",
                   quantize_activations: str | None = None, gguf_weights: str = "codes",
                   compile_cache: str | Path | None = None, no_compile_cache: bool = False) -> dict:
        """The perplexity on the text file ``text``, as ``tessera perplexity --format json`` gives it: by
        default llama.cpp's llama-perplexity figure (windows of ``context`` tokens, each scoring its
        second half), with ``stride`` transformers' sliding window (runtime/driver.perplexity_windows);
        ``tokenizer`` as --tokenizer (a checkpoint folder or GGUF file as the model brings its own),
        ``quantize``... as --quantize..., ``compile_cache`` and ``no_compile_cache`` as --compile-cache and
        --no-compile-cache."""
        o = PerplexityOptions(text=text, context=context, stride=stride,
                              tokenizer=tokenizer if tokenizer is not None else self._folder_tokenizer,
                              provider=provider, quantize=quantize, quantize_block=quantize_block,
                              quantize_head=quantize_head, quantize_embedding=quantize_embedding, quantize_activations=quantize_activations,
                              gguf_weights=gguf_weights, compile_cache=compile_cache,
                              no_compile_cache=no_compile_cache).for_api()
        return driver.perplexity(self.ref, o, weights=self._weights).as_dict()

    def cached(self, threads: int | None = None, cache: str = "auto") -> gen.CachedModel:
        """The KV-cached decoder in an onnxruntime session (compiled once per thread count and cache mode)."""
        o = GenerateOptions(threads=threads, cache=cache).for_api()
        o.check()
        return loop.load_model(self.ref, o, self._weights, self._models)

    def tokenizer(self, path: str | Path):
        if self._tokenizer is None or self._tokenizer[0] != str(path):
            self._tokenizer = (str(path), text.load_tokenizer(path))
        return self._tokenizer[1]

    def generate(self, prompt=None, max_new_tokens: int | None = None, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                 min_p: float | None = None, no_repeat_ngram_size: int | None = None,
                 min_new_tokens: int | None = None, logprobs: int | None = None, chat: bool = False,
                 ignore_eos: bool = False, explain: bool = False, seed: int | None = None, stop=(),
                 stop_tokens=(), tokenizer: str | Path | None = None, stream: bool = False, threads: int | None = None,
                 cache: str = "auto", quantize: str = "none", quantize_block: int | None = None,
                 quantize_head: str | bool = "auto", quantize_embedding: str = "auto", quantize_activations: str | None = None, gguf_weights: str = "codes",
                 inputs: dict | None = None, provider: str = "auto", dtype: str = "fp32", kv_cache_dtype: str = "auto",
                 start_token: int | None = None, speculative=None, draft_tokens: int | None = None,
                 json_schema=None, regex: str | None = None, grammar: str | Path | None = None,
                 compile_cache: str | Path | None = None, no_compile_cache: bool = False):
        """Generate from token ids (a list, or a list of lists for a batch) or text (a str or list of str,
        with ``tokenizer``). Returns the new tokens (or texts) per prompt -- one list (or str) for a single
        prompt; with ``stream=True`` yields them as they are decoded instead (per step: the new token of
        each prompt, None once a prompt has stopped; for a single text prompt, the new text). ``cache``
        and ``quantize``... are generate's --cache and --quantize.... A setting left None comes from the
        checkpoint's generation_config.json (else 32 new tokens, greedy); generation stops at the
        checkpoint's eos_token_id unless ``ignore_eos=True``; ``explain=True`` prints where each came from.
        ``min_p``, ``no_repeat_ngram_size`` and ``min_new_tokens`` are transformers' (docs/generate.md);
        ``chat=True`` renders each text prompt as the user's message with the tokenizer folder's chat
        template. With ``logprobs=N`` the result is, per prompt, a dict (as ``tessera generate
        --format json`` prints it): ``tokens``, ``text`` for a text prompt, and ``logprobs``, per new
        token its log-probability under the model and the N most likely alternatives'; streamed, each
        new token comes as such a dict (``token``, ``logprob``, ``top``, and ``text``, the new text, for
        a text prompt): one per step for a single prompt, else a list per step (None once a prompt stopped).
        An encoder-decoder takes its source inputs as ``inputs`` ({name: array, nested lists or a .npy
        path}: Whisper's float features, BART's ids and mask) and its target's first tokens as the
        prompt or ``start_token`` (the decoder's start token, for every source row; then no prompt; without
        either, the checkpoint's decoder_start_token_id).
        ``speculative`` ("ngram", a draft model's spec, checkpoint folder or .onnx file, or a loaded Model)
        with ``draft_tokens`` (default 10 with "ngram", 4 with a draft model): speculative decoding, greedy
        only, the same tokens as without it (docs/generate.md); streamed, a round's tokens come together.
        Structured output (one of, with a tokenizer): ``json_schema`` (a dict, or a JSON schema file),
        ``regex`` (a regular expression), ``grammar`` (a Lark grammar file): every output follows it.
        ``provider`` and ``dtype``: generate's --provider and --dtype (on CUDA the spec is compiled for CUDA);
        ``kv_cache_dtype``: --kv-cache-dtype ("fp16": the KV cache stored at fp16, the model in fp32).
        ``compile_cache`` (a folder) and ``no_compile_cache=True``: --compile-cache and --no-compile-cache
        (the compiled decoder kept between runs, keyed by the weights' files: weights changed in memory,
        ``m.weights[...]``, are not seen by a cache hit; give ``no_compile_cache=True`` then)."""
        # an encoder-decoder may have no prompt: its sources and a start token (given or the checkpoint's)
        no_prompt = prompt is None and (start_token is not None or bool(inputs))
        texts, ids, single = ([], None, False) if no_prompt else split_prompt(prompt)
        is_text = bool(texts)
        if tokenizer is None and (is_text or stop) and self._folder_tokenizer is not None:
            tokenizer = self._folder_tokenizer
        o = GenerateOptions(max_new_tokens=max_new_tokens, tokenizer=tokenizer, prompts=texts,
                            temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                            min_p=min_p, no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens,
                            logprobs=logprobs, chat=chat, ignore_eos=ignore_eos, explain=explain,
                            sampling_seed=seed, stops=[stop] if isinstance(stop, str) else stop,
                            stop_tokens=stop_tokens, threads=threads, cache=cache, quantize=quantize,
                            quantize_block=quantize_block, quantize_head=quantize_head, quantize_embedding=quantize_embedding,
                            quantize_activations=quantize_activations, gguf_weights=gguf_weights, provider=provider,
                            dtype=dtype, kv_cache_dtype=kv_cache_dtype, start_token=start_token, speculative=speculative, draft_tokens=draft_tokens,
                            json_schema=json_schema, regex=regex, grammar=grammar, compile_cache=compile_cache,
                            no_compile_cache=no_compile_cache).for_api()
        o.check()  # before the tokenizer is read
        tok = self.tokenizer(tokenizer) if tokenizer is not None else None
        # errors now, not at the first next()
        run = driver.generate(self.ref, o, ids, self._weights, self._models, tok, inputs)
        if stream:
            if logprobs is not None:
                return self._stream_logprobs(run, is_text, single)
            return self._stream(run, is_text, single)
        out: list[list[int]] | None = None
        for emitted in run.steps():
            out = out or [[] for _ in emitted]
            for r, t in enumerate(emitted):
                if t is not None:
                    out[r].append(t)
        out = out or []
        if explain and run.explain():
            print(run.explain(), file=sys.stderr)
        if logprobs is not None:
            rows = run.rows(out)
            return rows[0] if single else rows
        if is_text:
            decoded = [run.text(row) for row in out]
            return decoded[0] if single else decoded
        return out[0] if single else out

    @staticmethod
    def _stream(run: loop.Generation, is_text: bool, single: bool) -> Iterator:
        if not is_text or not single:
            for emitted in run.steps():
                yield emitted[0] if single else emitted
            return
        row: list[int] = []
        shown = ""
        for emitted in run.steps():
            if emitted[0] is None:
                continue
            row.append(emitted[0])
            text = run.text(row)
            if text.startswith(shown) and len(text) > len(shown):
                yield text[len(shown):]
                shown = text


    @staticmethod
    def _stream_logprobs(run: loop.Generation, is_text: bool, single: bool) -> Iterator:
        """generate(stream=True, logprobs=N): per step, each new token's entry of run.logprobs (filled by
        the step before it is yielded), with the text it adds for a text prompt (an incomplete character
        waits for the token that completes it)."""
        rows: list[list[int]] = []
        shown: list[str] = []
        for emitted in run.steps():
            if not rows:
                rows, shown = [[] for _ in emitted], ["" for _ in emitted]
            items: list[dict | None] = []
            for r, t in enumerate(emitted):
                if t is None:
                    items.append(None)
                    continue
                rows[r].append(t)
                entry = dict(run.logprobs[r][len(rows[r]) - 1])
                if is_text:
                    text, entry["text"] = run.text(rows[r]), ""
                    if text.startswith(shown[r]) and not text.endswith("\ufffd"):
                        entry["text"], shown[r] = text[len(shown[r]):], text
                items.append(entry)
            if not single:
                yield items
            elif items[0] is not None:
                yield items[0]


def load(spec: str | Path, variant: str | None = None, weights: str | Path | None = None, seed: int = 0,
         allow_large: bool = False, **overrides) -> Model:
    """Load a spec (a .tsr path) with a variant, hyperparameter overrides and weights (else seeded);
    ``allow_large`` is --allow-large (go ahead with weights that look too large for the memory)."""
    return Model(spec, variant, weights, seed, allow_large, **overrides)
