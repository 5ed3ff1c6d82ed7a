"""Tessera's IR: a networkx graph of primitive ops over typed, symbolic tensors.

Values are named tensors. A value is a graph input, a parameter (a trainable
weight with a hierarchical path such as ``layers.3.attn.q.weight``), a
constant (a literal or a derived table), or the output of a node. Nodes carry
the scope they were created in (for names and per-block roll-ups) and the spec
position that created them (for errors raised later, e.g. by passes).

The networkx ``DiGraph`` ``graph.nx`` holds the dataflow (values and nodes as
vertices, see ``Graph``) and answers the graph questions; ``graph.nodes`` keeps
a topological order.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from tessera.spec import Pos

from tessera.compiler.ir import dims
from tessera.compiler.ir.dims import Shape

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": None, "i64": np.int64, "i32": np.int32,
          "bool": np.bool_, "u8": np.uint8, "i8": np.int8}
def numpy_dtype(name: str):
    """The numpy type of an IR dtype; bf16 is ml_dtypes' bfloat16 (onnx's dependency), imported only when
    asked (``tessera ir`` and ``report`` import neither onnx nor it: tests/project/test_cli_help.py)."""
    if name == "bf16":
        from ml_dtypes import bfloat16

        return bfloat16
    return DTYPES[name]


FLOAT_DTYPES = {"f32", "f16", "bf16"}
# Precisions as the command line, kernel choice and the report name them (--dtype fp32|fp16|bf16),
# and their element sizes; IR tensor types spell them f32, f16, bf16.
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


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
    # Set for a parameter computed from another one at export (the quantisation pass's packed
    # weights and scales): ("quantize", source path, bits, block, "packed" | "scales"), block 0 for one
    # scale per output row (the w8a8 scheme, compiler/reference/quant.py quantize_rows); the fusion of
    # linears sharing an input (compiler/passes/fuse_linears.py): ("concat", source paths, axis,
    # the sources' own recipes or None: the sources themselves are dropped from the graph).
    derive: tuple | None = None
    # A checkpoint tensor that is not trained (a PyTorch registered buffer: BART's final_logits_bias):
    # loaded and exported like a parameter, not counted as one (transformers' sum(p.numel()) skips it).
    buffer: bool = False
    # The checkpoint also holds this weight block-quantised, exactly (a GGUF file's own codes,
    # runtime/io/gguf_codes.py): (bits, block, source type, an offset per block or not).
    # compiler/passes/stored_codes.py reads it as MatMulNBits where asked; otherwise it changes nothing.
    stored: tuple | None = None

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
    """The model as a dataflow graph.

    ``nx`` is a networkx ``DiGraph`` with one vertex per value (``("v", name)``) and one per
    node (``("n", name)``): an edge value -> node for every input a node reads and node -> value
    for every output it writes. It is kept up to date by every mutation below (never rebuilt), and
    the graph queries are networkx queries on it: consumers (successors of a value), topological
    order, what reaches the outputs (dead-node elimination), cycles. ``nodes`` keeps the nodes in a
    topological order (creation order, and after a rewrite the stable topological sort), which is
    the order the interpreter runs and the exporter writes them in.
    """

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
        self._pos: dict[str, int] = {}  # node -> a number increasing along ``nodes`` (orders consumers)
        self._ends = [0, 0]  # the next free numbers before the first and after the last node

    # ------------------------------------------------------------ construction
    def unique_name(self, base: str) -> str:
        if base not in self.values and base not in self.nodes:
            return base
        i = 1
        while f"{base}_{i}" in self.values or f"{base}_{i}" in self.nodes:
            i += 1
        return f"{base}_{i}"

    def _add_value(self, v: Value) -> Value:
        self.values[v.name] = v
        self.nx.add_node(("v", v.name))
        return v

    def add_input(self, name: str, type: TensorType) -> Value:
        v = self._add_value(Value(name, type, "input"))
        self.inputs.append(name)
        return v

    def remove_input(self, name: str) -> None:
        """Drop an input no node reads any more (a rewrite gave its readers another value)."""
        if self.nx.out_degree(("v", name)) or name in self.outputs:
            raise ValueError(f"cannot remove input {name}: it is still read")
        self.inputs.remove(name)
        del self.values[name]
        self.nx.remove_node(("v", name))

    def add_param(self, param: Param) -> Value:
        self.params[param.path] = param
        return self._add_value(Value(param.path, TensorType(param.dtype, dims.shape(param.shape)), "param"))

    def remove_param(self, path: str) -> None:
        """Drop a parameter no node reads any more (a rewrite replaced it by derived ones)."""
        if self.nx.out_degree(("v", path)):
            raise ValueError(f"cannot remove parameter {path}: it is still read")
        del self.params[path]
        del self.values[path]
        self.nx.remove_node(("v", path))

    def add_const(self, base: str, array: np.ndarray, dtype: str) -> Value:
        name = self.unique_name(base)
        self.consts[name] = array
        return self._add_value(Value(name, TensorType(dtype, dims.shape(array.shape)), "const"))

    def add_node(self, op: str, inputs: list[str], out_types: list[TensorType], attrs: dict,
                 scope: str, pos: Pos | None, name: str | None = None, origin: Pos | None = None,
                 first: bool = False) -> Node:
        """Append a node (``first``: put it at the front of the order, e.g. a cast of an input)."""
        base = name or (f"{scope}/{op}" if scope else op)
        node_name = self.unique_name(base)
        outs = []
        for i, t in enumerate(out_types):
            vname = node_name if len(out_types) == 1 else f"{node_name}:{i}"
            vname = self.unique_name(vname) if vname != node_name else vname
            self._add_value(Value(vname, t, "node", node_name))
            outs.append(vname)
        node = Node(node_name, op, list(inputs), outs, dict(attrs), scope, pos, origin or pos)
        if first:
            self.nodes = {node_name: node, **self.nodes}
            self._ends[0] -= 1
            self._pos[node_name] = self._ends[0]
        else:
            self.nodes[node_name] = node
            self._pos[node_name] = self._ends[1]
            self._ends[1] += 1
        self._link(node)
        return node

    def _link(self, node: Node) -> None:
        vertex = ("n", node.name)
        self.nx.add_node(vertex)
        for inp in node.inputs:
            self.nx.add_edge(("v", inp), vertex)
        for out in node.outputs:
            self.nx.add_edge(vertex, ("v", out))

    def _unlink_inputs(self, node: Node) -> None:
        vertex = ("n", node.name)
        self.nx.remove_edges_from([(u, vertex) for u in list(self.nx.predecessors(vertex))])

    # ---------------------------------------------------------------- rewriting (used by passes)
    def replace_node(self, old: str, op: str, inputs: list[str], attrs: dict) -> Node:
        """Put a new node where ``old`` was (same position, same output values), e.g. a fused kernel."""
        prev = self.nodes[old]
        node = Node(prev.name, op, list(inputs), list(prev.outputs), dict(attrs), prev.scope, prev.pos, prev.origin)
        self._unlink_inputs(prev)
        self.nodes[old] = node  # same key: the position in the order is kept
        self._link(node)
        return node

    def set_inputs(self, node: Node, inputs: list[str]) -> None:
        """Make ``node`` read ``inputs`` (its edges in ``nx`` follow)."""
        self._unlink_inputs(node)
        node.inputs = list(inputs)
        vertex = ("n", node.name)
        for inp in node.inputs:
            self.nx.add_edge(("v", inp), vertex)

    def reindex(self) -> None:
        """Rebuild ``nx`` and the order numbers from ``values`` and ``nodes``: for a graph assembled in
        bulk (a subgraph cut out of another) or whose ``nodes`` were reordered as a whole."""
        self.nx = nx.DiGraph()
        for name in self.values:
            self.nx.add_node(("v", name))
        for node in self.nodes.values():
            self._link(node)
        self._pos = {name: i for i, name in enumerate(self.nodes)}
        self._ends = [0, len(self.nodes)]

    def replace_uses(self, value: str, new: str, users: list[Node]) -> None:
        """Make ``users`` read ``new`` where they read ``value``."""
        for u in users:
            u.inputs = [new if i == value else i for i in u.inputs]
            self.nx.remove_edge(("v", value), ("n", u.name))
            self.nx.add_edge(("v", new), ("n", u.name))

    def remove_nodes(self, names) -> None:
        """Drop nodes whose outputs nobody uses any more."""
        names = set(names)
        for n in names:
            for o in self.nodes[n].outputs:
                users = [u.name for u in self.consumers(o) if u.name not in names]
                if users or o in self.outputs:
                    raise ValueError(f"cannot remove {n}: {o} is still used by {users or 'the outputs'}")
        for n in names:
            for o in self.nodes[n].outputs:
                del self.values[o]
                self.nx.remove_node(("v", o))
            del self.nodes[n]
            del self._pos[n]
            self.nx.remove_node(("n", n))

    def prune_constants(self) -> None:
        """Drop constants that no node reads any more (after a rewrite)."""
        for name in [c for c in self.consts if self.nx.out_degree(("v", c)) == 0]:
            del self.consts[name]
            del self.values[name]
            self.nx.remove_node(("v", name))

    def live_nodes(self) -> set[str]:
        """Nodes some graph output depends on."""
        seen = {("v", o) for o in self.outputs}
        stack = list(seen)
        while stack:  # one backwards search from all outputs at once
            for p in self.nx.predecessors(stack.pop()):
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        return {name for kind, name in seen if kind == "n"}

    def eliminate_dead_nodes(self) -> list[str]:
        """Remove nodes no graph output depends on (and constants left unread); return their names."""
        live = self.live_nodes()
        dead = [n for n in self.nodes if n not in live]
        if dead:
            self.remove_nodes(dead)
            self.prune_constants()
        return dead

    def topological_order(self) -> list[str]:
        """Node names in a topological order; ties go to the current order of ``nodes``, so a graph
        already in topological order keeps it exactly (and its export stays byte-identical)."""
        pos = self._pos
        first = float("-inf")  # graph inputs, parameters and constants come before every node
        vpos = {v: (pos[p], i) if (p := self.values[v].producer) is not None else (first, i)
                for i, v in enumerate(self.values)}

        def key(vertex):
            kind, name = vertex
            return (pos[name], -1) if kind == "n" else vpos[name]

        return [name for kind, name in nx.lexicographical_topological_sort(self.nx, key=key) if kind == "n"]

    def in_topological_order(self) -> bool:
        """Whether every node comes after the producers of its inputs: ``topological_order() ==
        list(nodes)`` (ties keep the current order) in one linear pass instead of a sort."""
        seen: set[str] = set()
        for name, n in self.nodes.items():
            for v in n.inputs:
                p = self.values[v].producer if v in self.values else None
                if p is not None and p not in seen:
                    return False
            seen.add(name)
        return True

    def sort(self) -> None:
        """Reorder ``nodes`` topologically (a no-op on a graph already in order)."""
        if self.in_topological_order():
            return
        order = self.topological_order()
        if order != list(self.nodes):
            self.nodes = {name: self.nodes[name] for name in order}
            self._pos = {name: i for i, name in enumerate(order)}
            self._ends = [0, len(order)]

    def cycle(self) -> list[str] | None:
        """Node names on a dataflow cycle, or None (a rewrite must never make one)."""
        if nx.is_directed_acyclic_graph(self.nx):  # linear time; find_cycle only to name one
            return None
        edges = nx.find_cycle(self.nx)
        return [v[1] for v, _ in edges if v[0] == "n"]

    def copy(self) -> "Graph":
        """An independent copy: rewriting it leaves this graph as it was (constant arrays are shared,
        never written in place)."""
        g = Graph(self.name)
        g.values = {k: Value(v.name, v.type, v.kind, v.producer) for k, v in self.values.items()}
        g.nodes = {k: Node(n.name, n.op, list(n.inputs), list(n.outputs), copy.deepcopy(n.attrs), n.scope,
                           n.pos, n.origin) for k, n in self.nodes.items()}
        g.params = {k: dataclasses.replace(p) for k, p in self.params.items()}
        g.consts = dict(self.consts)
        g.inputs, g.outputs, g.symbols = list(self.inputs), list(self.outputs), dict(self.symbols)
        g.nx = self.nx.copy()
        g._pos, g._ends = dict(self._pos), list(self._ends)
        return g

    def producer(self, value: str) -> Node | None:
        p = self.values[value].producer
        return self.nodes.get(p) if p is not None else None

    # ---------------------------------------------------------------- queries
    def type_of(self, value: str) -> TensorType:
        return self.values[value].type

    def consumers(self, value: str) -> list[Node]:
        """The nodes reading ``value``, in graph order (an adjacency lookup in ``nx``)."""
        users = [self.nodes[name] for _, name in self.nx.successors(("v", value))]
        if len(users) > 1:
            users.sort(key=lambda n: self._pos[n.name])
        return users

    def param_count(self) -> int:
        """Trained parameters (buffers, Param.buffer, are not counted)."""
        return sum(p.numel for p in self.params.values() if not p.buffer)

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
            for _, v in sorted(n.attrs.items()):  # a step body (scan) is listed under its node, indented
                body = getattr(v, "graph", None)
                if isinstance(body, Graph):
                    lines += ["    " + line for line in body.dump().splitlines()]
        for name in self.outputs:
            lines.append(f"  out {name}: {self.values[name].type}")
        return "\n".join(lines)


def _fmt_attr(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_attr(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
