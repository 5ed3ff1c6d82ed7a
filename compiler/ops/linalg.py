"""Products: linear, matmul, embedding (a gather from a weight table) and the convolutions.

``dense`` ops are products with weights (input 1 is the weight [out, in, ...]); the cost report
counts them as the N·D² part, and memory keeps only their input for backward. Note that GPT-2's
``Conv1D`` module is a linear layer with its weight stored [in, out]: specs write it as ``linear``
(checkpoints are transposed on load), not as ``conv1d``.
"""

from __future__ import annotations

import numpy as np
import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, free, op, product
from tessera.compiler.reference.quant import BITS, blocks, dequantize, int8_product, packed_shape, zeros_shape


# ------------------------------------------------------------------ linear
def _linear_ref(x, a, ev):
    y = x[0] @ x[1].T
    return y + x[2] if len(x) == 3 else y


@op("linear", reference=_linear_ref,
    # y[..., out] = x[..., in] W^T: one multiply-add per output element and input feature
    cost=product(lambda c: c.out() * c.dim(c.type(1).shape[1])),
    saved=common.saved_weight_product, traits=("dense", "matmul_class"))
def _linear(t, a):
    """y = x W^T (+ b), W stored [out, in]."""
    x, w = t[0], t[1]
    common.need_float(x, "linear")
    if w.rank != 2:
        raise ShapeError(f"linear weight must be [out, in], got {dims.fmt_shape(w.shape)}")
    if x.rank < 1 or not dims.equal(x.shape[-1], w.shape[1]):
        raise ShapeError(f"linear expects input [..., {dims.fmt(w.shape[1])}], got {dims.fmt_shape(x.shape)}")
    if len(t) == 3 and not dims.shapes_equal(t[2].shape, (w.shape[0],)):
        raise ShapeError(f"linear bias must be [{dims.fmt(w.shape[0])}], got {dims.fmt_shape(t[2].shape)}")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


# ------------------------------------------------------------------ linear_nbits
def _linear_nbits_ref(x, a, ev):
    zp = a.get("zero_points", 0) + a.get("block_mins", 0)  # the inputs before the bias, past the scales
    w = dequantize(x[1], x[2], a["bits"], a["block_size"], a["K"], x[3] if zp else None)
    if a.get("block_mins", 0):  # an offset per block (a GGUF file's Q4_1 min): w + mins, block by block
        w = w + np.repeat(x[4].astype(np.float32), a["block_size"], axis=1)[:, :a["K"]]
    y = (x[0].astype(np.float32) @ w.T).astype(x[0].dtype)
    return y + x[3 + zp] if len(x) == 4 + zp else y


@op("linear_nbits", reference=_linear_nbits_ref,
    # the same products as the linear it replaces: y[..., N] = x[..., K] W^T
    cost=product(lambda c: c.out() * c.attrs["K"]),
    saved=common.saved_weight_product, traits=("dense", "matmul_class", "quantized"))
def _linear_nbits(t, a):
    """y = x W^T (+ b) with W [N, K] quantised block-wise to ``bits`` (compiler/reference/quant.py):
    input 1 the packed uint8 [N, blocks, block_size*bits/8], input 2 the scales [N, blocks]; with
    ``zero_points`` 1 (asymmetric blocks, the int4-asym scheme) input 3 the packed uint8 zero points
    [N, ceil(blocks * bits / 8)] and the bias after them. ``accuracy_level`` 4 lets onnxruntime
    quantise x to int8 per block inside the product; the reference computes the product in fp32
    (the test tolerances cover the difference). With ``block_mins`` 1 (zero points too) input 4 is an
    offset per block, f32 [N, blocks], added to every weight of its block: a GGUF file's Q4_1 or Q4_K
    min (compiler/passes/stored_codes.py); the lowering adds x's block sums times the offsets to
    MatMulNBits' product, so the kernel reads the file's codes as they are."""
    x, packed, scales = t[0], t[1], t[2]
    mins = a.get("block_mins", 0)
    if mins not in (0, 1) or (mins and not a.get("zero_points", 0)):
        raise ShapeError(f"linear_nbits block_mins must be 0, or 1 with zero_points 1, got {mins!r}")
    if mins and (len(t) < 5 or not dims.shapes_equal(t[4].shape, (a["N"], blocks(a["K"], a["block_size"])))
                 or t[4].dtype != x.dtype):
        raise ShapeError(f"linear_nbits block mins must be {x.dtype}[{a['N']}, {blocks(a['K'], a['block_size'])}], "
                         f"got {t[4] if len(t) > 4 else 'none'}")
    zp = a.get("zero_points", 0) + mins  # the inputs past the scales before the bias
    common.need_float(x, "linear_nbits")
    bits, block, k, n = a["bits"], a["block_size"], a["K"], a["N"]
    if a.get("accuracy_level", 0) not in (0, 4):
        raise ShapeError(f"linear_nbits accuracy_level must be 0 (fp32) or 4 (int8 activations), got {a['accuracy_level']}")
    if bits not in BITS:
        raise ShapeError(f"linear_nbits bits must be one of {BITS}, got {bits}")
    if block < 16 or block & (block - 1):
        raise ShapeError(f"linear_nbits block_size must be a power of two >= 16, got {block}")
    if packed.dtype != "u8" or not dims.shapes_equal(packed.shape, packed_shape(n, k, bits, block)):
        raise ShapeError(f"linear_nbits packed weight must be u8{list(packed_shape(n, k, bits, block))}, got {packed}")
    if not dims.shapes_equal(scales.shape, (n, blocks(k, block))) or scales.dtype != x.dtype:
        raise ShapeError(f"linear_nbits scales must be {x.dtype}[{n}, {blocks(k, block)}], got {scales}")
    if x.rank < 1 or not dims.equal(x.shape[-1], k):
        raise ShapeError(f"linear_nbits expects input [..., {k}], got {dims.fmt_shape(x.shape)}")
    if a.get("zero_points", 0) not in (0, 1):
        raise ShapeError(f"linear_nbits zero_points must be 0 or 1, got {a.get('zero_points')!r}")
    if zp and (len(t) < 4 or t[3].dtype != "u8" or not dims.shapes_equal(t[3].shape, zeros_shape(n, k, bits, block))):
        raise ShapeError(f"linear_nbits zero points must be u8{list(zeros_shape(n, k, bits, block))}, got "
                         f"{t[3] if len(t) > 3 else 'none'}")
    if len(t) > 4 + zp:
        raise ShapeError(f"linear_nbits takes at most {4 + zp} inputs, got {len(t)}")
    if len(t) == 4 + zp and not dims.shapes_equal(t[3 + zp].shape, (n,)):
        raise ShapeError(f"linear_nbits bias must be [{n}], got {dims.fmt_shape(t[3 + zp].shape)}")
    return [TensorType(x.dtype, x.shape[:-1] + (dims.dim(n),))]


# ------------------------------------------------------------------ linear_int8
def _linear_int8_ref(x, a, ev):
    y = int8_product(x[0], x[1], x[2]).astype(x[0].dtype)
    return y + x[3] if len(x) == 4 else y


@op("linear_int8", reference=_linear_int8_ref,
    # the same products as the linear it replaces: y[..., N] = x[..., K] W^T
    cost=product(lambda c: c.out() * c.dim(c.type(1).shape[1])),
    saved=common.saved_weight_product, traits=("dense", "matmul_class", "quantized"))
def _linear_int8(t, a):
    """y = x W^T (+ b) in integers (the w8a8 scheme, compiler/passes/quantize.py): input 1 W [N, K] as
    int8, one symmetric scale per output row (input 2, [N]); at run time each row of x is quantised
    to int8 with a scale of its own (compiler/reference/quant.py says how, and the reference computes
    exactly that), so a row's result does not depend on the other rows."""
    x, q, scales = t[0], t[1], t[2]
    common.need_float(x, "linear_int8")
    if q.dtype != "i8" or q.rank != 2:
        raise ShapeError(f"linear_int8 weight must be i8[N, K], got {q}")
    n, k = q.shape
    if scales.dtype != "f32" or not dims.shapes_equal(scales.shape, (n,)):
        raise ShapeError(f"linear_int8 scales must be f32[{dims.fmt(n)}], got {scales}")
    if x.dtype != "f32":
        raise ShapeError(f"linear_int8 takes f32 activations (onnxruntime's integer products are fp32 around), got {x}")
    if x.rank < 1 or not dims.equal(x.shape[-1], k):
        raise ShapeError(f"linear_int8 expects input [..., {dims.fmt(k)}], got {dims.fmt_shape(x.shape)}")
    if len(t) == 4 and not dims.shapes_equal(t[3].shape, (n,)):
        raise ShapeError(f"linear_int8 bias must be [{dims.fmt(n)}], got {dims.fmt_shape(t[3].shape)}")
    return [TensorType(x.dtype, x.shape[:-1] + (n,))]


# ------------------------------------------------------------------ matmul
@op("matmul", reference=lambda x, a, ev: np.matmul(x[0], x[1]),
    # [..., m, k] @ [..., k, n]: one per output element and inner index
    cost=product(lambda c: c.out() * c.dim(c.type(0).shape[-1])),
    saved=common.saved_product, traits=("matmul_class",))
def _matmul(t, a):
    """Batched matrix product over the last two axes."""
    x, y = t
    common.same_dtype(x, y, "matmul")
    if x.rank < 2 or y.rank < 2:
        raise ShapeError(f"matmul needs tensors of rank >= 2, got {dims.fmt_shape(x.shape)} and {dims.fmt_shape(y.shape)}")
    if not dims.equal(x.shape[-1], y.shape[-2]):
        raise ShapeError(f"matmul inner dimensions differ: {dims.fmt_shape(x.shape)} @ {dims.fmt_shape(y.shape)}")
    batch = dims.broadcast(x.shape[:-2], y.shape[:-2])
    if batch is None:
        raise ShapeError(f"matmul batch dimensions do not broadcast: {dims.fmt_shape(x.shape)} @ {dims.fmt_shape(y.shape)}")
    return [TensorType(x.dtype, batch + (x.shape[-2], y.shape[-1]))]


# ------------------------------------------------------------------ embedding
@op("embedding", reference=lambda x, a, ev: x[1][x[0]],
    cost=free(),          # a gather: no arithmetic
    saved=(0,))           # the ids, to scatter the gradient into the table
def _embedding(t, a):
    """Rows of a [vocab, d] table (input 1) picked by integer ids (input 0)."""
    ids, w = t
    if ids.dtype not in ("i64", "i32"):
        raise ShapeError(f"embedding ids must be integers, got {ids}")
    return [TensorType(w.dtype, ids.shape + (w.shape[1],))]


def _embedding_nbits_ref(x, a, ev):
    ids = np.asarray(x[0])
    rows = ids.reshape(-1)
    zeros = x[3][rows] if a.get("zero_points", 0) else None  # 8-bit zero points: one byte a block, unpacked
    w = dequantize(x[1][rows], x[2][rows], a["bits"], a["block_size"], a["K"], zeros)
    return w.astype(x[2].dtype).reshape(ids.shape + (a["K"],))


@op("embedding_nbits", reference=_embedding_nbits_ref,
    cost=free(),          # a gather and one multiply per element: no products
    saved=(0,))
def _embedding_nbits(t, a):
    """Rows of a [vocab, K] table stored block-quantised at 8 bits, picked by integer ids (input 0) and
    dequantised: input 1 the codes uint8 [vocab, blocks, block_size] (MatMulNBits' layout at 8 bits,
    compiler/reference/quant.py), input 2 the scales [vocab, blocks] (the output's float type); with
    ``zero_points`` 1 input 3 the zero points uint8 [vocab, blocks], else 128. Why: the table of a
    small-vocabulary-heavy model (SmolLM2: 49,152 x 576) is most of its bytes once the linears are
    int4; the same codes are a tied head's at 8 bits, so the two share them (passes/quantize.py)."""
    ids, codes, scales = t[0], t[1], t[2]
    bits, block, k = a["bits"], a["block_size"], a["K"]
    zp = a.get("zero_points", 0)
    if ids.dtype not in ("i64", "i32"):
        raise ShapeError(f"embedding_nbits ids must be integers, got {ids}")
    if bits != 8:
        raise ShapeError(f"embedding_nbits stores 8-bit codes, got bits {bits!r}")
    if block < 16 or block & (block - 1):
        raise ShapeError(f"embedding_nbits block_size must be a power of two >= 16, got {block}")
    vocab = codes.shape[0] if codes.rank == 3 else None
    if codes.dtype != "u8" or vocab is None or not dims.shapes_equal(codes.shape, packed_shape(vocab, k, bits, block)):
        raise ShapeError(f"embedding_nbits codes must be u8[vocab, {blocks(k, block)}, {block}], got {codes}")
    if scales.dtype not in ("f32", "f16", "bf16") or not dims.shapes_equal(scales.shape, (vocab, blocks(k, block))):
        raise ShapeError(f"embedding_nbits scales must be float[{dims.fmt(vocab)}, {blocks(k, block)}], got {scales}")
    if zp not in (0, 1) or len(t) != 3 + zp:
        raise ShapeError(f"embedding_nbits takes ids, codes, scales and, with zero_points 1, zero points: "
                         f"zero_points {zp!r}, {len(t)} inputs")
    if zp and (t[3].dtype != "u8" or not dims.shapes_equal(t[3].shape, (vocab, blocks(k, block)))):
        raise ShapeError(f"embedding_nbits zero points must be u8[{dims.fmt(vocab)}, {blocks(k, block)}], got {t[3]}")
    return [TensorType(scales.dtype, ids.shape + (dims.dim(k),))]


# ------------------------------------------------------------------ convolutions
def _conv_len(what: str, size, k: int, stride: int, pad: int, exact: bool):
    """Output length of a convolution along one axis: (size + 2·pad - k) / stride + 1, rounded
    down as PyTorch and ONNX do (``exact`` demands no remainder, as conv2d's patches do)."""
    span = size + 2 * pad - k
    if dims.is_static(span):
        if int(span) < 0:
            raise ShapeError(f"{what}: input length {dims.fmt(size)}"
                             f"{f' plus padding 2·{pad}' if pad else ''} is shorter than the kernel {k}")
        if exact and int(span) % stride:
            raise ShapeError(f"{what}: size {dims.fmt(size)} minus kernel {k} is not a multiple of stride {stride}")
        return sympy.Integer(int(span) // stride + 1)
    q = sympy.cancel(span / stride)
    if not q.is_integer:
        if exact:
            raise ShapeError(f"{what}: size {dims.fmt(size)} minus kernel {k} is not a multiple of stride {stride}")
        raise ShapeError(f"{what}: length {dims.fmt(size)}{f' + 2·{pad}' if pad else ''} - kernel {k} is not a "
                         f"multiple of stride {stride} for every value of it; use a fixed length")
    return q + 1


def _conv_bias(what, t, w):
    if len(t) == 3 and not dims.shapes_equal(t[2].shape, (w.shape[0],)):
        raise ShapeError(f"{what} bias must be [{dims.fmt(w.shape[0])}], got {dims.fmt_shape(t[2].shape)}")


def _conv2d_ref(x, a, ev):
    x_, w = x[0], x[1]
    k, s = w.shape[-1], a["stride"]
    win = np.lib.stride_tricks.sliding_window_view(x_, (k, k), axis=(2, 3))[:, :, ::s, ::s]
    y = np.einsum("bchwij,ocij->bohw", win, w, optimize=True)
    return y + x[2][None, :, None, None] if len(x) == 3 else y


@op("conv2d", reference=_conv2d_ref,
    # one per output element, input channel and kernel tap
    cost=product(lambda c: c.out() * c.dim(c.type(1).shape[1]) * (c.attrs["kernel"] * c.attrs["kernel"])),
    saved=common.saved_weight_product, traits=("dense", "matmul_class", "conv"))
def _conv2d(t, a):
    """2-D convolution without padding: x [B, C, H, W], weight [out, C, k, k] -> [B, out, H', W']."""
    x, w = t[0], t[1]
    if x.rank != 4:
        raise ShapeError(f"conv2d expects [B, C, H, W], got {dims.fmt_shape(x.shape)}")
    if not dims.equal(x.shape[1], w.shape[1]):
        raise ShapeError(f"conv2d expects {dims.fmt(w.shape[1])} input channels, got {dims.fmt(x.shape[1])}")
    k, s = a["kernel"], a["stride"]
    out = [_conv_len("conv2d", d, k, s, 0, exact=True) for d in x.shape[2:]]
    return [TensorType(x.dtype, (x.shape[0], w.shape[0], *out))]


def _conv1d_ref(x, a, ev):
    x_, w = x[0], x[1]
    k, s, p = w.shape[-1], a["stride"], a["padding"]
    if p:
        x_ = np.pad(x_, ((0, 0), (0, 0), (p, p)))
    win = np.lib.stride_tricks.sliding_window_view(x_, k, axis=2)[:, :, ::s]  # [B, C, L', k]
    g = a.get("groups", 1)  # channels in g groups, each convolved with its own out/g filters
    b_, c, n = win.shape[:3]
    win = win.reshape(b_, g, c // g, n, k)
    y = np.einsum("bgclk,gock->bgol", win, w.reshape(g, w.shape[0] // g, c // g, k), optimize=True)
    y = y.reshape(b_, w.shape[0], n)
    return y + x[2][None, :, None] if len(x) == 3 else y


@op("conv1d", reference=_conv1d_ref,
    # one per output element, input channel and kernel tap
    cost=product(lambda c: c.out() * c.dim(c.type(1).shape[1]) * c.attrs["kernel"]),
    saved=common.saved_weight_product, traits=("dense", "matmul_class", "conv"))
def _conv1d(t, a):
    """1-D convolution with zero padding (Whisper's audio front end): x [B, C, L], weight [out, C / groups, k]
    -> [B, out, (L + 2·padding - k) // stride + 1]; attrs["groups"] (absent: 1) splits the channels
    into groups convolved apart (groups = C = out: depthwise, Mamba's)."""
    x, w = t[0], t[1]
    k, s, p = a["kernel"], a["stride"], a["padding"]
    groups = a.get("groups", 1)
    if not isinstance(groups, int) or groups < 1:
        raise ShapeError(f"conv1d groups must be 1 or more, got {groups!r}")
    if groups > 1:
        if not (dims.is_static(x.shape[1]) and dims.is_static(w.shape[0])) or int(x.shape[1]) % groups \
                or int(w.shape[0]) % groups:
            raise ShapeError(f"conv1d with {groups} groups needs input channels and outputs that are multiples "
                             f"of {groups}, got {dims.fmt(x.shape[1])} and {dims.fmt(w.shape[0])}")
        if not (w.rank == 3 and dims.equal(w.shape[1], int(x.shape[1]) // groups)):
            raise ShapeError(f"conv1d weight must be [out, {int(x.shape[1]) // groups}, {k}] with {groups} groups, "
                             f"got {dims.fmt_shape(w.shape)}")
        x = TensorType(x.dtype, (x.shape[0], w.shape[1], x.shape[2]))  # the per-group channels, checked below
    if x.rank != 3:
        raise ShapeError(f"conv1d expects [B, C, L], got {dims.fmt_shape(x.shape)}")
    if w.rank != 3 or not (dims.is_static(w.shape[2]) and int(w.shape[2]) == k):
        raise ShapeError(f"conv1d weight must be [out, in, {k}], got {dims.fmt_shape(w.shape)}")
    if not dims.equal(x.shape[1], w.shape[1]):
        raise ShapeError(f"conv1d expects {dims.fmt(w.shape[1])} input channels, got {dims.fmt(x.shape[1])} "
                         f"(input {dims.fmt_shape(x.shape)})")
    if s < 1 or p < 0:
        raise ShapeError(f"conv1d needs stride >= 1 and padding >= 0, got stride {s}, padding {p}")
    common.need_float(x, "conv1d")
    common.same_dtype(x, w, "conv1d")
    _conv_bias("conv1d", t, w)
    return [TensorType(x.dtype, (x.shape[0], w.shape[0], _conv_len("conv1d", x.shape[2], k, s, p, exact=False)))]
