"""A GGUF file's Q4_0, Q8_0 and Q5_0 matrices kept as the file stores them (runtime/io/gguf_codes.py,
compiler/passes/stored_codes.py): MatMulNBits over the file's own codes and scales.

The references are independent of the code under test: ``gguf.quants`` (llama.cpp's own Python
quantiser and dequantiser) makes and reads the blocks, onnxruntime runs a MatMulNBits node the test
builds itself, numpy multiplies. The tiny Llama files are written here with the ``gguf`` package.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from gguf import quants  # noqa: E402

from conftest import cli  # noqa: E402

from tessera.runtime.io import gguf_codes  # noqa: E402

T = gguf.GGMLQuantizationType


def _blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid random raw blocks: every code pattern, finite fp16 scales of both signs (the scale first)."""
    size = {"Q4_0": 18, "Q8_0": 34, "Q5_0": 22}[kind]
    b = rng.integers(0, 256, (rows, cols // 32, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 0.5, (rows, cols // 32)) * rng.choice([-1, 1], (rows, cols // 32))
    b[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def _matmulnbits(packed, scales, bits: int, k: int, accuracy: int = 0):
    """An onnxruntime session of one com.microsoft.MatMulNBits node (no zero points: the default)."""
    from onnx import TensorProto, helper, numpy_helper

    n = packed.shape[0]
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=32, accuracy_level=accuracy)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])],
                              [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q8_0", 8), ("Q5_0", 8)])
def test_matmulnbits_dequantises_the_file_codes_as_ggml_does(kind, bits):
    rng = np.random.default_rng(1)
    n, k = 48, 128
    raw = _blocks(kind, n, k, rng)
    want = quants.dequantize(raw, T[kind]).astype(np.float32)
    packed, scales = gguf_codes.to_nbits(kind, raw, n, k)
    assert packed.shape == (n, k // 32, 32 * bits // 8) and scales.dtype == np.float32
    sess = _matmulnbits(packed, scales, bits, k)
    # one-hot activations read the dequantised weight back: column j of the output is W[:, j] (plus zeros),
    # bit for bit but for a zero's sign (ggml's -0.0 comes back +0.0 from the sum)
    got = sess.run(None, {"A": np.eye(k, dtype=np.float32)})[0].T
    nonzero = want != 0
    assert np.array_equal(got[nonzero].view(np.uint32), want[nonzero].view(np.uint32))
    assert (got[~nonzero] == 0).all()
    x = rng.standard_normal((5, k)).astype(np.float32)
    y = sess.run(None, {"A": x})[0]
    # fp32 rounding: relative to the sum of the magnitudes of the products (the sums cancel)
    ref = x.astype(np.float64) @ want.T.astype(np.float64)
    assert (np.abs(y - ref) <= 1e-5 * (np.abs(x) @ np.abs(want).T)).all()


def test_another_type_has_no_nbits_form():
    with pytest.raises(Exception, match="Q4_1"):
        gguf_codes.to_nbits("Q4_1", np.zeros((1, 20), np.uint8), 1, 32)


# ------------------------------------------------------------------ a tiny Llama with kept codes
VOCAB, D, HEADS, KV, FF, LAYERS = 64, 64, 4, 2, 96, 2
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
KINDS = {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0", "output": "Q4_0"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(cfg) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(VOCAB - 3)]
    return {"llama.vocab_size": VOCAB, "llama.context_length": 128, "llama.embedding_length": D,
            "llama.block_count": LAYERS, "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS,
            "llama.attention.head_count_kv": KV, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": D // HEADS,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (VOCAB - 3), "tokenizer.ggml.merges": ["t 1"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def _write_llama(path, tied: bool):
    """A tiny Llama as llama.cpp's converter writes it, its matrices in KINDS' types; returns the
    transformers model holding the file's weights (dequantised by gguf.quants)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=FF,
                                   max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in _meta(cfg).items():
        if isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name == "lm_head.weight" and tied:
                continue
            arr = (p.numpy() + np.random.default_rng(len(name)).standard_normal(p.shape) * 0.05).astype(np.float32)
            parts = name.split(".")
            if name == "lm_head.weight":
                g = "output"
            elif name == "model.embed_tokens.weight":
                g = "token_embd"
            elif name == "model.norm.weight":
                g = "output_norm"
            else:
                g = f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}"
            heads = HEADS if "attn_q" in g else KV if "attn_k" in g else None
            stored = _permute(arr, heads) if heads else arr
            kind = KINDS.get(g.split(".")[-1]) if arr.ndim == 2 else None
            if kind:
                raw = quants.quantize(stored, T[kind])
                w.add_tensor(f"{g}.weight", raw, raw_dtype=T[kind])
                back = quants.dequantize(raw, T[kind]).astype(np.float32)
                arr = _unpermute(back, heads) if heads else back
            else:
                w.add_tensor(f"{g}.weight", arr)
            p.copy_(torch.from_numpy(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


IDS = [5, 17, 42, 33, 3, 9, 60, 1]


def _logits(capsys, tmp_path, path, *flags):
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    rc, _, err = cli(capsys, "run", path, "--input", f"tokens=[{IDS}]", "--save", out, "--no-compile-cache", *flags)
    assert rc == 0, err
    return np.load(out / "logits.npy"), err


@pytest.mark.parametrize("tied", [False, True])
def test_kept_codes_give_the_dequantised_logits(tied, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _write_llama(tmp_path / "m.gguf", tied)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([IDS])).logits.numpy()
    fp32, _ = _logits(capsys, tmp_path, tmp_path / "m.gguf", "--gguf-weights", "dequantize")
    exact, err = _logits(capsys, tmp_path, tmp_path / "m.gguf", "--gguf-weights", "codes-fp32", "--explain")
    fast, _ = _logits(capsys, tmp_path, tmp_path / "m.gguf")
    np.testing.assert_allclose(fp32, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(exact, fp32, atol=2e-5, rtol=0)  # the same weights: accumulation order only
    # int8 activations per block of 32 (llama.cpp's arithmetic): close, not equal
    assert np.abs(fast - fp32).max() < 0.05 * np.abs(fp32).max()
    # q, o, gate: Q4_0; k: Q5_0; v, up: Q8_0 per layer; the head (Q8_0 tied table, else Q4_0); down: Q4_1 stays float
    assert "linears reading the GGUF file's own codes (MatMulNBits, no requantisation): 13" in err
    assert "Q4_1: 2 (a min per block" in err


def test_the_compiled_file_holds_the_codes_and_quantize_fills_the_rest(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    _write_llama(tmp_path / "m.gguf", False)
    sizes, ops = {}, {}
    for mode in ("codes", "dequantize"):
        out = tmp_path / f"{mode}.onnx"
        rc, _, err = cli(capsys, "compile", tmp_path / "m.gguf", "-o", out, "--gguf-weights", mode)
        assert rc == 0, err
        m = onnx.load(str(out))
        ops[mode] = sum(n.op_type == "MatMulNBits" for n in m.graph.node)
        sizes[mode] = sum(p.stat().st_size for p in tmp_path.glob(f"{mode}.onnx*"))
    assert ops == {"codes": 13, "dequantize": 0} and sizes["codes"] < sizes["dequantize"]
    # --quantize on top: the file's codes stay, the linears left in float (ffn_down, Q4_1) are quantised
    rc, _, err = cli(capsys, "compile", tmp_path / "m.gguf", "-o", tmp_path / "q.onnx", "--quantize", "int4-asym",
                     "--explain")
    assert rc == 0, err
    assert sum(n.op_type == "MatMulNBits" for n in onnx.load(str(tmp_path / "q.onnx")).graph.node) == 15
    index = json.loads(next((tmp_path / "cache" / "gguf").glob("m-*/gguf_codes/index.json")).read_text())
    assert index["model.layers.0.self_attn.k_proj.weight"] == {"type": "Q5_0", "bits": 8, "block": 32,
                                                               "shape": [KV * D // HEADS, D]}


def test_a_bad_gguf_weights_value_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):  # argparse's choices: a usage error, no traceback
        cli(capsys, "run", tmp_path / "m.gguf", "--gguf-weights", "int3")
    err = capsys.readouterr().err
    assert "--gguf-weights: invalid choice: 'int3'" in err and "dequantize" in err
    from tessera.runtime.options import RunOptions, UsageError

    with pytest.raises(UsageError, match="gguf_weights"):
        RunOptions(gguf_weights="int3").for_api().check()
