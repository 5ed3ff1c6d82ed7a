"""The report's quantisation section: what --quantize would store, from the graph alone.

Why: the bytes of the weights set the memory a model needs and, in decoding, the time per
token; with --quantize they are the packed weights, one scale per block and everything left in
float. The quantisation pass runs on a copy of the graph (nothing is allocated), so the report
counts exactly what an export with the same options writes.
"""

from __future__ import annotations

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights, quantized_bytes


def quantization_section(graph: Graph, config: QuantConfig) -> dict:
    float_bytes = quantized_bytes(graph)
    g = graph.copy()
    result = QuantizeWeights(config)(g)
    q = quantized_bytes(g)
    kept = [n for n in result.notes if not n.quantized]
    return {"scheme": config.scheme, "bits": config.bits, "block_size": config.block_size, "head": config.head,
            "activations": config.activations,
            "weights_bytes": q, "float_weights_bytes": float_bytes, "ratio": float_bytes / q if q else None,
            "quantized_linears": len(result.notes) - len(kept), "float_linears": len(kept),
            "kept_in_float": [{"node": n.node, "weight": n.weight, "reason": n.reason} for n in kept]}
