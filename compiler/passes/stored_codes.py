"""Linears whose weight the checkpoint also holds block-quantised, exactly (``Param.stored``: a GGUF
file's own Q4_0, Q8_0, Q5_0, Q4_1, Q5_1, Q4_K or Q5_K codes, runtime/io/gguf_codes.py), become
``linear_nbits`` over those codes.

Why a pass of its own rather than --quantize: nothing is quantised here. The packed codes and scales are
read from the checkpoint as they are (the derived parameters' recipe ``("stored", weight, bits, block,
part)``: compiler/reference/quant.py ParamValues asks the weights for them), and MatMulNBits dequantises
them to exactly the weight the file's own dequantisation gives (gguf_codes' docstring says why for each
type). Where the weight is also an embedding table (a tied head), the head reads the codes and the
embedding keeps gathering from the float table, unless --quantize stores the embedding at 8 bits
(compiler/passes/quantize.py): then a table held as 8-bit codes without offsets (Q8_0, Q5_0) is
gathered from these same codes (GatherBlockQuantized reads MatMulNBits' 8-bit layout) and the float
table is dropped.
The types with a min per block (Q4_1, Q4_K ...) take uint8 zero points 0 and ``block_mins`` (the
offsets, added by the lowering: compiler/ops/linalg.py).

``accuracy_level``: 4 (``codes``, the default) lets MatMulNBits quantise the activations to int8 per
block of 32 inside the product, as llama.cpp does for these types (its vec_dot_q4_0_q8_0 and
q8_0_q8_0 quantise the activations to Q8_0 blocks of 32); 0 (``codes-fp32``) keeps the product in fp32,
so the logits equal the dequantised model's to accumulation order; there the 8-bit codes (Q8_0, Q5_0,
Q5_1, Q5_K) are read as their fp32 weights instead, the same values: onnxruntime 1.31.1's CPU kernel has
no fast fp32 path for 8 bits (it dequantises the whole matrix at every call: 9.5 ms against fp32
MatMul's 0.05 ms for a 1536 x 576 weight at one token, bench/gguf_codes.py --kernels).

Runs first in every pipeline that quantises, before QuantizeWeights: --quantize then quantises the
linears left in float (QuantizeWeights leaves these alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph, Param
from tessera.compiler.passes import activations as act
from tessera.compiler.passes.base import Pass, PassResult
from tessera.compiler.reference.quant import blocks, packed_shape, zeros_shape

ACCURACY = {"codes": 4, "codes-fp32": 0}
TAG = "stored"  # the derived parameters' paths: WEIGHT.stored_packed, WEIGHT.stored_scales


@dataclass(frozen=True)
class StoredNote:
    node: str
    weight: str
    kind: str  # the source type (Q4_0 ...)
    kept: bool = True  # False: 8-bit codes under codes-fp32, read as the fp32 weight instead
    level: int = 4  # MatMulNBits' accuracy_level (4: int8 activations, 0: fp32)
    product: str = "other"  # the linear's kind (compiler/passes/activations.py)

    def describe(self) -> str:
        return f"{self.node} ({self.weight}): " + (f"the file's {self.kind} codes" if self.kept else
                                                   f"{self.kind} read as fp32 (8-bit codes, codes-fp32)")


def is_stored(graph: Graph, value: str) -> bool:
    """Whether ``value`` is one of this pass's derived parameters (QuantizeWeights leaves its linears)."""
    p = graph.params.get(value)
    return p is not None and isinstance(p.derive, tuple) and p.derive[0] == TAG


class KeepStoredCodes(Pass):
    name = "stored-codes"

    def __init__(self, mode: str = "codes", activations: str | None = None):
        """``activations``: under ``codes``, the kinds kept in fp32 (--quantize-activations' values,
        compiler/passes/activations.py; None: int8 in every product). ``codes-fp32`` is fp32 in all."""
        if mode not in ACCURACY:
            raise ValueError(f"stored codes mode must be one of {', '.join(ACCURACY)}, got {mode!r}")
        act.check(activations)
        self.mode, self.activations = mode, "float" if mode == "codes-fp32" else activations

    def run(self, graph: Graph) -> PassResult:
        notes = []
        for node in list(graph.nodes.values()):
            if node.op != "linear" or len(node.inputs) < 2:
                continue
            w = node.inputs[1]
            p = graph.params.get(w)
            if p is None or p.stored is None or p.dtype != "f32" or len(p.shape) != 2:
                continue
            bits, block, kind, mins = p.stored
            head = act.is_head(graph, node)
            if bits == 8 and act.level(self.activations, node.name, head) == 0:
                # no fast fp32 path for 8 bits: read as fp32, exactly
                notes.append(StoredNote(node.name, w, kind, kept=False, level=0, product=act.kind(node.name, head)))
                continue
            n, k = p.shape
            names = {}
            parts = [("packed", packed_shape(n, k, bits, block), "u8"), ("scales", (n, blocks(k, block)), "f32")]
            if mins:  # zero points 0 and an offset per block: w = scale * u + offset
                parts += [("zeros", zeros_shape(n, k, bits, block), "u8"), ("mins", (n, blocks(k, block)), "f32")]
            product = act.kind(node.name, head)
            level = act.level(self.activations, node.name, head)
            for part, shape, dtype in parts:
                path = f"{w}.{TAG}_{part}"
                # int8 activations: the zero points nearest each block's offset (quant.py centre_zero_points)
                recipe = f"centred_{part}" if level == 4 and part in ("zeros", "mins") else part
                if path not in graph.params:
                    graph.add_param(Param(path, shape, dtype, "derived", 0.0, p.pos, (TAG, w, bits, block, recipe)))
                names[part] = path
            attrs = {"bits": bits, "block_size": block, "K": k, "N": n, "accuracy_level": level}
            if mins:
                attrs.update(zero_points=1, block_mins=1)
            graph.replace_node(node.name, "linear_nbits", [node.inputs[0], *names.values(), *node.inputs[2:]], attrs)
            if not graph.consumers(w):
                graph.remove_param(w)
            notes.append(StoredNote(node.name, w, kind, level=level, product=product))
        return PassResult(graph, any(n.kept for n in notes), notes)

