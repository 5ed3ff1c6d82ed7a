"""ONNX lowerings of the products (compiler/ops/linalg.py): linear (MatMul on weights written
[in, out]), the block-quantised linear (com.microsoft MatMulNBits), the int8 linear (activations
quantised per row, com.microsoft MatMulIntegerToFloat; its weight written [in, out] too), matmul,
embedding, convolutions."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto


def _linear(L):
    # A weight only linears read is written [in, out] (builder.transposed_weights), so MatMul takes it
    # as it lies; a Transpose of the [out, in] parameter would be folded by onnxruntime into a second
    # copy of the weight. Any other weight (a computed one, GPT-2's head tied to the token table) is
    # transposed here.
    w = L.x[1]
    wt = w if w in L.b.transposed else L.b.node("Transpose", [w], perm=[1, 0])[0]
    if len(L.x) == 3:
        mm = L.b.node("MatMul", [L.x[0], wt])[0]
        L.emit("Add", [mm, L.x[2]])
    else:
        L.emit("MatMul", [L.x[0], wt])



def _linear_nbits(L):
    zp = L.a.get("zero_points", 0)
    mins = L.a.get("block_mins", 0)
    inputs = list(L.x[:3 + zp])  # MatMulNBits' inputs: A, B, scales, zero_points, g_idx, bias
    if len(L.x) == 4 + zp + mins:
        inputs += ([] if zp else [""]) + ["", L.x[3 + zp + mins]]
    attrs = dict(domain="com.microsoft", K=L.a["K"], N=L.a["N"], bits=L.a["bits"], block_size=L.a["block_size"],
                 accuracy_level=L.a.get("accuracy_level", 0))
    if not mins:
        L.emit("MatMulNBits", inputs, **attrs)
        return
    # w = scale * u + offset per block: x W^T = MatMulNBits(x; u, scale, zero points 0) + (x's block sums)
    # (offsets [N, blocks])^T. K is a whole number of blocks (a GGUF row is); x's rank is known.
    b, x = L.b, L.x[0]
    k, block = L.a["K"], L.a["block_size"]
    assert k % block == 0, f"linear_nbits block_mins needs whole blocks, K {k} block {block}"
    rank = len(L.t_in[0].shape)
    product = b.node("MatMulNBits", inputs, **attrs)[0]
    split = b.node("Reshape", [x, b.i64([0] * (rank - 1) + [k // block, block])])[0]
    sums = b.node("ReduceSum", [split, b.i64([-1])], keepdims=0)[0]
    offsets = b.node("MatMul", [sums, b.node("Transpose", [L.x[3 + zp]], perm=[1, 0])[0]])[0]
    L.emit("Add", [product, offsets])



def _linear_int8(L):
    """x quantised per row (compiler/reference/quant.py quantize_activation_rows: scale = max|x_row| / 127,
    q = round(x / scale) + 128 as uint8), MatMulIntegerToFloat (u8 x u8 in onnxruntime's integer GEMM,
    the weight's int8 values + 128 as uint8, both zero points 128; times W's row scales), times x's row
    scale, + bias. Not DynamicQuantizeMatMul: its one scale for the whole tensor would make each row's
    result depend on the other rows of the batch.

    Why u8 x u8 and not u8 x s8 (onnxruntime's fastest form where the CPU has VNNI): on a CPU with AVX2
    and no VNNI, its u8 x s8 kernel adds pairs of products in 16 bits (vpmaddubsw), which saturates
    once two adjacent products pass 32,767 -- an activation near 255 times a weight near 127 does --
    and the linear is silently wrong (measured on an AMD EPYC with AVX2 only: integer sums off by
    thousands; tests/compiler/test_quantize_w8a8.py). Its u8 x u8 kernel widens to 16 bits before
    multiplying and is exact there, at 0.9-1.4x u8 x s8's time (s8 x s8, also exact, took 9 ms for
    what u8 x u8 does in 0.19: bench/int8_gemm.py). The compiled file does not know which CPU will
    run it, so it takes the form that is exact on all of them. The weight's shift is a Cast/Add over
    an initializer: onnxruntime folds it once, when the session is made."""
    from tessera.compiler.reference.quant import ACTIVATION_ZERO_POINT, INV_127, ROW_SCALE_FLOOR, WEIGHT_ZERO_POINT

    b, x = L.b, L.x[0]
    assert L.x[1] in b.transposed, f"linear_int8's weight {L.x[1]} must be written [in, out]"
    peak = b.node("ReduceMax", [b.node("Abs", [x])[0], b.i64([-1])], keepdims=1)[0]
    scale = b.node("Max", [b.node("Mul", [peak, b.const(INV_127, "inv127")])[0],
                           b.const(ROW_SCALE_FLOOR, "row_scale_floor")])[0]
    rounded = b.node("Round", [b.node("Div", [x, scale])[0]])[0]
    shifted = b.node("Add", [rounded, b.const(np.float32(ACTIVATION_ZERO_POINT), "f128")])[0]
    xq = b.node("Cast", [shifted], to=TensorProto.UINT8)[0]
    wide = b.node("Cast", [L.x[1]], to=TensorProto.INT16)[0]
    wq = b.node("Cast", [b.node("Add", [wide, b.const(np.int16(WEIGHT_ZERO_POINT), "i16_128")])[0]],
                to=TensorProto.UINT8)[0]
    product = b.node("MatMulIntegerToFloat",
                     [xq, wq, b.const(np.float32(1), "one"), L.x[2], b.const(np.uint8(ACTIVATION_ZERO_POINT), "u128"),
                      b.const(np.uint8(WEIGHT_ZERO_POINT), "w_u128")],
                     domain="com.microsoft")[0]
    if len(L.x) == 4:  # the bias after x's row scale (MatMulIntegerToFloat's own bias input would be scaled by it)
        L.emit("Add", [b.node("Mul", [product, scale])[0], L.x[3]])
    else:
        L.emit("Mul", [product, scale])



def _conv(L, **attrs):
    """One Conv; in bf16 in fp32 between casts (Conv takes bfloat16 from opset 22; the exporter writes 21)."""
    if L.t_in[0].dtype != "bf16":
        return L.emit("Conv", L.x, **attrs)
    b = L.b
    wide = b.node("Conv", [b.node("Cast", [x], to=b.onnx_type("f32"))[0] for x in L.x], **attrs)[0]
    L.emit("Cast", [wide], to=b.onnx_type("bf16"))


def _conv2d(L):
    k = L.a["kernel"]
    _conv(L, kernel_shape=[k, k], strides=[L.a["stride"], L.a["stride"]])



def _conv1d(L):
    p = L.a["padding"]
    _conv(L, kernel_shape=[L.a["kernel"]], strides=[L.a["stride"]], pads=[p, p], group=L.a.get("groups", 1))



def _embedding_nbits(L):
    """com.microsoft GatherBlockQuantized (CPU and CUDA kernels for uint8 codes) over the codes as they
    lie, [vocab, blocks, block] (a tied head's MatMulNBits reads the same initializer), blocks along
    the last axis: the scales (and zero points) [vocab, blocks] get that axis back as [vocab, blocks, 1]
    (a view, not a copy of the codes), and the gathered [..., blocks, block] is reshaped to [..., K]
    (sliced where the last block is padded)."""
    b = L.b
    block, k = L.a["block_size"], L.a["K"]
    axis = b.i64([2])
    inputs = [L.x[1], L.x[0], b.node("Unsqueeze", [L.x[2], axis])[0]]
    if L.a.get("zero_points", 0):
        inputs.append(b.node("Unsqueeze", [L.x[3], axis])[0])
    rows = b.node("GatherBlockQuantized", inputs, domain="com.microsoft", bits=8, block_size=block,
                  gather_axis=0, quantize_axis=2)[0]
    rank = len(L.t_in[0].shape)
    padded = -(-k // block) * block
    if padded == k:
        L.emit("Reshape", [rows, b.i64([0] * rank + [k])])
        return
    flat = b.node("Reshape", [rows, b.i64([0] * rank + [padded])])[0]
    L.emit("Slice", [flat, b.i64([0]), b.i64([k]), b.i64([-1])])


LOWERINGS = {
    "linear": _linear,
    "linear_nbits": _linear_nbits,
    "linear_int8": _linear_int8,
    "matmul": lambda L: L.emit("MatMul", L.x),
    "embedding": lambda L: L.emit("Gather", [L.x[1], L.x[0]], axis=0),
    "embedding_nbits": _embedding_nbits,
    "conv2d": _conv2d,
    "conv1d": _conv1d,
}
