"""The report's sections that run passes: attention (what fusion does at each site), quantisation
(what --quantize stores) and a GGUF file's codes (which linears read the file's own codes,
--gguf-weights), each on a copy of the graph.

Why here, above analysis/ and passes/: analysis/ counts and passes/ rewrite, and neither imports
the other (pyproject.toml's import contracts); a section that asks "what would the pipeline do?"
needs both, so it runs the pipeline here and hands the result to analysis/attention_report.py and
analysis/quant_report.py to describe. runtime/report/build.py calls these.
"""

from __future__ import annotations

from tessera.compiler.analysis.attention_report import describe_sites
from tessera.compiler.analysis.quant_report import describe_quantization, describe_stored
from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.pipeline import PipelineOptions, attention_sites, pipeline
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights, quantized_bytes
from tessera.compiler.passes.stored_codes import ACCURACY, KeepStoredCodes


def attention_section(graph: Graph, bindings: dict, bytes_per_element: int, device: str, dtype: str) -> dict:
    """Fuse attention on a copy of ``graph`` for the device's target (the ``full`` pipeline, as an
    analysis runs it: no precision lowering) and describe every site (the caller's graph is left as it was)."""
    target = Target("cpu" if device == "cpu" else "cuda", dtype)
    graph = graph.copy()
    sites = attention_sites(pipeline("full", PipelineOptions(target))(graph))
    return describe_sites(graph, sites, bindings, bytes_per_element, f"{target.device} {target.dtype}")


def quantization_section(graph: Graph, config: QuantConfig, gguf_weights: str = "dequantize") -> dict:
    """Quantise a copy of ``graph`` and count what it stores, against the float weights; the linears
    over a checkpoint's own codes first read them (``gguf_weights`` codes or codes-fp32), as every
    pipeline that quantises runs the two passes, so the bytes are the export's."""
    g = graph.copy()
    if gguf_weights in ACCURACY:
        KeepStoredCodes(gguf_weights)(g)
    result = QuantizeWeights(config)(g)
    return describe_quantization(config, quantized_bytes(graph), quantized_bytes(g), result.notes)


def stored_codes_section(graph: Graph, gguf_weights: str) -> dict | None:
    """Which linears read the checkpoint's own codes (a GGUF file's, ``Param.stored``) under
    ``gguf_weights``, and the weights' bytes then; None when the graph has no such parameter."""
    if not any(p.stored is not None for p in graph.params.values()):
        return None
    g = graph.copy()
    notes = KeepStoredCodes(gguf_weights)(g).notes if gguf_weights in ACCURACY else []
    return describe_stored(gguf_weights, graph, notes, quantized_bytes(graph), quantized_bytes(g))


__all__ = ["attention_section", "quantization_section", "stored_codes_section"]
