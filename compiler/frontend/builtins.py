"""The language's primitive functions: argument checking and the IR they emit.

Each builtin receives its arguments as (value, position) pairs, already
matched to its parameter list, so an error can point at the exact argument.
Builtins that own parameters (linear, embedding, the norms, conv1d, conv2d) open a
name scope: ``linear(x, 64, name="q")`` inside ``layers.0.attn`` creates
``layers.0.attn.q.weight`` and ``layers.0.attn.q.bias``.
"""

from __future__ import annotations

import math

import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import DTYPES
from tessera.compiler.frontend.values import REQUIRED, Builtin, Tensor, describe
from tessera.compiler.reference.numerics import ROPE_TYPES
from tessera.compiler.ops.experts import GATES_ON, SCORINGS, group_problem

BUILTINS: dict[str, Builtin] = {}


def builtin(name: str, *params: tuple[str, object], doc: str = ""):
    def deco(fn):
        BUILTINS[name] = Builtin(name, tuple(params), fn, doc or (fn.__doc__ or "").strip())
        return fn
    return deco


R = REQUIRED


# ------------------------------------------------------------------ argument helpers
def _tensor(call, arg, what="x") -> Tensor:
    value, pos = arg
    if isinstance(value, Tensor):
        return value
    if isinstance(value, list):
        return call.tensor(value, pos, what=what)
    raise call.error(f"'{what}' must be a tensor, got {describe(value)}", pos)


def _int(call, arg, what, minimum=None) -> int:
    value, pos = arg
    if isinstance(value, sympy.Expr) and dims.is_static(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise call.error(f"'{what}' must be an int, got {describe(value)}", pos)
    if minimum is not None and value < minimum:
        raise call.error(f"'{what}' must be at least {minimum}, got {value}", pos)
    return value


def _dim(call, arg, what):
    value, pos = arg
    if isinstance(value, bool) or not isinstance(value, (int, sympy.Expr)):
        raise call.error(f"'{what}' must be a dimension (int or symbol), got {describe(value)}", pos)
    return dims.dim(value)


def _float(call, arg, what) -> float:
    value, pos = arg
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise call.error(f"'{what}' must be a number, got {describe(value)}", pos)
    return float(value)


def _bool(call, arg, what) -> bool:
    value, pos = arg
    if not isinstance(value, bool):
        raise call.error(f"'{what}' must be true or false, got {describe(value)}", pos)
    return value


def _choice(call, arg, what, choices) -> str:
    value, pos = arg
    if value not in choices:
        raise call.error(f"'{what}' must be one of {', '.join(repr(c) for c in choices)}, got {describe(value)}", pos)
    return value


def _shape(call, arg, what):
    value, pos = arg
    if not isinstance(value, list):
        raise call.error(f"'{what}' must be a list of dimensions, got {describe(value)}", pos)
    return tuple(_dim(call, (v, pos), what) for v in value)


def _scalar_math(fn, tensor_op):
    def impl(call, x):
        value, pos = x
        if isinstance(value, Tensor):
            return call.emit(tensor_op, [value])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise call.error(f"expected a number or tensor, got {describe(value)}", pos)
        try:
            result = fn(value)
        except OverflowError:
            raise call.error(f"the result for {value} is too large for a float", pos) from None
        except ValueError:  # math domain error: sqrt(-1), log(0)
            raise call.error(f"undefined for {value} (outside the function's domain)", pos) from None
        if isinstance(result, float) and not math.isfinite(result):
            raise call.error(f"the result for {value} is not a finite number", pos)
        return result
    return impl


# ------------------------------------------------------------------ layers with parameters
@builtin("linear", ("x", R), ("out", R), ("bias", True), ("weight", None))
def _linear(call, x, out, bias, weight):
    """y = x W^T + b, with W stored [out, in] (PyTorch's layout). weight= reuses a tensor (tying, literals);
    bias= true/false, or an existing [out] tensor to reuse (weight("./k.bias"))."""
    x = _tensor(call, x)
    n_out = _int(call, out, "out", 1)
    n_in = x.type.shape[-1] if x.type.rank else None
    if weight[0] is None:
        if n_in is None or not dims.is_static(n_in):
            raise call.error(f"input width must be a fixed size, got {x.type}")
        w = call.param("weight", (n_out, int(n_in)), "normal")
    else:
        w = _tensor(call, weight, "weight")
        if w.type.rank != 2 or not dims.equal(w.type.shape[0], n_out):
            raise call.error(f"weight must be [{n_out}, in], got {w.type}", weight[1])
    inputs = [x, w]
    if isinstance(bias[0], Tensor):  # a shared bias
        b = bias[0]
        if b.type.rank != 1 or not dims.equal(b.type.shape[0], n_out):
            raise call.error(f"bias must be [{n_out}], got {b.type}", bias[1])
        inputs.append(b)
    elif _bool(call, bias, "bias"):
        inputs.append(call.param("bias", (n_out,), "zeros"))
    return call.emit("linear", inputs)


@builtin("embedding", ("ids", R), ("vocab", R), ("d", R), ("weight", None))
def _embedding(call, ids, vocab, d, weight):
    """Look up rows of a [vocab, d] table by integer ids; weight= shares an existing table."""
    ids = _tensor(call, ids, "ids")
    shape = (_int(call, vocab, "vocab", 1), _int(call, d, "d", 1))
    if weight[0] is None:
        w = call.param("weight", shape, "normal")
    else:
        w = _tensor(call, weight, "weight")
        if not dims.shapes_equal(w.type.shape, dims.shape(shape)):
            raise call.error(f"weight must be [{shape[0]}, {shape[1]}], got {w.type}", weight[1])
    return call.emit("embedding", [ids, w])


@builtin("layernorm", ("x", R), ("eps", 1e-5), ("bias", True))
def _layernorm(call, x, eps, bias):
    """Layer normalisation over the last axis, with a learned scale (and shift)."""
    x = _tensor(call, x)
    d = _static_last(call, x)
    inputs = [x, call.param("weight", (d,), "ones")]
    if _bool(call, bias, "bias"):
        inputs.append(call.param("bias", (d,), "zeros"))
    return call.emit("layernorm", inputs, {"eps": _float(call, eps, "eps")})


@builtin("rmsnorm", ("x", R), ("eps", 1e-6))
def _rmsnorm(call, x, eps):
    """Root-mean-square normalisation over the last axis, with a learned scale."""
    x = _tensor(call, x)
    d = _static_last(call, x)
    return call.emit("rmsnorm", [x, call.param("weight", (d,), "ones")], {"eps": _float(call, eps, "eps")})


def _conv_operands(call, x, out, kernel, rank: int, layout: str):
    """A convolution's input (of ``rank``, channels fixed), channels, output channels and kernel size."""
    x = _tensor(call, x)
    if x.type.rank != rank:
        raise call.error(f"expects {layout}, got {x.type}")
    k = _int(call, kernel, "kernel", 1)
    c = x.type.shape[1]
    if not dims.is_static(c):
        raise call.error(f"input channels must be a fixed size, got {x.type}")
    return x, int(c), _int(call, out, "out", 1), k


@builtin("conv2d", ("x", R), ("out", R), ("kernel", R), ("stride", 1), ("bias", True))
def _conv2d(call, x, out, kernel, stride, bias):
    """2-D convolution without padding (patch embedding): x [B, C, H, W]."""
    x, c, n_out, k = _conv_operands(call, x, out, kernel, 4, "[B, C, H, W]")
    inputs = [x, call.param("weight", (n_out, c, k, k), "normal")]
    if _bool(call, bias, "bias"):
        inputs.append(call.param("bias", (n_out,), "zeros"))
    return call.emit("conv2d", inputs, {"kernel": k, "stride": _int(call, stride, "stride", 1)})


@builtin("conv1d", ("x", R), ("out", R), ("kernel", R), ("stride", 1), ("padding", 0), ("bias", True),
         ("groups", 1),
         doc="1-D convolution over x [B, C, L], zero-padded at both ends: weight [out, C / groups, kernel] "
             "(PyTorch's Conv1d), output [B, out, (L + 2*padding - kernel) // stride + 1]. Whisper's audio front "
             "end: kernel=3, padding=1, then stride=2. groups=G convolves G groups of channels apart (G = C = out: "
             "depthwise, Mamba's). (GPT-2's \"Conv1D\" is a linear layer: write linear.)")
def _conv1d(call, x, out, kernel, stride, padding, bias, groups):
    x, c, n_out, k = _conv_operands(call, x, out, kernel, 3, "[B, C, L]")
    attrs = {"kernel": k, "stride": _int(call, stride, "stride", 1), "padding": _int(call, padding, "padding", 0)}
    g = _int(call, groups, "groups", 1)
    if g > 1:
        if c % g or n_out % g:
            raise call.error(f"groups={g} must divide the input channels ({c}) and out ({n_out})", groups[1])
        attrs["groups"] = g
    inputs = [x, call.param("weight", (n_out, c // g, k), "normal")]
    if _bool(call, bias, "bias"):
        inputs.append(call.param("bias", (n_out,), "zeros"))
    return call.emit("conv1d", inputs, attrs)


@builtin("parameter", ("shape", R), ("init", "normal"), ("std", 0.02))
def _parameter(call, shape, init, std):
    """A free-standing learned tensor (class token, position table); its path is the name= given."""
    shp = _shape(call, shape, "shape")
    init_kind = _choice(call, init, "init", ("normal", "zeros", "ones"))
    return call.raw_param("param", shp, init_kind, _float(call, std, "std"))


@builtin("buffer", ("shape", R), ("init", "zeros"))
def _buffer(call, shape, init):
    """A checkpoint tensor that is not trained (a PyTorch buffer: BART's final_logits_bias): loaded by
    its path (name=) like a parameter, not counted in the parameter totals."""
    shp = _shape(call, shape, "shape")
    init_kind = _choice(call, init, "init", ("zeros", "ones", "normal"))
    return call.raw_param("buffer", shp, init_kind, 0.02, buffer=True)


@builtin("weight", ("path", R))
def _weight(call, path):
    """An existing parameter by its full path, e.g. weight("wte.weight") to tie an output head, or
    relative to the current block ("./k.weight", "../norm.weight"): a block's own projection applied to
    a second input (DeBERTa's relative positions through its key and query projections)."""
    value, pos = path
    if not isinstance(value, str):
        raise call.error(f"'path' must be a string, got {describe(value)}", pos)
    return call.lookup_param(value, pos)


@builtin("tensor", ("values", R), ("dtype", "f32"))
def _tensor_lit(call, values, dtype):
    """A literal tensor from nested lists of numbers."""
    dt = _choice(call, dtype, "dtype", tuple(k for k, v in DTYPES.items() if v is not None))
    if not isinstance(values[0], (list, int, float)) or isinstance(values[0], bool):
        raise call.error(f"'values' must be a list of numbers, got {describe(values[0])}", values[1])
    return call.tensor(values[0], values[1], dt)


# ------------------------------------------------------------------ linear algebra and layout
@builtin("matmul", ("a", R), ("b", R))
def _matmul(call, a, b):
    """Batched matrix product over the last two axes."""
    return call.emit("matmul", [_tensor(call, a, "a"), _tensor(call, b, "b")])


@builtin("transpose", ("x", R), ("perm", None))
def _transpose(call, x, perm):
    """Permute axes; without perm, swap the last two."""
    x = _tensor(call, x)
    if perm[0] is None:
        if x.type.rank < 2:
            raise call.error(f"needs rank >= 2, got {x.type}")
        p = list(range(x.type.rank))
        p[-1], p[-2] = p[-2], p[-1]
    else:
        p = [_int(call, (v, perm[1]), "perm") for v in (perm[0] if isinstance(perm[0], list) else [perm[0]])]
        p = [i % x.type.rank if -x.type.rank <= i < x.type.rank else i for i in p]
    return call.emit("transpose", [x], {"perm": p})


@builtin("reshape", ("x", R), ("shape", R))
def _reshape(call, x, shape):
    """Reshape to the given dimensions (which may be symbolic)."""
    return call.emit("reshape", [_tensor(call, x)], {"shape": list(_shape(call, shape, "shape"))})


@builtin("split_heads", ("x", R), ("heads", R))
def _split_heads(call, x, heads):
    """[..., T, H*hd] -> [..., H, T, hd]."""
    return call.emit("split_heads", [_tensor(call, x)], {"heads": _int(call, heads, "heads", 1)})


@builtin("merge_heads", ("x", R))
def _merge_heads(call, x):
    """[..., H, T, hd] -> [..., T, H*hd]."""
    return call.emit("merge_heads", [_tensor(call, x)])


@builtin("repeat_kv", ("x", R), ("times", R))
def _repeat_kv(call, x, times):
    """Repeat each key/value head `times` times (grouped-query attention): [B, G, T, hd] -> [B, G*times, T, hd]."""
    x = _tensor(call, x)
    n = _int(call, times, "times", 1)
    return x if n == 1 else call.emit("repeat_kv", [x], {"times": n})


@builtin("concat", ("xs", R), ("axis", R))
def _concat(call, xs, axis):
    """Join a list of tensors along an axis."""
    value, pos = xs
    if not isinstance(value, list) or not value:
        raise call.error(f"'xs' must be a non-empty list of tensors, got {describe(value)}", pos)
    ts = [_tensor(call, (v, pos), "xs") for v in value]
    return call.emit("concat", ts, {"axis": _int(call, axis, "axis")})


@builtin("slice", ("x", R), ("axis", R), ("start", R), ("end", R))
def _slice(call, x, axis, start, end):
    """x[start:end] along one axis (start and end may be symbolic)."""
    return call.emit("slice", [_tensor(call, x)], {"axis": _int(call, axis, "axis"),
                                                   "start": _dim(call, start, "start"), "end": _dim(call, end, "end")})


@builtin("select", ("x", R), ("axis", R), ("index", R))
def _select(call, x, axis, index):
    """Take one position along an axis, removing it (e.g. the class token)."""
    return call.emit("select", [_tensor(call, x)], {"axis": _int(call, axis, "axis"),
                                                    "index": _int(call, index, "index")})


@builtin("gather", ("x", R), ("index", R), ("axis", R))
def _gather(call, x, index, axis):
    """x's values at the positions ``index`` gives along ``axis`` (torch.gather, onnx GatherElements):
    the index has x's rank and its sizes on the other axes; the result has the index's shape
    (DeBERTa's relative-position lookups)."""
    return call.emit("gather", [_tensor(call, x), _tensor(call, index)], {"axis": _int(call, axis, "axis")})


@builtin("expand", ("x", R), ("shape", R))
def _expand(call, x, shape):
    """Broadcast to a larger shape (e.g. a [1, 1, d] class token to [B, 1, d])."""
    return call.emit("expand", [_tensor(call, x)], {"shape": list(_shape(call, shape, "shape"))})


@builtin("mean", ("x", R), ("axis", R), ("keepdims", False))
def _mean(call, x, axis, keepdims):
    """Mean over one axis or a list of axes."""
    return _reduce(call, "mean", x, axis, keepdims)


@builtin("sum", ("x", R), ("axis", R), ("keepdims", False))
def _sum(call, x, axis, keepdims):
    """Sum over one axis or a list of axes."""
    return _reduce(call, "sum", x, axis, keepdims)


def _reduce(call, op, x, axis, keepdims):
    axes = axis[0] if isinstance(axis[0], list) else [axis[0]]
    return call.emit(op, [_tensor(call, x)], {"axes": [_int(call, (a, axis[1]), "axis") for a in axes],
                                              "keepdims": _bool(call, keepdims, "keepdims")})


@builtin("cast", ("x", R), ("dtype", R))
def _cast(call, x, dtype):
    """Convert a tensor's element type."""
    dt = _choice(call, dtype, "dtype", tuple(k for k, v in DTYPES.items() if v is not None))
    x = _tensor(call, x)
    return x if x.type.dtype == dt else call.emit("cast", [x], {"dtype": dt})


# ------------------------------------------------------------------ activations and elementwise math
@builtin("softmax", ("x", R), ("axis", -1))
def _softmax(call, x, axis):
    """Softmax over one axis (the key axis, -1, for attention scores)."""
    return call.emit("softmax", [_tensor(call, x)], {"axis": _int(call, axis, "axis")})


@builtin("gelu", ("x", R), ("approx", "none"))
def _gelu(call, x, approx):
    """GELU, exact (erf) or with the tanh approximation (approx="tanh", GPT-2's)."""
    return call.emit("gelu", [_tensor(call, x)], {"approx": _choice(call, approx, "approx", ("none", "tanh"))})


def _unary_builtin(name, doc):
    def impl(call, x):
        return call.emit(name, [_tensor(call, x)])
    impl.__doc__ = doc
    builtin(name, ("x", R))(impl)


_unary_builtin("relu", "max(x, 0).")
_unary_builtin("silu", "x * sigmoid(x) (also called swish).")
_unary_builtin("sigmoid", "1 / (1 + exp(-x)).")
_unary_builtin("tanh", "Hyperbolic tangent.")
_unary_builtin("softplus", "log(1 + exp(x)), computed without overflow (Mamba's time step).")

builtin("sqrt", ("x", R), doc="Square root of a number or, elementwise, of a tensor.")(
    _scalar_math(math.sqrt, "sqrt"))
builtin("exp", ("x", R), doc="Exponential of a number or, elementwise, of a tensor.")(
    _scalar_math(math.exp, "exp"))


builtin("log", ("x", R), doc="Natural logarithm of a number or, elementwise, of a float tensor.")(
    _scalar_math(math.log, "log"))
builtin("abs", ("x", R), doc="Absolute value of a number or, elementwise, of a tensor.")(
    _scalar_math(abs, "abs"))
builtin("sign", ("x", R), doc="-1, 0 or 1 by the sign of a number or, elementwise, of a tensor (same dtype).")(
    _scalar_math(lambda v: type(v)((v > 0) - (v < 0)), "sign"))
builtin("floor", ("x", R), doc="Round down: an int for a number; elementwise (same float dtype) for a tensor.")(
    _scalar_math(math.floor, "floor"))
builtin("ceil", ("x", R), doc="Round up: an int for a number; elementwise (same float dtype) for a tensor.")(
    _scalar_math(math.ceil, "ceil"))
builtin("round", ("x", R), doc="Round to the nearest integer, halves to even (2.5 -> 2, as ONNX Round and "
                               "torch.round): an int for a number; elementwise for a float tensor.")(
    _scalar_math(round, "round"))


@builtin("int", ("x", R))
def _int_of(call, x):
    """A compile-time number as an int, truncated toward zero (int(2.9) = 2, int(-2.9) = -2), as Python's int()."""
    value, pos = x
    if isinstance(value, sympy.Expr) and dims.is_static(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise call.error(f"expected a compile-time number, got {describe(value)}"
                         + (" (for a tensor write cast(x, \"i64\"))" if isinstance(value, Tensor) else ""), pos)
    if isinstance(value, float) and not math.isfinite(value):
        raise call.error(f"{value} has no integer value", pos)
    return int(value)


@builtin("float", ("x", R))
def _float_of(call, x):
    """A compile-time number as a float (int(7) / 2 is exact division; float(7) / 2 is 3.5)."""
    value, pos = x
    if isinstance(value, sympy.Expr) and dims.is_static(value):
        return float(int(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise call.error(f"expected a compile-time number, got {describe(value)}"
                         + (" (for a tensor write cast(x, \"f32\"))" if isinstance(value, Tensor) else ""), pos)
    return float(value)


# ------------------------------------------------------------------ elementwise on tensors: selection, extrema
def _operands(call, args, names):
    """Tensors (or numbers, made constants of the tensors' dtype) for an elementwise op; at least one a tensor."""
    values = [a[0] for a in args]
    ref = next((v for v in values if isinstance(v, Tensor)), None)
    if ref is None:
        raise call.error(f"needs a tensor among {', '.join(names)} (for numbers use min/max)", args[0][1])
    out = []
    for (value, pos), name in zip(args, names):
        if isinstance(value, Tensor):
            out.append(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise call.error(f"'{name}' must be a tensor or a number, got {describe(value)}", pos)
        dt = ref.type.dtype
        if isinstance(value, float) and dt not in ("f32", "f16", "bf16"):
            raise call.error(f"'{name}' is the float {value} but the tensors are {dt}; cast them first", pos)
        out.append(call.tensor(value, pos, dt, what=name))
    return out


@builtin("minimum", ("a", R), ("b", R))
def _minimum(call, a, b):
    """Elementwise smaller of two tensors (or a tensor and a number), broadcast."""
    return call.emit("minimum", _operands(call, [a, b], ["a", "b"]))


@builtin("maximum", ("a", R), ("b", R))
def _maximum(call, a, b):
    """Elementwise larger of two tensors (or a tensor and a number), broadcast."""
    return call.emit("maximum", _operands(call, [a, b], ["a", "b"]))


@builtin("clamp", ("x", R), ("lo", None), ("hi", None))
def _clamp(call, x, lo, hi):
    """Limit x to [lo, hi] elementwise (either bound may be none): minimum(maximum(x, lo), hi), as torch.clamp."""
    y = _tensor(call, x)
    if lo[0] is None and hi[0] is None:
        raise call.error("give lo=, hi= or both", call.pos)
    if lo[0] is not None and hi[0] is not None and not isinstance(lo[0], Tensor) and not isinstance(hi[0], Tensor) \
            and _float_or_int(call, lo) > _float_or_int(call, hi):
        raise call.error(f"lo={lo[0]} is above hi={hi[0]}", lo[1])
    if lo[0] is not None:
        y = call.emit("maximum", _operands(call, [(y, x[1]), lo], ["x", "lo"]))
    if hi[0] is not None:
        y = call.emit("minimum", _operands(call, [(y, x[1]), hi], ["x", "hi"]))
    return y


@builtin("where", ("cond", R), ("a", R), ("b", R))
def _where(call, cond, a, b):
    """a where the bool tensor cond holds, else b (tensors or numbers; all three broadcast)."""
    c = _tensor(call, cond, "cond")
    if isinstance(a[0], Tensor) or isinstance(b[0], Tensor):
        x, y = _operands(call, [a, b], ["a", "b"])
    else:
        nums = [_float_or_int(call, a), _float_or_int(call, b)]
        dt = "f32" if any(isinstance(v, float) for v in nums) else "i64"
        x, y = (call.tensor(v, p, dt, what=n) for v, (_, p), n in zip(nums, (a, b), ("a", "b")))
    return call.emit("where", [c, x, y])


@builtin("cumsum", ("x", R), ("axis", R))
def _cumsum(call, x, axis):
    """Running (inclusive) sum along an axis: positions from a padding mask are cumsum(mask, 1) * mask - 1."""
    return call.emit("cumsum", [_tensor(call, x)], {"axis": _int(call, axis, "axis")})


@builtin("min", ("a", R), ("b", R))
def _min(call, a, b):
    """The smaller of two numbers (for tensors: minimum)."""
    return min(_float_or_int(call, a), _float_or_int(call, b))


@builtin("max", ("a", R), ("b", R))
def _max(call, a, b):
    """The larger of two numbers (for tensors: maximum)."""
    return max(_float_or_int(call, a), _float_or_int(call, b))


def _float_or_int(call, arg):
    value, pos = arg
    if isinstance(value, Tensor):
        raise call.error(f"expected a number, got {describe(value)} (for tensors use minimum, maximum or clamp)", pos)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise call.error(f"expected a number, got {describe(value)}", pos)
    return value


# ------------------------------------------------------------------ attention pieces
@builtin("causal_mask", ("scores", R), ("window", 0), ("chunk", 0))
def _causal_mask(call, scores, window, chunk):
    """Hide keys after each query (and, with window=W, keys W or more positions before it; with
    chunk=C, keys outside the query's block of C positions: chunked attention, Llama 4)."""
    attrs = {"window": _int(call, window, "window", 0)}
    c = _int(call, chunk, "chunk", 0)
    if c:
        attrs["chunk"] = c
    return call.emit("causal_mask", [_tensor(call, scores, "scores")], attrs)


@builtin("sliding_window_mask", ("scores", R), ("window", R))
def _sliding_window(call, scores, window):
    """Causal mask limited to the last `window` positions (each query sees itself and window-1 before)."""
    return call.emit("causal_mask", [_tensor(call, scores, "scores")], {"window": _int(call, window, "window", 1)})


@builtin("local_window_mask", ("scores", R), ("window", R))
def _local_window(call, scores, window):
    """Two-sided (non-causal) window: each query sees the keys less than `window` positions away on either side."""
    return call.emit("local_mask", [_tensor(call, scores, "scores")], {"window": _int(call, window, "window", 1)})


@builtin("padding_mask", ("scores", R), ("mask", R))
def _padding_mask(call, scores, mask):
    """Hide padded keys: mask [B, Tk] holds 1 for real tokens and 0 for padding."""
    return call.emit("padding_mask", [_tensor(call, scores, "scores"), _tensor(call, mask, "mask")])


@builtin("rope", ("x", R), ("theta", 10000.0), ("factor", 1.0), ("low_freq", 1.0), ("high_freq", 4.0),
         ("original_ctx", 8192), ("dims", 0), ("layout", "half"), ("max_ctx", 0), ("scaling", "llama3"),
         ("beta_fast", 32.0), ("beta_slow", 1.0), ("attention_factor", 0.0), ("truncate", True),
         ("short_factor", []), ("long_factor", []))
def _rope(call, x, theta, factor, low_freq, high_freq, original_ctx, dims, layout, max_ctx, scaling,
          beta_fast, beta_slow, attention_factor, truncate, short_factor, long_factor):
    """Rotary position embedding on [..., T, hd].

    layout="half" pairs feature i with i + r/2 (rotate-half: GPT-NeoX, Llama); "interleaved" pairs
    2i with 2i+1 (GPT-J). dims=r > 0 rotates only the first r features (partial rotary; 0: all of
    them) with frequencies theta^(-2i/r). factor > 1 turns on Llama 3.1's frequency scaling
    ("llama3" rope_type) with low_freq, high_freq and original_ctx as in a checkpoint's
    rope_scaling; factor = 1 (the default) is plain RoPE and ignores the other three. scaling picks
    another rope_type of transformers' for factor > 1: "linear" (frequencies / factor), "dynamic"
    (dynamic NTK: the base grows with the run's length past original_ctx, the checkpoint's
    max_position_embeddings; no KV-cached form), "yarn" (beta_fast, beta_slow, original_ctx =
    original_max_position_embeddings, truncate; cos and sin times attention_factor, 0: derived from
    factor as transformers does) or "longrope" (Phi-3's, at any factor: short_factor and long_factor,
    r/2 numbers each, divide each frequency, the short ones while the sequence -- its largest
    position + 1 -- is at most original_ctx, the long ones past it; cos and sin times
    attention_factor, 0: sqrt(1 + ln(factor) / ln(original_ctx)), 1 for factor 1). max_ctx > 0
    declares the positions the model was trained for: `run` and `generate` refuse longer sequences
    (0: no limit declared)."""
    base = _float(call, theta, "theta")
    if not (base > 0.0 and math.isfinite(base)):
        raise call.error(f"'theta' (the rotary base) must be a finite number > 0, got {base}", theta[1])
    attrs = {"theta": base}
    n_ctx = _int(call, max_ctx, "max_ctx", 0)
    if n_ctx:
        attrs["max_ctx"] = n_ctx
    t = _tensor(call, x)
    r = _int(call, dims, "dims", 0)
    if r:
        hd = _static_last(call, t)
        if r % 2 or r > hd:
            raise call.error(f"'dims' must be even and at most the head size {hd}, got {r}", dims[1])
        if r < hd:
            attrs["dims"] = r
    if _choice(call, layout, "layout", ("half", "interleaved")) == "interleaved":
        attrs["interleaved"] = True
    f = _float(call, factor, "factor")
    if f < 1.0:
        raise call.error(f"'factor' must be at least 1.0 (1.0 is no scaling), got {f}", factor[1])
    kind = _choice(call, scaling, "scaling", ROPE_TYPES)
    if kind == "longrope":  # its factor lists apply at any factor
        attrs["scaling"] = _longrope(call, r or _static_last(call, t), f, original_ctx, attention_factor,
                                     short_factor, long_factor)
        attrs["rope_type"] = kind
    elif f > 1.0 and kind != "llama3":
        ctx = _int(call, original_ctx, "original_ctx", 1)
        if kind == "linear":
            attrs["scaling"] = (f,)
        elif kind == "dynamic":
            attrs["scaling"] = (f, ctx)
        else:
            fast, slow = _float(call, beta_fast, "beta_fast"), _float(call, beta_slow, "beta_slow")
            if not 0.0 < slow < fast:
                raise call.error(f"yarn needs 0 < beta_slow < beta_fast, got beta_fast={fast}, beta_slow={slow}",
                                 beta_fast[1] or beta_slow[1])
            if not base > 1.0:  # its correction dimensions divide by log(theta)
                raise call.error(f"yarn needs 'theta' (the rotary base) > 1, got {base}", theta[1])
            af = _float(call, attention_factor, "attention_factor")
            if af < 0.0:
                raise call.error(f"'attention_factor' must be 0 (derived) or more, got {af}", attention_factor[1])
            attrs["scaling"] = (f, fast, slow, ctx, af, int(_bool(call, truncate, "truncate")))
        attrs["rope_type"] = kind
    elif f > 1.0:
        low, high = _float(call, low_freq, "low_freq"), _float(call, high_freq, "high_freq")
        if not 0.0 < low <= high:  # equal bounds (Llama 4 Scout): no band between, nothing interpolated
            raise call.error(f"rope scaling needs 0 < low_freq <= high_freq, got low_freq={low}, high_freq={high}",
                             high_freq[1] or low_freq[1])
        attrs["scaling"] = (f, low, high, _int(call, original_ctx, "original_ctx", 1))
    return call.emit("rope", [t], attrs)


def _longrope(call, r, factor, original_ctx, attention_factor, short_factor, long_factor) -> tuple:
    """longrope's attribute (numerics.longrope_parts): original_ctx, the cos/sin factor (given, or
    transformers' sqrt(1 + ln(factor) / ln(original_ctx)), 1 for factor 1), the short factors then
    the long ones, r/2 positive numbers each."""
    ctx = _int(call, original_ctx, "original_ctx", 2)  # ln(original_ctx) divides
    lists = []
    for arg, what in ((short_factor, "short_factor"), (long_factor, "long_factor")):
        value, pos = arg
        if not isinstance(value, (list, tuple)) or len(value) != r // 2 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value):
            got = f"{len(value)} values" if isinstance(value, (list, tuple)) else describe(value)
            raise call.error(f"longrope needs '{what}': a list of {r // 2} numbers > 0 (one per frequency of the "
                             f"{r} rotated features), got {got}", pos)
        lists.append(tuple(float(v) for v in value))
    af = _float(call, attention_factor, "attention_factor")
    if af < 0.0:
        raise call.error(f"'attention_factor' must be 0 (derived) or more, got {af}", attention_factor[1])
    if af == 0.0:
        af = math.sqrt(1 + math.log(factor) / math.log(ctx)) if factor > 1.0 else 1.0
    return (ctx, af, *lists[0], *lists[1])


MAX_EXPERTS = 512  # experts one router (topk_gates) may choose among: Kimi K2's 384 is the most published


@builtin("topk_gates", ("logits", R), ("k", R), ("normalize", True))
def _topk_gates(call, logits, k, normalize):
    """Mixture-of-experts routing: softmax over the top-k logits, zero elsewhere, shape kept [..., E];
    normalize=false: the softmax over all logits, kept at the top k (Qwen-MoE's norm_topk_prob=false)."""
    attrs = {"k": _int(call, k, "k", 1)}
    if not _bool(call, normalize, "normalize"):
        attrs["normalize"] = False
    t = _tensor(call, logits, "logits")
    if t.type.rank and dims.is_static(t.type.shape[-1]) and int(t.type.shape[-1]) > MAX_EXPERTS:
        raise call.error(f"{int(t.type.shape[-1]):,} experts is past the budget of {MAX_EXPERTS} per router (the "
                         f"most a published model routes over is 384): each expert adds its own subgraph, and "
                         f"onnxruntime's start-up grows faster than their count (2 layers of 1,000 did not "
                         f"start generating in 240 s)", logits[1])
    return call.emit("topk_gates", [t], attrs)


@builtin("topk_indices", ("x", R), ("k", R))
def _topk_indices(call, x, k):
    """The positions of the k largest values along the last axis (a fixed size), i64 [..., k], largest
    first, ties to the lower index (torch.topk's indices; ``gather(x, topk_indices(x, k), -1)`` are the
    values). A routing step, not a mixture of experts."""
    return call.emit("topk_indices", [_topk_input(call, x, k)], {"k": _int(call, k, "k", 1)})


@builtin("topk_mask", ("x", R), ("k", R))
def _topk_mask(call, x, k):
    """True at the k largest values along the last axis (ties to the lower index), false elsewhere, x's
    shape: ``where(topk_mask(s, k), s, -inf)`` keeps the top k (what ``topk_gates(s, k) > 0.0`` stood
    for, without its softmax underflowing to 0). A routing step, not a mixture of experts."""
    return call.emit("topk_mask", [_topk_input(call, x, k)], {"k": _int(call, k, "k", 1)})


def _topk_input(call, x, k) -> Tensor:
    """x for topk_indices/topk_mask: a float tensor whose last axis is fixed and at least k."""
    t = _tensor(call, x)
    if t.type.dtype not in ("f32", "f16", "bf16"):
        raise call.error(f"top-k needs a floating-point tensor, got {t.type}", x[1])
    e = _static_last(call, t)
    n = _int(call, k, "k", 1)
    if n > e:
        raise call.error(f"k={n} is more than the last axis' {e}", k[1])
    return t


CLAMPED_SWIGLU = {"alpha": 1.702, "limit": 7.0}  # gpt-oss's (GptOssConfig swiglu_alpha, swiglu_limit)


@builtin("experts", ("x", R), ("count", R), ("top", R), ("d_ff", R), ("normalize", True), ("bias", False),
         ("router_bias", False), ("act", "swiglu"), ("alpha", 0.0), ("limit", 0.0), ("scoring", "softmax"),
         ("correction_bias", False), ("groups", 1), ("top_groups", 0), ("scale", 1.0), ("gates_on", "output"))
def _experts(call, x, count, top, d_ff, normalize, bias, router_bias, act, alpha, limit, scoring, correction_bias,
             groups, top_groups, scale, gates_on):
    """A mixture of ``count`` SwiGLU experts as one sparse node: a router (``router.weight`` [count, d],
    and with router_bias=true ``router.bias``) picks the ``top`` experts of each token, which alone run
    down(silu(gate(x)) * up(x)) (``experts.{e}.ffn.gate/up/down.weight``, the standard library moe
    block's paths) weighted by the softmax over the chosen logits (the same as "top k, then softmax over
    them"; normalize=false: the softmax over all, at the chosen). bias=true: each expert's linears have
    biases (``experts.{e}.ffn.gate/up/down.bias``); act="clamped_swiglu": gpt-oss's
    (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), with alpha and limit
    (0: gpt-oss's 1.702 and 7.0; given with act="swiglu" they are refused, not ignored). Routing
    (DeepSeek-V3, Llama 4): scoring="sigmoid": each score sigmoid(logit), the gates the chosen scores
    (normalize=true: divided by their sum + 1e-20; false: as they are); correction_bias=true: a bias
    ``router.correction_bias`` [count] added to the scores for choosing only (DeepSeek's
    e_score_correction_bias); groups=n, top_groups=m: the experts in n groups, each scored by the sum
    of its two best (bias included), only the best m groups' experts eligible; scale: the gates times
    it (routed_scaling_factor); gates_on="input": each chosen expert runs on x * gate and its output is
    summed unweighted (Llama 4). Without a correction bias or groups the top logits are chosen.
    Equal to ``moe(x, count, top, d_ff)`` for the defaults, in one IR node instead of one subgraph per
    expert, so models of 128 experts in 48 layers elaborate."""
    t = _tensor(call, x)
    e, k, f = _int(call, count, "count", 1), _int(call, top, "top", 1), _int(call, d_ff, "d_ff", 1)
    if k > e:
        raise call.error(f"top={k} is more than count={e}", top[1])
    if e > MAX_EXPERTS:
        raise call.error(f"{e:,} experts is past the budget of {MAX_EXPERTS} per router", count[1])
    d = t.type.shape[-1] if t.type.rank else None
    if d is None or not dims.is_static(d):
        raise call.error(f"input width must be a fixed size, got {t.type}")
    d = int(d)
    kind = _choice(call, act, "act", ("swiglu", "clamped_swiglu"))
    attrs = {"k": k, "experts": e, "impl": "gather"}
    for name, v in (("alpha", alpha), ("limit", limit)):
        val = _float(call, v, name)
        if kind == "swiglu" and val != 0.0:  # it would be silently unused
            raise call.error(f"'{name}' applies to act=\"clamped_swiglu\" only, not act=\"{kind}\"", v[1])
        if kind == "clamped_swiglu":
            val = val or CLAMPED_SWIGLU[name]
            if not (0.0 < val < math.inf):
                raise call.error(f"'{name}' of the clamped SwiGLU must be a finite number > 0 (0: {CLAMPED_SWIGLU[name]}), "
                                 f"got {val}", v[1])
            attrs["act"], attrs[name] = kind, val
    attrs.update(_routing_options(call, e, k, scoring, groups, top_groups, scale, gates_on))
    router = [t, call.param("router.weight", (e, d), "normal")]
    if _bool(call, router_bias, "router_bias"):
        router.append(call.param("router.bias", (e,), "zeros"))
    logits = call.emit("linear", router)
    routing = [t, logits]
    if _bool(call, correction_bias, "correction_bias"):
        routing.append(call.param("router.correction_bias", (e,), "zeros"))
        attrs["correction_bias"] = True
    with_bias = _bool(call, bias, "bias")
    weights = []
    for i in range(e):
        weights += [call.param(f"experts.{i}.ffn.gate.weight", (f, d), "normal"),
                    call.param(f"experts.{i}.ffn.up.weight", (f, d), "normal"),
                    call.param(f"experts.{i}.ffn.down.weight", (d, f), "normal")]
        if with_bias:
            weights += [call.param(f"experts.{i}.ffn.gate.bias", (f,), "zeros"),
                        call.param(f"experts.{i}.ffn.up.bias", (f,), "zeros"),
                        call.param(f"experts.{i}.ffn.down.bias", (d,), "zeros")]
    if with_bias:
        attrs["bias"] = True
    if not _bool(call, normalize, "normalize"):
        attrs["normalize"] = False
    return call.emit("sparse_moe", [*routing, *weights], attrs)


def _routing_options(call, e, k, scoring, groups, top_groups, scale, gates_on) -> dict:
    """The experts builtin's routing attributes (compiler/ops/experts.py), each checked where it is written;
    defaults leave no attribute, so a default mixture is the node it always was."""
    attrs = {}
    if _choice(call, scoring, "scoring", SCORINGS) != "softmax":
        attrs["scoring"] = scoring[0]
    if _choice(call, gates_on, "gates_on", GATES_ON) != "output":
        attrs["gates_on"] = gates_on[0]
    s = _float(call, scale, "scale")
    if not 0.0 < s < math.inf:
        raise call.error(f"'scale' (the gates' scaling factor) must be a finite number > 0, got {s}", scale[1])
    if s != 1.0:
        attrs["scale"] = s
    g, tg = _int(call, groups, "groups", 1), _int(call, top_groups, "top_groups", 0)
    if g == 1:
        if tg:  # it would be silently unused
            raise call.error("'top_groups' applies to groups > 1, not groups=1", top_groups[1])
        return attrs
    if not tg:
        raise call.error(f"groups={g} needs 'top_groups', how many groups' experts may be chosen", groups[1])
    why = group_problem(e, k, g, tg)
    if why:
        raise call.error(why, top_groups[1] if "top_groups" in why else groups[1])
    attrs["groups"], attrs["top_groups"] = g, tg
    return attrs


# ------------------------------------------------------------------ positions
@builtin("arange", ("n", R))
def _arange(call, n):
    """Positions 0..n-1 as i64 (n may be the symbolic sequence length)."""
    return call.emit("arange", [], {"n": _dim(call, n, "n")})


@builtin("sinusoidal", ("n", R), ("d", R))
def _sinusoidal(call, n, d):
    """Fixed sinusoidal position table [n, d]: sin and cos interleaved, as in the original transformer."""
    dd = _int(call, d, "d", 2)
    if dd % 2:
        raise call.error(f"'d' must be even, got {dd}", d[1])
    return call.emit("sinusoidal", [], {"n": _dim(call, n, "n"), "d": dd})


def _static_last(call, x: Tensor) -> int:
    if x.type.rank == 0 or not dims.is_static(x.type.shape[-1]):
        raise call.error(f"the last axis must be a fixed size, got {x.type}")
    return int(x.type.shape[-1])


from tessera.compiler.frontend import recurrence  # noqa: E402  (after the others: the table's order is the docs')

builtin("scan", *recurrence.PARAMS)(recurrence.scan)

__all__ = ["BUILTINS"]
