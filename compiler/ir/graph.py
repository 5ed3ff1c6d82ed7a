"""Tessera's IR: a networkx graph of primitive ops over typed, symbolic tensors.

Values are named tensors. A value is a graph input, a parameter (a trainable
weight with a hierarchical path such as ``layers.3.attn.q.weight``), a
constant (a literal or a derived table), or the output of a node. Nodes carry
the scope they were created in (for names and per-block roll-ups) and the spec
position that created them (for errors raised later, e.g. by passes).

The networkx ``DiGraph`` ``graph.nx`` has one vertex per node and an edge
producer -> consumer for every value passed between them; ``graph.nodes``
keeps creation order, which is a topological order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from tessera.spec import Pos

from tessera.compiler.ir import dims
from tessera.compiler.ir.dims import Shape

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": None, "i64": np.int64, "i32": np.int32,
          "bool": np.bool_}
FLOAT_DTYPES = {"f32", "f16", "bf16"}


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: Shape

    def __str__(self) -> str:
        return f"{self.dtype}{dims.fmt_shape(self.shape)}"

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass
class Value:
    name: str
    type: TensorType
    kind: str  # "input", "param", "const", "node"
    producer: str | None = None


@dataclass
class Param:
    """A trainable weight. ``init`` is how the seeded initialiser fills it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    init: str  # "normal", "zeros", "ones"
    std: float = 0.02
    pos: Pos | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: exact, and fast for GPT-3's thousands of parameters


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    pos: Pos | None = None
    # The innermost position in the user's own files that led here (the call of a stdlib block),
    # so messages about stdlib internals can point at the user's line.
    origin: Pos | None = None


@dataclass
class SymbolSource:
    """Where a symbolic dimension can be read at run time: an input's axis."""

    input: str
    axis: int


class Graph:
    def __init__(self, name: str):
        self.name = name
        self.values: dict[str, Value] = {}
        self.nodes: dict[str, Node] = {}
        self.params: dict[str, Param] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.symbols: dict[str, SymbolSource] = {}
        self.nx = nx.DiGraph()
        self.hyperparams: dict[str, Any] = {}
        # Scope path of every block instance -> the block's name (for per-block roll-ups).
        self.block_scopes: dict[str, str] = {}

    # ------------------------------------------------------------ construction
    def unique_name(self, base: str) -> str:
        if base not in self.values and base not in self.nodes:
            return base
        i = 1
        while f"{base}_{i}" in self.values or f"{base}_{i}" in self.nodes:
            i += 1
        return f"{base}_{i}"

    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(name, type, "input")
        self.values[name] = v
        self.inputs.append(name)
        return v

    def add_param(self, param: Param) -> Value:
        self.params[param.path] = param
        v = Value(param.path, TensorType(param.dtype, dims.shape(param.shape)), "param")
        self.values[param.path] = v
        return v

    def add_const(self, base: str, array: np.ndarray, dtype: str) -> Value:
        name = self.unique_name(base)
        self.consts[name] = array
        v = Value(name, TensorType(dtype, dims.shape(array.shape)), "const")
        self.values[name] = v
        return v

    def add_node(self, op: str, inputs: list[str], out_types: list[TensorType], attrs: dict,
                 scope: str, pos: Pos | None, name: str | None = None, origin: Pos | None = None) -> Node:
        base = name or (f"{scope}/{op}" if scope else op)
        node_name = self.unique_name(base)
        outs = []
        for i, t in enumerate(out_types):
            vname = node_name if len(out_types) == 1 else f"{node_name}:{i}"
            vname = self.unique_name(vname) if vname != node_name else vname
            self.values[vname] = Value(vname, t, "node", node_name)
            outs.append(vname)
        node = Node(node_name, op, list(inputs), outs, dict(attrs), scope, pos, origin or pos)
        self.nodes[node_name] = node
        self.nx.add_node(node_name)
        for inp in inputs:
            prod = self.values[inp].producer
            if prod is not None:
                self.nx.add_edge(prod, node_name, value=inp)
        return node

    # ---------------------------------------------------------------- rewriting (used by passes)
    def replace_node(self, old: str, op: str, inputs: list[str], attrs: dict, keep_outputs: bool = True) -> Node:
        """Put a new node where ``old`` was (same position, same output values), e.g. a fused kernel."""
        prev = self.nodes[old]
        node = Node(prev.name, op, list(inputs), list(prev.outputs), dict(attrs), prev.scope, prev.pos, prev.origin)
        self.nodes = {k: (node if k == old else v) for k, v in self.nodes.items()}
        self._rebuild_nx()
        return node

    def remove_nodes(self, names) -> None:
        """Drop nodes whose outputs nobody uses any more."""
        names = set(names)
        for n in names:
            for o in self.nodes[n].outputs:
                users = [u.name for u in self.nodes.values() if o in u.inputs and u.name not in names]
                if users or o in self.outputs:
                    raise ValueError(f"cannot remove {n}: {o} is still used by {users or 'the outputs'}")
        for n in names:
            for o in self.nodes[n].outputs:
                del self.values[o]
            del self.nodes[n]
        self._rebuild_nx()

    def prune_constants(self) -> None:
        """Drop constants that no node reads any more (after a rewrite)."""
        used = {v for n in self.nodes.values() for v in n.inputs}
        for name in [c for c in self.consts if c not in used]:
            del self.consts[name]
            del self.values[name]

    def _rebuild_nx(self) -> None:
        self.nx = nx.DiGraph()
        for node in self.nodes.values():
            self.nx.add_node(node.name)
            for inp in node.inputs:
                prod = self.values[inp].producer
                if prod is not None:
                    self.nx.add_edge(prod, node.name, value=inp)

    def producer(self, value: str) -> Node | None:
        p = self.values[value].producer
        return self.nodes.get(p) if p is not None else None

    # ---------------------------------------------------------------- queries
    def type_of(self, value: str) -> TensorType:
        return self.values[value].type

    def consumers(self, value: str) -> list[Node]:
        return [n for n in self.nodes.values() if value in n.inputs]

    def param_count(self) -> int:
        return sum(p.numel for p in self.params.values())

    def dump(self) -> str:
        """A readable listing of the graph, one node a line (used by golden tests)."""
        lines = [f"graph {self.name}"]
        for name in self.inputs:
            lines.append(f"  in  {name}: {self.values[name].type}")
        for p in self.params.values():
            lines.append(f"  param {p.path}: {p.dtype}{list(p.shape)}")
        for name, arr in self.consts.items():
            shown = np.array2string(arr, separator=", ") if arr.size <= 16 else f"<{arr.size} values>"
            lines.append(f"  const {name}: {self.values[name].type} = {' '.join(shown.split())}")
        for n in self.nodes.values():
            attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in sorted(n.attrs.items()))
            outs = ", ".join(f"{o}: {self.values[o].type}" for o in n.outputs)
            lines.append(f"  {outs} = {n.op}({', '.join(n.inputs)}){' {' + attrs + '}' if attrs else ''}")
        for name in self.outputs:
            lines.append(f"  out {name}: {self.values[name].type}")
        return "\n".join(lines)


def _fmt_attr(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_attr(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
