"""A numpy reference interpreter for the IR.

It executes the graph node by node with plain numpy, written for clarity
rather than speed. It is the ground truth the ONNX export is tested against,
so each op here follows its textbook definition (and, where models differ,
the convention of the reference implementation named in the comment).
"""

from __future__ import annotations

import math

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import DTYPES, Graph
from tessera.compiler.ir.signature import bind_inputs

_erf = np.frompyfunc(math.erf, 1, 1)


def _min_value(dtype) -> float:
    return float(np.finfo(dtype).min)


def erf(x: np.ndarray) -> np.ndarray:
    return _erf(x.astype(np.float64)).astype(np.float64).astype(x.dtype)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w
    return y + b if b is not None else y


def _causal(s, window):
    tq, tk = s.shape[-2], s.shape[-1]
    i = np.arange(tq)[:, None] + (tk - tq)
    j = np.arange(tk)[None, :]
    hide = j > i
    if window:
        hide |= j <= i - window
    return np.where(hide, _min_value(s.dtype), s).astype(s.dtype)


def rope_inv_freq(hd: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """RoPE's hd/2 inverse frequencies theta^(-2i/hd), in fp32 as Hugging Face computes them.

    ``scaling`` = (factor, low_freq, high_freq, original_ctx) applies Llama 3.1's frequency
    scaling ("llama3" rope_type): wavelengths longer than original_ctx / low_freq are divided by
    factor, those shorter than original_ctx / high_freq are kept, and those between are
    interpolated smoothly."""
    inv_freq = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))).astype(np.float32)
    if scaling is None:
        return inv_freq
    factor, low, high, ctx = (np.float32(v) for v in scaling)
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > ctx / low, inv_freq / factor, inv_freq)
    smooth = (ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < ctx / high) & ~(wavelen > ctx / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(n: int, hd: int, theta: float, dtype=np.float32, scaling: tuple | None = None):
    """cos and sin tables [n, hd] for rotate-half rotary embedding (Hugging Face Llama's layout)."""
    inv_freq = rope_inv_freq(hd, theta, scaling)
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)


def _rope(x, theta, scaling=None, positions=None):
    n, hd = x.shape[-2], x.shape[-1]
    if positions is None:
        cos, sin = rope_tables(n, hd, theta, x.dtype, scaling)
    else:  # explicit positions [B, T] (a KV-cached graph: past length P > 0, left padding)
        freqs = positions.astype(np.float32)[..., None] * rope_inv_freq(hd, theta, scaling)
        emb = np.concatenate([freqs, freqs], axis=-1)[:, None]  # [B, 1, T, hd]
        cos, sin = np.cos(emb).astype(x.dtype), np.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated = np.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def sinusoidal_table(n: int, d: int) -> np.ndarray:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))."""
    pos = np.arange(n, dtype=np.float32)[:, None]
    div = np.power(np.float32(10000.0), np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    ang = pos / div[None, :]
    pe = np.zeros((n, d), dtype=np.float32)
    pe[:, 0::2] = np.sin(ang)
    pe[:, 1::2] = np.cos(ang)
    return pe


def _topk_gates(x, k):
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(x, idx, axis=-1)
    w = _softmax(top, -1)
    out = np.zeros_like(x)
    np.put_along_axis(out, idx, w, axis=-1)
    return out


def _conv2d(x, w, b, stride):
    k = w.shape[-1]
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    y = np.einsum("bchwij,ocij->bohw", win, w, optimize=True)
    return y + b[None, :, None, None] if b is not None else y


def _split_heads(x, h):
    *lead, t, d = x.shape
    return np.swapaxes(x.reshape(*lead, t, h, d // h), -2, -3)


def _merge_heads(x):
    *lead, h, t, hd = x.shape
    return np.swapaxes(x, -2, -3).reshape(*lead, t, h * hd)


def run(graph: Graph, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the graph on concrete inputs; returns {output name: array}."""
    bind = bind_inputs(graph, feeds)

    def ev(d):
        return dims.evaluate(dims.dim(d), bind)

    env: dict[str, np.ndarray] = dict(feeds)
    for path in graph.params:
        env[path] = weights[path]
    env.update(graph.consts)
    for node in graph.nodes.values():
        x = [env[i] for i in node.inputs]
        a = node.attrs
        op = node.op
        if op == "linear":
            y = x[0] @ x[1].T
            if len(x) == 3:
                y = y + x[2]
        elif op == "embedding":
            y = x[1][x[0]]
        elif op == "matmul":
            y = np.matmul(x[0], x[1])
        elif op in ("add", "sub", "mul", "div", "pow"):
            y = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                 "pow": np.power}[op](x[0], x[1])
        elif op == "neg":
            y = -x[0]
        elif op == "sqrt":
            y = np.sqrt(x[0])
        elif op == "exp":
            y = np.exp(x[0])
        elif op == "sin":
            y = np.sin(x[0])
        elif op == "cos":
            y = np.cos(x[0])
        elif op == "relu":
            y = np.maximum(x[0], 0)
        elif op == "gelu":
            v = x[0]
            if a["approx"] == "tanh":
                y = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
            else:
                y = 0.5 * v * (1 + erf(v / math.sqrt(2)))
        elif op == "silu":
            y = x[0] / (1 + np.exp(-x[0]))
        elif op == "sigmoid":
            y = 1 / (1 + np.exp(-x[0]))
        elif op == "tanh":
            y = np.tanh(x[0])
        elif op == "identity":
            y = x[0]
        elif op == "cast":
            y = x[0].astype(DTYPES[a["dtype"]])
        elif op == "softmax":
            y = _softmax(x[0], a["axis"])
        elif op == "layernorm":
            y = _layernorm(x[0], x[1], x[2] if len(x) == 3 else None, a["eps"])
        elif op == "rmsnorm":
            v = x[0]
            y = v / np.sqrt((v * v).mean(-1, keepdims=True) + a["eps"]) * x[1]
        elif op == "reshape":
            y = x[0].reshape([ev(d) for d in a["shape"]])
        elif op == "transpose":
            y = np.transpose(x[0], a["perm"])
        elif op == "split_heads":
            y = _split_heads(x[0], a["heads"])
        elif op == "merge_heads":
            y = _merge_heads(x[0])
        elif op == "repeat_kv":
            y = np.repeat(x[0], a["times"], axis=-3)
        elif op == "concat":
            y = np.concatenate(x, axis=a["axis"])
        elif op == "slice":
            idx = [slice(None)] * x[0].ndim
            idx[a["axis"]] = slice(ev(a["start"]), ev(a["end"]))
            y = x[0][tuple(idx)]
        elif op == "select":
            y = np.take(x[0], a["index"], axis=a["axis"])
        elif op == "expand":
            y = np.broadcast_to(x[0], [ev(d) for d in a["shape"]]).copy()
        elif op in ("mean", "sum"):
            f = np.mean if op == "mean" else np.sum
            y = f(x[0], axis=tuple(a["axes"]), keepdims=a["keepdims"])
        elif op == "causal_mask":
            y = _causal(x[0], a["window"])
        elif op == "padding_mask":
            keep = (x[1] != 0)[:, None, None, :]
            y = np.where(keep, x[0], _min_value(x[0].dtype)).astype(x[0].dtype)
        elif op == "rope":
            y = _rope(x[0], a["theta"], a.get("scaling"), x[1] if len(x) > 1 else None)
        elif op == "topk_gates":
            y = _topk_gates(x[0], a["k"])
        elif op == "arange":
            y = np.arange(ev(a["n"]), dtype=np.int64)
        elif op == "sinusoidal":
            y = sinusoidal_table(ev(a["n"]), a["d"])
        elif op == "fused_attention":
            from tessera.compiler.reference.flash import attention_reference

            rep = a["heads"] // a["kv_heads"]
            k_, v_ = np.repeat(x[1], rep, axis=1), np.repeat(x[2], rep, axis=1)
            extra = x[3:]
            mask = extra.pop(0) if a["padding"] else None
            bias = extra.pop(0) if a["bias"] else None
            y = attention_reference(x[0], k_, v_, a["scale"], a["causal"], a["window"], mask, bias)
        elif op == "conv2d":
            y = _conv2d(x[0], x[1], x[2] if len(x) == 3 else None, a["stride"])
        else:
            raise NotImplementedError(f"numpy interpreter has no rule for op '{op}'")
        out_dtype = DTYPES.get(graph.type_of(node.outputs[0]).dtype)
        y = np.asarray(y)
        if out_dtype is not None and y.dtype != out_dtype:
            y = y.astype(out_dtype)
        env[node.outputs[0]] = y
    return {name: env[name] for name in graph.outputs}
