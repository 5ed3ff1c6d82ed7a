"""A GGUF file (llama.cpp's and Ollama's format) as the model: converted once into a checkpoint folder.

Why a folder: a GGUF file holds what a Hugging Face checkpoint folder spreads over several files
(config.json's hyperparameters as ``{arch}.*`` metadata, the tensors, the tokenizer's vocabulary and
merges, the chat template, the end-of-sequence id). Written out as such a folder -- config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json -- the file then
takes the path every checkpoint folder takes (runtime/io/checkpoint.py: its ``model_type`` picks the
bundled spec, the spec's ``.hf.toml`` maps names and hyperparameters), so ``generate``, ``serve``,
``batch``, ``compile``, ``report`` and ``perplexity`` read it with nothing of their own. The folder
lives in Tessera's cache folder (spec/cache_folder.py, ``gguf/``), keyed by the file's path, size and
modification time and by this converter's version, so a file is converted once; with the cache off
it is a temporary folder removed at exit.

What is read: the ``llama`` architecture (Llama 1/2/3 without rope scaling tensors, Mistral,
SmolLM2, TinyLlama ...) and ``gemma3`` (Gemma 3's text decoder, models/gemma3.tsr: its norms stored
as 1 + w and read back as w, every sixth layer full and the others sliding with the local base
10,000, as llama.cpp takes them), ``qwen2`` (models/qwen2.tsr: q/k/v biases), ``qwen3`` (models/qwen3.tsr:
q/k norms, a head size of its own) and ``qwen3moe`` (models/qwen3_moe.tsr: its experts stored as one
[experts, out, in] stack per layer and split one per expert, read as fp32 since the sparse experts take
no stored codes), tensors of type F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and
the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (a Q4_K_M file mixes Q4_K and Q6_K, with Q5_0, Q5_1, Q8_0
or IQ4_NL where a row is not a multiple of 256), each dequantised to fp32 exactly as llama.cpp's
``dequantize_row_*`` computes it (``DEQUANTIZE``; the note says how many tensors came from each
type); the matrices whose type MatMulNBits holds exactly also keep their own codes beside the fp32
shards (runtime/io/gguf_codes.py: what --gguf-weights codes, the default, compiles them from; the
note says which are kept and why the others are not); and llama's query and key matrices (not
Qwen's: llama.cpp rotates those in the NeoX layout) are permuted back from llama.cpp's rotary layout (its converter's ``permute``: each head's rows interleaved as
pairs) to Hugging Face's (rotate-half). The tokenizer is rebuilt from the metadata where it is
byte-level BPE with a known pre-tokenizer or SentencePiece BPE (Llama 2's and Gemma's;
runtime/io/gguf_tokenizer.py); another is left out with a note (give ``--tokenizer``). Anything else -- another architecture, another
tensor type (IQ2_XS and the other IQ* types, TQ*, MXFP4), rope scaling the spec does not take -- is a
WeightsError naming it.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from tessera.runtime.io import gguf_codes, gguf_tokenizer
from tessera.runtime.io.weights import WeightsError

VERSION = 5  # of the conversion: a change here converts every file again (2: the note by type; 3: SentencePiece;
# 4: the codes kept; 5: the shards named as transformers names them)
SUFFIX = ".gguf"
MAGIC = b"GGUF"
SHARD_BYTES = 2 * 1024 ** 3


# ------------------------------------------------------------------ tensor types
def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _halves(block: np.ndarray, at: int) -> np.ndarray:
    """The fp16 scalar at byte ``at`` of each block, as fp32 [blocks, 1]."""
    return np.ascontiguousarray(block[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: byte j holds element j in its low nibble and element j + 16 in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _q8_0(raw: np.ndarray) -> np.ndarray:   # 34 bytes: fp16 d, 32 x int8 q; w = d * q
    b = raw.reshape(-1, 34)
    return (_halves(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def _q4_0(raw: np.ndarray) -> np.ndarray:   # 18 bytes: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
    b = raw.reshape(-1, 18)
    return (_halves(b, 0) * (_nibbles(b[:, 2:]) - 8.0)).reshape(-1)


def _q4_1(raw: np.ndarray) -> np.ndarray:   # 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
    b = raw.reshape(-1, 20)
    return (_halves(b, 0) * _nibbles(b[:, 4:]) + _halves(b, 2)).reshape(-1)


def _q5_0(raw: np.ndarray) -> np.ndarray:   # 22 bytes: fp16 d, 32 high bits, 16 bytes of nibbles; w = d * (q - 16)
    b = raw.reshape(-1, 22)
    return (_halves(b, 0) * (_nibbles(b[:, 6:]) + 16.0 * _bits32(b[:, 2:6]) - 16.0)).reshape(-1)


def _q5_1(raw: np.ndarray) -> np.ndarray:   # 24 bytes: fp16 d, fp16 m, 32 high bits, nibbles; w = d * q + m
    b = raw.reshape(-1, 24)
    return (_halves(b, 0) * (_nibbles(b[:, 8:]) + 16.0 * _bits32(b[:, 4:8])) + _halves(b, 2)).reshape(-1)


# IQ4_NL's 16 levels (ggml-common.h kvalues_iq4nl): non-linear, denser near zero
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_nl(raw: np.ndarray) -> np.ndarray:  # 18 bytes: fp16 d, 16 bytes of nibbles indexing the levels
    b = raw.reshape(-1, 18)
    q = np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1)
    return (_halves(b, 0) * IQ4_NL_LEVELS[q]).reshape(-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: a little-endian uint32 whose bit j belongs to element j, as [blocks, 32] fp32."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# K-quants (ggml-common.h block_q*_K, ggml-quants.c dequantize_row_q*_K): super-blocks of QK_K = 256
# elements in sub-blocks of 16 or 32, each sub-block with a scale (and a min) quantised against the
# super-block's fp16 d (and dmin). The arithmetic is ggml's, in fp32 and in its order, so the values are
# llama.cpp's to the bit (tests/io/test_gguf_kquants.py).
QK_K = 256
_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8)  # four 2-bit fields of a byte, low first
_BIT8 = np.arange(8, dtype=np.uint8)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes as 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4): sub-blocks
    0-3 take the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 a nibble of bytes 8-11
    (scale low, min high) with the top 2 bits of bytes 0-3 (scale) and 4-7 (min) above it."""
    scale = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _q2_k(raw: np.ndarray) -> np.ndarray:
    """84 bytes: 16 scale bytes (scale low nibble, min high), 64 bytes of 2-bit q, fp16 d, fp16 dmin.
    Each 128-element half reads 32 q bytes four times (bits 0-1, 2-3, 4-5, 6-7: 32 elements each);
    16 elements a scale: w = d * scale * q - dmin * min."""
    b = raw.reshape(-1, 84)
    sc = b[:, 0:16]
    q = (b[:, 16:80].reshape(-1, 2, 1, 32) >> _SHIFT2[:, None]) & 3
    dl = _halves(b, 80) * (sc & 0x0F).astype(np.float32)
    ml = _halves(b, 82) * (sc >> 4).astype(np.float32)
    return (dl[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32) - ml[:, :, None]).reshape(-1)


def _q3_k(raw: np.ndarray) -> np.ndarray:
    """110 bytes: 32 bytes of high bits, 64 bytes of 2-bit q, 12 bytes of 16 six-bit scales, fp16 d.
    q as Q2_K's; element e of the 32-element group g (0-7) takes bit g of high-bit byte e, and a clear
    bit subtracts 4; scale k: the low nibble (k < 8) or high nibble of byte k % 8, and 2 bits of byte
    8 + k % 4 (bits 2 * (k // 4)) above it, less 32; w = d * scale * q."""
    b = raw.reshape(-1, 110)
    s = b[:, 96:108]
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    high = ((s[:, None, 8:12] >> _SHIFT2[:, None]) & 3).reshape(-1, 16)
    scale = (low | (high << 4)).astype(np.float32) - 32.0
    q = ((b[:, 32:96].reshape(-1, 2, 1, 32) >> _SHIFT2[:, None]) & 3).astype(np.int8)
    hbit = ((b[:, None, 0:32] >> _BIT8[:, None]) & 1).reshape(-1, 2, 4, 32).astype(np.int8)
    q = (q - 4 * (1 - hbit)).reshape(-1, 16, 16).astype(np.float32)
    return ((_halves(b, 108) * scale)[:, :, None] * q).reshape(-1)


def _q4_k(raw: np.ndarray) -> np.ndarray:
    """144 bytes: fp16 d, fp16 dmin, 12 bytes of scales and mins (_scale_min_k4), 128 bytes of nibbles:
    each 64 elements read 32 bytes, low nibbles then high, 32 elements a scale: w = d * scale * q - dmin * min."""
    b = raw.reshape(-1, 144)
    scale, mins = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    return ((_halves(b, 0) * scale)[:, :, None] * q - (_halves(b, 2) * mins)[:, :, None]).reshape(-1)


def _q5_k(raw: np.ndarray) -> np.ndarray:
    """176 bytes: Q4_K's d, dmin and scales, 32 bytes of fifth bits (element e of 32-element sub-block s:
    bit s of byte e), Q4_K's 128 bytes of nibbles; w = d * scale * (q + 16 * bit) - dmin * min."""
    b = raw.reshape(-1, 176)
    scale, mins = _scale_min_k4(b[:, 4:16])
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    q = (q + 16 * ((b[:, None, 16:48] >> _BIT8[:, None]) & 1)).astype(np.float32)
    return ((_halves(b, 0) * scale)[:, :, None] * q - (_halves(b, 2) * mins)[:, :, None]).reshape(-1)


def _q6_k(raw: np.ndarray) -> np.ndarray:
    """210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d. Each
    128-element half reads 64 low bytes and 32 high bytes: its four 32-element quarters take the low
    nibbles of bytes 0-31, of 32-63, the high nibbles of 0-31, of 32-63, and bits 0-1, 2-3, 4-5, 6-7 of
    the high bytes; 16 elements a scale: w = d * scale * (q - 32)."""
    b = raw.reshape(-1, 210)
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [blocks, half, quarter, 32]
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> _SHIFT2[:, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).reshape(-1, 16, 16).astype(np.float32)
    scale = b[:, 192:208].view(np.int8).astype(np.float32)
    return ((_halves(b, 208) * scale)[:, :, None] * q).reshape(-1)


# type name -> (elements per block, bytes per block, dequantise raw bytes to fp32 elements)
DEQUANTIZE = {
    "F32": (1, 4, lambda raw: raw.view(np.float32).copy()),
    "F16": (1, 2, _f16),
    "BF16": (1, 2, _bf16),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "IQ4_NL": (32, 18, _iq4_nl),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def dequantize(kind: str, raw: np.ndarray, shape: tuple[int, ...], name: str = "tensor") -> np.ndarray:
    """A GGUF tensor's bytes as fp32 of ``shape`` (Hugging Face order: GGUF's ne reversed)."""
    if kind not in DEQUANTIZE:
        raise WeightsError(f"{name} is of GGUF tensor type {kind}, which Tessera does not read (it reads "
                           f"{', '.join(DEQUANTIZE)}); convert the file with llama.cpp's llama-quantize to one "
                           f"of these, or to F16")
    per, nbytes, fn = DEQUANTIZE[kind]
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if count % per or raw.size != count // per * nbytes:
        raise WeightsError(f"{name}: {raw.size} bytes of {kind} do not hold {count} elements of shape {list(shape)}")
    with np.errstate(invalid="ignore", over="ignore"):  # an inf or NaN scale: convert() names the tensor
        return fn(raw).reshape(shape)


FLOATS = ("F32", "F16", "BF16")  # read as they are (F16, BF16 widened); every other type is dequantised


def type_summary(types: dict[str, int]) -> str:
    """Tensor counts by GGUF type, as the note and --explain say them: ``dequantised from Q4_K: 112
    tensors, Q6_K: 14; read from F32: 25``."""
    parts = []
    for verb, kinds in (("dequantised from", [k for k in types if k not in FLOATS]),
                        ("read from", [k for k in types if k in FLOATS])):
        if kinds:
            counts = [f"{k}: {types[k]}" for k in kinds]
            counts[0] += " tensor" + ("s" if types[kinds[0]] != 1 else "")
            parts.append(f"{verb} {', '.join(counts)}")
    return "; ".join(parts) or "no tensors"


# ------------------------------------------------------------------ metadata
def _value(field):
    """A GGUF metadata field as a Python value (a string, number, bool or list of them)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None

    def scalar(kind, part):
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        v = part[0].item() if hasattr(part[0], "item") else part[0]
        return bool(v) if kind == GGUFValueType.BOOL else v

    if types[0] == GGUFValueType.ARRAY:
        if len(types) < 2:
            return []
        return [scalar(types[1], field.parts[i]) for i in field.data]
    return scalar(types[0], field.parts[field.data[0]])


def is_gguf(path) -> bool:
    """A regular file named *.gguf (its magic is checked when it is read)."""
    p = Path(str(path))
    return p.suffix.lower() == SUFFIX and p.is_file()


class GGUFModel:
    """A GGUF file opened (memory-mapped): its metadata by key and its tensors by name."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.read(4) != MAGIC:
                raise WeightsError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        try:
            from gguf import GGUFReader
        except ImportError:
            raise WeightsError(f"reading {self.path} needs the gguf package: pip install 'tessera[gguf]' "
                               f"(gguf and tokenizers)") from None
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError, struct errors, IndexError on a damaged file
            raise WeightsError(f"cannot read {self.path} as GGUF: {type(e).__name__}: {e}") from None
        self.meta = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.meta[key] = _value(field)
            except Exception as e:
                raise WeightsError(f"{self.path}: metadata {key} cannot be read: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.meta.get("general.architecture")

    def get(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise WeightsError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    def read(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        shape = tuple(int(n) for n in reversed(list(t.shape)))
        return dequantize(t.tensor_type.name, np.asarray(t.data), shape, name)

    def types(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------ architectures
def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter stores q and k as ``w.reshape(heads, 2, hd/2, in).swapaxes(1, 2)``
    (its rotary pairs adjacent); this is the inverse, back to Hugging Face's rotate-half rows."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _hf_name(name: str, table: dict[str, str]) -> str | None:
    if name in table:
        return table[name]
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        pattern = ".".join(["blk", "{i}", *parts[2:]])
        if pattern in table:
            return table[pattern].replace("{i}", parts[1])  # an expert stack's "{e}" stays: _expert_items
    return None


def _llama_config(m: GGUFModel) -> dict:
    d, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    kv = int(m.get("attention.head_count_kv") or heads)
    if m.get("expert_count"):
        raise WeightsError(f"{m.path}: llama with {m.get('expert_count')} experts (a mixture of experts) is not "
                           f"read from GGUF yet; the bundled mixtral spec reads its Hugging Face checkpoint folder")
    if d % heads:
        raise WeightsError(f"{m.path}: embedding_length {d} is not divisible by head_count {heads}")
    head_dim = d // heads
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = m.get(key)
        if value is not None and int(value) != head_dim:
            raise WeightsError(f"{m.path}: {m.arch}.{key} = {value} differs from the head size {head_dim} "
                               f"(embedding_length / head_count); the bundled llama spec rotates and attends "
                               f"over whole heads of that size")
    if "rope_freqs.weight" in m.tensors:
        raise WeightsError(f"{m.path} has rope_freqs.weight (Llama 3.1's rope scaling as per-frequency factors), "
                           f"which Tessera does not read from GGUF yet; use the Hugging Face checkpoint folder")
    tokens = m.meta.get("tokenizer.ggml.tokens") or []
    vocab = m.get("vocab_size") or len(tokens) or int(m.tensors["token_embd.weight"].shape[-1])
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": d,
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": int(m.need("feed_forward_length")),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(m.get("context_length", 4096)),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in m.tensors,
    }
    scaling = m.get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = m.get("rope.scaling.factor")
        if scaling == "linear" and factor:
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        elif scaling == "yarn" and factor:
            config["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor),
                                      "original_max_position_embeddings":
                                          int(m.get("rope.scaling.original_context_length") or
                                              config["max_position_embeddings"])}
        else:
            raise WeightsError(f"{m.path}: {m.arch}.rope.scaling.type = {scaling!r} is not read from GGUF "
                               f"(linear and yarn are)")
    return config


def _llama_tensor(m: GGUFModel, gguf_name: str, hf_name: str, config: dict) -> np.ndarray:
    w = m.read(gguf_name)
    if hf_name.endswith("self_attn.q_proj.weight"):
        w = _unpermute(w, config["num_attention_heads"])
    elif hf_name.endswith("self_attn.k_proj.weight"):
        w = _unpermute(w, config["num_key_value_heads"])
    return w


GEMMA3_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# What llama.cpp's Gemma 3 takes as given rather than storing (llama-model.cpp, LLM_ARCH_GEMMA3): every
# sixth layer full, the others sliding with the local rotary base 10,000.
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_BASE = 10000.0


def _gemma3_config(m: GGUFModel) -> dict:
    """Gemma 3's text decoder (models/gemma3.tsr) from llama.cpp's metadata. The query scale is
    head_dim^-0.5, except for the 27B (62 layers), whose query_pre_attn_scalar is d / heads, as
    llama.cpp computes it."""
    d, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    layers = int(m.need("block_count"))
    head_dim = int(m.get("attention.key_length") or d // heads)
    if int(m.get("attention.value_length") or head_dim) != head_dim:
        raise WeightsError(f"{m.path}: {m.arch}.attention.value_length differs from key_length; Gemma 3's heads "
                           f"have one size")
    tokens = m.meta.get("tokenizer.ggml.tokens") or []
    vocab = m.get("vocab_size") or len(tokens) or int(m.tensors["token_embd.weight"].shape[-1])
    full = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base", 1000000.0))}
    scaling = m.get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear" or not m.get("rope.scaling.factor"):
            raise WeightsError(f"{m.path}: {m.arch}.rope.scaling.type = {scaling!r} is not read from GGUF (linear is)")
        full.update(rope_type="linear", factor=float(m.get("rope.scaling.factor")))
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(m.need("feed_forward_length")),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(m.get("context_length", 32768)),
        "sliding_window": int(m.need("attention.sliding_window")),
        "query_pre_attn_scalar": d // heads if layers == 62 else head_dim,
        "_sliding_window_pattern": GEMMA3_PATTERN,
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_BASE}},
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in m.tensors,
    }


def _gemma3_tensor(m: GGUFModel, gguf_name: str, hf_name: str, config: dict) -> np.ndarray:
    """llama.cpp's converter stores Gemma's norms as their scale 1 + w; Hugging Face (and the spec's
    gemma_rmsnorm) keep w."""
    w = m.read(gguf_name)
    return w - np.float32(1.0) if gguf_name.endswith("norm.weight") else w


# Qwen2 and Qwen3 (llama.cpp's LLM_ARCH_QWEN2, QWEN3, QWEN3MOE): llama's tensor names, plus Qwen2's
# q/k/v biases, Qwen3's q/k norms and Qwen3-MoE's router and expert stacks. Their converter
# (convert_hf_to_gguf.py Qwen2Model, Qwen3Model, Qwen3MoeModel) does not permute q and k: llama.cpp
# rotates these with LLAMA_ROPE_TYPE_NEOX, Hugging Face's rotate-half, and transformers' GGUF loader
# reads them with its plain TensorProcessor (modeling_gguf_pytorch_utils.py: only "llama" unpermutes).
QWEN2_NAMES = {**LLAMA_NAMES, **{f"blk.{{i}}.attn_{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias"
                                 for x in "qkv"}}
QWEN3_NAMES = {**LLAMA_NAMES,
               "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
               "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
# the experts stacked [experts, out, in] in one tensor each, split into Hugging Face's one per expert ({e})
QWEN3MOE_NAMES = {**{k: v for k, v in QWEN3_NAMES.items() if not k.startswith("blk.{i}.ffn_")},
                  "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
                  "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
                  "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
                  "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
                  "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight"}


def _rope_default(m: GGUFModel) -> None:
    """The Qwen specs rotate with plain RoPE: rope scaling in the metadata (Qwen2.5's long-context yarn)
    is refused, not dropped."""
    scaling = m.get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise WeightsError(f"{m.path}: {m.arch}.rope.scaling.type = {scaling!r}: the bundled {m.arch} spec has "
                           f"plain rotary positions only")


def _qwen_common(m: GGUFModel, model_type: str, architecture: str) -> dict:
    """The hyperparameters Qwen2, Qwen3 and Qwen3-MoE share, from llama.cpp's metadata."""
    if m.get("attention.sliding_window"):
        raise WeightsError(f"{m.path}: {m.arch}.attention.sliding_window is set; the bundled spec attends over "
                           f"the whole context at every layer")
    _rope_default(m)
    d, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    tokens = m.meta.get("tokenizer.ggml.tokens") or []
    vocab = m.get("vocab_size") or len(tokens) or int(m.tensors["token_embd.weight"].shape[-1])
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": int(vocab),
        "hidden_size": d,
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv") or heads),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(m.get("context_length", 32768)),
        "rope_theta": float(m.get("rope.freq_base", 1000000.0)),
        "hidden_act": "silu",
        "use_sliding_window": False,
        "tie_word_embeddings": "output.weight" not in m.tensors,
    }


def _head_dim(m: GGUFModel, config: dict) -> int:
    """Qwen3's head size: attention.key_length (128 in the released models, not d / heads)."""
    key = int(m.get("attention.key_length") or config["hidden_size"] // config["num_attention_heads"])
    if int(m.get("attention.value_length") or key) != key:
        raise WeightsError(f"{m.path}: {m.arch}.attention.value_length differs from key_length; the bundled "
                           f"spec's heads have one size")
    return key


def _qwen2_config(m: GGUFModel) -> dict:
    config = _qwen_common(m, "qwen2", "Qwen2ForCausalLM")
    d, heads = config["hidden_size"], config["num_attention_heads"]
    if d % heads or _head_dim(m, config) != d // heads:
        raise WeightsError(f"{m.path}: Qwen2's heads are embedding_length / head_count ({d} / {heads}); this "
                           f"file's key_length says otherwise")
    return dict(config, intermediate_size=int(m.need("feed_forward_length")))


def _qwen3_config(m: GGUFModel) -> dict:
    config = _qwen_common(m, "qwen3", "Qwen3ForCausalLM")
    return dict(config, head_dim=_head_dim(m, config), intermediate_size=int(m.need("feed_forward_length")),
                attention_bias=False)


def _qwen3moe_config(m: GGUFModel) -> dict:
    """Qwen3-MoE: llama.cpp renormalises the chosen experts' gates (its qwen3moe graph passes norm_w =
    true; transformers' GGUF loader sets norm_topk_prob = true for it); a file whose
    expert_weights_norm says false keeps the softmax weights."""
    config = _qwen_common(m, "qwen3_moe", "Qwen3MoeForCausalLM")
    if m.get("expert_shared_feed_forward_length") or any(".ffn_gate_shexp." in n for n in m.tensors):
        raise WeightsError(f"{m.path}: a shared expert is not in the bundled qwen3_moe spec")
    norm = m.get("expert_weights_norm")
    return dict(config, head_dim=_head_dim(m, config), attention_bias=False,
                moe_intermediate_size=int(m.need("expert_feed_forward_length")),
                num_experts=int(m.need("expert_count")), num_experts_per_tok=int(m.need("expert_used_count")),
                norm_topk_prob=True if norm is None else bool(norm), decoder_sparse_step=1, mlp_only_layers=[])


def _plain_tensor(m: GGUFModel, gguf_name: str, hf_name: str, config: dict) -> np.ndarray:
    return m.read(gguf_name)


# general.architecture -> (config.json from the metadata, tensor names, one tensor as Hugging Face has it)
ARCHITECTURES = {
    "llama": (_llama_config, LLAMA_NAMES, _llama_tensor),
    "gemma3": (_gemma3_config, GEMMA3_NAMES, _gemma3_tensor),
    "qwen2": (_qwen2_config, QWEN2_NAMES, _plain_tensor),
    "qwen3": (_qwen3_config, QWEN3_NAMES, _plain_tensor),
    "qwen3moe": (_qwen3moe_config, QWEN3MOE_NAMES, _plain_tensor),
}


# ------------------------------------------------------------------ the folder
def _generation_config(m: GGUFModel) -> dict:
    out = {}
    bos, eos, eot = (m.meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot"))
    if isinstance(bos, int):
        out["bos_token_id"] = bos
    ends = [t for t in (eos, eot) if isinstance(t, int)]
    if ends:
        out["eos_token_id"] = ends[0] if len(set(ends)) == 1 else list(dict.fromkeys(ends))
    return out


def convert(path: Path, folder: Path, final: Path | None = None) -> str:
    """Write the checkpoint folder of GGUF file ``path`` into ``folder`` (made); returns the note (which
    names ``final``, the folder's name once moved into place, where given)."""
    m = GGUFModel(path)
    if m.arch not in ARCHITECTURES:
        raise WeightsError(f"{path}: GGUF architecture {m.arch!r} is not read by Tessera (it reads "
                           f"{', '.join(ARCHITECTURES)}); for another architecture use its Hugging Face "
                           f"checkpoint folder with a bundled spec, or write a spec (docs/language.md)")
    make_config, names, tensor = ARCHITECTURES[m.arch]
    try:
        config = make_config(m)
    except (TypeError, ValueError, OverflowError) as e:  # a metadata value of the wrong type ("30" layers, a list)
        raise WeightsError(f"{path}: the {m.arch} hyperparameters in its metadata cannot be read: {e}") from None
    unknown = [n for n in m.tensors if _hf_name(n, names) is None]
    if unknown:
        raise WeightsError(f"{path}: tensors the {m.arch} reader does not know: {', '.join(unknown[:8])}"
                           + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    bad = [f"{n} ({t.tensor_type.name})" for n, t in m.tensors.items() if t.tensor_type.name not in DEQUANTIZE]
    if bad:
        raise WeightsError(f"{path}: tensor type(s) Tessera does not read: {', '.join(bad[:6])}"
                           + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
                           + f" (it reads {', '.join(DEQUANTIZE)})")
    need = sum(int(np.prod([int(x) for x in t.shape])) * 4 for t in m.tensors.values())
    free = shutil.disk_usage(folder.parent).free
    if need > free:
        raise WeightsError(f"{path} dequantised to fp32 is {need / 1e9:.1f} GB; {folder.parent} has "
                           f"{free / 1e9:.1f} GB free (set TESSERA_CACHE_DIR to a larger disk)")
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    shard: dict[str, np.ndarray] = {}
    size, index = 0, 0
    shard_keys: list[list[str]] = []

    def flush():
        nonlocal shard, size, index
        if shard:
            save_file(shard, str(folder / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard_keys.append(list(shard))
            shard, size, index = {}, 0, index + 1

    for name in m.tensors:
        hf = _hf_name(name, names)
        arr = np.ascontiguousarray(tensor(m, name, hf, config), dtype=np.float32)
        if not np.isfinite(arr).all():
            raise WeightsError(f"{path}: tensor {name} holds NaN or infinity")
        if "{e}" in hf and arr.ndim != 3:
            raise WeightsError(f"{path}: tensor {name} has shape {list(arr.shape)}; an expert stack is "
                               f"[experts, out, in]")
        for key, part in ([(hf.replace("{e}", str(e)), arr[e]) for e in range(arr.shape[0])] if "{e}" in hf
                          else [(hf, arr)]):
            shard[key] = np.ascontiguousarray(part)
            size += part.nbytes
            if size >= SHARD_BYTES:
                flush()
    flush()
    _name_shards(folder, shard_keys)
    kept, inexact = gguf_codes.write(folder, _kept_items(m, names, config))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(_generation_config(m), indent=1))
    try:
        why = gguf_tokenizer.write(m.meta, m.arch, folder, m.get("context_length", 4096))
    except Exception as e:  # tokenizers raises plain Exceptions for a vocabulary or merges it cannot take
        why = f"its tokenizer metadata could not be built into a tokenizer ({type(e).__name__}: {e})"
    note = f"{path}: GGUF {m.arch}, {len(m.tensors)} tensors as fp32 in {final or folder} ({type_summary(m.types())})"
    summary = codes_summary(m, inexact) if kept or m.types().keys() - set(FLOATS) else ""
    if summary:
        note += f"; {summary}"
    if why:
        note += f"; no tokenizer read: {why} (give --tokenizer)"
    (folder / "gguf_source.json").write_text(json.dumps({"source": str(path), "version": VERSION, "note": note}))
    return note


def _name_shards(folder: Path, shard_keys: list[list[str]]) -> None:
    """Rename the shards as transformers' save_pretrained names them -- ``model.safetensors`` alone, or
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` -- so that the folder is a
    checkpoint transformers (and tools built on it, onnxruntime-genai's model builder, optimum) loads too,
    not only Tessera (which reads every ``*.safetensors``)."""
    n = len(shard_keys)
    if n == 1:
        (folder / "model-00000.safetensors").rename(folder / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, keys in enumerate(shard_keys):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (folder / f"model-{i:05d}.safetensors").rename(folder / name)
        total += (folder / name).stat().st_size
        weight_map.update(dict.fromkeys(keys, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _rows(m: GGUFModel, hf_name: str, config: dict, n: int) -> np.ndarray | None:
    """The row order the architecture's tensor function gives a matrix of ``n`` rows (llama's q and k
    permuted back to rotate-half), as an index into the file's rows; None for the file's own order."""
    if m.arch == "llama" and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
        return _unpermute(np.arange(n), heads)
    return None


def _kept_items(m: GGUFModel, names: dict, config: dict) -> list:
    """The matrices whose codes are kept (gguf_codes.KEPT types, 2-D, not a norm: Gemma's norms are
    read as w - 1), as gguf_codes.write takes them."""
    items = []
    for name, t in m.tensors.items():
        hf = _hf_name(name, names)
        if t.tensor_type.name in gguf_codes.KEPT and len(t.shape) == 2 and not hf.endswith("norm.weight"):
            n, k = int(t.shape[1]), int(t.shape[0])  # GGUF's ne: columns first
            want = m.read(name) if t.tensor_type.name in gguf_codes.MINS else None  # ggml's, for gguf_codes.exact
            items.append((hf, t.tensor_type.name, np.asarray(t.data), n, k, _rows(m, hf, config, n), want))
    return items


def codes_summary(m: GGUFModel, inexact: list[str] = ()) -> str:
    """Which quantised types keep their codes and which are dequantised, and why (the note's words);
    ``inexact``: the Hugging Face names of matrices whose d * q + m rounds in fp32 (gguf_codes.exact)."""
    kept: dict[str, int] = {}
    other: dict[tuple[str, str], int] = {}  # (type, why dequantised) -> tensors
    names = ARCHITECTURES[m.arch][1] if m.arch in ARCHITECTURES else {}
    for name, t in m.tensors.items():
        kind = t.tensor_type.name
        if kind in gguf_codes.KEPT and len(t.shape) == 3:
            why = "expert stacks: the sparse experts read fp32 weights"
        elif kind in gguf_codes.KEPT and len(t.shape) != 2:
            why = "not a matrix"
        elif kind in gguf_codes.KEPT and _hf_name(name, names) in inexact:
            why = "d * q + m rounds in fp32 somewhere in it"
        elif kind in gguf_codes.KEPT:
            kept[kind] = kept.get(kind, 0) + 1
            continue
        elif kind not in FLOATS:
            why = gguf_codes.WHY_NOT.get(kind, "no exact MatMulNBits form")
        else:
            continue
        other[kind, why] = other.get((kind, why), 0) + 1
    parts = []
    if kept:
        parts.append("codes kept for MatMulNBits (no requantisation; --gguf-weights dequantize reads them as fp32): "
                     + ", ".join(f"{k}: {v}" for k, v in kept.items()))
    if other:
        parts.append("dequantised: " + ", ".join(f"{k}: {v} ({why})" for (k, why), v in other.items()))
    return "; ".join(parts)


def source_note(folder) -> str | None:
    """The conversion's note kept in a converted folder (which tensors came from which type, which keep
    their codes and why the others do not); None for any other folder."""
    try:
        return json.loads((Path(str(folder)) / "gguf_source.json").read_text())["note"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


_converted: dict[tuple, Path] = {}


def explain(path, mode: str = "codes") -> str | None:
    """--explain's line for a GGUF file (None for any other path): how its tensors were read (the
    conversion's note, kept in the folder) and whether --gguf-weights (``mode``) reads the kept codes;
    None too when this call converted the file, its note just printed."""
    if path is None or not is_gguf(path):
        return None
    folder, now = _folder(path)
    if now:
        return None
    try:
        note = json.loads((folder / "gguf_source.json").read_text())["note"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (folder / gguf_codes.FOLDER).is_dir():
        note += ("; --gguf-weights dequantize: every tensor read as fp32" if mode == "dequantize" else
                 f"; --gguf-weights {mode}: the linears over kept codes run as MatMulNBits ("
                 + ("int8 activations per block of 32" if mode == "codes" else "fp32 products") + ")")
    return f"GGUF weights: {note}"


def folder_for(path) -> Path:
    """The checkpoint folder of GGUF file ``path``: from the cache when converted before, else converted
    now (a note on stderr says so)."""
    return _folder(path)[0]


def _folder(path) -> tuple[Path, bool]:
    """folder_for's folder, and whether it was converted now."""
    p = Path(str(path)).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise WeightsError(f"cannot read {path}: {e.strerror}") from None
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key in _converted and _converted[key].is_dir():
        return _converted[key], False
    from tessera.spec.cache_folder import cache_folder

    digest = hashlib.sha256(repr((key, VERSION)).encode()).hexdigest()[:16]
    base = cache_folder("gguf")
    if base is not None:
        folder = Path(base) / f"{p.stem[:60]}-{digest}"
        if (folder / "gguf_source.json").is_file():
            _converted[key] = folder
            return folder, False
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=base))
        try:
            note = convert(p, work, folder)
            try:
                os.rename(work, folder)
            except OSError:  # converted meanwhile by another process
                shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        print(f"note: {note} (once: reused while the file is unchanged)", file=sys.stderr)
    else:
        folder = Path(tempfile.mkdtemp(prefix="tessera-gguf-"))
        atexit.register(shutil.rmtree, folder, True)
        note = convert(p, folder)
        print(f"note: {note} (the cache is off: converted again each run)", file=sys.stderr)
    _converted[key] = folder
    return folder, True
