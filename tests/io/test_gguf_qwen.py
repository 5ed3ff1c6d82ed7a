"""GGUF files of architectures qwen2, qwen3 and qwen3moe (runtime/io/gguf_file.py).

Each file is written here as llama.cpp's converter writes it (convert_hf_to_gguf.py Qwen2Model,
Qwen3Model, Qwen3MoeModel: llama's tensor names, q and k NOT permuted -- llama.cpp rotates Qwen with
the NeoX layout, Hugging Face's rotate-half --, Qwen2's q/k/v biases, Qwen3's q/k norms, Qwen3-MoE's
router and experts stacked [experts, out, in]) from a tiny seeded, perturbed transformers model.
Two references, both independent of Tessera: transformers' own GGUF loader (``gguf_file=``, given the
model's config) must read the file's tensors back to the model's logits (so the file is laid out as
transformers expects llama.cpp's), and
Tessera's logits on the file must equal the model's. The Q4_1 case replaces the model's weights by
those the file holds, dequantised by test_gguf's _by_hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli, cli_error  # noqa: E402
from test_gguf import _by_hand, _quantize_q4_1, _write  # noqa: E402

VOCAB, D, HEADS, KV, FF, LAYERS, THETA = 64, 64, 4, 2, 96, 2, 50000.0
EXPERTS, TOP, D_EXPERT = 4, 2, 32
IDS = [5, 17, 42, 33, 3, 9, 60, 1]

# Hugging Face's name (less model. and the layer) -> llama.cpp's (gguf.constants TENSOR_NAMES)
NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
         "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight",
         **{f"self_attn.{x}_proj.{p}": f"attn_{x}.{p}" for x in "qkv" for p in ("weight", "bias")}}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def _model(arch: str, tied: bool):
    common = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, max_position_embeddings=128, rope_theta=THETA, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=FF, **common))
    elif arch == "qwen3":  # a head size of its own: 4 heads of 32 on d 64
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=FF, head_dim=32, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=FF, head_dim=32, moe_intermediate_size=D_EXPERT, num_experts=EXPERTS,
            num_experts_per_tok=TOP, norm_topk_prob=True, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _meta(arch: str, cfg) -> dict:
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 3)]
    meta = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": THETA, "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }
    if arch != "qwen2":  # Qwen3Model writes head_dim as key_length and value_length
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim})
    if arch == "qwen3moe":
        meta.update({"expert_count": EXPERTS, "expert_used_count": TOP, "expert_feed_forward_length": D_EXPERT})
    return {**{f"{arch}.{k}": v for k, v in meta.items()},
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (VOCAB - 3), "tokenizer.ggml.merges": ["a a", "b b"],
            "tokenizer.ggml.eos_token_id": 2}


def _stored(w: np.ndarray, kind: str):
    """(GGUF type, array as stored) of one weight; a Q4_1 matrix's own dequantisation (by hand) as the value
    the model takes."""
    if kind != "Q4_1" or w.ndim < 2:
        return ("F32", w), w
    raw = np.stack([_quantize_q4_1(m) for m in w.reshape(-1, *w.shape[-2:])]).reshape(*w.shape[:-1], -1)
    flat = raw.reshape(-1, raw.shape[-1])
    back = np.stack([_by_hand("Q4_1", flat[r].tobytes(), w.shape[-1]) for r in range(flat.shape[0])])
    return ("Q4_1", raw), back.reshape(w.shape).astype(np.float32)


def _gguf_of(arch: str, model, path, kind: str) -> None:
    """``model`` written as llama.cpp's converter writes it; its weights replaced by the file's."""
    cfg = model.config
    tensors = {}
    state = model.state_dict()
    with torch.no_grad():
        for name, p in state.items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            w = p.numpy().astype(np.float32)
            parts = name.split(".")
            if name == "lm_head.weight":
                gname = "output.weight"
            elif parts[1] != "layers":
                gname = NAMES[".".join(parts[1:])]
            elif parts[3:5] == ["mlp", "experts"]:  # transformers 5 keeps the experts fused: gate_up_proj [E, 2F, D]
                continue
            else:
                gname = f"blk.{parts[2]}.{NAMES['.'.join(parts[3:])]}"
            tensors[gname], back = _stored(w, kind)
            p.copy_(torch.from_numpy(back))
        for i, layer in enumerate(getattr(model.model, "layers")):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            stacks = _expert_stacks(experts)
            for hf, stack in stacks.items():
                tensors[f"blk.{i}.{EXPERT_NAMES[hf]}"], stacks[hf] = _stored(stack, kind)
            _set_expert_stacks(experts, stacks)
    _write(path, tensors, arch=arch, meta=_meta(arch, cfg))


def _expert_stacks(experts) -> dict:
    """The experts as llama.cpp stacks them, [experts, out, in] each (transformers 5: gate_up_proj [E, 2F, D],
    gate rows first; down_proj [E, D, F]); older transformers: one module per expert."""
    if hasattr(experts, "gate_up_proj"):
        gu = experts.gate_up_proj.detach().numpy()
        f = gu.shape[1] // 2
        return {"gate_proj": gu[:, :f].copy(), "up_proj": gu[:, f:].copy(), "down_proj": experts.down_proj.detach().numpy().copy()}
    return {hf: np.stack([getattr(e, hf).weight.detach().numpy() for e in experts]) for hf in EXPERT_NAMES}


def _set_expert_stacks(experts, stacks: dict) -> None:
    with torch.no_grad():
        if hasattr(experts, "gate_up_proj"):
            experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([stacks["gate_proj"], stacks["up_proj"]], 1)))
            experts.down_proj.copy_(torch.from_numpy(stacks["down_proj"]))
            return
        for e, expert in enumerate(experts):
            for hf in EXPERT_NAMES:
                getattr(expert, hf).weight.copy_(torch.from_numpy(stacks[hf][e]))


CASES = [("qwen2", "F32", False), ("qwen2", "Q4_1", True), ("qwen3", "F32", True), ("qwen3", "Q4_1", False),
         ("qwen3moe", "F32", False), ("qwen3moe", "Q4_1", True)]


@pytest.mark.parametrize("arch,kind,tied", CASES)
def test_a_tiny_gguf_qwen_gives_transformers_logits(arch, kind, tied, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(arch, tied)
    path = tmp_path / "tiny.gguf"
    _gguf_of(arch, model, path, kind)  # the model now holds the file's (dequantised) weights
    with torch.no_grad():
        want = model(input_ids=torch.tensor([IDS])).logits.numpy()
        # transformers reads the file as llama.cpp wrote it (no q/k permutation for Qwen): the file is faithful
        # the config given: transformers' GGUF config maps miss qwen3's attention.key_length and qwen3moe's
        # expert_feed_forward_length (its defaults, 128 and 768, would be taken); its tensors are what is checked
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                                   config=model.config, dtype=torch.float32).eval()
        np.testing.assert_allclose(theirs(input_ids=torch.tensor([IDS])).logits.numpy(), want, atol=1e-5, rtol=0)
    capsys.readouterr()
    modes = [["--gguf-weights", "dequantize"]] + ([["--gguf-weights", "codes-fp32"]] if kind == "Q4_1" else [])
    for how in modes:
        rc, _, err = cli(capsys, "run", path, "--input", f"tokens=[{IDS}]", "--save", tmp_path / "out", *how)
        assert rc == 0, err
        got = np.load(tmp_path / "out" / "logits.npy")
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    config = json.loads(next((tmp_path / "cache" / "gguf").glob("tiny-*/config.json")).read_text())
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == KV


def test_qwen3moe_expert_stacks_are_named_as_dequantised(tmp_path, capsys, monkeypatch):
    """The sparse experts read fp32 weights: a Q4_1 expert stack is dequantised, and the note says why."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    _gguf_of("qwen3moe", _model("qwen3moe", False), tmp_path / "moe.gguf", "Q4_1")
    rc, _, err = cli(capsys, "run", tmp_path / "moe.gguf", "--input", f"tokens=[{IDS}]", "--explain")
    assert rc == 0, err
    assert f"Q4_1: {3 * LAYERS} (expert stacks" in err, err
    assert f"top {TOP} of {EXPERTS} experts: sparse" in err, err  # split per expert, the experts builtin's form


def test_unread_qwen_metadata_and_another_architecture_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _model("qwen2", False)
    _gguf_of("qwen2", model, tmp_path / "ok.gguf", "F32")
    from tessera.runtime.io import gguf_file

    src = gguf_file.GGUFModel(tmp_path / "ok.gguf")
    tensors = {n: ("F32", np.asarray(t.data)) for n, t in src.tensors.items()}
    meta = _meta("qwen2", model.config)
    _write(tmp_path / "yarn.gguf", tensors, arch="qwen2", meta=dict(meta, **{"qwen2.rope.scaling.type": "yarn"}))
    err = cli_error(capsys, "report", tmp_path / "yarn.gguf")
    assert "qwen2.rope.scaling.type = 'yarn'" in err
    _write(tmp_path / "phi.gguf", tensors, arch="phi2", meta={})
    err = cli_error(capsys, "run", tmp_path / "phi.gguf", "--input", f"tokens=[{IDS}]")
    assert "architecture 'phi2'" in err and "qwen2" in err and "qwen3moe" in err


def test_the_qwen2_pre_tokenizer_tokenizes_as_transformers_gguf_tokenizer(tmp_path):
    """tokenizer.ggml.pre = "qwen2" (Qwen2's and Qwen3's files): Llama 3's split with digits one by one.
    The reference is transformers' own GGUF tokenizer on the same file."""
    from tokenizers import Tokenizer, pre_tokenizers

    from tessera.runtime.io import gguf_tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["i n", "Ġ t", "Ġt h", "2 0", "Ġ 1", "' L", "'L L"]
    tokens = ["<|endoftext|>"] + alphabet + [m.replace(" ", "") for m in merges]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": False}
    _write(tmp_path / "tok.gguf", {"token_embd.weight": ("F32", np.zeros((len(tokens), 4), np.float32))},
           arch="qwen2", meta=meta)
    assert gguf_tokenizer.write(meta, "qwen2", tmp_path, 128) is None
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in ["in 2024.\n\nI'LL think 123456 the", "  tin\t20 20  ", "x'S 1 12 ñ 漢字 🙂"]:
        assert ours.encode(text).ids == theirs(text, add_special_tokens=False)["input_ids"], text
    # one digit a token: "2024" is never "20" + "24" or "202" + "4"
    assert [ours.decode([i]) for i in ours.encode("2024").ids] == ["2", "0", "2", "4"]
