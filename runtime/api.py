"""The Python API: ``tessera.load(spec)`` and what the commands do, as methods.

Why: notebooks and scripts want a model object, not a subprocess. Each method
goes through the same steps as its command (pipeline.build, weights_for,
optimize, export, the generation loop), so the two cannot drift apart.

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

import argparse
from pathlib import Path
from typing import Iterator

import numpy as np

from tessera.runtime.generation import cached as gen
from tessera.runtime import pipeline


def _set_args(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        out.append(f"{k}={'true' if v is True else 'false' if v is False else v}")
    return out


class Model:
    """A spec with a variant, overrides and weights; compiled lazily for each use."""

    def __init__(self, spec: str | Path, variant: str | None = None, weights: str | Path | None = None,
                 seed: int = 0, **overrides):
        self.spec, self.variant, self.seed = Path(spec), variant, seed
        self.weights_path = str(weights) if weights is not None else None
        self.sets = _set_args(overrides)
        # spec errors surface here, at load; a checkpoint folder's config.json may supply hyperparameters
        self._built = pipeline.build(self.spec, variant, self.sets, self.weights_path)
        self._weights = pipeline.weights_for(self._built, self.weights_path, seed)
        self._session = None
        self._cached: dict[tuple, gen.CachedModel] = {}
        self._tokenizer = None

    # ---------------------------------------------------------------- what the model is
    @property
    def graph(self):
        return self._built.graph

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self._weights

    def _fresh(self):
        return pipeline.build(self.spec, self.variant, self.sets, self.weights_path)

    def report(self, batch: int = 1, seq: int = 1024, dtype: str = "fp32", device: str = "h200",
               sparse_moe: bool = True) -> dict:
        """The static cost report (parameters, MACs, memory, roofline) as ``tessera report --format json`` gives it
        (``sparse_moe=False``: --no-sparse-moe)."""
        from tessera.runtime.cli import report

        args = argparse.Namespace(spec=str(self.spec), variant=self.variant, sets=self.sets, batch=batch, seq=seq,
                                  dtype=dtype, device=device, plot=None, no_sparse_moe=not sparse_moe)
        return report.build(args)

    # ---------------------------------------------------------------- compile and run
    def _cached_onnx(self, target: str = "cpu", dtype: str = "fp32", last_only: bool = True, cache: str = "auto",
                     quant=None, sparse_moe: bool = True):
        """The KV-cached decoder as an in-memory ModelProto (runtime/generate.compile_cached), its
        linears quantised first when ``quant`` (a QuantConfig) says so."""
        from tessera.compiler.passes.attention_kernels import Target

        built = self._fresh()
        pipeline.quantize(built, quant)
        return gen.compile_cached(built, self._weights, last_only=last_only, mode=cache,
                                  target=Target(target, dtype), dtype=dtype, sparse_moe=sparse_moe)[0]

    def _optimized(self, attention: str = "auto", target: str = "cpu", dtype: str = "fp32", quant_args=None,
                   sparse_moe: bool = True):
        built = self._fresh()
        pipeline.optimize(built, argparse.Namespace(attention=attention, target=target, dtype=dtype,
                                                    no_sparse_moe=not sparse_moe,
                                                    **(quant_args or {})))
        return built, pipeline.metadata(built)

    def compile(self, out: str | Path, kv_cache: bool = False, attention: str = "auto", target: str = "cpu",
                dtype: str = "fp32", check: bool = True, quantize: str = "none", quantize_block: int | None = None,
                quantize_head: bool = False, quantize_activations: str | None = None,
                sparse_moe: bool = True, genai: bool = False, tokenizer: str | Path | None = None,
                context_length: int | None = None) -> list[Path]:
        """Write the ONNX file (kv_cache=True: the cached decoder that ``tessera generate`` loads);
        the weights are streamed to it one tensor at a time. ``quantize`` "int8" or "int4" (with
        ``quantize_block``, ``quantize_head``, ``quantize_activations``) is --quantize's quantisation;
        ``sparse_moe=False`` is --no-sparse-moe (mixtures of experts stay dense). ``genai=True``
        (with ``tokenizer``, and ``context_length`` where the model has none) writes the folder
        ``out`` for onnxruntime-genai, as ``tessera compile --genai`` does."""
        from tessera.compiler.backends.onnx import export as onnx_export

        verify = onnx_export.check if check else None
        quant_args = {"quantize": quantize, "quantize_block": quantize_block, "quantize_head": quantize_head,
                      "quantize_activations": quantize_activations}
        if genai:
            from tessera.compiler.passes.attention_kernels import Target

            from tessera.runtime.packaging import genai as genai_mod

            genai_mod.check_options(argparse.Namespace(cache="concat", target=target, output=str(out),
                                                       context_length=context_length))
            if tokenizer is None:
                raise pipeline.UsageError("genai=True needs tokenizer='tokenizer.json' (onnxruntime-genai reads the "
                                          "tokenizer and the end-of-sequence token from the folder)")
            genai_mod.Tokenizer(Path(tokenizer))
            built = self._fresh()
            pipeline.quantize(built, pipeline.quant_config(argparse.Namespace(**quant_args)))
            model, info = gen.compile_cached(built, self._weights, mode="concat", target=Target(target, dtype),
                                             dtype=dtype, sparse_moe=sparse_moe)
            return genai_mod.write_folder(out, built.graph, info, model, str(tokenizer), self.weights_path, verify,
                                          context=context_length)
        if tokenizer is not None or context_length is not None:
            raise pipeline.UsageError("tokenizer and context_length apply to genai=True")
        if kv_cache:
            quant = pipeline.quant_config(argparse.Namespace(**quant_args))
            return onnx_export.save(self._cached_onnx(target, dtype, quant=quant, sparse_moe=sparse_moe), out,
                                    verify=verify, external=True)  # as `tessera compile --kv-cache` writes it
        built, meta = self._optimized(attention, target, dtype, quant_args, sparse_moe)
        return onnx_export.write(built.graph, self._weights, out, meta, verify=verify)

    def _feeds(self, inputs: dict) -> dict[str, np.ndarray]:
        from tessera.compiler.ir.graph import DTYPES
        from tessera.compiler.ir.signature import bind_inputs

        feeds = {}
        for name, value in inputs.items():
            if name in self.graph.inputs:
                value = np.asarray(value, dtype=DTYPES[self.graph.type_of(name).dtype])
            feeds[name] = np.asarray(value)
        bind_inputs(self.graph, feeds)
        return feeds

    def run(self, **inputs) -> dict[str, np.ndarray]:
        """Run the model in onnxruntime (CPU) on named inputs (arrays or nested lists)."""
        from tessera.runtime.session import open_session, run_session

        feeds = self._feeds(inputs)
        if self._session is None:
            from tessera.compiler.backends.onnx import export as onnx_export

            built, meta = self._optimized()
            self._session = open_session(onnx_export.to_bytes(built.graph, self._weights, meta), "cpu")
        return run_session(self._session, feeds)

    def alignment(self, layer: int | None = None, output: str | None = None, head: int | str | None = None,
                  batch_index: int = 0, tokenizer: str | Path | None = None, plot: str | Path | None = None,
                  **inputs):
        """The attention matrix `tessera run --plot-attention` draws, as an ``Alignment`` (runtime/report/alignment.py:
        ``matrix`` [Tq, Tk], ``rows`` and ``cols`` the target and source tokens): of attention site
        ``layer`` (its probabilities exposed, that site unfused) or of the model output ``output``
        (default: the only one named as attention weights); ``head`` a head or "mean"; ``plot`` also
        draws it to that file."""
        from tessera.compiler.backends.onnx import export as onnx_export
        from tessera.compiler.ir.signature import input_limits, specs_from_graph

        from tessera.runtime.report import alignment as alignment_mod
        from tessera.runtime.session import open_session, run_session

        if layer is not None and output is not None:
            raise pipeline.UsageError("layer and output both choose the weights to plot; give one")
        feeds = self._feeds(inputs)
        built = self._fresh()
        pipeline.optimize(built, argparse.Namespace(attention="auto", target="cpu", dtype="fp32"),
                          attention_probs=None if layer is None else [layer])
        sess = open_session(onnx_export.to_bytes(built.graph, self._weights, pipeline.metadata(built)), "cpu")
        tok = None
        if tokenizer is not None:
            from tessera.runtime.io import text

            tok = text.load_tokenizer(tokenizer)
        al = alignment_mod.from_run(sess, run_session(sess, feeds), specs_from_graph(built.graph), feeds,
                                    input_limits(built.graph), output, layer, batch_index, head, tok, str(self.spec))
        if plot is not None:
            from tessera.runtime.report import alignment_plot

            alignment_plot.draw(al, str(plot))
        return al

    # ---------------------------------------------------------------- generation
    def cached(self, threads: int | None = None, cache: str = "auto") -> gen.CachedModel:
        """The KV-cached decoder in an onnxruntime session (compiled once per thread count and cache mode)."""
        key = (threads, cache)
        if key not in self._cached:
            model, info = gen.compile_cached(self._fresh(), self._weights, mode=cache)
            self._cached[key] = gen.CachedModel(model.SerializeToString(), info, threads=threads)
        return self._cached[key]

    def tokenizer(self, path: str | Path):
        from tessera.runtime.io import text

        if self._tokenizer is None or self._tokenizer[0] != str(path):
            self._tokenizer = (str(path), text.load_tokenizer(path))
        return self._tokenizer[1]

    def generate(self, prompt, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None, stop=(),
                 stop_tokens=(), tokenizer: str | Path | None = None, stream: bool = False, threads: int | None = None):
        """Generate from token ids (a list, or a list of lists for a batch) or text (a str or list of str,
        with ``tokenizer``). Returns the new tokens (or texts) per prompt -- one list (or str) for a single
        prompt; with ``stream=True`` yields them as they are decoded instead (per step: the new token of
        each prompt, None once a prompt has stopped; for a single text prompt, the new text)."""
        sampling = gen.Sampling(temperature, top_k, top_p, repetition_penalty, self.seed if seed is None else seed)
        sampling.check()
        tok = self.tokenizer(tokenizer) if tokenizer is not None else None
        is_text = isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and
                                              all(isinstance(p, str) for p in prompt))
        if is_text and tok is None:
            raise pipeline.UsageError("a text prompt needs tokenizer='tokenizer.json'")
        if isinstance(stop, str):
            stop = [stop]
        if stop and tok is None:
            raise pipeline.UsageError("stop strings need a tokenizer; use stop_tokens=[ids] for token ids")
        single = isinstance(prompt, str) or (not is_text and len(prompt) > 0 and
                                             all(isinstance(t, (int, np.integer)) for t in prompt))
        texts = [prompt] if isinstance(prompt, str) else list(prompt) if is_text else None
        ids = gen.encode_prompts(tok, texts) if is_text else prompt
        stop_ids = list(stop_tokens) + gen.stop_token_ids(tok, list(stop))
        stopper = gen.TextStopper(tok, list(stop)) if stop else None
        model = self.cached(threads)
        gen.check_request(model, ids, max_new_tokens, sampling, stop_ids)  # errors now, not at the first next()
        steps = gen.stream(model, ids, max_new_tokens, sampling, stop_ids, should_stop=stopper)
        if stream:
            return self._stream(steps, tok if is_text else None, stopper, single)
        out: list[list[int]] | None = None
        for emitted in steps:
            out = out or [[] for _ in emitted]
            for r, t in enumerate(emitted):
                if t is not None:
                    out[r].append(t)
        out = out or []
        if is_text:
            decoded = [self._decode(tok, row, stopper) for row in out]
            return decoded[0] if single else decoded
        return out[0] if single else out

    @staticmethod
    def _decode(tok, row, stopper) -> str:
        text = tok.decode(row, skip_special_tokens=True)
        return stopper.trim(text) if stopper is not None else text

    def _stream(self, steps, tok, stopper, single) -> Iterator:
        if tok is None or not single:
            for emitted in steps:
                yield emitted[0] if single else emitted
            return
        row: list[int] = []
        shown = ""
        for emitted in steps:
            if emitted[0] is None:
                continue
            row.append(emitted[0])
            text = self._decode(tok, row, stopper)
            if text.startswith(shown) and len(text) > len(shown):
                yield text[len(shown):]
                shown = text


def load(spec: str | Path, variant: str | None = None, weights: str | Path | None = None, seed: int = 0,
         **overrides) -> Model:
    """Load a spec (a .tsr path) with a variant, hyperparameter overrides and weights (else seeded)."""
    return Model(spec, variant, weights, seed, **overrides)
