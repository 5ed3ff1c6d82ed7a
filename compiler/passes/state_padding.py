"""Left padding kept out of the recurrent state: a hybrid decoder's prompts of different lengths in one batch.

Why: a decoder with attention and recurrent state together (Jamba: Mamba layers between attention
layers) takes a batch of prompts of different lengths left-padded, as an attention-only decoder does
(runtime/generation/cached.py): the attention mask hides the padding from every attention. A
recurrence has no such mask of its own: the pad tokens would run through every scan and causal
conv1d and leave the state different from the row's state without them. transformers' Jamba and
Mamba zero the padded positions' inputs to the conv1d and to the selective scan, so that with a
state that starts at zero the padding leaves it at zero. Here the cached graph's ``attention_mask``
(its last ``T`` columns: this call's positions) says the same to the recurrence:

- every causal ``conv1d`` over time reads zeros at the padded positions (``where(real, x, 0)``):
  zeros are what the convolution's own causal padding and the first call's ``past_conv`` hold, so
  a left-padded row's real outputs and its carried window equal the unpadded row's exactly;
- every ``scan`` over time takes the mask as one more per-step input, and its step keeps the state
  it was given at a padded position (``where(real, new, old)`` on each carried state). This is
  exact for any step, not only Mamba's (a GRU's step from a zero state with a zero input is not
  zero): the state after the padding is the initial state. The scan is then lowered as ONNX Scan,
  not as onnx's RNN/GRU/LSTM op, whose body no longer matches the cell.

What this assumes, checked where it can be: the padding is on the LEFT and every state starts at
zero (check_state refuses any other initial state before this runs), so "the state the padding
left" is "the state the row starts from". The runtime pads on the left only (cached.py); a padded
position after a real one (right padding, holes) would hold the state across it, which is what
a mask means but not what running the row without those tokens gives for a conv1d window (zeros
in its window where the row has tokens). Per-step outputs at padded positions are not meaningful;
every later layer reads them only through the attention mask (keys) and this gating.
"""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node, TensorType, numpy_dtype
from tessera.compiler.ops.recurrence import Body, parts
from tessera.compiler.passes.cache_parts import insert_before


def real_positions(g: Graph, mask: str, b_dim, t_dim) -> str:
    """bool [B, T]: which of this call's T positions hold real tokens -- the last T columns of the
    attention mask [B, P+T] (1 = a real token), the columns of the call's own tokens."""
    p_dim = dims.symbol("P")
    cols = g.unique_name("cache/real_columns")
    zero = g.add_const("cache/pad", np.array(0, dtype=np.int64), "i64")
    # both at the front of the order (they read a graph input only): added last to first
    real = g.add_node("not_equal", [cols, zero.name], [TensorType("bool", (b_dim, t_dim))], {}, "", None,
                      name="cache/real", first=True)
    g.add_node("slice", [mask], [TensorType("i64", (b_dim, t_dim))], {"axis": 1, "start": p_dim, "end": p_dim + t_dim},
               "", None, name=cols, first=True)
    return real.outputs[0]


def _real_as(g: Graph, real: str, shape: tuple, node: Node, tag: str) -> str:
    """``real`` [B, T] reshaped to ``shape`` (its axes of size 1 placed to broadcast), before ``node``."""
    r = g.add_node("reshape", [real], [TensorType("bool", shape)], {"shape": list(shape)}, node.scope, node.pos,
                   name=f"{node.name}/{tag}", origin=node.origin)
    insert_before(g, r, node.name)
    return r.outputs[0]


def zero_padded_conv_input(g: Graph, node: Node, real: str) -> None:
    """The conv1d over time (input [B, C, T]) reads zeros at the padded positions."""
    x = node.inputs[0]
    xt = g.type_of(x)
    b_dim, _, t_dim = xt.shape
    keep = _real_as(g, real, (b_dim, dims.dim(1), t_dim), node, "real")
    zero = g.add_const(f"{node.name}/pad_zero", np.zeros((), dtype=numpy_dtype(xt.dtype)), xt.dtype)
    w = g.add_node("where", [keep, x, zero.name], [xt], {}, node.scope, node.pos, name=f"{node.name}/unpadded",
                   origin=node.origin)
    insert_before(g, w, node.name)
    g.set_inputs(node, [w.outputs[0]] + node.inputs[1:])


def hold_state_at_padding(g: Graph, node: Node, real: str) -> None:
    """The scan over time takes ``real`` as a last per-step input, one per carried state's rank (shaped
    [B, T, 1, ...] so that its step's slice broadcasts over the state), and its step returns the state
    it was given where the position is padding."""
    k, m = node.attrs["n_state"], node.attrs["n_seq"]
    states, seqs, caps = parts(node.attrs, list(node.inputs))
    body = node.attrs["body"].graph.copy()
    b_dim, t_dim = g.type_of(seqs[0]).shape[:2]
    step_keep: dict[int, str] = {}  # state rank -> the body's input
    outer: list[str] = []
    for j in range(k):
        rank = g.type_of(states[j]).rank
        if rank not in step_keep:
            ones = (dims.dim(1),) * (rank - 1)
            outer.append(_real_as(g, real, (b_dim, t_dim) + ones, node, f"real{rank}"))
            name = body.unique_name(f"real{rank}")
            body.add_input(name, TensorType("bool", (b_dim,) + ones))
            body.inputs.insert(k + m + len(step_keep), body.inputs.pop())  # per-step inputs before captured ones
            step_keep[rank] = name
        old, new = body.inputs[j], body.outputs[j]
        held = body.add_node("where", [step_keep[rank], new, old], [body.type_of(new)], {}, "", None,
                             name=f"held{j}")
        body.outputs[j] = held.outputs[0]
    body.reindex()
    node.attrs.update(body=Body(body), n_seq=m + len(step_keep), lowering="scan")
    g.set_inputs(node, list(states) + list(seqs) + outer + list(caps))
