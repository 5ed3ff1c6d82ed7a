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

What does not, and stays dequantised (the note and --explain say so):

- Q4_1, Q5_1 and the K-quants with a min (Q2_K, Q4_K, Q5_K: w = d * q + m): MatMulNBits takes float
  zero points and computes q * scale - zp * scale (checked: tests/io/test_gguf_codes.py), so a zero
  point with fl(zp * d) = -m reproduces ggml's fl(d * q + m) bit for bit; but onnxruntime 1.31.1's CPU
  kernel then dequantises the whole matrix at every call: 1.58 ms against fp32 MatMul's 0.05 ms for a
  1536 x 576 weight at one token (bench/gguf_codes.py). Exact but 30x slower, so not taken.
- Q3_K, Q6_K (16-element sub-blocks, scale d * sc with up to 19 significant bits: the product with
  the code may round, and whether the kernel rounds it as ggml does depends on its order) and IQ4_NL
  (non-linear levels): no exact MatMulNBits form.

The codes live beside the fp32 checkpoint folder's shards (``gguf_codes/codes.safetensors``, one
``NAME.packed`` uint8 [N, blocks, 32 * bits / 8] and ``NAME.scales`` f32 [N, blocks] per Hugging Face
weight name, rows in Hugging Face's order) with ``gguf_codes/index.json`` (name -> type, bits, block,
[N, K]); the fp32 shards keep every tensor, so ``--gguf-weights dequantize`` reads the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tessera.runtime.io.weights import WeightsError

FOLDER = "gguf_codes"
BLOCK = 32
# GGUF type -> MatMulNBits bits; every one of these has block 32 and no zero points (the default one)
KEPT = {"Q4_0": 4, "Q8_0": 8, "Q5_0": 8}
# why each other quantised type is dequantised (the note and --explain say it)
WHY_NOT = {
    "Q4_1": "a min per block: exact with float zero points, which onnxruntime 1.31.1's CPU MatMulNBits runs "
            "about 30x slower than fp32",
    "Q5_1": "a min per block: exact with float zero points, which onnxruntime 1.31.1's CPU MatMulNBits runs "
            "about 30x slower than fp32",
    "Q2_K": "a min per sub-block (as Q4_1)", "Q4_K": "a min per sub-block (as Q4_1)",
    "Q5_K": "a min per sub-block (as Q4_1)",
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


def to_nbits(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF matrix [n, k] (raw blocks, rows of k / 32 blocks) as MatMulNBits' (packed uint8
    [n, k / 32, 32 * bits / 8], scales f32 [n, k / 32]); ``kind`` one of KEPT."""
    if kind not in KEPT or k % BLOCK:
        raise WeightsError(f"GGUF type {kind} of {k} columns has no MatMulNBits form here")
    size = {"Q4_0": 18, "Q8_0": 34, "Q5_0": 22}[kind]
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(n, k // BLOCK, size)
    d = _halves(b, 0)
    if kind == "Q4_0":
        u = _ggml_nibbles(b[..., 2:])                       # q in [0, 15]; w = d * (q - 8)
        packed = u[..., 0::2] | (u[..., 1::2] << 4)         # MatMulNBits: the even element low
    elif kind == "Q8_0":
        packed = b[..., 2:] ^ np.uint8(0x80)                # int8 q as q + 128
    else:  # Q5_0: four low bits in bytes 6..21 (ggml's nibble layout), the fifth bits in a uint32 at 2
        high = (np.ascontiguousarray(b[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        q = _ggml_nibbles(b[..., 6:]).astype(np.uint32) | (high << 4).astype(np.uint32)
        packed = (q + 112).astype(np.uint8)                 # q - 16 + 128
    return np.ascontiguousarray(packed), np.ascontiguousarray(d)


def write(folder: Path, items: list[tuple[str, str, np.ndarray, int, int, np.ndarray | None]]) -> int:
    """Write ``gguf_codes/`` into a checkpoint folder: ``items`` (Hugging Face name, GGUF type, raw
    bytes, N, K, the row order or None); returns the bytes written."""
    from safetensors.numpy import save_file

    tensors, index = {}, {}
    for name, kind, raw, n, k, rows in items:
        packed, scales = to_nbits(kind, raw, n, k)
        if rows is not None:
            packed, scales = packed[rows], scales[rows]
        if not np.isfinite(scales).all():
            raise WeightsError(f"tensor {name} has a NaN or infinite scale")
        tensors[f"{name}.packed"], tensors[f"{name}.scales"] = np.ascontiguousarray(packed), np.ascontiguousarray(scales)
        index[name] = {"type": kind, "bits": KEPT[kind], "block": BLOCK, "shape": [n, k]}
    if not index:
        return 0
    (folder / FOLDER).mkdir(exist_ok=True)
    save_file(tensors, str(folder / FOLDER / "codes.safetensors"))
    (folder / FOLDER / "index.json").write_text(json.dumps(index, indent=1))
    return sum(t.nbytes for t in tensors.values())


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
