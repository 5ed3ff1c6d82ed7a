"""The bound decoding step's GroupQueryAttention over an fp16 cache in the grouped form: each key/value
head's G = num_heads / kv_num_heads queries given to the kernel as G rows of one head (num_heads =
kv_num_heads, sequence length G). An ONNX-level rewrite of the bound step's branch (backends/onnx/bound_step.py),
run right after it by the same pass (passes/model_passes.py SplitBoundStep).

Why (docs/benchmarks/log.md, "Why a decoding step at 4,096 positions costs what it does", kp4-kp7):
onnxruntime 1.31's CPU kernel loops over the QUERY heads and, over an fp16 cache, converts that head's
key/value cache to fp32 for each: with G query heads per key/value head every cache is converted G times
a step, and the fp16 cache decodes slower than fp32 at long contexts. Given each key/value head's queries
as rows, the kernel converts and reads each cache once (2.0x faster a call at 4,096 positions, fp16). An
fp32 cache gains nothing (bound by memory reads: kp4, kp5), so only fp16 caches are rewritten.

Where it runs: the bound branch becomes the grouped step, and the top-level If's condition (bound_step.py)
becomes ``Or(condition, Not(room))``, computed in the main graph (copies of the nodes that compute
total_sequence_length from cache_length):

- ``room``: total_sequence_length + G - 1 <= the narrowest past buffer's width (every past the kernels
  read), since the grouped kernel writes each row's G new columns at cache_length[b] .. cache_length[b] +
  G - 1, the longest row's last at total + G - 2. At a buffer's end the kernel therefore never writes past it;
- and ONE row: onnxruntime 1.31's CPU kernel refuses a sequence length > 1 after a past at batch > 1
  (group_query_attention_helper.h: "batch_size must be 1 when sequence_length > 1 and past context is
  given"). The graph is built for any batch (Reshapes over 0, the bias per row), the test keeps it to one.

Otherwise the general branch runs: the graph as it was, whose per-layer Ifs' decoding branches are the
compiled step (correct for any decoding step; it also gathers the cache columns the bound step skips: about
30 us a layer more, bound_step.py). So with an fp16 cache a decoding step of more than one row costs what it
did before the bound step was split. Not a nested If in the bound branch (grouped / compiled): onnxruntime
does not prepack the weights of nodes two subgraph levels below the main graph (SmolLM2-135M's MatMulNBits:
1.5 s a step against 68 ms, measured), and not a runtime that always keeps G - 1 columns of room: that
would bind every caller (generate, the serving engine, speculation's rollback, a bench) to a rule the
graph cannot check, and the batch test is needed anyway.

The grouped step, per GroupQueryAttention (row b of the batch, row j = 0..G-1 of the G; head h = g*G + j):
- the queries [B, 1, H*hd] as [B, G, kv*hd] (Reshape [0, kv, G, hd], Transpose, Reshape [0, G, kv*hd]:
  the batch dimension copied, never a literal 1); the new key and value ([B, 1, kv*hd] each, or the packed
  projection's key/value part) Expanded to the G rows, so every row writes the same key and value;
- seqlens_k + G - 1 and total_sequence_length + G - 1 (the kernel places the G rows at the last G columns);
- rotary (do_rotary): every row the token's position (position_ids [B, 1] Expanded to [B, G]);
- attention_bias [B, 1, G, total + G - 1]: the compiled bias (or zeros where it has none: the engine's
  ``prefix_keys`` variant) padded by G - 1 columns, and every column c > cache_length[b] hidden (the
  dtype's lowest) for every row j of batch row b. Row j's causal length is cache_length[b] + j + 1, so
  it would see the j spare columns after its new one, which hold copies of the new key and value. They
  are hidden by each row's OWN length, not by the padded bias: for a row shorter than the batch's
  longest, its spare columns can include column `longest`, the last column of the step's mask, which
  the compiled bias leaves visible (it is the longest row's new column). Row 0 sees no column past
  cache_length[b], so hiding them for all rows changes nothing for it;
- the output [B, G, kv*hd] back to [B, 1, H*hd] in head order (the inverse Reshapes and Transpose).

Assumptions (each checked here, else the step is left as compiled and the reason returned; the pass
records it in its note, shown by --explain):
- the past inputs are FLOAT16 graph inputs of equal head size (an fp16 cache), and the kernel's queries
  come from a Cast to FLOAT16 (the fp16 step passes/kv_cache_dtype.py compiles); fp32 (and bf16) caches
  are not rewritten;
- G = num_heads / kv_num_heads is an integer >= 2 (G == 1 has nothing to group);
- the node's attributes are among num_heads, kv_num_heads, scale, do_rotary, rotary_interleaved: a local
  window (local_window_size), smooth softmax, softcap (whether onnxruntime applies it before or after the
  bias is not checked here) and anything else are refused, and so are head_sink (input 11) and the
  output_qk output;
- with do_rotary, position_ids is given (without it the kernel would derive each row's position from
  seqlens_k, which the grouped form shifts);
- every GroupQueryAttention of the branch reads the same seqlens_k and total_sequence_length;
- the columns of a row past its cache_length hold nothing a later call reads before rewriting them (the
  compiled kernel already writes a riding-along prefilling row's ignored column there: serving/engine.py
  ``_decode_step``; the G - 1 spare columns are overwritten by later steps and chunks before any mask
  shows them, and a row's slots are marked filled only where its own calls wrote them);
- the attention's value for a query row does not depend on the other rows (the kernel's rows are
  independent given the bias), so the grouped output equals the compiled one up to the order of the
  products' summation (rounding: tests/generation/test_grouped_decode.py).

Off with ``PipelineOptions.grouped_decode`` = False, whose default reads the environment variable
TESSERA_GROUPED_DECODE ("0" turns it off: passes/pipeline.py); the compile cache keys it with the other options.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tessera.compiler.backends.onnx.walk import all_nodes

GQA = "GroupQueryAttention"
ALLOWED_ATTRS = {"num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved"}
GENERAL = "grouped_decode/general"  # the top-level If's new condition: the general branch unless grouped


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _bound_branch(model):
    top = [n for n in model.graph.node if n.name == "bound_step/If"]
    if not top:
        return None, None
    return top[0], next(a.g for a in top[0].attribute if a.name == "else_branch")


def _check_node(n, producer: dict, inputs: dict) -> "str | tuple[int, int]":
    """(G, head size) when this GroupQueryAttention can be grouped, else the reason it cannot."""
    where = f"{GQA} {n.name or n.output[0]}"
    extra = {a.name for a in n.attribute} - ALLOWED_ATTRS
    if extra:
        return f"{where} has {', '.join(sorted(extra))} (a local window, smooth softmax or softcap is not grouped)"
    heads, kv = _attr(n, "num_heads"), _attr(n, "kv_num_heads")
    if not heads or not kv or heads % kv:
        return f"{where}: num_heads {heads} is not a multiple of kv_num_heads {kv}"
    if heads == kv:
        return f"{where}: one query head per key/value head (G == 1: nothing to group)"
    ins = list(n.input) + [""] * (12 - len(n.input))
    if ins[11]:
        return f"{where} reads head_sink (attention sinks are per head)"
    if len(n.output) > 3 and n.output[3]:
        return f"{where} gives output_qk"
    if bool(ins[1]) != bool(ins[2]):
        return f"{where}: a key without a value or a value without a key"
    if _attr(n, "do_rotary", 0) and not (ins[7] and ins[8] and ins[9]):
        return f"{where}: rotary without position_ids (the kernel would derive positions from seqlens_k)"
    dims = []
    for past in ins[3:5]:
        t = inputs.get(past)
        if t is None:
            return f"{where}: its past {past or '(none)'} is not a graph input (not the bound buffer)"
        if t.elem_type != TensorProto.FLOAT16:
            return (f"{where}: the cache {past} is {TensorProto.DataType.Name(t.elem_type)}, not FLOAT16 (the "
                    f"grouped form pays only over an fp16 cache)")
        shape = t.shape.dim
        dims.append(shape[3].dim_value if len(shape) == 4 and shape[3].HasField("dim_value") else 0)
    if not dims[0] or dims[0] != dims[1]:
        return f"{where}: the key and value head sizes are not known and equal ({dims})"
    cast = producer.get(ins[0])
    if cast is None or cast.op_type != "Cast" or _attr(cast, "to") != TensorProto.FLOAT16:
        return f"{where}: its queries are not a Cast to FLOAT16 (not the fp16 cache's step)"
    return heads // kv, dims[0]


def group_bound_step(model) -> "str | int":
    """Rewrite the bound step's branch of ``model`` (split by bound_step.split_bound_step) as the module says.
    Returns the number of GroupQueryAttention nodes grouped, or the reason the branch was left as it was."""
    top, branch = _bound_branch(model)
    if branch is None:
        return "no bound step's branch"
    if any(n.op_type == "If" for n in branch.node):
        return "the bound step's branch holds an If"
    gqas = [n for n in branch.node if n.op_type == GQA]
    if not gqas:
        return "no GroupQueryAttention in the bound step's branch"
    if any(m.op_type == GQA for n in branch.node for m in all_nodes([n]) if m is not n):
        return "a GroupQueryAttention inside a subgraph"
    producer = {o: n for n in branch.node for o in n.output if o}
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    checked = {}
    for n in gqas:
        got = _check_node(n, producer, inputs)
        if isinstance(got, str):
            return got
        checked[id(n)] = got
    lengths = {(n.input[5], n.input[6]) for n in gqas}
    if len(lengths) != 1:
        return "the GroupQueryAttention nodes read different seqlens_k / total_sequence_length"
    seqlens, total = lengths.pop()

    from tessera.compiler.backends.onnx.bound_step import _ancestors, _copy

    # the room test, in the main graph (it chooses the top-level If's branch): total's nodes copied there, renamed
    lengths_nodes = [n for n in branch.node if id(n) in {id(m) for m in _ancestors(producer, total)}]
    if any(n.op_type == GQA or any(a.type == a.GRAPH for a in n.attribute) for n in lengths_nodes):
        return "total_sequence_length is computed from a GroupQueryAttention or a subgraph"
    main_names = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer} | \
        {o for n in model.graph.node for o in n.output}
    branch_inits = {i.name: i for i in branch.initializer}
    made_here = {o for n in lengths_nodes for o in n.output}
    for n in lengths_nodes:
        for x in n.input:
            if x and x not in made_here and x not in main_names and x not in branch_inits:
                return f"total_sequence_length reads {x}, not a value of the main graph"

    consts: list = []

    def const(name: str, value) -> str:
        consts.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    g_max = max(g for g, _ in checked.values())
    lowest = np.array(np.finfo(np.float16).min, np.float16)
    zero16 = np.array(0, np.float16)
    grouped_nodes, shared = [], {}

    def lengths_for(g: int):
        """seqlens_k + G - 1, total + G - 1, and the per-row hiding [B, 1, 1, total + G - 1] (bool)."""
        if g not in shared:
            p = f"grouped_decode/g{g}"
            spare = const(f"{p}/spare", np.array(g - 1, np.int32))
            s, t = f"{p}/seqlens_k", f"{p}/total"
            cols, hide = f"{p}/columns", f"{p}/hide"
            grouped_nodes.extend([
                helper.make_node("Add", [seqlens, spare], [s]),
                helper.make_node("Add", [total, spare], [t]),
                helper.make_node("Range", [const(f"{p}/zero", np.array(0, np.int32)), t,
                                           const(f"{p}/one", np.array(1, np.int32))], [cols]),
                # column c of batch row b hidden where c > cache_length[b]: columns [1, T'] against lengths [B, 1]
                helper.make_node("Unsqueeze", [cols, const(f"{p}/axis0", np.array([0], np.int64))], [f"{p}/columns_row"]),
                helper.make_node("Unsqueeze", [seqlens, const(f"{p}/axis1", np.array([1], np.int64))],
                                 [f"{p}/seqlens_col"]),
                helper.make_node("Greater", [f"{p}/columns_row", f"{p}/seqlens_col"], [f"{p}/hide2"]),
                helper.make_node("Unsqueeze", [f"{p}/hide2", const(f"{p}/axes12", np.array([1, 2], np.int64))],
                                 [hide])])
            shared[g] = (s, t, hide)
        return shared[g]

    biases, positions = {}, {}

    def bias_for(g: int, bias: str) -> str:
        key = (g, bias)
        if key not in biases:
            p = f"grouped_decode/g{g}/bias{len(biases)}"
            _, _, hide = lengths_for(g)
            if bias:
                base = f"{p}/padded"
                grouped_nodes.append(helper.make_node(
                    "Pad", [bias, const(f"{p}/pads", np.array([0] * 7 + [g - 1], np.int64)), const(f"{p}/zero", zero16)],
                    [base]))
            else:
                base = const(f"{p}/zero", zero16)
            grouped_nodes.extend([
                helper.make_node("Where", [hide, const(f"{p}/lowest", lowest), base], [f"{p}/row"]),
                helper.make_node("Expand", [f"{p}/row", const(f"{p}/rows", np.array([1, 1, g, 1], np.int64))],
                                 [f"{p}/bias"])])
            biases[key] = f"{p}/bias"
        return biases[key]

    def positions_for(g: int, pos: str) -> str:
        key = (g, pos)
        if key not in positions:
            p = f"grouped_decode/g{g}/positions{len(positions)}"
            grouped_nodes.append(helper.make_node(
                "Expand", [pos, const(f"{p}/shape", np.array([1, g], np.int64))], [f"{p}/expanded"]))
            positions[key] = f"{p}/expanded"
        return positions[key]

    for n in branch.node:
        if n.op_type != GQA:
            grouped_nodes.append(_copy(n))
            continue
        g, hd = checked[id(n)]
        heads, kv = _attr(n, "num_heads"), _attr(n, "kv_num_heads")
        p = f"grouped_decode/{n.name or n.output[0]}"
        ins = list(n.input) + [""] * (11 - len(n.input))
        rows = const(f"{p}/rows", np.array([1, g, 1], np.int64))
        q_src = ins[0]
        if not ins[1]:  # packed q+k+v [B, 1, (H + 2kv)·hd]: the key/value part repeated over the rows
            q_src = f"{p}/q"
            end = const(f"{p}/q_end", np.array([heads * hd], np.int64))
            axis = const(f"{p}/axis", np.array([2], np.int64))
            grouped_nodes += [
                helper.make_node("Slice", [ins[0], const(f"{p}/start", np.array([0], np.int64)), end, axis], [q_src]),
                helper.make_node("Slice", [ins[0], end, const(f"{p}/kv_end", np.array([(heads + 2 * kv) * hd], np.int64)),
                                           axis], [f"{p}/kv"]),
                helper.make_node("Expand", [f"{p}/kv", rows], [f"{p}/kv_rows"])]
        grouped_nodes += [
            helper.make_node("Reshape", [q_src, const(f"{p}/q4", np.array([0, kv, g, hd], np.int64))], [f"{p}/q4d"]),
            helper.make_node("Transpose", [f"{p}/q4d"], [f"{p}/qt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{p}/qt", const(f"{p}/q3", np.array([0, g, kv * hd], np.int64))],
                             [f"{p}/q_rows"])]
        new_ins = list(ins)
        if not ins[1]:
            grouped_nodes.append(helper.make_node("Concat", [f"{p}/q_rows", f"{p}/kv_rows"], [f"{p}/qkv"], axis=2))
            new_ins[0] = f"{p}/qkv"
        else:  # q, k, v apart (rotated before the kernel): k and v repeated over the rows
            new_ins[0] = f"{p}/q_rows"
            for i, what in ((1, "k"), (2, "v")):
                grouped_nodes.append(helper.make_node("Expand", [ins[i], rows], [f"{p}/{what}_rows"]))
                new_ins[i] = f"{p}/{what}_rows"
        s, t, _ = lengths_for(g)
        new_ins[5], new_ins[6] = s, t
        if _attr(n, "do_rotary", 0):
            new_ins[9] = positions_for(g, ins[9])
        new_ins[10] = bias_for(g, ins[10])
        node = _copy(n)
        del node.input[:]
        node.input.extend(new_ins)
        for a in node.attribute:
            if a.name == "num_heads":
                a.i = kv
        node.output[0] = f"{p}/out"
        node.name = f"{p}/{GQA}"
        grouped_nodes += [
            node,
            helper.make_node("Reshape", [f"{p}/out", const(f"{p}/o4", np.array([0, g, kv, hd], np.int64))], [f"{p}/o4d"]),
            helper.make_node("Transpose", [f"{p}/o4d"], [f"{p}/ot"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{p}/ot", const(f"{p}/o3", np.array([0, 1, heads * hd], np.int64))],
                             [n.output[0]])]

    # room: total + G - 1 <= the narrowest past buffer's width, and one row; else the general branch runs
    rename = {o: f"grouped_decode/room/{o}" for n in lengths_nodes for o in n.output if o}
    rename.update({x: f"grouped_decode/room/{x}" for n in lengths_nodes for x in n.input if x in branch_inits})
    room_inits = [numpy_helper.from_array(numpy_helper.to_array(branch_inits[x]), rename[x])
                  for x in sorted({x for n in lengths_nodes for x in n.input if x in branch_inits})]
    room_nodes = []
    for n in lengths_nodes:
        c = _copy(n)
        c.name = f"grouped_decode/room/{n.name}" if n.name else ""
        for k, x in enumerate(c.input):
            c.input[k] = rename.get(x, x)
        for k, x in enumerate(c.output):
            c.output[k] = rename.get(x, x)
        room_nodes.append(c)
    pasts = sorted({x for n in gqas for x in n.input[3:5]})
    r = "grouped_decode/room"
    room_nodes += [helper.make_node("Shape", [x], [f"{r}/width{i}"], start=2, end=3) for i, x in enumerate(pasts)]
    room_nodes += [
        helper.make_node("Concat", [f"{r}/width{i}" for i in range(len(pasts))], [f"{r}/widths"], axis=0),
        helper.make_node("ReduceMin", [f"{r}/widths"], [f"{r}/narrowest"], keepdims=0),
        helper.make_node("Cast", [rename[total]], [f"{r}/total64"], to=TensorProto.INT64),
        helper.make_node("Add", [f"{r}/total64", f"{r}/spare"], [f"{r}/needed"]),
        helper.make_node("LessOrEqual", [f"{r}/needed", f"{r}/narrowest"], [f"{r}/fits"]),
        # onnxruntime 1.31's CPU kernel takes G rows after a past at batch 1 only (module docstring)
        helper.make_node("Shape", [pasts[0]], [f"{r}/batch"], start=0, end=1),
        helper.make_node("Squeeze", [f"{r}/batch"], [f"{r}/batch0"]),
        helper.make_node("Equal", [f"{r}/batch0", f"{r}/one_row"], [f"{r}/one"]),
        helper.make_node("And", [f"{r}/fits", f"{r}/one"], [f"{r}/room"]),
        helper.make_node("Not", [f"{r}/room"], [f"{r}/no_room"]),
        helper.make_node("Or", [top.input[0], f"{r}/no_room"], [GENERAL])]
    room_inits += [numpy_helper.from_array(np.array(g_max - 1, np.int64), f"{r}/spare"),
                   numpy_helper.from_array(np.array(1, np.int64), f"{r}/one_row")]
    clash = {o for n in room_nodes for o in n.output} & (main_names | {o for n in all_nodes(branch.node) for o in n.output})
    if clash:
        return f"the room test's names are taken ({sorted(clash)[0]})"

    at = list(model.graph.node).index(top)
    for k, n in enumerate(room_nodes):
        model.graph.node.insert(at + k, n)
    top.input[0] = GENERAL
    model.graph.initializer.extend(room_inits)
    branch.initializer.extend(consts)
    del branch.node[:]
    branch.node.extend(grouped_nodes)
    return len(gqas)


def grouped_branch(model):
    """The bound step's branch when it is in the grouped form (this module's rewrite ran), else None."""
    top, branch = _bound_branch(model)
    return branch if top is not None and top.input[0] == GENERAL else None
