"""The bound decoding step as a graph of its own under one top-level If: an ONNX-level pass after
export (compiler/build.py), for a cached decoder whose attention sites are phased Ifs on T == 1
with a GroupQueryAttention decoding branch (backends/onnx/cached_attention.py).

Why: such a graph runs, on every decoding step, one If per layer (each ~30 us of its own in
onnxruntime: the subgraph's feeds and fetches set up per call) and, for the packed step, two
GatherElements per layer that read the new key and value columns back from the buffers for the
cache outputs ``key.{i}`` / ``value.{i}`` -- outputs a step bound in place (IOBinding:
runtime/generation/cached.py BoundStep, the serving engine's ``_run_in_place``) never reads,
since the kernel wrote those columns into the buffers itself.

The rewrite: the top level keeps the nodes that compute the phase condition (T == 1) and one If:

- condition ``Or(Not(T == 1), cache_columns)``, ``cache_columns`` a new bool input with a default
  (an initializer of the same name, so callers that do not know it, ``tessera run`` or an older
  loop, need not feed it and get today's graph);
- then (``general``): the graph as it was, its per-layer Ifs included: a prompt, a verifying call
  and an unbound one-token step run exactly the nodes they ran before;
- else (``bound``): the graph specialised for a decoding step whose caller does not want the
  columns: every phased If replaced by its decoding branch's nodes (inlined), the cache column
  outputs of the layers the kernel writes in place given as empty tensors, and every node no
  output then reads dropped (the GatherElements, the per-layer conditions, the prompt-only nodes).

The weights stay initializers of the main graph, read by both branches from the outer scope (not
copied into the file). Each branch's nodes are a copy: the value names inside them repeat across the
two sibling branches, which ONNX scoping allows; only the graph outputs are renamed per branch.

Checks (each failed one is the returned reason, and the graph is left as it was): every top-level
If computes the same condition (the same nodes over the same inputs), there is one at least, at
least one decoding branch runs GroupQueryAttention, no graph output is computed with the condition,
and no other top-level node holds a subgraph.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tessera.compiler.backends.onnx.walk import all_nodes

INPUT = "cache_columns"  # bool []; default True; a bound decoding step feeds False


def _attr_graph(node, name: str):
    return next(a.g for a in node.attribute if a.name == name)


def _cond_key(producer: dict, name: str, inits: set[str], memo: dict):
    """A structural key of the value ``name``: its producing node's op, attributes and its inputs'
    keys (graph inputs and initializers by name), so equal keys compute the same value."""
    if name in memo:
        return memo[name]
    n = producer.get(name)
    if n is None:
        key = ("value", name)
    else:
        attrs = tuple(sorted((a.name, a.SerializeToString()) for a in n.attribute))
        key = (n.op_type, n.domain, attrs, list(n.output).index(name),
               tuple(_cond_key(producer, x, inits, memo) for x in n.input))
    memo[name] = key
    return key


def _ancestors(producer: dict, name: str) -> list:
    """The nodes computing ``name``, each once."""
    seen, out, stack = set(), [], [name]
    while stack:
        n = producer.get(stack.pop())
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(n.input)
    return out


def _rename(nodes, names: dict) -> None:
    """Rename inputs and outputs of these nodes, and the inputs of the nodes of their subgraphs."""
    for n in all_nodes(nodes):
        for i, x in enumerate(n.input):
            if x in names:
                n.input[i] = names[x]
        for i, x in enumerate(n.output):
            if x in names:
                n.output[i] = names[x]


def _give_outer(nodes: list, names: list[str], suffix: str) -> None:
    """An Identity for each graph output no node of the branch produces (an input or initializer given
    as it is), so the branch's renamed output exists."""
    made = {o for n in nodes for o in n.output}
    nodes.extend(helper.make_node("Identity", [x], [f"{x}/{suffix}"]) for x in names if f"{x}/{suffix}" not in made)


def _live(nodes, outputs: list[str]) -> list:
    """The nodes some output reads (through subgraphs too), in their order."""
    live, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in live for o in n.output):
            keep.append(n)
            live |= {x for m in all_nodes([n]) for x in m.input}
    return keep[::-1]


def _copy(node):
    c = type(node)()
    c.CopyFrom(node)
    return c


def _inline_decode(node, inits: list) -> list:
    """The decoding (then) branch's nodes of a phased If, writing the If's own output names (its own
    initializers, if it has any, appended to ``inits``)."""
    branch = _attr_graph(node, "then_branch")
    inits.extend(_copy(i) for i in branch.initializer)
    nodes = [_copy(n) for n in branch.node]
    produced = {o for n in nodes for o in n.output}
    names = {}
    for out, target in zip(branch.output, node.output):
        if out.name in produced:
            names[out.name] = target
        else:  # the branch gives a value of the outer scope as it is
            nodes.append(helper.make_node("Identity", [out.name], [target]))
    _rename(nodes, names)
    return nodes


def split_bound_step(model, columns: set[str]) -> "int | str":
    """Rewrite ``model`` (in place) as the module says. ``columns``: the cache column outputs the bound
    step does not read (the present keys and values of the layers whose buffers the kernel writes).
    Returns the bound branch's node count, or the reason the graph was left as it was."""
    graph = model.graph
    ifs = [n for n in graph.node if n.op_type == "If"]
    if not ifs:
        return "no top-level If (no phased attention site)"
    if any(a.type == a.GRAPH for n in graph.node if n.op_type != "If" for a in n.attribute):
        return "a top-level node other than the phased Ifs holds a subgraph"
    if not any(m.op_type == "GroupQueryAttention" for n in ifs for m in all_nodes(_attr_graph(n, "then_branch").node)):
        return "no decoding branch runs GroupQueryAttention (nothing is bound in place)"
    if INPUT in {i.name for i in graph.input}:
        return f"the graph already has an input {INPUT}"
    producer = {o: n for n in graph.node for o in n.output if o}
    inits = {i.name for i in graph.initializer}
    memo: dict = {}
    keys = {_cond_key(producer, n.input[0], inits, memo) for n in ifs}
    if len(keys) != 1:
        return "the Ifs test different conditions"
    decoding = ifs[0].input[0]
    prefix = _ancestors(producer, decoding)
    if any(n.op_type == "If" for n in prefix):
        return "the condition is computed from an If"
    if {o for n in prefix for o in n.output} & {o.name for o in graph.output}:
        return "a graph output is computed with the condition"
    prefix_ids = {id(n) for n in prefix}
    body_prefix = [_copy(n) for n in graph.node if id(n) in prefix_ids]  # in the graph's (topological) order
    body = [n for n in graph.node if id(n) not in prefix_ids]
    outputs = list(graph.output)

    # bound: the phased Ifs' decoding branches inlined, the columns as empty tensors, the rest pruned
    bound_nodes, branch_inits = [], []
    for n in body:
        bound_nodes.extend(_inline_decode(n, branch_inits) if n.op_type == "If" else [_copy(n)])
    bound_outs = []
    for o in outputs:
        if o.name in columns:
            t = o.type.tensor_type
            rank = max(1, len(t.shape.dim))
            dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
            branch_inits.append(numpy_helper.from_array(np.zeros((0,) + (1,) * (rank - 1), dtype), f"{o.name}/unbound"))
            bound_outs.append(helper.make_tensor_value_info(f"{o.name}/unbound", t.elem_type, None))
        else:
            bound_outs.append(helper.make_tensor_value_info(f"{o.name}/bound", o.type.tensor_type.elem_type, None))
    bound_nodes = _live(bound_nodes, [o.name for o in outputs if o.name not in columns])
    _rename(bound_nodes, {o.name: f"{o.name}/bound" for o in outputs})
    _give_outer(bound_nodes, [o.name for o in outputs if o.name not in columns], "bound")
    bound = helper.make_graph(bound_nodes, "bound_step", [], bound_outs, branch_inits)

    # general: the graph as it was, its outputs renamed (a branch value may not shadow the If's outputs)
    general_nodes = [_copy(n) for n in body]
    _rename(general_nodes, {o.name: f"{o.name}/general" for o in outputs})
    _give_outer(general_nodes, [o.name for o in outputs], "general")
    general = helper.make_graph(general_nodes, "general", [], [
        helper.make_tensor_value_info(f"{o.name}/general", o.type.tensor_type.elem_type, None) for o in outputs])

    not_decoding = helper.make_node("Not", [decoding], ["bound_step/not_decoding"])
    general_cond = helper.make_node("Or", ["bound_step/not_decoding", INPUT], ["bound_step/general"])
    top = helper.make_node("If", ["bound_step/general"], [o.name for o in outputs], name="bound_step/If",
                           then_branch=general, else_branch=bound)
    del graph.node[:]
    graph.node.extend(body_prefix)
    graph.node.extend([not_decoding, general_cond, top])
    graph.input.append(helper.make_tensor_value_info(INPUT, TensorProto.BOOL, []))
    graph.initializer.append(numpy_helper.from_array(np.array(True), INPUT))
    return len(bound_nodes)



def general_graph(model):
    """The graph whose top level holds the per-layer phased Ifs (what the passes before this one wrote):
    the general branch of a split model, else the model's graph."""
    top = [n for n in model.graph.node if n.name == "bound_step/If"]
    return _attr_graph(top[0], "then_branch") if top else model.graph
