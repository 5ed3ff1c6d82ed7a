"""Block-wise weight quantisation (int8, int4) in onnxruntime's MatMulNBits layout, in numpy.

Why here: the quantisation pass (compiler/passes/quantize.py) declares the packed weights and
their scales as parameters derived from a float weight; the exporter and the interpreter read
them through ``ParamValues``; the op's reference dequantises them (``dequantize``).

Layout (com.microsoft.MatMulNBits, onnxruntime 1.31): a linear weight W [N, K] (Tessera's
[out, in]) is cut along K into ceil(K / block) blocks, the last one padded with zeros. Each block
is quantised symmetrically: scale = max|w| / (2^(bits-1) - 1), q = round(w / scale) clipped to
[-2^(bits-1), 2^(bits-1) - 1], stored as the unsigned q + 2^(bits-1) (MatMulNBits' default zero
point when the zero_points input is absent). ``packed`` is uint8 [N, blocks, block * bits / 8]: for
int4 two values a byte, the even index in the low nibble; ``scales`` is float32 [N, blocks].
Dequantised: w = (q_unsigned - 2^(bits-1)) * scale.

Asymmetric blocks (the ``int4-asym`` scheme, ``quantize_zp``): each block has an integer zero point
zp in [0, 2^bits - 1] (MatMulNBits' zero_points input, uint8 [N, ceil(blocks * bits / 8)], for 4 bits
two a byte, the even block in the low nibble) besides its scale, w = (q - zp) * scale with q in
[0, 2^bits - 1]: the whole range of levels covers [min, max] of the block rather than
[-max|w|, max|w|], and the scale is searched per block (``SEARCH`` candidate ranges around
(max - min) / (2^bits - 1), each rounded and its scale refit by least squares ``ROUNDS`` times, the
levels and scale of the smallest squared error kept; llama.cpp's make_qkx2_quants does the like for its K-quants).

The ``w8a8`` scheme (``linear_int8``): W [N, K] quantised per output row, symmetrically, to int8
[N, K] with one float32 scale per row (``quantize_rows``); at run time each row of the activations
is quantised likewise (``quantize_activation_rows``) and onnxruntime multiplies in integers
(com.microsoft.MatMulIntegerToFloat; ``int8_product``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

BITS = (4, 8)
ROWS = 0  # a derived parameter's block size meaning one scale per output row (quantize_rows)


def blocks(k: int, block: int) -> int:
    return -(-k // block)


def packed_shape(n: int, k: int, bits: int, block: int) -> tuple[int, int, int]:
    return (n, blocks(k, block), block * bits // 8)


def quantize(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed uint8 [N, blocks, block*bits/8], scales float32 [N, blocks]) of a float weight [N, K]."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    n, k = w.shape
    nb = blocks(k, block)
    w = np.asarray(w, dtype=np.float32)
    if nb * block != k:
        w = np.concatenate([w, np.zeros((n, nb * block - k), np.float32)], axis=1)
    w = w.reshape(n, nb, block)
    qmax = 2 ** (bits - 1) - 1
    scales = np.abs(w).max(axis=2) / np.float32(qmax)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.rint(w / safe[..., None])
    np.clip(q, -qmax - 1, qmax, out=q)
    u = (q + 2 ** (bits - 1)).astype(np.uint8)
    if bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    return np.ascontiguousarray(u), scales.astype(np.float32)


def dequantize(packed: np.ndarray, scales: np.ndarray, bits: int, block: int, k: int,
               zeros: np.ndarray | None = None) -> np.ndarray:
    """The float weight [N, K] that ``packed`` and ``scales`` (and the packed zero points ``zeros``,
    else MatMulNBits' default 2^(bits-1)) stand for."""
    if bits == 4:
        u = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], packed.shape[1], block)
    else:
        u = packed
    zp = np.float32(2 ** (bits - 1)) if zeros is None else \
        unpack_zeros(zeros, bits, packed.shape[1]).astype(np.float32)[..., None]
    w = (u.astype(np.float32) - zp) * scales[..., None].astype(np.float32)
    return w.reshape(packed.shape[0], -1)[:, :k]


def zeros_shape(n: int, k: int, bits: int, block: int) -> tuple[int, int]:
    """MatMulNBits' zero points of a weight [N, K]: uint8, ``bits`` each, a row's blocks packed in bytes."""
    return (n, -(-blocks(k, block) * bits // 8))


def pack_zeros(zp: np.ndarray, bits: int) -> np.ndarray:
    """Zero points [N, blocks] (integers in [0, 2^bits)) packed as MatMulNBits reads them."""
    zp = zp.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(zp)
    if zp.shape[1] % 2:
        zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray(zp[:, 0::2] | (zp[:, 1::2] << 4))


def centre_zero_points(scales: np.ndarray, mins: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """A block-with-offset weight w = scale * u + offset (a GGUF file's Q4_1, Q5_1, Q4_K, Q5_K: zero point
    0, u in [0, 2^bits)) rewritten with the integer zero point nearest -offset / scale (clipped to the
    codes' range) and the offset left over: w = scale * (u - zp) + (offset + zp * scale), the same weight
    to one rounding of the fp32 offset. Returns (zero points [N, blocks] uint8, offsets [N, blocks] f32).

    Why: MatMulNBits' int8 activations (accuracy_level 4) round x per block; the kernel multiplies the
    rounded x by (u - zp) and the offsets are added from x's exact block sums (compiler/ops/linalg.py
    ``block_mins``), so the rounding's error is scale * sum((x_rounded - x) * (u - zp)). With zp 0 every
    u - zp is >= 0 (7.5 on average at 4 bits) and the errors of a block add up instead of cancelling;
    centred, (u - zp) has about the weights' own sign and size, as in llama.cpp's dot products, where the
    rounded x multiplies the whole weight (docs/benchmarks/log.md, "One row, one kernel")."""
    scales = np.asarray(scales, np.float32)
    mins = np.asarray(mins, np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    zp = np.where(scales == 0, 0, np.clip(np.rint(-mins / safe), 0, 2 ** bits - 1)).astype(np.uint8)
    return zp, (mins + zp.astype(np.float32) * scales).astype(np.float32)


def unpack_zeros(packed: np.ndarray, bits: int, nb: int) -> np.ndarray:
    if bits == 8:
        return packed[:, :nb]
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)[:, :nb]


ROUNDS = 2  # roundings and least-squares refits of each candidate's scale (quantize_zp)
SEARCH = 9  # candidate ranges a block's scale is searched over (quantize_zp)


def quantize_zp(w: np.ndarray, bits: int, block: int, search: int = SEARCH) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray]:
    """(packed uint8 [N, blocks, block*bits/8], scales float32 [N, blocks], zero points packed
    (``zeros_shape``)) of a float weight [N, K]: asymmetric blocks, w ~ (q - zp) * scale with
    q, zp in [0, 2^bits - 1], the scale searched per block for the least squared error."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    n, k = w.shape
    nb = blocks(k, block)
    w = np.asarray(w, dtype=np.float32)
    if nb * block != k:  # padded with zeros, as quantize: the padding's error is its own (never read)
        w = np.concatenate([w, np.zeros((n, nb * block - k), np.float32)], axis=1)
    w = w.reshape(n, nb, block)
    top = np.float32(2 ** bits - 1)
    lo = np.minimum(w.min(axis=2, keepdims=True), 0)  # zero is a level: a zero weight stays zero
    hi = np.maximum(w.max(axis=2, keepdims=True), 0)
    span = hi - lo
    flat = span <= 0
    span = np.where(flat, np.float32(1), span)
    best_err = best_s = best_zp = best_q = None
    steps = np.linspace(top - 1, top + 1, search, dtype=np.float32) if search > 1 else np.array([top], np.float32)
    w2 = (w * w).sum(axis=2, keepdims=True)
    for levels in steps:
        s = span / levels
        zp = np.clip(np.rint(-lo / s), 0, top)
        for _ in range(ROUNDS):  # round with the scale, refit the scale to those levels: each is a candidate
            c = np.rint(w * (1 / s))
            c += zp
            np.clip(c, 0, top, out=c)
            c -= zp
            wc, cc = (w * c).sum(axis=2, keepdims=True), (c * c).sum(axis=2, keepdims=True)
            ok = (cc > 0) & (wc > 0)
            s = np.where(ok, wc / np.where(ok, cc, 1), s).astype(np.float32)  # least squares for these levels
            err = np.where(ok, w2 - wc * wc / np.where(ok, cc, 1), w2)
            if best_err is None:
                best_err, best_s, best_zp, best_q = err, s, zp, c + zp
            else:
                better = err < best_err
                best_err = np.where(better, err, best_err)
                best_s, best_zp = np.where(better, s, best_s), np.where(better, zp, best_zp)
                best_q = np.where(better, c + zp, best_q)
    best_s = np.where(flat, np.float32(1), best_s)
    best_zp = np.where(flat, np.float32(0), best_zp)
    best_q = np.where(flat, np.float32(0), best_q)
    u = best_q.astype(np.uint8)
    if bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    return (np.ascontiguousarray(u), best_s[..., 0].astype(np.float32),
            pack_zeros(best_zp[..., 0].astype(np.uint8), bits))


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [N, K], float32 scales [N]) of a float weight [N, K]: per row, scale = max|w| / 127 and
    q = round(w / scale) in [-127, 127] (symmetric: no zero point)."""
    w = np.asarray(w, dtype=np.float32)
    scales = np.abs(w).max(axis=1) / np.float32(127)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return q, scales.astype(np.float32)


# Activations: each row (token) quantised on its own, symmetrically, so that a row's product never
# depends on the other rows of its batch (a per-tensor scale would make a request's tokens depend on
# whatever else the serving engine runs with it). A row of zeros gets the smallest scale instead of 0.
ROW_SCALE_FLOOR = np.float32(1e-30)
INV_127 = np.float32(1 / 127)
ACTIVATION_ZERO_POINT = 128  # the row's int8 value + 128 as uint8: onnxruntime's u8 x u8 GEMM
WEIGHT_ZERO_POINT = 128  # and the weight's (u8 x s8 saturates on AVX2 without VNNI: lowerings/linalg.py _linear_int8)


def quantize_activation_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int values in [-127, 127], float32 scales [..., 1]) of ``x`` [..., K], one scale per row:
    scale = max(max|x_row| * (1/127), 1e-30), q = round(x / scale) (half to even), in float32 and
    in the order the ONNX lowering computes them (compiler/backends/onnx/lowerings/linalg.py)."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) * INV_127, ROW_SCALE_FLOOR)
    return np.rint(x / scale), scale


def int8_product(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x [..., K] W^T with W given as ``quantize_rows``' (q [N, K], scales [N]), as the lowering
    computes it: x quantised per row, the product in integers (exact), times W's row scales, times
    x's row scale."""
    xq, xs = quantize_activation_rows(x)
    acc = xq.astype(np.int64) @ q.astype(np.int64).T
    return (acc.astype(np.float32) * scales.astype(np.float32)) * xs


CENTRED = ("centred_zeros", "centred_mins")  # a stored code's parts with its zero points centred (centre_zero_points)
RECENT = 4  # quantised weights ParamValues keeps: a fused q/k/v reads each part of its three weights in turn


class ParamValues(Mapping):
    """The values of a graph's parameters: those in ``weights`` (a mapping by path) as they are,
    and each derived parameter (``Param.derive``, set by the quantisation pass and by the fusion of
    linears sharing an input) computed from its sources' values when it is read. One of these serves one export (or one interpreter run): it
    keeps the last ``RECENT`` weights it quantised, so the packed values, the scales (and zero
    points) of a weight, read one after the other (maybe by two writer threads, and for a fused
    q/k/v each part of the three in turn), are computed once."""

    def __init__(self, graph, weights):
        self.graph, self.weights = graph, weights
        self._lock = threading.Lock()
        self._recent: dict = {}  # (kind, source, bits, block) -> the quantised parts, the last RECENT weights

    def __getitem__(self, path: str) -> np.ndarray:
        p = self.graph.params.get(path)
        return self._derived(path, getattr(p, "derive", None))

    def _derived(self, path: str, recipe) -> np.ndarray:
        if recipe is None:
            return self.weights[path]
        if recipe[0] == "concat":  # ("concat", source paths, axis, their recipes): linears sharing an input
            _, sources, axis, recipes = recipe
            return np.concatenate([np.asarray(self._derived(s, r)) for s, r in zip(sources, recipes)], axis=axis)
        kind, source, bits, block, part = recipe
        if kind == "stored":  # a checkpoint's own codes (compiler/passes/stored_codes.py): read, not computed
            read = getattr(self.weights, "stored", None)
            if read is None:
                raise ValueError(f"{path} is a stored code of {source}, and these weights hold none")
            if part in CENTRED:  # zero points nearest the block's offset (int8 activations): centre_zero_points
                zp, offsets = centre_zero_points(read(source, "scales"), read(source, "mins"), bits)
                return pack_zeros(zp, bits) if part == "centred_zeros" else offsets
            return read(source, part)
        if kind not in ("quantize", "quantize_zp") or part not in ("packed", "scales", "zeros") or \
                (part == "zeros" and kind != "quantize_zp"):
            raise ValueError(f"unknown derived parameter {path}: {recipe}")
        with self._lock:
            key = (kind, source, bits, block)
            value = self._recent.pop(key, None)
            if value is None:
                w = np.asarray(self.weights[source])
                value = quantize_rows(w) if block == ROWS else quantize_zp(w, bits, block) \
                    if kind == "quantize_zp" else quantize(w, bits, block)
            self._recent[key] = value  # most recent last
            while len(self._recent) > RECENT:
                self._recent.pop(next(iter(self._recent)))
        return value[("packed", "scales", "zeros").index(part)]

    def __iter__(self):
        return iter(self.graph.params)

    def __len__(self) -> int:
        return len(self.graph.params)
