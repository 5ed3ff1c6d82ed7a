"""A GGUF file's quantised matrices kept as the file stores them: its codes and scales rewritten into
onnxruntime's com.microsoft.MatMulNBits layout, with no requantisation.

Why: a Q4_0 file dequantised to fp32 is 7x larger in memory and on disk than the file, and Tessera's
own --quantize would quantise those fp32 values a second time (a different grid: more error). Where
MatMulNBits dequantises a block to exactly the values ggml's ``dequantize_row_*`` gives, the file's
own codes and scales are the model: the kernel reads them as they are.

What maps exactly (MatMulNBits, onnxruntime 1.31.1: w = (u - zp) * scale per block, u unsigned
``bits`` wide, zp 2^(bits-1) when no zero points are given, the scales the activations' float type):

- Q4_0 (block 32: fp16 d, 32 four-bit q; ggml w = d * (q - 8)): bits 4, block 32, u = q, the default
  zero point 8, scale = d (fp16 -> fp32, exact). d has 11 significant bits and q - 8 four, so every
  product is exact in fp32 and no order of the kernel's arithmetic can round it differently.
- Q8_0 (block 32: fp16 d, 32 int8 q; w = d * q): bits 8, block 32, u = q + 128, zero point 128.
  11 + 8 significant bits: exact likewise.
- Q5_0 (block 32: fp16 d, five-bit q; w = d * (q - 16)): bits 8 (MatMulNBits has no 5), u = q + 112,
  zero point 128: exact likewise; stored in 8 bits, 1.5x the file's 5.5 bits a weight.
- Q4_1, Q5_1 (w = d * q + m) and Q4_K, Q5_K (per 32-element sub-block w = (d * sc) * q - dmin * mn):
  4 or 8 bits, block 32, u = q, uint8 zero points 0, scale d (or d * sc: an fp16 times a six-bit
  integer, exact), and an offset per block (m, or -(dmin * mn), exact likewise) that the lowering
  adds as x's block sums times the offsets (compiler/ops/linalg.py ``block_mins``). scale * u never
  rounds; ggml's fp32 sum scale * u + offset mostly does not either, and where it does anywhere in a
  matrix (``exact``) that matrix is dequantised instead, so the two parts always add up to ggml's
  weight exactly. Why not MatMulNBits' float zero points: it computes u * scale - zp * scale
  (measured), so a zero point with fl(zp * d) = -m gives ggml's weight to the bit, but onnxruntime
  1.31.1's CPU kernel then dequantises the whole matrix at every call, about 30x slower than fp32's
  MatMul at one token (bench/gguf_codes.py --kernels); the uint8 zero points keep its fast path.

What does not, and stays dequantised (the note and --explain say so, ``WHY_NOT``): Q3_K and Q6_K
(16-element sub-blocks, scale d * sc with up to 19 significant bits: its product with the code may
round, and whether the kernel rounds it as ggml does depends on its order), Q2_K (not mapped yet),
IQ4_NL (non-linear levels).

The codes live beside the fp32 checkpoint folder's shards (``gguf_codes/codes.safetensors``, one
``NAME.packed`` uint8 [N, blocks, 32 * bits / 8] and ``NAME.scales`` f32 [N, blocks] per Hugging Face
weight name, rows in Hugging Face's order, and for the types with a min ``NAME.zeros`` and ``NAME.mins``
f32 [N, blocks]) with ``gguf_codes/index.json`` (name -> type, bits, block, [N, K], mins); the fp32
shards keep every tensor, so ``--gguf-weights dequantize`` reads the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tessera.runtime.io.weights import WeightsError

FOLDER = "gguf_codes"
BLOCK = 32
# GGUF type -> MatMulNBits bits, block 32; those with a min (MINS) take zero points 0 and an offset per block
KEPT = {"Q4_0": 4, "Q8_0": 8, "Q5_0": 8, "Q4_1": 4, "Q5_1": 8, "Q4_K": 4, "Q5_K": 8}
MINS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
SIZES = {"Q4_0": 18, "Q8_0": 34, "Q5_0": 22, "Q4_1": 20, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176}
SUPER = {"Q4_K": 256, "Q5_K": 256}  # elements per stored block where not 32
# why each other quantised type is dequantised (the note and --explain say it)
WHY_NOT = {
    "Q2_K": "16-element sub-blocks and 2-bit codes: not mapped yet",
    "Q3_K": "16-element sub-blocks whose scale d * sc times the code may round",
    "Q6_K": "16-element sub-blocks whose scale d * sc times the code may round",
    "IQ4_NL": "non-linear levels",
}
MODES = ("codes", "codes-fp32", "dequantize")  # --gguf-weights


def _halves(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _ggml_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: byte j of a block holds element j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes as 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    scale = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: a little-endian uint32 whose bit j belongs to element j."""
    return (np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1


def _k_blocks(b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks [n, supers, bytes] as per-32 (scale, min) [n, blocks]: d * sc and -(dmin * m),
    each exact in fp32 (an fp16 times a six-bit integer)."""
    sc, mn = _scale_min_k4(b[..., 4:16])
    scale = (_halves(b, 0)[..., None] * sc).reshape(n, -1)
    mins = -(_halves(b, 2)[..., None] * mn).reshape(n, -1)
    return scale, mins


def to_nbits(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF matrix [n, k] (raw blocks, rows of whole blocks) as MatMulNBits' packed uint8 codes
    [n, k / 32, 32 * bits / 8] and scales f32 [n, k / 32], and the per-block offsets f32 [n, k / 32] for
    the types with a min (None for the others): w = scale * (u - zp) (+ offset), zp the default for the
    types without a min and 0 for those with one; ``kind`` one of KEPT."""
    if kind not in KEPT or k % SUPER.get(kind, BLOCK):
        raise WeightsError(f"GGUF type {kind} of {k} columns has no MatMulNBits form here")
    size = SIZES[kind]
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(n, k // SUPER.get(kind, BLOCK), size)
    mins = None
    if kind in ("Q4_K", "Q5_K"):
        scales, mins = _k_blocks(b, n)
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32)  # each 64 elements: 32 bytes, low nibbles then high
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 32)
        if kind == "Q5_K":  # the fifth bit of element e of sub-block s: bit s of byte e of 32 at offset 16
            u = u | (((b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, -1, 32) << 4)
    else:
        d = _halves(b, 0)
        scales = d
        if kind in ("Q4_1", "Q5_1"):
            mins = _halves(b, 2)
        if kind == "Q4_0":
            u = _ggml_nibbles(b[..., 2:])                   # q in [0, 15]; w = d * (q - 8)
        elif kind == "Q4_1":
            u = _ggml_nibbles(b[..., 4:])                   # w = d * q + m
        elif kind == "Q8_0":
            u = b[..., 2:] ^ np.uint8(0x80)                 # int8 q as q + 128
        elif kind == "Q5_0":  # w = d * (q - 16): q - 16 + 128
            u = ((_ggml_nibbles(b[..., 6:]).astype(np.uint32) | (_fifth_bits(b[..., 2:6]) << 4)) + 112).astype(np.uint8)
        else:  # Q5_1: w = d * q + m
            u = (_ggml_nibbles(b[..., 8:]).astype(np.uint32) | (_fifth_bits(b[..., 4:8]) << 4)).astype(np.uint8)
    u = u.astype(np.uint8)
    packed = u[..., 0::2] | (u[..., 1::2] << 4) if KEPT[kind] == 4 else u  # MatMulNBits: the even element low
    return (np.ascontiguousarray(packed), np.ascontiguousarray(scales, dtype=np.float32),
            None if mins is None else np.ascontiguousarray(mins, dtype=np.float32))


def exact(kind: str, raw: np.ndarray, n: int, k: int, want: np.ndarray) -> bool:
    """Whether scale * (u - zp) + offset, computed exactly (float64), is ggml's fp32 weight ``want``
    [n, k] everywhere: always for the types without a min (a product of at most 19 significant bits);
    for those with one, where ggml's fp32 sum d * q + m did not round."""
    packed, scales, mins = to_nbits(kind, raw, n, k)
    bits = KEPT[kind]
    u = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1, BLOCK) if bits == 4 else packed
    zp = 0 if mins is not None else 2 ** (bits - 1)
    w = (u.astype(np.float64) - zp) * scales[..., None].astype(np.float64)
    if mins is not None:
        w += mins[..., None].astype(np.float64)
    return bool(np.array_equal(w.reshape(n, k), want.astype(np.float64)))


def write(folder: Path, items: list) -> tuple[int, list[str]]:
    """Write ``gguf_codes/`` into a checkpoint folder: ``items`` (Hugging Face name, GGUF type, raw
    bytes, N, K, the row order or None, ggml's fp32 weight [N, K] in the file's row order or None where
    the type has no min); returns the bytes written and the names left out (with a min, inexact: ``exact``)."""
    from safetensors.numpy import save_file
    from tessera.compiler.reference.quant import zeros_shape

    tensors, index, inexact = {}, {}, []
    for name, kind, raw, n, k, rows, want in items:
        if want is not None and not exact(kind, raw, n, k, want):
            inexact.append(name)
            continue
        packed, scales, mins = to_nbits(kind, raw, n, k)
        parts = {"packed": packed, "scales": scales}
        if mins is not None:
            parts["zeros"] = np.zeros(zeros_shape(n, k, KEPT[kind], BLOCK), np.uint8)
            parts["mins"] = mins
        for part, arr in parts.items():
            arr = arr[rows] if rows is not None else arr
            if arr.dtype == np.float32 and not np.isfinite(arr).all():
                raise WeightsError(f"tensor {name} has a NaN or infinite scale or min")
            tensors[f"{name}.{part}"] = np.ascontiguousarray(arr)
        index[name] = {"type": kind, "bits": KEPT[kind], "block": BLOCK, "shape": [n, k], "mins": mins is not None}
    if index:
        (folder / FOLDER).mkdir(exist_ok=True)
        save_file(tensors, str(folder / FOLDER / "codes.safetensors"))
        (folder / FOLDER / "index.json").write_text(json.dumps(index, indent=1))
    return sum(t.nbytes for t in tensors.values()), inexact


class Codes:
    """A converted folder's stored codes (None from ``open`` when it has none): the index, and each
    weight's packed codes and scales read (memory-mapped) when asked for."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        try:
            self.index = json.loads((self.folder / FOLDER / "index.json").read_text())
            self._file = safe_open(str(self.folder / FOLDER / "codes.safetensors"), framework="numpy")
        except Exception as e:  # a damaged cache entry: say which
            raise WeightsError(f"cannot read the GGUF codes in {self.folder / FOLDER}: {e} (remove the folder: it "
                               f"is converted again)") from None

    @classmethod
    def open(cls, folder) -> "Codes | None":
        if folder is None or not (Path(folder) / FOLDER / "index.json").is_file():
            return None
        return cls(Path(folder))

    def read(self, name: str, part: str) -> np.ndarray:
        return self._file.get_tensor(f"{name}.{part}")
