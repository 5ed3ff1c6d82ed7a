"""Fuse the linears that read the same input into one: attention's q, k and v, SwiGLU's gate and up.

Why: a decoding step multiplies one row by every weight, so each linear is a GEMV whose cost is
reading its weight; three GEMVs over [d, d] weights cost the same bytes as one over [d, 3d], but
three kernel launches, three reads of the input and three sets of threads. onnxruntime-genai's
builder exports q, k and v as one MatMul for this reason.

Pattern (compiler/patterns/linears.py): two or more ``linear`` nodes (or ``linear_nbits``, the
quantised form, with the same bits, block and K, or ``linear_int8``, whose scales are per row too) with the same input value, each weight a parameter
of the same dtype and input width that nothing but that one linear reads (a tied head is left
alone), all with a bias parameter or all without. Rewrite: one linear over the concatenated weight ([sum of outs, in]; for linear_nbits the
packed values and the scales, which are per output row, so concatenating them quantises nothing
differently), a derived parameter (``Param.derive`` = ("concat", sources, 0, the sources' own recipes),
computed from the sources when the model is written; the biases likewise), followed by a ``slice`` of the last axis
per original linear, which keeps the original output value names, so every reader is unchanged.
The sources' parameters are dropped.

Notes: a ``FusedLinears`` per group (the fused node, the linears it replaced).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import sympy

from tessera.compiler.ir.graph import Graph, Param, TensorType
from tessera.compiler.passes.base import Pass, PassResult
from tessera.compiler.patterns.linears import OWN_WEIGHT_LINEAR
from tessera.compiler.patterns.matcher import match


@dataclass(frozen=True)
class FusedLinears:
    node: str  # the fused linear
    weight: str  # its concatenated weight
    linears: tuple[str, ...]  # the linears it replaced (now slices of its output)

    def describe(self) -> str:
        return f"{self.node}: {', '.join(self.linears)} fused into one linear ({self.weight})"


def _fused_path(paths: list[str]) -> str:
    """``layers.0.attn.q.weight`` + ``...k.weight`` + ``...v.weight`` -> ``layers.0.attn.q+k+v.weight``
    (a parameter path: no '/')."""
    parts = [p.split(".") for p in paths]
    pre = os.path.commonprefix(parts)
    post = os.path.commonprefix([list(reversed(p[len(pre):])) for p in parts])
    mid = ["_".join(p[len(pre):len(p) - len(post)]) or "_" for p in parts]
    return ".".join(pre + ["+".join(mid)] + list(reversed(post)))


# per op: the inputs that are weights concatenated along their axis 0 (the outputs), and the optional bias's index
WEIGHT_INPUTS = {"linear": ((1,), 2), "linear_nbits": ((1, 2), 3), "linear_int8": ((1, 2), 3)}
ZERO_POINT_INPUTS = ((1, 2, 3), 4)  # a linear_nbits with zero_points: its zero points concatenated too


MINS_INPUTS = ((1, 2, 3, 4), 5)  # with block mins (passes/stored_codes.py) too: [N, blocks], by output row


def _weight_inputs(node) -> tuple[tuple[int, ...], int]:
    if node.attrs.get("block_mins"):
        return MINS_INPUTS
    return ZERO_POINT_INPUTS if node.attrs.get("zero_points") else WEIGHT_INPUTS[node.op]


class FuseSharedInputLinears(Pass):
    """One linear for each group of linears that read the same input (q/k/v, gate/up)."""

    name = "fuse-linears"

    def _key(self, graph: Graph, node):
        """What linears must share to be fused (input, op, weight shapes but the outputs, attributes,
        bias or not), or None for a linear that is not one of patterns/linears.py's."""
        pat = OWN_WEIGHT_LINEAR.get(node.op)
        if pat is None or not match(graph, pat, node.outputs[0]):
            return None
        idx, bias_idx = _weight_inputs(node)
        params = [graph.params[node.inputs[i]] for i in idx]
        has_bias = len(node.inputs) > bias_idx
        shapes = tuple((p.dtype,) + tuple(int(s) for s in p.shape[1:]) for p in params)  # all but the outputs
        attrs = tuple(sorted((k, v) for k, v in node.attrs.items() if k != "N"))
        return (node.inputs[0], node.op, shapes, attrs, has_bias)

    def run(self, graph: Graph) -> PassResult:
        groups: dict[tuple, list] = {}
        for node in graph.nodes.values():
            key = self._key(graph, node)
            if key is not None:
                groups.setdefault(key, []).append(node)
        notes = []
        for (x, op, _, _, has_bias), nodes in groups.items():
            if len(nodes) < 2:
                continue
            idx, bias_idx = _weight_inputs(nodes[0])  # the key holds the attributes: one layout for the group
            slots = list(idx) + ([bias_idx] if has_bias else [])
            outs = [int(graph.params[n.inputs[idx[0]]].shape[0]) for n in nodes]
            total = sum(outs)
            inputs = [x]
            removed = []
            for i in slots:
                sources = [n.inputs[i] for n in nodes]
                first = graph.params[sources[0]]
                path = _fused_path(sources)
                graph.add_param(Param(path, (total,) + tuple(first.shape[1:]), first.dtype, "derived", 0.0, first.pos,
                                      ("concat", tuple(sources), 0,
                                       tuple(graph.params[p].derive for p in sources))))
                inputs.append(path)
                removed += sources
            attrs = dict(nodes[0].attrs)
            if "N" in attrs:
                attrs["N"] = total
            xt = graph.type_of(x)
            out_t = graph.type_of(nodes[0].outputs[0])
            head = nodes[0]
            fused = graph.add_node(op, inputs, [TensorType(out_t.dtype, xt.shape[:-1] + (sympy.Integer(total),))], attrs,
                                   head.scope, head.pos, name=_fused_path([n.name for n in nodes]), origin=head.origin)
            start = 0
            for n, width in zip(nodes, outs):
                graph.replace_node(n.name, "slice", [fused.outputs[0]], {"axis": -1, "start": start, "end": start + width})
                start += width
            for p in removed:
                graph.remove_param(p)
            notes.append(FusedLinears(fused.name, inputs[1], tuple(n.name for n in nodes)))
        if notes:
            graph.sort()  # the fused linear was appended: put it before its slices
        return PassResult(graph, bool(notes), notes)
