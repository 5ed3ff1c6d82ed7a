"""Phi-3 (models/phi3.tsr): a seeded, perturbed Hugging Face Phi3ForCausalLM saved as a checkpoint folder
is the model (config.json through the mapping's [config] table, model_type "phi3" to the bundled spec,
the fused qkv_proj and gate_up_proj split by the mapping): its parameter count is transformers'
``sum(p.numel())``, its logits equal transformers' (numpy interpreter, onnxruntime, fused) and the cached
decoder's greedy tokens equal transformers' ``generate`` for a left-padded batch of two, with and without
a repetition penalty, in three configurations: plain rotary with a sliding window shorter than the
sequences; longrope (Phi-3-mini-128k's rope_scaling) with its factor derived from the contexts; longrope
with the factor given, half of each head rotated (Phi-4-mini's partial rotary) and a tied head. The
longrope generations cross original_max_position_embeddings, where transformers switches to the long
factors and recomputes its cache: the cached decoder's logits equal transformers' uncached forward over
the whole batch at every step, and not without its recomputation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import MODELS, build, cli, hf_greedy, ort_run, perturbed
from tessera.compiler.ops import interpret
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "phi3.tsr"
VOCAB = 200
ORIGINAL = 16  # the longrope cases' original_max_position_embeddings: the generations below cross it
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5]  # one factor per frequency of a head of 16
LONG = [1.3, 2.2, 3.5, 5.0, 8.0, 12.0, 19.0, 30.0]

CASES = {
    "plain_window": dict(sliding_window=6),
    "longrope": dict(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                     original_max_position_embeddings=ORIGINAL),
    "longrope_factor_partial_tied": dict(
        rope_parameters={"rope_type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG[:4], "factor": 8.0,
                         "original_max_position_embeddings": ORIGINAL, "rope_theta": 500.0,
                         "partial_rotary_factor": 0.5},
        original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """d 64, 4 query heads and 2 key/value heads of 16, every weight moved off its initial value."""
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **CASES[request.param])
    model = perturbed(transformers.Phi3ForCausalLM(cfg), 0.2)
    folder = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(folder)
    return request.param, model, folder


@pytest.mark.parametrize("t", [9, 30])
def test_logits_and_count_equal_transformers_unfused_and_fused(case, t):
    """t = 30 is past the longrope cases' original context (the long factors), t = 9 within it."""
    name, model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, t)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    fused = pipeline.build(SPEC, weights=str(folder)).graph
    sites = optimize(fused)
    assert len(sites) == 2 and all(s.fused for s in sites), [s.describe() for s in sites]
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(fused, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL


def _cached(folder, stale: bool = False, **options):
    """The cached decoder of the folder; ``stale``: its CacheInfo without the length switch (a decoder
    that never recomputes its cache)."""
    from tessera.runtime.generation.cached import CachedModel, compile_cached

    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    compiled, info = compile_cached(pipeline.build(SPEC, weights=str(folder)), weights, **options)
    if stale:
        info = dataclasses.replace(info, length_switch=None)
    return CachedModel(compiled.SerializeToString(), info)


PROMPTS = [np.random.default_rng(3).integers(1, VOCAB, n).tolist() for n in (11, 5)]
NEW = 16  # 11 + 16 positions: past ORIGINAL at the sixth new token


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_cached_greedy_generation_of_a_left_padded_batch_equals_transformers(case, penalty):
    from tessera.runtime.generation.cached import generate
    from tessera.runtime.generation.sampling import Sampling

    name, model, folder = case
    cached = _cached(folder)
    assert cached.info.length_switch == (ORIGINAL if name.startswith("longrope") else None)
    assert ("longrope: the rotary switches to its long factors past 16 positions" in cached.info.explain()) == \
        name.startswith("longrope")
    ours = generate(cached, PROMPTS, NEW, Sampling(repetition_penalty=penalty)).tokens
    assert ours == hf_greedy(model, PROMPTS, NEW, repetition_penalty=penalty)
    assert len({t for row in ours for t in row}) > 5, "degenerate: the model repeats one token"


class WholeBatch:
    """An ``on_logits`` hook: each step's logits against transformers' forward over the whole left-padded
    batch so far with no cache (its position ids from the mask, as generate makes them), where the
    longrope factors follow the batch's length as they do in transformers' generate."""

    def __init__(self, model, prompts):
        t0 = max(len(p) for p in prompts)
        self.model, self.worst = model, []
        self.ids = torch.zeros((len(prompts), t0), dtype=torch.long)
        self.mask = torch.zeros_like(self.ids)
        for r, p in enumerate(prompts):
            self.ids[r, t0 - len(p):] = torch.tensor(p)
            self.mask[r, t0 - len(p):] = 1

    def __call__(self, step, logits) -> None:
        positions = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 1)
        with torch.no_grad():
            ref = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=positions,
                             use_cache=False).logits[:, -1].numpy()
        self.worst.append(float(np.abs(logits - ref).max()))
        chosen = torch.from_numpy(np.argmax(logits, axis=-1))[:, None]
        self.ids = torch.cat([self.ids, chosen], 1)
        self.mask = torch.cat([self.mask, torch.ones_like(chosen)], 1)


@pytest.mark.parametrize("mode", ["buffer", "concat"])
def test_longrope_generation_recomputes_its_cache_where_the_factors_switch(case, mode):
    """Every step equals transformers' uncached forward over the batch, also past the switch; the same
    decoder without the recomputation (length_switch cleared) is off there by far more than the
    tolerance, so the recomputation is what keeps it exact."""
    from tessera.runtime.generation.cached import generate

    name, model, folder = case
    if not name.startswith("longrope"):
        pytest.skip("plain rotary: nothing switches")
    cached = _cached(folder, mode=mode)
    assert cached.info.mode == mode
    check = WholeBatch(model, PROMPTS)
    generate(cached, PROMPTS, NEW, on_logits=check)
    assert max(check.worst) <= TOL, check.worst
    check = WholeBatch(model, PROMPTS)
    generate(_cached(folder, stale=True, mode=mode), PROMPTS, NEW, on_logits=check)
    switch = ORIGINAL - len(PROMPTS[0])  # the first step whose sequence passes ORIGINAL
    assert max(check.worst[:switch]) <= TOL and max(check.worst[switch:]) > 100 * TOL, check.worst


def test_longrope_generation_from_a_prompt_past_the_switch(case):
    """A prompt already longer than original_ctx: the prompt runs with the long factors and nothing is
    recomputed; every step equals transformers' uncached forward over the batch."""
    from tessera.runtime.generation.cached import generate

    name, model, folder = case
    if not name.startswith("longrope"):
        pytest.skip("plain rotary: nothing switches")
    prompts = [np.random.default_rng(5).integers(1, VOCAB, n).tolist() for n in (ORIGINAL + 4, 9)]
    check = WholeBatch(model, prompts)
    generate(_cached(folder), prompts, 6, on_logits=check)
    assert max(check.worst) <= TOL, check.worst


def test_the_folder_alone_is_the_model_every_site_fused(case, tmp_path, capsys):
    import onnxruntime as ort

    name, model, folder = case
    out = tmp_path / "phi3.onnx"
    rc, stdout, err = cli(capsys, "compile", folder, "--explain", "-o", out)
    assert rc == 0, err
    assert "attention sites: 2 (2 fused, 0 not fused)" in stdout + err, stdout + err
    tokens = np.random.default_rng(1).integers(1, VOCAB, (1, 21)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"tokens": tokens})[0]
    assert np.abs(got - ref).max() <= TOL


def test_tessera_generate_takes_the_folder(case, capsys):
    """`tessera generate FOLDER` (no spec, no --set): one prompt of 11 ids, 16 new tokens past the
    longrope switch, equal to transformers' greedy generate (EOS ignored on both sides)."""
    import json

    name, model, folder = case
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps([PROMPTS[0]])}", "--format",
                       "json", "-q", "--max-new-tokens", str(NEW), "--ignore-eos")
    assert rc == 0, err
    assert json.loads(out)["outputs"][0]["tokens"] == hf_greedy(model, PROMPTS[:1], NEW)[0]


def test_what_cannot_follow_the_switch_refuses_it(case):
    """The serving engine batches unrelated requests (no one length to switch on): it serves up to the
    switch. Speculative decoding's rolled-back drafts cannot follow a recomputed cache: it refuses a
    generation that crosses the switch, and runs one that stays below it."""
    from tessera.runtime.errors import UsageError
    from tessera.runtime.generation.rollback import RollbackCache
    from tessera.runtime.serving.engine import Engine

    name, model, folder = case
    if not name.startswith("longrope"):
        pytest.skip("plain rotary: nothing switches")
    cached = _cached(folder)
    assert Engine(cached, max_batch=2).capacity == ORIGINAL
    with pytest.raises(UsageError, match=f"--max-context 40 is past {ORIGINAL} positions, where this model's "
                                         f"longrope rotary switches"):
        Engine(cached, max_batch=2, capacity=40)
    with pytest.raises(UsageError, match=f"speculative decoding cannot cross position {ORIGINAL}"):
        RollbackCache(cached, PROMPTS, NEW, 2)
    RollbackCache(cached, [[5, 6]], 1, 2)


def test_a_config_the_spec_does_not_implement_is_refused(case, tmp_path, capsys):
    """Another rope_type, or biases (Phi-4-mini's config names them), are refused with the reason."""
    import json
    import shutil

    name, model, folder = case
    if name != "longrope":
        pytest.skip("one folder is enough")
    for key, value, want in (("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                              "rope_type dynamic is not implemented (default, longrope)"),
                             ("mlp_bias", True, "mlp_bias = true is not supported")):
        edited = tmp_path / key
        shutil.copytree(folder, edited)
        config = json.loads((edited / "config.json").read_text())
        config[key] = value
        (edited / "config.json").write_text(json.dumps(config))
        rc, _, err = cli(capsys, "compile", edited, "-o", tmp_path / f"{key}.onnx")
        assert rc == 2 and want in err and "Traceback" not in err, err


# config.json sizes (huggingface.co/microsoft/Phi-3-mini-4k-instruct: 3,821,079,552 parameters;
# Phi-3-medium-4k-instruct)
VARIANTS = {
    "mini_4k": dict(),
    "medium_4k": dict(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=10),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_counts_equal_transformers_on_the_meta_device(variant):
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(vocab_size=32064, **VARIANTS[variant]))
    want = sum(p.numel() for p in model.parameters())
    assert build("phi3", variant).param_count() == want
    if variant == "mini_4k":
        assert want == 3_821_079_552
