"""Recurrent state as cache state: the cached form of a decoder that carries state over time.

Why: an attention-free decoder (Mamba, any ``scan`` over the tokens) has no keys and values to
cache; its whole past is the state its recurrence carries, and, for a causal convolution over
time (Mamba's depthwise conv1d), the last ``kernel - 1`` inputs the next outputs still read. Both
are derived from the spec's own graph here, so such a model generates with no hand-packed state:
the cached decoder takes them as past inputs and gives them back as present outputs, and the
decoding loop (runtime/generation/cached.py) feeds each call's present as the next call's past,
as it does the KV cache. The cache layers pass (kv_cache.py ``AddCacheLayers``, kv-cache-layers)
runs ``check_state`` and ``carry_state`` after the attention layers, so every cached tensor, keys,
values and state, is added by one pass:

- every ``scan`` over the time axis (a per-step input whose axis 1 is the tokens' ``T``) starts
  from the input ``past_state.{i}`` instead of its initial state, and its final state is the
  output ``state.{i}`` (one per carried state: an LSTM carries two). The spec's initial state
  must be zeros (``zero_state``), which the first call (the prompt) is fed, or, in an
  encoder-decoder's decoder (passes/encdec.py), an input from the encoder part (RNNsearch's s_0,
  computed from the source), which the first call is fed instead (``CacheState.initial``). A
  ``reverse=true``
  scan over time reads positions not generated yet: it has no cached form.
- every ``conv1d`` over the time axis must be causal -- padded by ``kernel - 1`` with only the
  first ``T`` outputs read (``slice(conv1d(x, ..., padding=k-1), -1, 0, T)``): its input is then
  ``concat([past_conv.{i}, x])`` over time with no padding (the same ``T`` outputs: the past
  inputs stand where the zero padding was), and ``conv.{i}``, the last ``kernel - 1`` columns of
  that concatenation, is the next call's past. Any other convolution over time is refused.

In a hybrid (attention beside the state, so the cached graph takes ``attention_mask``), left
padding is kept out of every scan and conv1d over time (passes/state_padding.py: padded positions
feed the conv1d zeros and leave a scan's state as it was), so prompts of different lengths batch.

Scans and convolutions over other axes (a scan over a depth axis, a convolution over features)
are left alone. The first call starts from zeros (or the encoder's state), which is exactly what
the spec computes over the whole sequence.
"""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node, TensorType
from tessera.compiler.ops.recurrence import parts
from tessera.compiler.passes.cache_parts import CacheError, CacheState, insert_before as _insert_before
from tessera.compiler.passes.state_padding import hold_state_at_padding, real_positions, zero_padded_conv_input

ZERO_PATH = ("expand", "reshape", "identity", "transpose", "cast")
"""Ops through which an initial state of zeros stays zeros (zero_state is expand([[0.0]], [B, n]))."""


def _over(g: Graph, value: str, axis: int, t_dim) -> bool:
    shape = g.type_of(value).shape
    return len(shape) > axis and dims.equal(dims.dim(shape[axis]), t_dim)


def time_scans(g: Graph, t_dim) -> list[Node]:
    """The scans carried over the tokens' time axis (a per-step input [B, T, ...])."""
    return [n for n in g.nodes.values() if n.op == "scan"
            and any(_over(g, x, 1, t_dim) for x in parts(n.attrs, n.inputs)[1])]


def time_convs(g: Graph, t_dim) -> list[Node]:
    """The 1-D convolutions over the time axis (input [B, C, T]) that look back: a kernel of 1
    without padding is pointwise (each output of its own step), so it carries no window (and its
    window of kernel - 1 = 0 past inputs was an empty slice)."""
    return [n for n in g.nodes.values() if n.op == "conv1d" and _over(g, n.inputs[0], 2, t_dim)
            and not (n.attrs.get("kernel") == 1 and not n.attrs.get("padding"))]


def carries_state(g: Graph, t_dim) -> bool:
    """Whether the graph has state over time for the cache to carry."""
    return bool(time_scans(g, t_dim) or time_convs(g, t_dim))


def _is_zeros(g: Graph, value: str) -> bool:
    """Whether ``value`` is zeros whatever the input: constants of zeros through shape-only ops."""
    if value in g.consts:
        return not np.any(g.consts[value])
    node = g.producer(value)
    return node is not None and node.op in ZERO_PATH and _is_zeros(g, node.inputs[0])


def _where(node: Node) -> str:
    return node.scope or node.name


def _check_conv(g: Graph, node: Node, t_dim) -> None:
    a = node.attrs
    users = g.consumers(node.outputs[0])
    first_t = all(u.op == "slice" and _slice_axis(g, u) == 2 and dims.equal(dims.dim(u.attrs["start"]), dims.dim(0))
                  and dims.equal(dims.dim(u.attrs["end"]), t_dim) for u in users)
    causal = (a.get("stride", 1) == 1 and a["padding"] == a["kernel"] - 1 and users and first_t
              and node.outputs[0] not in g.outputs)
    if not causal:
        raise CacheError(f"the conv1d at {_where(node)} runs over the time axis but is not causal (padding "
                         f"kernel-1 = {a['kernel'] - 1}, stride 1, only its first {dims.fmt(t_dim)} outputs read: "
                         f"slice(conv1d(x, ..., padding={a['kernel'] - 1}), -1, 0, {dims.fmt(t_dim)})); it has no "
                         f"cached form")


def _slice_axis(g: Graph, node: Node) -> int:
    """A slice's axis, non-negative."""
    axis = node.attrs["axis"]
    return axis + g.type_of(node.inputs[0]).rank if axis < 0 else axis


def check_state(g: Graph, t_dim) -> None:
    """Refuse (CacheError) a recurrence over time with no cached form, before anything is rewritten."""
    for node in time_scans(g, t_dim):
        if node.attrs.get("reverse"):
            raise CacheError(f"the scan at {_where(node)} runs backwards over time (reverse=true): each "
                             f"position reads later ones, which generation has not made yet; it has no "
                             f"cached form")
        for init in parts(node.attrs, node.inputs)[0]:
            if not _is_zeros(g, init) and init not in g.inputs:
                raise CacheError(f"the scan at {_where(node)} starts from a state computed from the input; "
                                 f"its cached form starts the prompt from zeros (zero_state) or, in an "
                                 f"encoder-decoder, from an output of the encoder")
            t_syms = {str(s) for s in dims.dim(t_dim).free_symbols}
            if any(t_syms & {str(s) for s in dims.dim(d).free_symbols} for d in g.type_of(init).shape):
                raise CacheError(f"the scan at {_where(node)} carries a state whose shape grows with time")
    for node in time_convs(g, t_dim):
        _check_conv(g, node, t_dim)


def carry_state(g: Graph, t_dim, mask: str | None = None) -> list[CacheState]:
    """Scans over time start from ``past_state.{i}`` and give ``state.{i}``; causal conv1d over time
    read ``past_conv.{i}`` before their input and give ``conv.{i}`` (appended to the graph's outputs).
    ``mask``: the attention mask input [B, P+T] of a hybrid (attention beside the state), which then
    keeps left padding out of every scan and conv1d (passes/state_padding.py). Returns a CacheState
    each; the caller settles the graph."""
    if mask is not None:
        b_dim = g.type_of(mask).shape[0]
        real = real_positions(g, mask, b_dim, t_dim)
        for node in time_convs(g, t_dim):
            zero_padded_conv_input(g, node, real)
        for node in time_scans(g, t_dim):
            hold_state_at_padding(g, node, real)
    notes: list[CacheState] = []
    for node in time_scans(g, t_dim):
        k = node.attrs["n_state"]
        inputs = list(node.inputs)
        for j in range(k):
            i = len(notes)
            t = g.type_of(inputs[j])
            past, present = f"past_state.{i}", f"state.{i}"
            g.add_input(past, t)
            inputs[j] = past
            ident = g.add_node("identity", [node.outputs[j]], [t], {}, node.scope, node.pos, name=present,
                               origin=node.origin)
            g.outputs.append(ident.outputs[0])
            initial = node.inputs[j] if node.inputs[j] in g.inputs else None  # an encoder's output
            notes.append(CacheState(node.name, "scan", past, present, [int(d) for d in t.shape[1:]], t.dtype,
                                    initial))
        g.set_inputs(node, inputs)
    for node in time_convs(g, t_dim):
        i = len(notes)
        x = node.inputs[0]
        xt = g.type_of(x)
        b_dim, channels = xt.shape[:2]
        keep = node.attrs["kernel"] - 1
        past, present = f"past_conv.{i}", f"conv.{i}"
        g.add_input(past, TensorType(xt.dtype, (b_dim, channels, dims.dim(keep))))
        cat = g.add_node("concat", [past, x], [TensorType(xt.dtype, (b_dim, channels, t_dim + keep))],
                         {"axis": 2}, node.scope, node.pos, name=f"{node.name}/past", origin=node.origin)
        _insert_before(g, cat, node.name)
        tail = g.add_node("slice", [cat.outputs[0]], [TensorType(xt.dtype, (b_dim, channels, dims.dim(keep)))],
                          {"axis": 2, "start": t_dim, "end": t_dim + keep}, node.scope, node.pos, name=present,
                          origin=node.origin)
        _insert_before(g, tail, node.name)
        g.set_inputs(node, [cat.outputs[0]] + node.inputs[1:])
        node.attrs["padding"] = 0
        g.outputs.append(tail.outputs[0])
        notes.append(CacheState(node.name, "conv", past, present, [int(channels), keep], xt.dtype))
    return notes
