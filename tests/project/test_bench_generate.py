"""bench/generate.py's arguments: --quantize-block and --quantize-head taken only with a 4-bit
--quantize (they set Tessera's compile and onnxruntime-genai's builder), refused otherwise before any
model is built, rather than ignored while the run goes on at fp32; --checkpoint (a real model's
transformers folder) refused with a reason when it is not one, its prompt drawn from the vocabulary
without the tokenizer's added tokens, and compiled as ``tessera generate DIR`` does: its greedy
tokens are transformers' on the same folder."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import hf_greedy, load_bench, perturbed


def _refused(monkeypatch, *argv) -> str:
    bench = load_bench("generate")
    monkeypatch.setattr(sys, "argv", ["generate.py", *argv])
    monkeypatch.setattr(bench, "make_weights", lambda *a: pytest.fail("a model was built before the refusal"))
    monkeypatch.setattr(bench, "make_genai_model", lambda *a: pytest.fail("a model was built before the refusal"))
    with pytest.raises(SystemExit) as e:
        bench.main()
    return e.value.code


def test_a_block_without_int4_is_refused(monkeypatch):
    assert _refused(monkeypatch, "--quantize-block", "64") == "--quantize-block needs --quantize int4"


def test_a_head_without_int4_is_refused(monkeypatch):
    assert _refused(monkeypatch, "--quantize-head", "8") == "--quantize-head needs --quantize int4 or int4-asym"


def _tied_llama(folder, vocab: int = 300, added: tuple[int, ...] = (0, 1, 2)):
    """A 2-layer Llama with a tied head (SmolLM2's layout) saved with a word-level tokenizer whose
    added tokens are ``added``; the transformers model is returned as the reference."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models

    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    hf = perturbed(transformers.LlamaForCausalLM(cfg), 0.3)  # 0.08 leaves it repeating one token
    hf.save_pretrained(folder, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.add_special_tokens([AddedToken(f"w{i}", special=True) for i in added])
    tok.save(str(folder / "tokenizer.json"))
    return hf


def test_a_folder_without_a_config_or_tokenizer_is_refused(monkeypatch, tmp_path):
    assert _refused(monkeypatch, "--checkpoint", str(tmp_path / "absent")).endswith("absent: not a folder")
    assert "no config.json" in _refused(monkeypatch, "--checkpoint", str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert "no tokenizer.json" in _refused(monkeypatch, "--checkpoint", str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert "no readable vocab_size" in _refused(monkeypatch, "--checkpoint", str(tmp_path))


def test_llama_cpp_on_a_checkpoint_is_refused(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    (tmp_path / "tokenizer.json").write_text("{}")
    said = _refused(monkeypatch, "--checkpoint", str(tmp_path), "--cases", "llama-cpp",
                    "--llama-cpp-python", sys.executable, "--llama-cpp-tools", str(tmp_path))
    assert "bench/gguf_llama_cpp.py" in said


def test_a_folder_transformers_cannot_read_is_refused_for_its_cases(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model-00000.safetensors").write_bytes(b"")  # as Tessera names a converted GGUF file's shard
    said = _refused(monkeypatch, "--checkpoint", str(tmp_path), "--cases", "tessera", "hf-sdpa")
    assert "no model.safetensors" in said and "hf-sdpa" in said


def test_the_prompt_leaves_out_the_added_tokens(tmp_path):
    bench = load_bench("generate")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 40}))
    added = list(range(0, 40, 2))  # every even id special: a uniform draw would hit one in 512 draws
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": i} for i in added]}))
    ids = bench.prompt_ids(512, "llama", str(tmp_path))
    assert len(ids) == 512 and set(ids) <= set(range(1, 40, 2)) and len(set(ids)) > 10


def test_a_tied_checkpoint_generates_transformers_tokens(tmp_path):
    bench = load_bench("generate")
    hf = _tied_llama(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    compiled = bench.compile_tessera(out, "llama", "buffer", "none", str(tmp_path / "ckpt"))
    assert compiled["weights_read_bytes"] == sum(p.numel() * 4 for p in hf.parameters())  # the tied table once
    prompt = bench.prompt_ids(12, "llama", str(tmp_path / "ckpt"))
    got = bench.run_tessera(out, "llama", "buffer", 12, 10, 0, 1, str(tmp_path / "ckpt"))["tokens"]
    want = hf_greedy(hf, [prompt], 10)[0]
    assert len(set(want)) > 3 and got == want  # a reference that moves, as Tessera's must
