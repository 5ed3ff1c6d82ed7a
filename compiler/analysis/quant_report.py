"""The report's quantisation section: what --quantize would store, from the graph alone.

Why: the bytes of the weights set the memory a model needs and, in decoding, the time per
token; with --quantize they are the packed weights, one scale per block and everything left in
float. The quantisation pass runs on a copy of the graph (compiler/report.py; nothing is
allocated), so the report counts exactly what an export with the same options writes.
"""

from __future__ import annotations


def describe_quantization(config, float_bytes: int, quantized_bytes: int, notes: list) -> dict:
    """The section from the weights' bytes before and after the pass and its QuantNote per linear and
    per embedding table (``embedding``: the tables' notes, kept apart from the linears' counts)."""
    tables = [n for n in notes if n.embedding]
    notes = [n for n in notes if not n.embedding]
    kept = [n for n in notes if not n.quantized]
    heads = [n for n in notes if getattr(n, "head", False) and n.quantized]
    return {"scheme": config.scheme, "bits": config.bits, "block_size": config.block_size,
            "granularity": config.granularity, "head": config.head_bits is not None, "head_bits": config.head_bits,
            "head_tied_float_table": any(n.reason == "tied" for n in heads) and not any(
                n.quantized and n.reason in ("shared", "stored") for n in tables),
            "embedding_bits": config.embedding_bits if not tables or any(n.quantized for n in tables) else None,
            "quantized_embeddings": sum(n.quantized for n in tables),
            "embedding_shares_head_codes": any(n.quantized and n.reason in ("shared", "stored") for n in tables),
            "embeddings_in_float": [{"node": n.node, "table": n.weight, "reason": n.reason}
                                    for n in tables if not n.quantized],
            "activations": config.activations, "activations_in_words": config.activation_words(),
            "weights_bytes": quantized_bytes, "float_weights_bytes": float_bytes,
            "ratio": float_bytes / quantized_bytes if quantized_bytes else None,
            "quantized_linears": len(notes) - len(kept), "float_linears": len(kept),
            "kept_in_float": [{"node": n.node, "weight": n.weight, "reason": n.reason} for n in kept]}


def describe_stored(mode: str, graph, notes: list, float_bytes: int, stored_bytes: int) -> dict:
    """The gguf_codes section: the parameters the checkpoint holds as codes (``Param.stored``), the
    linears reading them under --gguf-weights ``mode`` (passes/stored_codes.py's StoredNote per linear;
    none under dequantize) and the weights' bytes with and without them."""
    held: dict[str, int] = {}
    for p in graph.params.values():
        if p.stored is not None:
            held[p.stored[2]] = held.get(p.stored[2], 0) + 1
    kept = [n for n in notes if n.kept]
    by_type: dict[str, int] = {}
    for n in kept:
        by_type[n.kind] = by_type.get(n.kind, 0) + 1
    return {"mode": mode, "held": held, "codes_linears": len(kept), "by_type": by_type,
            "linears": [{"node": n.node, "weight": n.weight, "type": n.kind, "product": n.product,
                         "activations": "int8" if n.level == 4 else "fp32"} for n in kept],
            "read_as_fp32": [{"node": n.node, "weight": n.weight, "type": n.kind} for n in notes if not n.kept],
            "weights_bytes": stored_bytes, "float_weights_bytes": float_bytes}
