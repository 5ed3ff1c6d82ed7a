"""gpt-oss (models/gpt_oss.tsr): a seeded, perturbed Hugging Face GptOssForCausalLM saved as a checkpoint
folder is the model (model_type "gpt_oss"): its stacked expert tensors unstacked by the mapping, parameter
count, logits (numpy interpreter, onnxruntime, fused) and the cached decoder's greedy tokens for a
left-padded batch of two (and with a repetition penalty) equal transformers', with a sliding window
shorter than the test's sequences (so the sliding layers differ from the full ones), YaRN rotary,
attention sinks and the clamped, biased experts; each variant's count equals transformers' model on
the meta device (gpt-oss-20b: 20.9 B, 3.6 B active, as OpenAI's model card)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, build, cli, hf_greedy, ort_run
from tessera.compiler.analysis.params import parameter_report
from tessera.compiler.ops import interpret
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "gpt_oss.tsr"
VOCAB = 100


def tiny_config(**kw):
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 8, "rope_theta": 150000.0}, **kw)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(tiny_config()).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers:  # experts large enough that the SwiGLU's clamps (limit 7) bite
            layer.mlp.experts.gate_up_proj.mul_(20.0)
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(folder)
    return model, folder


def test_the_clamps_bite(case):
    """The perturbed experts reach the limit on both sides, so the clamp is exercised, not only written."""
    model, _ = case
    hits = []
    layer = model.model.layers[0]
    h = model.model.embed_tokens(torch.arange(VOCAB)[None])
    x = layer.post_attention_layernorm(h)[0]
    gate_up = x @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
    hits = ((gate_up[:, ::2] > 7.0).any().item(), (gate_up[:, 1::2].abs() > 7.0).any().item())
    assert hits == (True, True)


def test_logits_and_count_equal_transformers(case):
    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, 19)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    fused = pipeline.build(SPEC, weights=str(folder)).graph
    assert all(s.fused for s in optimize(fused))
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(fused, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL


def test_the_window_matters_at_this_length(case):
    """With every layer full, transformers' logits move: the sliding layers are tested, not idle."""
    model, folder = case
    full = transformers.GptOssForCausalLM(tiny_config(layer_types=["full_attention"] * 3)).eval()
    full.load_state_dict(model.state_dict())
    tokens = torch.from_numpy(np.random.default_rng(0).integers(1, VOCAB, (2, 19)))
    with torch.no_grad():
        assert (full(input_ids=tokens).logits - model(input_ids=tokens).logits).abs().max() > 1e-2


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["greedy", "repetition-penalty"])
def test_cached_greedy_generation_of_a_left_padded_batch_equals_transformers(case, penalty):
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate
    from tessera.runtime.generation.sampling import Sampling

    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    compiled, info = compile_cached(pipeline.build(SPEC, weights=str(folder)), weights)
    cached = CachedModel(compiled.SerializeToString(), info)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, 11).tolist(), rng.integers(1, VOCAB, 4).tolist()]
    new = 12  # past the window of 5: the cached sliding layers mask keys a full layer sees
    kw = {} if penalty == 1.0 else {"repetition_penalty": penalty}
    ours = generate(cached, prompts, new, Sampling(**kw)).tokens
    assert ours == hf_greedy(model, prompts, new, **kw)
    assert len({t for row in ours for t in row}) > 4, "degenerate: the model repeats one token"


def test_the_folder_alone_is_the_model(case, tmp_path, capsys):
    model, folder = case
    out = tmp_path / "m.onnx"
    rc, stdout, err = cli(capsys, "compile", folder, "--explain", "-o", out)
    assert rc == 0, err
    assert "attention sites: 3 (3 fused, 0 not fused)" in stdout + err, stdout + err
    assert "top 2 of 4 experts: sparse" in stdout + err, stdout + err


def test_quantised_checkpoints_are_refused_by_their_config(case, tmp_path):
    """A quantization_config other than MXFP4 (tests/models/test_gpt_oss_mxfp4.py: the released checkpoints')
    is refused up front, by name."""
    import json
    import shutil

    _, folder = case
    copy = tmp_path / "bnb"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes_4bit"}
    (copy / "config.json").write_text(json.dumps(cfg))
    from tessera.runtime.io.weights import WeightsError

    with pytest.raises(WeightsError, match=r'quantization_config.quant_method = "bitsandbytes_4bit" is not supported'):
        pipeline.build(SPEC, weights=str(copy))


# the released models' config.json: gpt-oss-120b is GptOssConfig's defaults; gpt-oss-20b has 24 layers of 32
VARIANTS = {"120b": dict(), "20b": dict(num_hidden_layers=24, num_local_experts=32)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_counts_equal_transformers_on_the_meta_device(variant):
    cfg = transformers.GptOssConfig(**VARIANTS[variant])
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(cfg)
    rep = parameter_report(build("gpt_oss", variant))
    assert rep["total"] == sum(p.numel() for p in model.parameters())
    # active per token: all but the experts a token does not run, each gate_up and down with biases
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                                         experts.down_proj_bias)) // cfg.num_local_experts
    idle = cfg.num_hidden_layers * (cfg.num_local_experts - cfg.num_experts_per_tok) * per_expert
    assert rep["active_per_token"] == rep["total"] - idle
    # OpenAI's model card (arXiv 2508.10925, table 1): 116.83 B total for 120b, 20.91 B for 20b; active per
    # token 5.13 B and 3.61 B there count the unembedding but not the embedding (a table lookup)
    card = {"120b": (116.83, 5.13), "20b": (20.91, 3.61)}[variant]
    embedding = cfg.vocab_size * cfg.hidden_size
    assert round(rep["total"] / 1e9, 2) == card[0]
    assert round((rep["active_per_token"] - embedding) / 1e9, 2) == card[1]
