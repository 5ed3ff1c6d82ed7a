"""Every architecture in models/ matches an independent reference implementation.

Each family builds a small reference model in PyTorch (Hugging Face transformers,
or torch.nn.Transformer), seeded and with every parameter perturbed so that no
bias is zero and no norm scale is one, saves it as safetensors under the
reference's own names, imports that file through the family's
``models/<family>.hf.toml`` mapping, and compares the outputs: fp32, batch 2,
random inputs, the second sequence shorter (through the padding mask where the
family has one), max abs difference at most 1e-4, in the numpy interpreter, in
onnxruntime, and through ``tessera compile --set ... --weights``. GPT-2 is
covered the same way in test_gpt2_hf.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import pytest

from conftest import MODELS, build, ort_run
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import WeightsError, load_weights, name_map_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")

TOL = 1e-4
FAMILIES = ["bert", "vit", "llama", "llama31", "mixtral", "transformer"]


@dataclass
class Case:
    """One family: the spec, its --set overrides, the checkpoint, inputs and the reference's outputs."""

    spec: str
    variant: str | None
    sets: dict
    ckpt: object
    feeds: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]
    valid: dict[str, np.ndarray] = field(default_factory=dict)  # output -> [B, T] positions to compare
    model: object = None

    def set_args(self) -> list[str]:
        return [a for k, v in self.sets.items() for a in ("--set", f"{k}={v}")]


def _perturb(model, scale=0.05):
    """Move every parameter off its textbook initial value (zero biases, unit norm scales)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def _save(model, folder):
    model.save_pretrained(folder, safe_serialization=True)
    return folder / "model.safetensors"


def _padded_batch(rng, vocab, t, short):
    """Two random sequences of length t; the second is real for `short` tokens, then padding (id 0)."""
    tokens = rng.integers(1, vocab, size=(2, t)).astype(np.int64)
    mask = np.ones((2, t), dtype=np.int64)
    mask[1, short:] = 0
    tokens[1, short:] = 0
    return tokens, mask


def max_diff(case: Case, outputs: dict[str, np.ndarray]) -> float:
    worst = 0.0
    for name, ref in case.ref.items():
        got = outputs[name]
        assert got.shape == ref.shape, name
        diff = np.abs(got - ref)
        if name in case.valid:
            diff = diff[case.valid[name]]
        worst = max(worst, float(diff.max()))
    return worst


# ------------------------------------------------------------------ the references
def bert_case(folder) -> Case:
    """BERT / MiniLM: Hugging Face BertModel (post-norm, token types, padding mask, pooler)."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, max_position_embeddings=64, type_vocab_size=2, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  layer_norm_eps=1e-12, hidden_act="gelu", hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = _perturb(transformers.BertModel(cfg, add_pooling_layer=True).eval())
    rng = np.random.default_rng(0)
    tokens, mask = _padded_batch(rng, 200, 11, 6)
    types = rng.integers(0, 2, size=tokens.shape).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), token_type_ids=torch.from_numpy(types),
                    attention_mask=torch.from_numpy(mask))
    return Case("bert", None, dict(vocab=200, ctx=64, types=2, d=32, layers=2, heads=4, d_ff=64, eps=1e-12),
                _save(model, folder), {"tokens": tokens, "token_types": types, "mask": mask},
                {"hidden": out.last_hidden_state.numpy(), "pooled": out.pooler_output.numpy()},
                {"hidden": mask.astype(bool)}, model)


def vit_case(folder) -> Case:
    """ViT-B/16: Hugging Face ViTModel (16x16 stride-16 patch convolution, class token, pooler)."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=48, patch_size=16, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, layer_norm_eps=1e-12,
                                 hidden_act="gelu", qkv_bias=True, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    model = _perturb(transformers.ViTModel(cfg, add_pooling_layer=True).eval())
    pixels = np.random.default_rng(0).standard_normal((2, 3, 48, 48)).astype(np.float32)
    with torch.no_grad():
        out = model(pixel_values=torch.from_numpy(pixels))
    return Case("vit", "b16", dict(image=48, patch=16, channels=3, d=32, layers=2, heads=4, d_ff=64, eps=1e-12),
                _save(model, folder), {"pixels": pixels},
                {"hidden": out.last_hidden_state.numpy(), "pooled": out.pooler_output.numpy()}, model=model)


def _llama_case(folder, variant: str, sets: dict, t: int, short: int, **config) -> Case:
    """A small LlamaForCausalLM (RMSNorm, SwiGLU, RoPE theta 500000, grouped-query attention) and its logits."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, rope_theta=500000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=128, attention_bias=False,
                                   mlp_bias=False, tie_word_embeddings=False, hidden_act="silu", **config)
    model = _perturb(transformers.LlamaForCausalLM(cfg).eval())
    tokens, mask = _padded_batch(np.random.default_rng(0), 256, t, short)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask)).logits.numpy()
    # causal: right padding cannot reach the real tokens before it, so the spec needs no mask input
    return Case("llama", variant, dict(vocab=256, d=64, layers=2, heads=4, kv_heads=2, d_ff=96, eps=1e-5, **sets),
                _save(model, folder), {"tokens": tokens}, {"logits": ref}, {"logits": mask.astype(bool)}, model)


def llama_case(folder) -> Case:
    """Llama-3."""
    return _llama_case(folder, "llama3_8b", dict(theta=500000.0), 12, 7)


# Llama 3.1's rope scaling with a short original context, so that the head size of 16 has
# frequencies in all three bands: kept (wavelength < 64 / 4), divided by 8 (> 64 / 1), and between
LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def llama31_case(folder) -> Case:
    """Llama-3.1: rope_scaling of type "llama3" (frequency-dependent scaling)."""
    return _llama_case(folder, "llama3_1_8b", dict(rope_original_ctx=64), 40, 30,
                       rope_scaling={"rope_type": "llama3", **LLAMA31_SCALING})


def mixtral_case(folder) -> Case:
    """Mixtral: Hugging Face MixtralForCausalLM (router softmax, top-2 of 8 experts, renormalised)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48, num_local_experts=8,
                                     num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5,
                                     max_position_embeddings=128, sliding_window=None, router_jitter_noise=0.0,
                                     tie_word_embeddings=False)
    model = _perturb(transformers.MixtralForCausalLM(cfg).eval())
    tokens, mask = _padded_batch(np.random.default_rng(0), 256, 12, 7)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask)).logits.numpy()
    return Case("mixtral", "8x7b",
                dict(vocab=256, d=64, layers=2, heads=4, kv_heads=2, d_ff=48, experts=8, top=2, theta=1e6, eps=1e-5),
                _save(model, folder), {"tokens": tokens}, {"logits": ref}, {"logits": mask.astype(bool)}, model)


def _sinusoidal(n, d):
    """The position table of Vaswani et al. (PyTorch tutorial form): sin on even, cos on odd features."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


def transformer_case(folder) -> Case:
    """The original encoder-decoder: torch.nn.Transformer plus a shared embedding and output layer."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    vocab, d, layers, heads, d_ff, eps = 200, 32, 2, 4, 64, 1e-5
    core = torch.nn.Transformer(d, heads, layers, layers, d_ff, dropout=0.0, activation="relu", batch_first=True,
                                norm_first=False, layer_norm_eps=eps)
    embed = torch.nn.Embedding(vocab, d)
    _perturb(core.eval())
    _perturb(embed)
    ckpt = folder / "model.safetensors"
    # torch's own state_dict names, plus the shared table; the output layer is that same table
    save_file({**{k: v.contiguous() for k, v in core.state_dict().items()}, "embed.weight": embed.weight.detach()},
              str(ckpt))
    rng = np.random.default_rng(0)
    src, src_mask = _padded_batch(rng, vocab, 9, 5)
    tgt, tgt_mask = _padded_batch(rng, vocab, 7, 4)
    with torch.no_grad():
        s, t = torch.from_numpy(src), torch.from_numpy(tgt)
        x = embed(s) * math.sqrt(d) + _sinusoidal(s.shape[1], d)
        y = embed(t) * math.sqrt(d) + _sinusoidal(t.shape[1], d)
        pad = torch.from_numpy(src_mask == 0)
        h = core(x, y, tgt_mask=core.generate_square_subsequent_mask(t.shape[1]), src_key_padding_mask=pad,
                 memory_key_padding_mask=pad, tgt_is_causal=True)
        ref = (h @ embed.weight.T).numpy()
    return Case("transformer", "base", dict(vocab=vocab, d=d, layers=layers, heads=heads, d_ff=d_ff, eps=eps),
                ckpt, {"src": src, "src_mask": src_mask, "tgt": tgt}, {"logits": ref},
                {"logits": tgt_mask.astype(bool)}, (core, embed))


BUILDERS = {"bert": bert_case, "vit": vit_case, "llama": llama_case, "llama31": llama31_case,
            "mixtral": mixtral_case, "transformer": transformer_case}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made: dict[str, Case] = {}

    def get(family: str) -> Case:
        if family not in made:
            made[family] = BUILDERS[family](tmp_path_factory.mktemp(family))
        return made[family]
    return get


# ------------------------------------------------------------------ the comparisons
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference(cases, family):
    case = cases(family)
    graph = build(case.spec, case.variant, **case.sets)
    weights = load_weights(graph, case.ckpt, name_map_for(MODELS / f"{case.spec}.tsr"))
    diff_np = max_diff(case, interpret.run(graph, weights, case.feeds))
    diff_ort = max_diff(case, ort_run(graph, weights, case.feeds))
    print(f"{family}: max abs difference numpy {diff_np:.2e}, onnxruntime {diff_ort:.2e}")
    assert diff_np <= TOL and diff_ort <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_with_set_and_weights_through_the_cli(cases, family, tmp_path, capsys):
    import onnxruntime as ort

    from tessera.runtime.cli import main

    case = cases(family)
    out = tmp_path / f"{family}.onnx"
    variant = ["--variant", case.variant] if case.variant else []
    rc = main(["compile", str(MODELS / f"{case.spec}.tsr"), *variant, *case.set_args(),
               "--weights", str(case.ckpt), "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    diff = max_diff(case, dict(zip(names, sess.run(names, case.feeds))))
    print(f"{family}: compiled file, max abs difference {diff:.2e}")
    assert diff <= TOL


def test_weights_of_another_size_are_listed_by_name(cases):
    """A checkpoint that does not fit: missing, unexpected and mis-shaped tensors, each by name."""
    case = cases("bert")
    graph = build("bert", None, **{**case.sets, "layers": 3, "d_ff": 48})
    with pytest.raises(WeightsError) as e:
        load_weights(graph, case.ckpt, name_map_for(MODELS / "bert.tsr"))
    msg = str(e.value)
    assert "missing (16): layers.2.attn.q.weight" in msg
    assert "mis-shaped: layers.0.mlp.fc.weight is [64, 32], expected [48, 32]" in msg
    graph = build("bert", None, **{**case.sets, "layers": 1})
    with pytest.raises(WeightsError) as e:  # a 2-layer checkpoint is not silently cut down to 1 layer
        load_weights(graph, case.ckpt, name_map_for(MODELS / "bert.tsr"))
    assert "unexpected (16): encoder.layer.1.attention.output.LayerNorm.bias" in str(e.value)
    assert "missing" not in str(e.value)


def test_mismatch_through_the_cli_exits_2(cases, tmp_path, capsys):
    from tessera.runtime.cli import main

    case = cases("llama")
    sets = [a for k, v in {**case.sets, "kv_heads": 4}.items() for a in ("--set", f"{k}={v}")]
    rc = main(["compile", str(MODELS / "llama.tsr"), "--variant", "llama3_8b", *sets, "--weights", str(case.ckpt),
               "-o", str(tmp_path / "x.onnx")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "mis-shaped: layers.0.attn.k.weight is [32, 64], expected [64, 64]" in err


def test_llama31_rope_scaling_matters(cases):
    """The Llama 3.1 comparison tests the scaling only if plain RoPE would not pass it, and its
    inverse frequencies are those of transformers' own llama3 rope function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tessera.compiler.reference.numerics import rope_inv_freq

    case = cases("llama31")
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](case.model.config, "cpu")
    scaling = tuple(LLAMA31_SCALING.values())
    got = rope_inv_freq(16, 500000.0, scaling)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    plain = rope_inv_freq(16, 500000.0)
    assert (got == plain).any() and (np.isclose(got, plain / 8)).any() and \
        ((got != plain) & ~np.isclose(got, plain / 8)).any(), "not all three bands are exercised"
    graph = build("llama", "llama3_1_8b", **{**case.sets, "rope_factor": 1.0})
    weights = load_weights(graph, case.ckpt, name_map_for(MODELS / "llama.tsr"))
    assert max_diff(case, interpret.run(graph, weights, case.feeds)) > 100 * TOL


def test_mixtral_routes_tokens_to_different_experts(cases):
    """The Mixtral comparison means something only if the top-2 choice varies from token to token."""
    case = cases("mixtral")
    graph = build("mixtral", "8x7b", **case.sets)
    weights = load_weights(graph, case.ckpt, name_map_for(MODELS / "mixtral.tsr"))
    x = weights["embed.weight"][case.feeds["tokens"]]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * weights["layers.0.moe_norm.weight"]
    chosen = np.argsort(-(x @ weights["layers.0.moe.router.weight"].T), axis=-1)[..., :2].reshape(-1, 2)
    assert len({tuple(sorted(r)) for r in chosen.tolist()}) > 3


@pytest.mark.parametrize("impl", ["moe", "gather"])
def test_mixtral_sparse_experts_match_transformers(cases, impl):
    """The sparse experts (compiler/passes/sparse_moe.py; onnxruntime's MoE kernel or the standard-op
    gather/scatter form) against MixtralForCausalLM, numpy interpreter and onnxruntime."""
    from tessera.compiler.passes.sparse_moe import SparseExperts

    case = cases("mixtral")
    graph = build("mixtral", "8x7b", **case.sets)
    result = SparseExperts(impl=impl)(graph)
    assert [s.sparse for s in result.notes] == [True, True]
    assert "topk_gates" not in {n.op for n in graph.nodes.values()}
    weights = load_weights(graph, case.ckpt, name_map_for(MODELS / "mixtral.tsr"))
    diff_np = max_diff(case, interpret.run(graph, weights, case.feeds))
    diff_ort = max_diff(case, ort_run(graph, weights, case.feeds))
    print(f"mixtral sparse ({impl}): max abs difference numpy {diff_np:.2e}, onnxruntime {diff_ort:.2e}")
    assert diff_np <= TOL and diff_ort <= TOL


def test_bert_task_model_checkpoint_loads(cases, tmp_path):
    """BertForPreTraining names everything 'bert.*' and adds 'cls.*' heads: the encoder loads, the heads are dropped."""
    case = cases("bert")
    torch.manual_seed(1)
    model = _perturb(transformers.BertForPreTraining(case.model.config).eval())
    ckpt = _save(model, tmp_path)
    graph = build("bert", None, **case.sets)
    weights = load_weights(graph, ckpt, name_map_for(MODELS / "bert.tsr"))
    feeds = case.feeds
    with torch.no_grad():
        ref = model.bert(input_ids=torch.from_numpy(feeds["tokens"]),
                         token_type_ids=torch.from_numpy(feeds["token_types"]),
                         attention_mask=torch.from_numpy(feeds["mask"]))
    ours = ort_run(graph, weights, feeds)
    valid = feeds["mask"].astype(bool)
    assert np.abs(ours["hidden"] - ref.last_hidden_state.numpy())[valid].max() <= TOL
    assert np.abs(ours["pooled"] - ref.pooler_output.numpy()).max() <= TOL


def test_folder_of_shards(cases, tmp_path):
    """--weights FOLDER reads every *.safetensors shard in it (a large checkpoint's layout)."""
    case = cases("llama")
    case.model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1, shards
    graph = build("llama", case.variant, **case.sets)
    weights = load_weights(graph, tmp_path, name_map_for(MODELS / "llama.tsr"))
    assert max_diff(case, ort_run(graph, weights, case.feeds)) <= TOL
