"""From a graph, its weights and one PipelineOptions to ONNX models: the compiler's export entry points.

Why here and not in the runtime: which passes run, in which order, and what the model file records
about itself are the compiler's business; the runtime (the command line, the Python API) only says
what it wants (PipelineOptions) and maps a PassError to its UsageError. Every export's metadata
(``tessera.model``, ``tessera.variant``, ``tessera.hyperparams``, ``tessera.quantize``, the KV cache's
``CacheInfo``) is built by ``model_metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.compiler.frontend.elaborate import ModelInfo
from tessera.compiler.frontend.values import BlockRef
from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.base import PipelineResult
from tessera.compiler.passes.encdec import SplitEncoder
from tessera.compiler.passes.kv_cache import CacheInfo, cache_info
from tessera.compiler.passes.pipeline import PipelineOptions, attention_sites, pipeline

if TYPE_CHECKING:  # onnx (and ml_dtypes under it) costs ~0.6 s to import: `tessera report` needs only model_metadata
    import onnx


def jsonable(value):
    """A hyperparameter as JSON can hold it: a block reference by its name."""
    return value.block.name if isinstance(value, BlockRef) else value


def model_metadata(info: ModelInfo, quantize=None, cache: CacheInfo | None = None) -> dict:
    """The model file's metadata: model, variant, hyperparameters, the quantisation if any (a
    QuantConfig), and the KV cache's interface for a cached decoder."""
    meta = {"tessera.model": info.model, "tessera.variant": info.variant or "",
            "tessera.hyperparams": {k: jsonable(v) for k, v in info.hyperparams.items()}}
    if quantize is not None:  # runtime/metadata.py ``quantization`` reads it back
        meta["tessera.quantize"] = {"scheme": quantize.scheme, "block_size": quantize.block_size,
                                    "head": quantize.head, "activations": quantize.activations}
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


def _export(graph: Graph, weights, metadata: dict | None, prune: bool = True) -> onnx.ModelProto:
    """The model in memory (only the graph's parameters are read from ``weights``); ``prune``: drop the
    nodes a cached graph leaves unread (backends/onnx/cached_attention.py)."""
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.backends.onnx.cached_attention import prune_dead_nodes, settle_packed
    from tessera.compiler.backends.onnx.mixed_attention import settle_mixed

    model = onnx_export.to_onnx(graph, weights, metadata)
    if prune:
        prune_dead_nodes(model)
        if settle_packed(model):  # a packed decoding step's prefill-only nodes into the prefill branch
            prune_dead_nodes(model)
        settle_mixed(model)  # the serving engine's combined call: chunk_row an input, the logits it needs
    return model


def _fuse_skip_norms(graph: Graph, model: onnx.ModelProto, info: CacheInfo) -> None:
    """A cached decoder's residual Add + norm as onnxruntime's Skip(Simplified)LayerNormalization
    (backends/onnx/skip_norm.py), when the graph already uses onnxruntime's com.microsoft ops (the
    GroupQueryAttention step); what it fused and why a norm kept its Add go to --explain."""
    from tessera.compiler.backends.onnx.skip_norm import fuse_skip_norms, ir_types
    from tessera.compiler.backends.onnx.walk import all_nodes

    if any(n.domain == "com.microsoft" for n in all_nodes(model.graph.node)):
        report = fuse_skip_norms(model, ir_types(graph))
        fused = ", ".join(f"{n} {kind}" for kind, n in report.fused.items()) or "none"
        kept = "; ".join(f"{name}: {why}" for name, why in list(report.kept.items())[:3])
        info.notes.append(f"residual Add + norm fused (Skip(Simplified)LayerNormalization): {fused}"
                          + (f"; left: {kept}{' ...' if len(report.kept) > 3 else ''}" if kept else ""))


def _note_packed(graph: Graph, info: CacheInfo) -> None:
    """Each gqa decoding site's --explain reason says whether its input is the packed projection
    (backends/onnx/cached_attention.py ``packed_qkv``) and, if not, which check failed."""
    import dataclasses

    from tessera.compiler.backends.onnx.cached_attention import packed_note

    info.kernels = [dataclasses.replace(k, reason=f"{k.reason}; {packed_note(graph, graph.nodes[layer.node])}")
                    if layer.buffer_key and layer.node in graph.nodes else k
                    for layer, k in zip(info.layers, info.kernels)]


def compile_cached(graph: Graph, weights, model: ModelInfo, options: PipelineOptions = PipelineOptions()
                   ) -> CachedDecoder:
    """Run the ``cached_decoder`` pipeline on ``graph`` (in place) and export it. Raises PassError
    (CacheError among them) when the graph has no cached form or an option does not apply."""
    result = pipeline("cached_decoder", options)(graph)
    info = cache_info(result)
    _note_packed(result.graph, info)
    onnx_model = _export(result.graph, weights, model_metadata(model, options.quantize, info))
    if options.skip_norm:  # both on by default; PipelineOptions turns them off to measure them
        _fuse_skip_norms(result.graph, onnx_model, info)
    if options.bound_step:
        _split_bound_step(onnx_model, info)
    return CachedDecoder(onnx_model, info, result)


def _split_bound_step(model: onnx.ModelProto, info: CacheInfo) -> None:
    """The bound decoding step as a branch of its own under one If (backends/onnx/bound_step.py); a graph
    it does not fit is left as it is."""
    from tessera.compiler.backends.onnx.bound_step import split_bound_step

    done = split_bound_step(model, {n for layer in info.layers if layer.buffer_key
                                    for n in (layer.present_key, layer.present_value)})
    info.notes.append(f"decoding step bound in place: one If, a branch of its own ({done} nodes; no per-layer If, "
                      "no cache columns)" if isinstance(done, int) else f"decoding step bound in place: as above ({done})")


def compile_seq2seq(graph: Graph, weights, options: PipelineOptions, model: ModelInfo | None = None
                    ) -> EncoderDecoder:
    """Run the ``encoder_decoder`` pipeline on ``graph`` and export both parts (with ``model``, each
    with its metadata; without, none, as generation has compiled them so far). Raises PassError."""
    result = pipeline("encoder_decoder", options)(graph)
    (part,) = result.notes(SplitEncoder.name)  # an EncoderPart
    info = cache_info(result)
    encoder = _export(part.graph, weights, None if model is None else model_metadata(model, options.quantize),
                      prune=False)
    decoder = _export(result.graph, weights, None if model is None else model_metadata(model, options.quantize, info))
    return EncoderDecoder(encoder, decoder, info, list(part.boundary), result)
