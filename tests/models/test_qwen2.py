"""Qwen2 (models/qwen2.tsr): a seeded, perturbed Hugging Face Qwen2ForCausalLM saved as a checkpoint
folder is the model (model_type "qwen2" picks the bundled spec, config.json through the mapping's
[config] table): its parameter count is transformers', its logits equal transformers' in the numpy
interpreter and onnxruntime, the q/k/v biases are what the comparison checks (zeroed, the logits move
far past the tolerance), the cached decoder's greedy tokens equal transformers' ``generate``, and each
variant's parameter count equals transformers' model built from that variant's config on the meta
device."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, build, cli, hf_greedy, ort_run, perturbed
from tessera.compiler.ops import interpret
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "qwen2.tsr"


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=request.param)
    model = perturbed(transformers.Qwen2ForCausalLM(cfg), 0.1)
    folder = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(folder)
    return model, folder


def test_logits_equal_transformers(case):
    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = np.random.default_rng(0).integers(1, 200, (2, 19)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL
    unbiased = {p: (np.zeros_like(w) if p.endswith(("q.bias", "k.bias", "v.bias")) else w) for p, w in weights.items()}
    assert np.abs(interpret.run(built.graph, unbiased, {"tokens": tokens})["logits"] - ref).max() > 100 * TOL


def test_the_folder_alone_generates_as_transformers(case, tmp_path, capsys):
    import json

    model, folder = case
    prompt = np.random.default_rng(3).integers(1, 200, 9).tolist()
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens=[{prompt}]", "--max-new-tokens", 12,
                       "--ignore-eos", "--format", "json", "-q")
    assert rc == 0, err
    assert json.loads(out)["outputs"][0]["tokens"] == hf_greedy(model, [prompt], 12)[0]


# each variant's config.json fields (huggingface.co/Qwen/Qwen2.5-*): Qwen2.5-0.5B has 494,032,768 parameters
VARIANTS = {
    "0_5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1_5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, vocab_size=152064),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_counts_equal_transformers_on_the_meta_device(variant):
    fields = dict(VARIANTS[variant])
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=fields.pop("vocab_size", 151936),
                                                                       **fields))
    want = sum(p.numel() for p in model.parameters())
    assert build("qwen2", variant).param_count() == want
    if variant == "0_5b":
        assert want == 494_032_768
