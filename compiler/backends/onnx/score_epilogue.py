"""The score epilogue in ONNX: scale, logit soft-cap, bias and masks on a block of Q·Kᵀ, for every
Tessera kernel that computes scores itself (backends/onnx/attention.py's block and portable
kernels, backends/onnx/cached_attention.py's decoding step and prefill).

It mirrors compiler/reference/score_epilogue.py step for step (``STEPS``: the features each
step computes), so the features a kernel using it supports are exactly ``computed()``; the
contrib-op kernels (GroupQueryAttention, MultiHeadAttention) declare their own, smaller
allow-lists in backends/onnx/attention.py.

A kernel calls ``prepare`` once, outside any Loop or If (what every block shares: the mask
made boolean, the bias brought to rank 4, a causal triangle for equal tiles; for the block kernel
behind a per-layer If, ``prepare_whole`` builds its masks once for every layer), then ``apply``
on each block of scores with a ``Block`` saying where the block lies and what the kernel has
applied already (queries scaled before the product, a mask the cache built once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tessera.compiler.backends.onnx.floats import np_float as _np_float

from tessera.compiler.ir import dims
from tessera.compiler.reference import score_epilogue as reference


def _scalar(b, value, dtype=np.int64) -> str:
    return b.const(np.array(value, dtype=dtype), "scalar")


@dataclass
class Prepared:
    """What every block of one node's scores shares, built once in the enclosing graph."""

    np_dtype: type
    tq: str                       # the run-time lengths, and Tk - Tq: keys before the first query
    tk: str                       # (causal only)
    offset: str
    min_value: str
    hidden: str | None = None     # padding mask [B, 1, 1, Tk], True = hidden
    bias: str | None = None       # the bias (rank 4 when tiled)
    bias_axes: tuple = (False, False, False)  # tiled: whether the bias varies over heads, rows, columns
    triangle: str | None = None   # tiled causal without window: [tile, tile] 0 on/below the diagonal, min above
    additive: str | None = None   # an additive mask covering causal, window and padding (cached kernels)
    hide: str | None = None       # whole block: True = hidden by causal, window, local window or padding,
                                  # [Tq, Tk] or [B, 1, Tq, Tk], built once for every layer (prepare_whole)
    sinks: str | None = None      # attention sinks: [H], one logit per query head, in the scores' dtype


@dataclass
class Block:
    """Where a block of scores lies in the [B, H, Tq, Tk] scores and what its kernel already did."""

    rows: tuple[str, str] | None = None   # query indices [start, end); None: all Tq
    cols: tuple[str, str] | None = None   # key indices [start, end); None: all Tk
    head: tuple[str, str] | None = None   # one head [h, h + 1) (tiled kernels slice the bias by it)
    scaled: bool = False                  # the queries were multiplied by the scale before the product
    causal: str = "compute"               # compute | visible (no key hidden by it, or add_triangle done)
    view: Callable[[str], str] | None = None  # a [B, 1|H, T, Tk] operand to the layout of the block
    sink_shape: tuple[int, ...] = (1, -1, 1, 1)  # the sinks [H] (or the block's heads) as the block's layout
    extra: dict = field(default_factory=dict)  # for steps a new feature adds


def _hidden_keys(b, mask: str) -> str:
    """A padding mask ([B, Tk]: true or non-zero = a real key) turned into "hidden" booleans, the form
    every mask here is combined in: Not of a bool mask, mask == 0 of an integer one."""
    m_dtype = b.graph.type_of(mask).dtype
    if m_dtype == "bool":
        return b.node("Not", [mask])[0]
    zero_m = b.const(np.array(0, dtype=np.int64 if m_dtype == "i64" else np.int32), "zero")
    return b.node("Equal", [mask, zero_m])[0]


def prepare(b, a: dict, mask: str | None, bias: str | None, q_t, k_t, tiled: bool = False,
            tile: str | None = None, additive: str | None = None,
            positions: tuple[str, str, str] | None = None, hide: str | None = None,
            sinks: str | None = None) -> Prepared:
    """``mask``/``bias``: the node's padding mask and bias inputs (or None); ``tile``: the tiled kernel's
    square tile size, for the causal triangle; ``additive``: a mask the cache built (``decode_mask``);
    ``positions``: (Tq, Tk, Tk - Tq) where the kernel has them already; ``hide``: the whole block's
    masks, built outside (``prepare_whole``): nothing of them is built here; ``sinks``: the node's sinks
    input (attention sinks: ``softmax`` reads it)."""
    np_dtype = _np_float(q_t.dtype)
    p = Prepared(np_dtype, "", "", "", b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min"),
                 additive=additive, hide=hide)
    if a.get("sinks"):
        if sinks is None:
            raise ValueError("a node with attention sinks needs its sinks input prepared")
        p.sinks = b.node("Reshape", [sinks, b.i64([-1])])[0]
    if hide is not None:
        mask = None  # the padding is in ``hide``; no positions are needed either
    elif positions is not None:
        p.tq, p.tk, p.offset = positions
    elif (a.get("causal") or a.get("local_window")) and additive is None:  # the masks' positions
        p.tq, p.tk = b.dim_scalar(q_t.shape[-2]), b.dim_scalar(k_t.shape[-2])
        p.offset = b.node("Sub", [p.tk, p.tq])[0]
    if mask is not None and additive is None:
        p.hidden = b.node("Unsqueeze", [_hidden_keys(b, mask), b.i64([1, 2])])[0]
    if bias is not None:
        p.bias = bias
        if tiled:
            bt = b.graph.type_of(bias)
            if bt.rank < 4:
                p.bias = b.node("Unsqueeze", [bias, b.i64(list(range(4 - bt.rank)))])[0]
            shape4 = (1,) * (4 - bt.rank) + tuple(bt.shape)
            not_one = lambda d: not (dims.is_static(dims.dim(d)) and int(d) == 1)  # noqa: E731
            p.bias_axes = (not_one(shape4[1]), not_one(shape4[2]), not_one(shape4[3]))
    if tile is not None and a.get("causal") and not a.get("window") and additive is None and hide is None:
        # [tile, tile]: 0 on and below the diagonal, the dtype's minimum above it. Added to a score,
        # it gives the minimum (fp32: |score| is far below the float spacing there) or -inf (fp16,
        # for scores below -16); either way the weight is exactly 0, and the diagonal itself stays
        # visible, so no row's maximum is -inf.
        zero, one = _scalar(b, 0), _scalar(b, 1)
        r = b.node("Range", [zero, tile, one])[0]
        above = b.node("Greater", [b.node("Unsqueeze", [r, b.i64([0])])[0],
                                   b.node("Unsqueeze", [r, b.i64([1])])[0]])[0]
        p.triangle = b.node("Where", [above, p.min_value, b.const(np.array(0, dtype=np_dtype), "zero")])[0]
    return p


def prepare_whole(b, a: dict, mask: str | None, q_t, k_t, fits: str) -> str | None:
    """The masks of a whole [B, H, Tq, Tk] block (causal, sliding window, two-sided window, padding) as
    one boolean tensor, True = hidden: [Tq, Tk], [B, 1, 1, Tk] (padding only) or [B, 1, Tq, Tk]. Built in the
    main graph, before the If of ``attention.short_or``, and kept in the builder (``b.shared``), so
    every layer with the same lengths, masks and ``fits`` test reads the same tensor instead of
    building its own Range/Greater/Where inside its short branch (once per layer, where --no-fuse's
    masks are built once: onnxruntime's common-subexpression pass merges main-graph nodes, not nodes
    across If branches; docs/benchmarks/log.md "Short sequences: masks built once"). ``fits`` (the If's condition) bounds it: while it is False the If takes the
    long branch, which never reads this tensor, and the tensor is empty ([0, 0]), not Tq × Tk.
    None when the node has no mask at all."""
    positional = a.get("causal") or a.get("local_window")
    if not positional and mask is None:
        return None
    key = ("whole_masks", fits, str(q_t.shape[-2]), str(k_t.shape[-2]), bool(a.get("causal")),
           int(a.get("window") or 0), int(a.get("chunk") or 0), int(a.get("local_window") or 0), mask)
    if key in b.shared:
        return b.shared[key]
    saved, b.current = b.current, ""
    try:
        zero, one = _scalar(b, 0), _scalar(b, 1)
        tq, tk = b.dim_scalar(q_t.shape[-2]), b.dim_scalar(k_t.shape[-2])
        n_q = b.node("Where", [fits, tq, zero])[0]  # 0 × 0 when the long branch runs
        n_k = b.node("Where", [fits, tk, zero])[0]
        hide = None
        if positional:
            offset = b.node("Sub", [tk, tq])[0]
            rows = b.node("Unsqueeze", [b.node("Add", [b.node("Range", [zero, n_q, one])[0], offset])[0],
                                        b.i64([1])])[0]
            cols = b.node("Unsqueeze", [b.node("Range", [zero, n_k, one])[0], b.i64([0])])[0]
            if a.get("causal"):
                hide = b.node("Greater", [cols, rows])[0]
                if a.get("window"):
                    far = b.node("LessOrEqual", [cols, b.node("Sub", [rows, _scalar(b, a["window"])])[0]])[0]
                    hide = b.node("Or", [hide, far])[0]
                if a.get("chunk"):
                    hide = b.node("Or", [hide, _other_chunk(b, a, rows, cols)])[0]
            if a.get("local_window"):  # two-sided: |key - query| >= local_window hidden
                dist = b.node("Abs", [b.node("Sub", [cols, rows])[0]])[0]
                far = b.node("GreaterOrEqual", [dist, _scalar(b, a["local_window"])])[0]
                hide = far if hide is None else b.node("Or", [hide, far])[0]
        if mask is not None:
            hidden = b.node("Slice", [_hidden_keys(b, mask), b.i64([0]), b.node("Unsqueeze", [n_k, b.i64([0])])[0],
                                      b.i64([1])])[0]  # [B, Tk] or [B, 0]
            hidden = b.node("Unsqueeze", [hidden, b.i64([1, 2])])[0]  # [B, 1, 1, Tk]
            hide = hidden if hide is None else b.node("Or", [hidden, hide])[0]
        b.shared[key] = b.node("Identity", [hide], [b.fresh("block_masks")])[0]
    finally:
        b.current = saved
    return b.shared[key]


def _other_chunk(b, a, rows: str, cols: str) -> str:
    """True where a key lies in another block of ``chunk`` positions than its query (rows [Tq, 1] and
    cols [1, Tk] absolute positions, non-negative: integer Div is floor division there)."""
    c = _scalar(b, a["chunk"])
    return b.node("Not", [b.node("Equal", [b.node("Div", [cols, c])[0], b.node("Div", [rows, c])[0]])[0]])[0]


def _u(b, x: str) -> str:
    return b.node("Unsqueeze", [x, b.i64([0])])[0]


def _scale(b, a, s, p: Prepared, blk: Block) -> str:
    if blk.scaled:
        return s
    return b.node("Mul", [s, b.const(np.array(a["scale"], dtype=p.np_dtype), "scale")])[0]


def _softcap(b, a, s, p: Prepared, blk: Block) -> str:
    cap = b.const(np.array(a["softcap"], dtype=p.np_dtype), "softcap")
    return b.node("Mul", [b.node("Tanh", [s])[0], cap])[0]


def _bias(b, a, s, p: Prepared, blk: Block) -> str:
    bt = p.bias
    heads, rows, cols = p.bias_axes
    if heads and blk.head is not None:
        bt = b.node("Slice", [bt, _u(b, blk.head[0]), _u(b, blk.head[1]), b.i64([1])])[0]
    if rows and blk.rows is not None:
        bt = b.node("Slice", [bt, _u(b, blk.rows[0]), _u(b, blk.rows[1]), b.i64([2])])[0]
    if cols and blk.cols is not None:
        bt = b.node("Slice", [bt, _u(b, blk.cols[0]), _u(b, blk.cols[1]), b.i64([3])])[0]
    return b.node("Add", [s, blk.view(bt) if blk.view else bt])[0]


def _masks(b, a, s, p: Prepared, blk: Block) -> str:
    """Causal, sliding window and padding: hidden scores become the dtype's minimum (weight 0)."""
    if p.hide is not None:  # the whole block's masks, built once outside (prepare_whole)
        if blk.rows is not None or blk.cols is not None or blk.view is not None:
            raise ValueError("the prepared whole-block masks apply to a whole [B, H, Tq, Tk] block only")
        return b.node("Where", [p.hide, p.min_value, s])[0]
    if p.additive is not None:  # one mask for all three, built by the cached kernel
        if a.get("local_window"):  # the cache builds causal masks only (its kernels' allow-lists refuse this)
            raise ValueError("a two-sided local window has no cached (additive) mask")
        return b.node("Add", [s, blk.view(p.additive) if blk.view else p.additive])[0]
    if a.get("causal") and blk.causal == "compute":
        zero, one = _scalar(b, 0), _scalar(b, 1)
        r0, r1 = blk.rows or (zero, p.tq)
        c0, c1 = blk.cols or (zero, p.tk)
        rows = b.node("Unsqueeze", [b.node("Add", [b.node("Range", [r0, r1, one])[0], p.offset])[0], b.i64([1])])[0]
        cols = b.node("Unsqueeze", [b.node("Range", [c0, c1, one])[0], b.i64([0])])[0]
        hide = b.node("Greater", [cols, rows])[0]
        if a.get("window"):
            far = b.node("LessOrEqual", [cols, b.node("Sub", [rows, _scalar(b, a["window"])])[0]])[0]
            hide = b.node("Or", [hide, far])[0]
        s = b.node("Where", [hide, p.min_value, s])[0]
    if a.get("chunk"):  # chunked attention, also on tiles the causal triangle made visible
        one = _scalar(b, 1)
        r0, r1 = blk.rows or (_scalar(b, 0), p.tq)
        c0, c1 = blk.cols or (_scalar(b, 0), p.tk)
        rows = b.node("Unsqueeze", [b.node("Add", [b.node("Range", [r0, r1, one])[0], p.offset])[0], b.i64([1])])[0]
        cols = b.node("Unsqueeze", [b.node("Range", [c0, c1, one])[0], b.i64([0])])[0]
        s = b.node("Where", [_other_chunk(b, a, rows, cols), p.min_value, s])[0]
    if a.get("local_window"):  # two-sided: |key - query| >= local_window hidden
        one = _scalar(b, 1)
        r0, r1 = blk.rows or (_scalar(b, 0), p.tq)
        c0, c1 = blk.cols or (_scalar(b, 0), p.tk)
        rows = b.node("Unsqueeze", [b.node("Add", [b.node("Range", [r0, r1, one])[0], p.offset])[0], b.i64([1])])[0]
        cols = b.node("Unsqueeze", [b.node("Range", [c0, c1, one])[0], b.i64([0])])[0]
        dist = b.node("Abs", [b.node("Sub", [cols, rows])[0]])[0]
        hide = b.node("GreaterOrEqual", [dist, _scalar(b, a["local_window"])])[0]
        s = b.node("Where", [hide, p.min_value, s])[0]
    if p.hidden is not None:
        hidden = p.hidden
        if blk.cols is not None:
            hidden = b.node("Slice", [hidden, _u(b, blk.cols[0]), _u(b, blk.cols[1]), b.i64([3])])[0]
        s = b.node("Where", [blk.view(hidden) if blk.view else hidden, p.min_value, s])[0]
    return s


def _sinks(b, a, s, p: Prepared, blk: Block) -> str:
    """Attention sinks change no score; ``softmax`` adds them to the normaliser. A kernel that did not
    prepare them cannot get here (``prepare`` refuses), so none drops them by calling Softmax itself."""
    if p.sinks is None:
        raise ValueError("attention sinks were not prepared")
    return s


def softmax(b, a: dict, s: str, p: Prepared, blk: Block) -> str:
    """The weights of a block of epilogued scores holding whole rows (every key of its rows): Softmax
    over the last axis, or with attention sinks the softmax over the keys and the head's sink, whose
    weight is dropped (the reference's ``softmax``): the sink concatenated to each row as one more score,
    one Softmax, the sink's column sliced off. One Softmax rather than the max, exp and sum written out:
    every provider has Softmax in every float type, where onnxruntime 1.31's CUDA provider has no bf16
    ReduceMax (tests/cuda). ``blk.head`` takes the block's head of the sinks, ``blk.sink_shape`` lays them
    out as the block (grouped heads: [1, G, rep, 1, 1])."""
    if not a.get("sinks"):
        return b.node("Softmax", [s], axis=-1)[0]
    sk = p.sinks
    if blk.head is not None:
        sk = b.node("Slice", [sk, _u(b, blk.head[0]), _u(b, blk.head[1]), b.i64([0])])[0]
    sk = b.node("Reshape", [sk, b.i64(list(blk.sink_shape))])[0]
    rows = b.node("Shape", [s], start=0, end=-1)[0]
    column = b.node("Expand", [sk, b.node("Concat", [rows, b.i64([1])], axis=0)[0]])[0]
    weights = b.node("Softmax", [b.node("Concat", [s, column], axis=-1)[0]], axis=-1)[0]
    return b.node("Slice", [weights, b.i64([0]), b.i64([-1]), b.i64([-1])])[0]


def add_triangle(b, s: str, p: Prepared) -> str:
    """The causal mask of a tiled kernel's diagonal block (the tile's last tile × tile scores): the
    prepared triangle added. The tiled kernel then applies the rest with ``Block(causal="visible")``."""
    return b.node("Add", [s, p.triangle])[0]


# The stage of the masks (and the bias): steps before it run on each part of a split block.
MASKS = reference.FEATURES["causal"].stage


def before_masks(stage: int) -> bool:
    return stage < MASKS


def from_masks(stage: int) -> bool:
    return stage >= MASKS


# The epilogue's steps: (features a step computes, the step), as compiler/reference/score_epilogue.py's STEPS.
STEPS: list[tuple[tuple[str, ...], Callable]] = [
    (("scale",), _scale),
    (("softcap",), _softcap),
    (("bias",), _bias),
    (("causal", "window", "chunk", "local_window", "padding"), _masks),
    (("sinks",), _sinks),
]


def computed() -> frozenset[str]:
    """The features this epilogue computes: the allow-list of every kernel that uses it."""
    return frozenset(f for feats, _ in STEPS for f in feats)


def apply(b, a: dict, s: str, p: Prepared, blk: Block, stages: Callable[[int], bool] = lambda stage: True) -> str:
    """The epilogue on a block of raw scores q·kᵀ, in the reference's stage order; ``stages``: only
    the steps of these stages (a tiled kernel runs ``before_masks`` on each part of a split block,
    then ``from_masks`` on their concatenation)."""
    on = set(reference.used(a))
    missing = on - computed()
    if missing:  # passes/attention_kernels.py never picks a kernel using this epilogue for such a node
        raise ValueError(f"the ONNX score epilogue does not compute {', '.join(sorted(missing))}")
    stage = lambda step: min((reference.FEATURES[f].stage for f in step[0] if f in reference.FEATURES),  # noqa: E731
                             default=len(reference.FEATURES))
    for feats, step in sorted(STEPS, key=stage):
        if on & set(feats) and stages(stage((feats, step))):
            s = step(b, a, s, p, blk)
    return s
