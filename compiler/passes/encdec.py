"""Split an encoder–decoder graph into the part run once per source and the part run per token.

Why: when an encoder–decoder generates, everything that does not depend on the
target tokens -- the encoder, and the keys and values that every decoder layer's
cross-attention computes from the encoder's output -- is the same at every step.
Computing it once and feeding it to a cached decoder is the encoder–decoder form
of the KV cache (cross-attention keys and values are cached whole, at prefill).

The split is by dependency, so it needs no knowledge of the model: a node is on
the decoder side if it reads a decoder input (the target tokens) or anything
computed from one, or if its output's shape uses a dimension only a decoder
input binds (``sinusoidal(T, d)``); every other node is on the encoder side.
The values the decoder side reads from the encoder side (per layer, the
cross-attention K and V; and inputs both sides read, such as the source mask)
become the encoder graph's outputs and the decoder graph's inputs. The decoder
graph then goes through the KV cache passes like any decoder-only model: in the
``encoder_decoder`` pipeline (passes/pipeline.py), ``SplitEncoder`` is the pass that
hands the rest of the pipeline the decoder graph and keeps the encoder in its note.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, SymbolSource, Value
from tessera.compiler import ops
from tessera.compiler.passes.base import Pass, PassError, PassResult


def _subgraph(g: Graph, name: str, nodes: list, inputs: list[str], outputs: list[str]) -> Graph:
    sub = Graph(name)
    read = {i for n in nodes for i in n.inputs} | set(outputs)
    for i in inputs:
        sub.values[i] = Value(i, g.type_of(i), "input")
    sub.inputs = list(inputs)
    for path, p in g.params.items():
        if path in read:
            sub.params[path] = p
            sub.values[path] = g.values[path]
    for c, arr in g.consts.items():
        if c in read:
            sub.consts[c] = arr
            sub.values[c] = g.values[c]
    for n in nodes:
        sub.nodes[n.name] = n
        for o in n.outputs:
            sub.values[o] = g.values[o]
    sub.outputs = list(outputs)
    # where each symbolic dimension can be read: its old input if still an input, else any input axis
    for sym, src in g.symbols.items():
        if src.input in sub.inputs:
            sub.symbols[sym] = src
            continue
        for i in sub.inputs:
            for axis, d in enumerate(sub.type_of(i).shape):
                if str(d) == sym:
                    sub.symbols[sym] = SymbolSource(i, axis)
                    break
            if sym in sub.symbols:
                break
    sub.reindex()
    ops.check_graph(sub)
    return sub


def split_encoder(g: Graph, decoder_inputs: list[str]) -> tuple[Graph, Graph, list[str]]:
    """(encoder graph, decoder graph, the values passed from the first to the second)."""
    dep = set(decoder_inputs)
    dec_syms = {s for s, src in g.symbols.items() if src.input in decoder_inputs}
    enc_syms = {s for s, src in g.symbols.items() if src.input not in decoder_inputs}
    dec_syms -= enc_syms
    dec_nodes, enc_nodes = [], []
    for n in g.nodes.values():
        shape_syms = {str(s) for o in n.outputs for d in g.type_of(o).shape for s in dims.dim(d).free_symbols}
        if any(i in dep for i in n.inputs) or shape_syms & dec_syms:
            dep.update(n.outputs)
            dec_nodes.append(n)
        else:
            enc_nodes.append(n)
    enc_outputs = {o for n in enc_nodes for o in n.outputs}
    shared_inputs = [i for i in g.inputs if i not in decoder_inputs]
    boundary = []
    for n in dec_nodes:
        for i in n.inputs:
            if (i in enc_outputs or i in shared_inputs) and i not in boundary:
                boundary.append(i)
    for o in g.outputs:
        if o not in dep:
            raise ValueError(f"output {o} does not depend on the decoder inputs {decoder_inputs}")
    enc = _subgraph(g, f"{g.name}_encoder", enc_nodes, shared_inputs, [b for b in boundary if b in enc_outputs])
    dec = _subgraph(g, f"{g.name}_decoder", dec_nodes, list(decoder_inputs) + boundary, list(g.outputs))
    return enc, dec, boundary


@dataclass(frozen=True)
class EncoderPart:
    """SplitEncoder's note: the encoder graph and the values it passes to the decoder."""

    graph: Graph
    boundary: tuple[str, ...]


class SplitEncoder(Pass):
    """Split off the encoder part; the pipeline goes on with the decoder graph (the result's graph),
    the encoder travels in the note."""

    name = "split-encoder"

    def __init__(self, decoder_inputs: list[str]):
        self.decoder_inputs = list(decoder_inputs)

    def requires(self, graph: Graph) -> None:
        for i in self.decoder_inputs:
            if i not in graph.inputs:
                raise PassError(f"the model has no input '{i}' (its inputs: {', '.join(graph.inputs)})")

    def run(self, graph: Graph) -> PassResult:
        try:
            enc, dec, boundary = split_encoder(graph, self.decoder_inputs)
        except ValueError as e:
            raise PassError(str(e)) from None
        return PassResult(dec, True, [EncoderPart(enc, tuple(boundary))])
