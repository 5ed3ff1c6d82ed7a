"""From a graph, its weights and one PipelineOptions to ONNX models: the compiler's export entry points.

Why here and not in the runtime: which passes run, in which order, and what the model file records
about itself are the compiler's business; the runtime (the command line, the Python API) only says
what it wants (PipelineOptions) and maps a PassError to its UsageError. Every export's metadata
(``tessera.model``, ``tessera.variant``, ``tessera.hyperparams``, ``tessera.quantize``, the KV cache's
``CacheInfo``) is built by ``model_metadata``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.compiler.frontend.elaborate import ModelInfo
from tessera.compiler.frontend.values import BlockRef
from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.base import PipelineResult
from tessera.compiler.passes.encdec import SplitEncoder
from tessera.compiler.passes.expose_attention import ExposeAttentionProbs
from tessera.compiler.passes.kv_cache import CacheInfo, cache_info
from tessera.compiler.passes.model_passes import Exported
from tessera.compiler.passes.pipeline import PipelineOptions, attention_sites, expert_sites, explain as explain_sites, \
    explain_experts, pipeline
from tessera.compiler.passes.activations import describe as describe_levels
from tessera.compiler.passes.quantize import QuantizeWeights, embedding_line, head_line, linear_notes
from tessera.compiler.passes.stored_codes import KeepStoredCodes
from tessera.compiler.passes.recurrence import ChooseRecurrenceLowering, explain as explain_scans

if TYPE_CHECKING:  # onnx (and ml_dtypes under it) costs ~0.6 s to import: `tessera report` needs only model_metadata
    import onnx


def jsonable(value):
    """A hyperparameter as JSON can hold it: a block reference by its name."""
    return value.block.name if isinstance(value, BlockRef) else value


def model_metadata(info: ModelInfo, quantize=None, cache: CacheInfo | None = None, graph: Graph | None = None
                   ) -> dict:
    """The model file's metadata: model, variant, hyperparameters, the quantisation if any (a
    QuantConfig), and the KV cache's interface for a cached decoder. With the quantised ``graph``,
    ``embedding_bits`` says what its tables are stored at (0 where every one stayed float: int8's
    default keeps an untied table float although its config's bits are 8), not only what was asked."""
    meta = {"tessera.model": info.model, "tessera.variant": info.variant or "",
            "tessera.hyperparams": {k: jsonable(v) for k, v in info.hyperparams.items()}}
    if quantize is not None:  # runtime/metadata.py ``quantization`` reads it back
        meta["tessera.quantize"] = {"scheme": quantize.scheme, "block_size": quantize.block_size,
                                    "head": quantize.head_bits is not None, "head_bits": quantize.head_bits or 0,
                                    "embedding_bits": (quantize.embedding_bits or 0) if graph is None or any(
                                        n.op == "embedding_nbits" for n in graph.nodes.values()) else 0,
                                    "activations": quantize.activations}
    if cache is not None:
        meta[CacheInfo.METADATA_KEY] = cache.to_json()
    return meta


@dataclass
class CachedDecoder:
    """A compiled cached decoder: the ONNX model, what the runtime needs to feed it, and every pass's
    result (for --explain: ``sites``)."""

    model: onnx.ModelProto
    info: CacheInfo
    result: PipelineResult

    @property
    def sites(self) -> list:
        return attention_sites(self.result)


@dataclass
class EncoderDecoder:
    """A compiled encoder-decoder for generation: the encoder (run once per source batch), the cached
    decoder, its CacheInfo, and the values the encoder hands the decoder."""

    encoder: onnx.ModelProto
    decoder: onnx.ModelProto
    info: CacheInfo
    boundary: list[str]
    result: PipelineResult


def _export(graph: Graph, weights, metadata: dict | None) -> onnx.ModelProto:
    """The model in memory (only the graph's parameters are read from ``weights``)."""
    from tessera.compiler.backends.onnx import export as onnx_export  # imports onnx (~0.6 s): compile only

    return onnx_export.to_onnx(graph, weights, metadata)


def _note_packed(graph: Graph, info: CacheInfo) -> None:
    """Each gqa decoding site's --explain reason says whether its input is the packed projection
    (backends/onnx/cached_attention.py ``packed_qkv``) and, if not, which check failed."""
    from tessera.compiler.backends.onnx.cached_attention import packed_note  # imports onnx (~0.6 s)

    info.kernels = [dataclasses.replace(k, reason=f"{k.reason}; {packed_note(graph, graph.nodes[layer.node])}")
                    if layer.buffer_key and layer.node in graph.nodes else k
                    for layer, k in zip(info.layers, info.kernels)]


def compile_cached(graph: Graph, weights, model: ModelInfo, options: PipelineOptions = PipelineOptions()
                   ) -> CachedDecoder:
    """Run the ``cached_decoder`` pipeline on ``graph`` (in place), export it and run the pipeline's
    passes over the exported model (their --explain notes go to the CacheInfo). Raises PassError
    (CacheError among them) when the graph has no cached form or an option does not apply."""
    manager = pipeline("cached_decoder", options)
    result = manager(graph)
    info = cache_info(result)
    _note_packed(result.graph, info)
    onnx_model = _export(result.graph, weights, model_metadata(model, options.quantize, info, result.graph))
    exported = Exported(onnx_model, result.graph, info)
    manager.after_export(exported)
    info.notes += exported.notes
    return CachedDecoder(onnx_model, info, result)


def compile_seq2seq(graph: Graph, weights, options: PipelineOptions, model: ModelInfo | None = None
                    ) -> EncoderDecoder:
    """Run the ``encoder_decoder`` pipeline on ``graph`` and export both parts (with ``model``, each
    with its metadata; without, none, as generation has compiled them so far); the pipeline's passes
    after export run on the decoder. Raises PassError."""
    manager = pipeline("encoder_decoder", options)
    result = manager(graph)
    (part,) = result.notes(SplitEncoder.name)  # an EncoderPart
    info = cache_info(result)
    encoder = _export(part.graph, weights, None if model is None else model_metadata(model, options.quantize,
                                                                                       graph=part.graph))
    decoder = _export(result.graph, weights, None if model is None else model_metadata(model, options.quantize, info,
                                                                                        result.graph))
    manager.after_export(Exported(decoder, result.graph, info))
    return EncoderDecoder(encoder, decoder, info, list(part.boundary), result)


@dataclass
class FullCompile:
    """The ``full`` pipeline's result for a graph to export, with what --explain says of it."""

    result: PipelineResult
    quantize: object = None  # the QuantConfig applied, if any

    @property
    def exposed(self) -> list:
        """The ExposedProbs notes of the sites whose probabilities became outputs."""
        return self.result.notes(ExposeAttentionProbs.name)

    def explain(self) -> str:
        """--explain's listing: every attention site's verdict and kernel, the quantised linears, the
        mixtures of experts and the recurrences (printing is the caller's)."""
        lines = [explain_sites(attention_sites(self.result), self.exposed)]
        if self.quantize is not None:
            notes = self.result.notes(QuantizeWeights.name)
            linears = linear_notes(notes)
            done = sum(n.quantized for n in linears)
            lines.append(f"quantised linears: {done} of {len(linears)} ({self.quantize.scheme}, "
                         f"{self.quantize.granularity}; {head_line(self.quantize, notes)})")
            lines += [f"  {n.describe()}" for n in linears if not n.quantized]
            if not self.quantize.per_row:
                lines.append(f"  activations: {self.quantize.activation_words()} (--quantize-activations)")
            lines.append(embedding_line(self.quantize, notes))
        stored = explain_stored(self.result)
        if stored:
            lines.append(stored)
        experts = explain_experts(expert_sites(self.result))
        if experts:
            lines.append(experts)
        scans = self.result.notes(ChooseRecurrenceLowering.name)
        if scans:  # models without recurrence keep their listing as it was
            lines.append(explain_scans(scans))
        return "\n".join(lines)


def explain_stored(result: PipelineResult) -> str:
    """--explain's line for the linears reading the checkpoint's own codes (passes/stored_codes.py)."""
    notes = result.notes(KeepStoredCodes.name)
    kept = [n for n in notes if n.kept]
    line = ""
    if kept:
        kinds: dict[str, int] = {}
        for n in kept:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        levels: dict[str, int] = {}
        for n in notes:  # a kind whose linears differ in level (none do: one level per kind) shows its last
            levels[n.product] = n.level
        line = (f"linears reading the GGUF file's own codes (MatMulNBits, no requantisation): {len(kept)} ("
                + ", ".join(f"{k}: {v}" for k, v in kinds.items()) + ")"
                + f"\n  activations: {describe_levels(levels)}")
    if len(kept) < len(notes):
        line += ("\n" if line else "") + (f"linears over 8-bit codes read as fp32 (--gguf-weights codes-fp32: "
                                          f"onnxruntime has no fast fp32 path for 8 bits): {len(notes) - len(kept)}")
    return line


def compile_full(graph: Graph, options: PipelineOptions = PipelineOptions()) -> FullCompile:
    """Run the ``full`` pipeline on ``graph`` (in place) for export. Raises PassError."""
    return FullCompile(pipeline("full", options)(graph), options.quantize)
