"""Gemma 3's text decoder (models/gemma3.tsr): a seeded, perturbed Hugging Face Gemma3ForCausalLM
saved as a checkpoint folder is the model (model_type gemma3_text; layer_types, the per-layer-type
rope_parameters and the sliding window read from config.json): parameter count, logits (numpy
interpreter, onnxruntime, fused) and the cached decoder's greedy tokens for a left-padded batch of two
equal transformers'. Cases: Gemma 3's default 5:1 pattern of sliding and full layers, a layer_types
list of its own, and a linearly scaled global rotary (the larger models'). Published counts: 270M and
1B."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, build, cli, hf_greedy, ort_run
from tessera.compiler.ops import interpret
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "gemma3.tsr"
BASE = dict(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, sliding_window=6, max_position_embeddings=128,
            query_pre_attn_scalar=10, rms_norm_eps=1e-6)
CASES = {
    "pattern": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 5000.0}}),
    "layer_types": dict(layer_types=["sliding_attention", "full_attention"] * 3),
    "linear_rope": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 5000.0}}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**BASE, **CASES[request.param])).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(folder)
    return request.param, model, folder


def _tokens(seed=0, t=21):
    return np.random.default_rng(seed).integers(1, 200, (2, t)).astype(np.int64)


def test_logits_and_count_equal_transformers(case):
    name, model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = _tokens()   # 21 tokens over a window of 6: the sliding layers' window matters
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    fused = pipeline.build(SPEC, weights=str(folder)).graph
    sites = optimize(fused)
    assert len(sites) == 6 and all(s.fused for s in sites), [s.describe() for s in sites]
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(fused, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL


def test_the_layer_kinds_and_the_two_bases_matter(case):
    """Every layer full, or the local and global bases swapped: the logits move far past the tolerance,
    so the comparison above checks the layer kinds and both rotary bases."""
    name, model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    hyper = built.info.hyperparams
    tokens = _tokens()
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    for change in (dict(layer_types=["full_attention"] * 6),
                   dict(theta=hyper["local_theta"], local_theta=hyper["theta"])):
        g = build("gemma3", None, **{**hyper, **change})
        assert np.abs(interpret.run(g, weights, {"tokens": tokens})["logits"] - ref).max() > 100 * TOL, change


@pytest.fixture(scope="module")
def cached(case):
    """The case's cached decoder, compiled once for both penalties (as test_llama4.py's)."""
    from tessera.runtime.generation.cached import CachedModel, compile_cached

    name, model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    compiled, info = compile_cached(pipeline.build(SPEC, weights=str(folder)), weights)
    return CachedModel(compiled.SerializeToString(), info)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_cached_greedy_generation_of_a_left_padded_batch_equals_transformers(case, cached, penalty):
    from tessera.runtime.generation.cached import generate
    from tessera.runtime.generation.sampling import Sampling

    name, model, folder = case
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, 11).tolist(), rng.integers(3, 200, 5).tolist()]
    new = 14   # past the window of 6 while decoding
    ours = generate(cached, prompts, new, Sampling(repetition_penalty=penalty)).tokens
    assert ours == hf_greedy(model, prompts, new, repetition_penalty=penalty)
    if penalty != 1.0:  # the penalty changed the tokens: its path was taken
        assert ours != hf_greedy(model, prompts, new)
    assert len({t for row in ours for t in row}) > 4, "degenerate: the model repeats one token"


def test_the_folder_alone_is_the_model(case, tmp_path, capsys):
    name, model, folder = case
    out = tmp_path / "m.onnx"
    rc, stdout, err = cli(capsys, "compile", folder, "--explain", "-o", out)
    assert rc == 0, err
    assert "attention sites: 6 (6 fused, 0 not fused)" in stdout + err, stdout + err


@pytest.mark.parametrize("variant,count", [("270m", 268_098_176), ("1b", 999_885_952)])
def test_published_counts(variant, count):
    """The model cards' figures (Gemma 3 270M: 268,098,176; 1B: 999,885,952)."""
    assert build("gemma3", variant).param_count() == count
