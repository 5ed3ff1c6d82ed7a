"""ONNX lowerings of the ops that only move data (compiler/ops/layout.py)."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir import dims


def _split_heads(L):
    r = L.t_in[0].rank
    hd = L.t_out.shape[-1]
    tail = [L.a["heads"], int(hd)] if dims.is_static(hd) else [L.a["heads"], -1]
    rs = L.b.node("Reshape", [L.x[0], L.b.i64([0] * (r - 1) + tail)])[0]
    perm = list(range(r + 1))
    perm[-3], perm[-2] = perm[-2], perm[-3]
    L.emit("Transpose", [rs], perm=perm)


def _merge_heads(L):
    r = L.t_in[0].rank
    perm = list(range(r))
    perm[-3], perm[-2] = perm[-2], perm[-3]
    tr = L.b.node("Transpose", L.x, perm=perm)[0]
    L.emit("Reshape", [tr, L.b.i64([0] * (r - 2) + [-1])])


def _repeat_kv(L):
    b, t = L.b, L.t_in[0]
    r = t.rank
    n = L.a["times"]
    un = b.node("Unsqueeze", [L.x[0], b.i64([r - 2])])[0]
    ex = b.node("Expand", [un, b.i64([1] * (r - 2) + [n, 1, 1])])[0]
    g_heads, hd = t.shape[-3], t.shape[-1]
    L.emit("Reshape", [ex, b.shape_vec(list(t.shape[:-3]) + [g_heads * n, t.shape[-2], hd])])


LOWERINGS = {
    "reshape": lambda L: L.emit("Reshape", [L.x[0], L.b.shape_vec(L.a["shape"])]),
    "transpose": lambda L: L.emit("Transpose", L.x, perm=list(L.a["perm"])),
    "split_heads": _split_heads,
    "merge_heads": _merge_heads,
    "repeat_kv": _repeat_kv,
    "concat": lambda L: L.emit("Concat", L.x, axis=L.a["axis"]),
    "slice": lambda L: L.emit("Slice", [L.x[0], L.b.dim(L.a["start"]), L.b.dim(L.a["end"]), L.b.i64([L.a["axis"]])]),
    "gather": lambda L: L.emit("GatherElements", [L.x[0], L.x[1]], axis=L.a["axis"]),
    "select": lambda L: L.emit("Gather", [L.x[0], L.b.const(np.array(L.a["index"], dtype=np.int64), "index")],
                               axis=L.a["axis"]),
    "expand": lambda L: L.emit("Expand", [L.x[0], L.b.shape_vec(L.a["shape"])]),
}
