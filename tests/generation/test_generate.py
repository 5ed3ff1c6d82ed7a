"""Generation with a KV cache equals transformers' generate and a full recomputation.

Each family is a small Hugging Face model, seeded and perturbed (as in
test_families.py), saved as safetensors and imported through its .hf.toml map.
Greedy decoding of a batch of two prompts of different lengths (left-padded)
must give transformers' ``generate(do_sample=False)`` tokens, token for token,
for 64 new tokens; and at every step the logits the cached graph chose from
must equal the uncached model's logits over the row's whole sequence so far
(onnxruntime, no cache, no padding) within 1e-4.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import MODELS, ROOT, Recomputation, hf_greedy

SPECS = ROOT / "tests" / "specs"
from tessera.runtime import pipeline
from tessera.runtime.generation.cached import CachedModel, Sampling, compile_cached, generate, process_logits
from tessera.compiler.backends.onnx.bound_step import general_graph

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
NEW = 64


def _perturb(model, scale):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def _gpt2(folder):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    model = _perturb(transformers.GPT2LMHeadModel(cfg).eval(), 0.1)
    return model, "gpt2", None, ["layers=2", "d=64", "heads=4", "vocab=1000", "ctx=128"]


def _llama(folder, scaled: bool):
    torch.manual_seed(0)
    extra = {}
    if scaled:
        extra = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, rope_theta=500000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=128, attention_bias=False,
                                   mlp_bias=False, tie_word_embeddings=False, hidden_act="silu", **extra)
    model = _perturb(transformers.LlamaForCausalLM(cfg).eval(), 0.05)
    sets = ["vocab=256", "d=64", "layers=2", "heads=4", "kv_heads=2", "d_ff=96", "eps=1e-5", "theta=500000.0"]
    if scaled:
        return model, "llama", "llama3_1_8b", sets + ["rope_original_ctx=64"]
    return model, "llama", "llama3_8b", sets


def _mixtral(folder):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48, num_local_experts=8,
                                     num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5,
                                     max_position_embeddings=128, sliding_window=None, router_jitter_noise=0.0,
                                     tie_word_embeddings=False)
    model = _perturb(transformers.MixtralForCausalLM(cfg).eval(), 0.05)
    return model, "mixtral", "8x7b", ["vocab=256", "d=64", "layers=2", "heads=4", "kv_heads=2", "d_ff=48",
                                      "experts=8", "top=2", "theta=1000000.0", "eps=1e-5"]


def _mistral_window(folder):
    """A sliding window of 8 positions, shorter than prompt + new tokens, so it hides keys while decoding."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=96, rope_theta=10000.0,
                                     rms_norm_eps=1e-5, max_position_embeddings=128, sliding_window=8,
                                     tie_word_embeddings=False)
    model = _perturb(transformers.MistralForCausalLM(cfg).eval(), 0.05)
    return model, SPECS / "mistral_window.tsr", None, ["vocab=256", "d=64", "layers=2", "heads=4", "kv_heads=2",
                                                      "d_ff=96", "window=8", "eps=1e-5"]


FAMILIES = {"gpt2": lambda f: _gpt2(f), "llama3": lambda f: _llama(f, False), "llama31": lambda f: _llama(f, True),
            "mixtral": _mixtral, "mistral_window": _mistral_window}


class Case:
    def __init__(self, family, folder):
        self.hf, self.spec, self.variant, self.sets = FAMILIES[family](folder)
        self.hf.save_pretrained(folder, safe_serialization=True)
        self.ckpt = folder / "model.safetensors"
        self.vocab = self.hf.config.vocab_size

    def built(self):
        spec = self.spec if str(self.spec).endswith(".tsr") else MODELS / f"{self.spec}.tsr"
        return pipeline.build(spec, self.variant, self.sets)

    def cached(self, **kw) -> CachedModel:
        built = self.built()
        weights = pipeline.weights_for(built, str(self.ckpt), 0)
        model, info = compile_cached(built, weights, **kw)
        return CachedModel(model.SerializeToString(), info)

    def full_session(self):
        """The uncached model (no fusion change, no cache) in onnxruntime: the recomputation reference."""
        import onnxruntime as ort

        from tessera.compiler.backends.onnx import export as onnx_export

        built = self.built()
        weights = pipeline.weights_for(built, str(self.ckpt), 0)
        model = onnx_export.to_onnx(built.graph, weights)
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def prompts(self, lengths=(11, 5), seed=0):
        rng = np.random.default_rng(seed)
        return [rng.integers(1, self.vocab, n).tolist() for n in lengths]

    def hf_generate(self, prompts, new, **kw):
        return hf_greedy(self.hf, prompts, new, **kw)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = Case(family, tmp_path_factory.mktemp(f"gen_{family}"))
        return made[family]
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_and_full_recomputation(cases, family):
    case = cases(family)
    model = case.cached()
    prompts = case.prompts()
    full = case.full_session()
    check = Recomputation(full, prompts)
    ours = generate(model, prompts, NEW, on_logits=check).tokens
    want = case.hf_generate(prompts, NEW)
    print(f"{family}: max |cached - full| logits over {NEW} steps: {check.worst:.2e}")
    assert check.worst <= TOL
    for r in range(len(prompts)):
        assert ours[r] == want[r], f"row {r}: first difference at token {next(i for i, (a, b) in enumerate(zip(ours[r], want[r])) if a != b)}"
    assert len({t for row in ours for t in row}) > 5, "degenerate test: the model repeats one token"


def test_concat_mode_and_full_logits_give_the_same_tokens(cases):
    case = cases("llama3")
    prompts = case.prompts((7, 12), seed=3)
    a = generate(case.cached(), prompts, 20).tokens
    b = generate(case.cached(mode="concat", last_only=False), prompts, 20).tokens
    assert a == b


def test_numpy_interpreter_runs_the_cached_graph(cases):
    """The cached graph is a plain IR graph: the numpy reference gives onnxruntime's logits."""
    from tessera.compiler.passes.kv_cache import add_kv_cache
    from tessera.compiler.passes.pipeline import optimize
    from tessera.compiler.ops import interpret

    case = cases("llama31")
    built = case.built()
    weights = pipeline.weights_for(built, str(case.ckpt), 0)
    optimize(built.graph)
    info = add_kv_cache(built.graph)
    tokens = np.array([[3, 4, 5], [0, 7, 8]], dtype=np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=np.int64)
    feeds = {"tokens": tokens, "attention_mask": mask, "position_ids": np.array([[0, 1, 2], [0, 0, 1]])}
    for layer in info.layers:
        feeds[layer.past_key] = np.zeros((2, layer.kv_heads, 2, layer.head_size), np.float32)
        feeds[layer.past_value] = np.zeros((2, layer.kv_heads, 2, layer.value_size), np.float32)
    assert info.length_input == "cache_length"  # decoding steps write the buffer in place (GroupQueryAttention)
    feeds[info.length_input] = np.array([2], np.int64)  # read by the ONNX decode branch only
    ours = interpret.run(built.graph, weights, feeds)["logits"]
    full = case.full_session()
    for r, n in ((0, 3), (1, 2)):
        ref = full.run(None, {"tokens": tokens[r:r + 1, 3 - n:]})[0][0]
        assert np.abs(ours[r, 3 - n:] - ref).max() <= TOL


def test_repetition_penalty_equals_transformers(cases):
    case = cases("gpt2")
    model = case.cached()
    for prompt in case.prompts((9, 4), seed=5):  # one at a time: transformers also penalises padding ids
        ours = generate(model, [prompt], 32, Sampling(repetition_penalty=1.3)).tokens[0]
        assert ours == case.hf_generate([prompt], 32, repetition_penalty=1.3)[0]


def test_sampling_is_reproducible(cases):
    case = cases("gpt2")
    model = case.cached()
    prompts = case.prompts()
    s = dict(temperature=0.9, top_k=50, top_p=0.95)
    a = generate(model, prompts, 24, Sampling(seed=7, **s)).tokens
    b = generate(model, prompts, 24, Sampling(seed=7, **s)).tokens
    c = generate(model, prompts, 24, Sampling(seed=8, **s)).tokens
    assert a == b
    assert a != c


def test_stop_token_ends_a_row(cases):
    case = cases("gpt2")
    model = case.cached()
    prompts = case.prompts()
    free = generate(model, prompts, 20).tokens
    stop = free[1][3]
    out = generate(model, prompts, 20, stop_tokens=[stop]).tokens
    assert out[1] == free[1][:free[1].index(stop) + 1]
    assert out[0] == (free[0][:free[0].index(stop) + 1] if stop in free[0] else free[0])


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.6), (20, 0.3)])
def test_top_k_top_p_never_leave_their_set(cases, k, p):
    """Over many draws (random scores and the model's own), every token is in the top-k / top-p set."""
    from tessera.runtime.generation.cached import choose

    rng = np.random.default_rng(0)
    s = Sampling(temperature=1.3, top_k=k, top_p=p, seed=0)
    for _ in range(200):
        logits = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
        picked = choose(logits, None, s, rng)
        for row, tok in zip(logits, picked):
            assert tok in _allowed(row, s)
    case = cases("gpt2")
    model = case.cached()
    seen_logits = {}
    out = generate(model, case.prompts(), 40, s, on_logits=lambda i, x: seen_logits.__setitem__(i, x.copy())).tokens
    for r, row in enumerate(out):
        for i, tok in enumerate(row):
            assert tok in _allowed(seen_logits[i][r], s)


def _allowed(row, s: Sampling) -> set[int]:
    """The top-k / top-p set written out directly (sorted probabilities, cumulative sum)."""
    x = row.astype(np.float64) / s.temperature
    order = np.argsort(-x, kind="stable")
    keep = list(order)
    if s.top_k:
        kth = x[order[s.top_k - 1]]
        keep = [i for i in keep if x[i] >= kth]
    if s.top_p < 1:
        xs = x[keep]
        pr = np.exp(xs - xs.max())
        pr /= pr.sum()
        out, total = [], 0.0
        for i, q in zip(keep, pr):
            out.append(i)
            total += q
            if total >= s.top_p:
                break
        keep = out
    return set(int(i) for i in keep)


def test_process_logits_matches_transformers_warpers():
    """Temperature, top-k and top-p give transformers' own processed scores (same -inf set)."""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, 100)) * 2).astype(np.float32)
    ids = torch.from_numpy(rng.integers(0, 100, (3, 6)))
    seen = np.zeros((3, 100), bool)
    for r in range(3):
        seen[r, ids[r].numpy()] = True
    s = Sampling(temperature=0.7, top_k=30, top_p=0.8, repetition_penalty=1.2)
    x = torch.from_numpy(logits.copy())
    for proc in (RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7), TopKLogitsWarper(30),
                 TopPLogitsWarper(0.8)):
        x = proc(ids, x)
    want = x.numpy()
    got = process_logits(logits, seen, s)
    assert (np.isinf(want) == np.isinf(got)).all()
    fin = np.isfinite(want)
    assert np.abs(want[fin] - got[fin]).max() < 1e-5


def test_sliding_window_matters_and_uses_the_concat_cache(cases):
    """The window test means something only if a longer window changes the tokens; and the buffer cache,
    whose mask offset is its capacity, is not used for windowed models."""
    case = cases("mistral_window")
    model = case.cached()
    assert model.info.mode == "concat"
    prompts = case.prompts()
    windowed = generate(model, prompts, 32).tokens
    case.sets = [s if not s.startswith("window=") else "window=1000" for s in case.sets]
    try:
        wide = generate(case.cached(), prompts, 32).tokens
    finally:
        case.sets = [s if not s.startswith("window=") else "window=8" for s in case.sets]
    assert windowed != wide


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_encoder_decoder_greedy_equals_torch(tmp_path):
    """models/transformer.tsr: the encoder (and every layer's cross-attention K and V) runs once, the
    decoder is cached. Greedy tokens equal a greedy loop over torch.nn.Transformer recomputing the
    whole target each step, and the logits match it within 1e-4, for left-padded target prompts of
    different lengths and a padded source."""
    import math

    from test_families import _sinusoidal, transformer_case
    from tessera.runtime.generation.cached import Seq2Seq, compile_seq2seq

    case = transformer_case(tmp_path)
    core, embed = case.model
    d = case.sets["d"]
    sets = [f"{k}={v}" for k, v in case.sets.items()]
    built = pipeline.build(MODELS / "transformer.tsr", "base", sets)
    weights = pipeline.weights_for(built, str(case.ckpt), 0)
    enc, dec, info, boundary = compile_seq2seq(built, weights, "tgt", max_positions=128)
    s2s = Seq2Seq(enc.SerializeToString(), CachedModel(dec.SerializeToString(), info), boundary)
    src, src_mask = case.feeds["src"], case.feeds["src_mask"]
    prompts = [[1, 17, 42], [1]]

    def torch_logits(r, tgt):
        with torch.no_grad():
            s, t = torch.from_numpy(src[r:r + 1]), torch.tensor([tgt])
            x = embed(s) * math.sqrt(d) + _sinusoidal(s.shape[1], d)
            y = embed(t) * math.sqrt(d) + _sinusoidal(t.shape[1], d)
            pad = torch.from_numpy(src_mask[r:r + 1] == 0)
            h = core(x, y, tgt_mask=core.generate_square_subsequent_mask(t.shape[1]), src_key_padding_mask=pad,
                     memory_key_padding_mask=pad, tgt_is_causal=True)
            return (h @ embed.weight.T).numpy()[0, -1]

    so_far = [list(p) for p in prompts]
    worst = [0.0]

    def check(step, logits):
        for r in range(2):
            ref = torch_logits(r, so_far[r])
            worst[0] = max(worst[0], float(np.abs(ref - logits[r]).max()))
            so_far[r].append(int(np.argmax(ref)))

    fixed = s2s.encode({"src": src, "src_mask": src_mask})
    ours = generate(s2s.decoder, prompts, 24, extra_feeds=fixed, on_logits=check).tokens
    print(f"encoder-decoder: max |cached - torch| logits over 24 steps: {worst[0]:.2e}")
    assert worst[0] <= TOL
    assert ours == [row[len(p):] for row, p in zip(so_far, prompts)]
    assert len({t for row in ours for t in row}) > 1  # post-norm with random weights settles fast; logits checked


class _Recording(CachedModel):
    """A CachedModel that records the length of the past it is fed at every step."""

    def __init__(self, inner: CachedModel):
        self.__dict__.update(inner.__dict__)
        self.past_lengths: list[int] = []
        self.mask_lengths: list[int] = []
        self.bound_steps = 0  # steps run through the bound buffers (BoundStep)

    def run(self, feeds, bound=None):
        self.past_lengths.append(feeds[self.info.layers[0].past_key].shape[2])
        self.mask_lengths.append(feeds["attention_mask"].shape[1])
        self.bound_steps += bound is not None
        return super().run(feeds, bound)


def test_sliding_window_cache_keeps_only_its_window(cases):
    """The concat cache of a windowed model is trimmed to the window after every step (so memory stays
    flat however long the generation), and the tokens and logits still equal a full recomputation."""
    case = cases("mistral_window")
    model = _Recording(case.cached())
    prompts = case.prompts()  # 11 and 5 tokens, window 8
    full = case.full_session()
    check = Recomputation(full, prompts)

    res = generate(model, prompts, 24, on_logits=check)
    assert model.past_lengths[0] == 0 and max(model.past_lengths) == 8, model.past_lengths
    assert res.stats.cache_bytes <= 2 * 2 * 2 * 2 * (8 + 1) * 16 * 4  # layers, K/V, B, kv_heads, window + new, hd, fp32
    assert check.worst <= TOL
    assert res.tokens == case.hf_generate(prompts, 24)


def test_buffer_cache_prefill_sees_an_empty_past_and_decode_the_buffer(cases):
    """The prompt runs against P = 0 (the tiled prefill kernel over the prompt alone); every decoding
    step gets the whole preallocated buffer (prompt + max_new_tokens slots), never a new one."""
    case = cases("llama3")
    model = _Recording(case.cached())
    prompts = case.prompts()
    generate(model, prompts, 6)
    assert model.past_lengths == [0] + [11 + 6] * 5
    assert model.mask_lengths == [11] + [11 + 6 + 1] * 5
    assert model.bound_steps == 5  # every decoding step through the bound buffers (GroupQueryAttention)


@pytest.mark.parametrize("decode", ["auto", "plain"])
def test_cached_graph_lowers_prefill_tiled_and_decode_by_its_kernel(decode):
    """--explain's claim, checked on the exported graph: each cached attention is an If on T == 1 whose
    prefill branch holds the portable kernel's Loop and whose decode branch has no Loop: on CPU by
    default one GroupQueryAttention over the buffer, whose written buffers are also If outputs (and
    graph outputs, for the loop to bind), with decode="plain" MatMul/Softmax."""
    from tessera.compiler.passes.kv_cache import CacheInfo

    built = pipeline.build(MODELS / "gpt2.tsr", None, ["layers=2", "d=64", "heads=4", "vocab=100", "ctx=64"])
    model, info = compile_cached(built, pipeline.weights_for(built, None, 0), decode=decode)
    ifs = [n for n in general_graph(model).node if n.op_type == "If"]  # the graph with a phased If per site
    assert len(ifs) == 2
    for n in ifs:
        branches = {a.name: [m.op_type for m in a.g.node] for a in n.attribute}
        assert "Loop" in branches["else_branch"] and "Loop" not in branches["then_branch"]
        if decode == "auto":
            assert branches["then_branch"].count("GroupQueryAttention") == 1 and "Softmax" not in branches["then_branch"]
            assert len(n.output) == 3
        else:
            assert "Softmax" in branches["then_branch"] and "GroupQueryAttention" not in branches["then_branch"]
    outputs = [o.name for o in model.graph.output]
    if decode == "auto":
        assert info.length_input == "cache_length" and "cache_length" in [i.name for i in model.graph.input]
        assert [layer.buffer_key for layer in info.layers] == ["cache_key.0", "cache_key.1"]
        assert {"cache_key.0", "cache_value.0", "cache_key.1", "cache_value.1"} <= set(outputs)
        assert "decode (T = 1): GroupQueryAttention over the cache buffer" in info.explain()
    else:
        assert info.length_input is None and not any(o.startswith("cache_") for o in outputs)
    assert [k.impl for k in info.kernels] == ["phased", "phased"]
    assert "prefill (T > 1): portable tiled kernel" in info.explain()
    back = CacheInfo.from_json(info.to_json())
    assert back.kernels == info.kernels and back.length_input == info.length_input and back.layers == info.layers


def test_gqa_decoding_falls_back_where_it_cannot_and_says_why_when_forced():
    """Head size 12 (not a multiple of 8): the default decodes with the plain branch (no cache_length
    input); forcing decode='gqa' there, or with the concat cache, is an error naming the site."""
    sets = ["layers=1", "d=48", "heads=4", "vocab=100", "ctx=64"]
    built = pipeline.build(MODELS / "gpt2.tsr", None, sets)
    weights = pipeline.weights_for(built, None, 0)
    _, info = compile_cached(built, weights)
    assert info.length_input is None and "plain MatMul/Softmax" in info.explain()
    with pytest.raises(pipeline.UsageError, match=r"layers\.0\.attn.*multiple of 8"):
        compile_cached(pipeline.build(MODELS / "gpt2.tsr", None, sets), weights, decode="gqa")
    with pytest.raises(pipeline.UsageError, match="not the buffer cache"):
        compile_cached(pipeline.build(MODELS / "gpt2.tsr", None, sets), weights, mode="concat", decode="gqa")


@pytest.mark.parametrize("sets", [[], ["rope_factor=8.0"]])
def test_cached_rope_is_one_rotary_embedding_with_shared_tables(sets):
    """Each rope of the cached graph (explicit positions) is one ONNX RotaryEmbedding (opset 23), and
    the cos/sin tables are computed once for every layer; a graph without one stays at opset 21. (The
    ropes are the prompt's: in the prefill branches; a decoding step rotates inside GroupQueryAttention,
    whose cos/sin caches are the second Cos and Sin, tests/generation/test_packed_gqa_decode.py.)"""
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.backends.onnx.walk import all_nodes

    hyper = ["layers=2", "d=64", "heads=4", "kv_heads=2", "vocab=100", "d_ff=96"] + sets
    built = pipeline.build(MODELS / "llama.tsr", None, hyper)
    model, _ = compile_cached(built, pipeline.weights_for(built, None, 0))
    ops = [n.op_type for n in all_nodes(general_graph(model).node)]  # not the bound step's copy (bound_step.py)
    assert ops.count("RotaryEmbedding") == 4  # q and k of two layers
    assert ops.count("Sin") == 2 and ops.count("Cos") == 2 and "Neg" not in ops
    assert {o.domain: o.version for o in model.opset_import}[""] == 23
    plain = pipeline.build(MODELS / "llama.tsr", None, hyper)
    full = onnx_export.to_onnx(plain.graph, pipeline.weights_for(plain, None, 0))
    assert {o.domain: o.version for o in full.opset_import}[""] == 21
    assert "RotaryEmbedding" not in [n.op_type for n in full.graph.node]


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_report_kv_cache_equals_the_bytes_generation_allocates(cases, family):
    """The report's KV-cache figure at batch B and N = prompt + new tokens is what the loop allocates
    (grouped-query attention: kv_heads, not heads)."""
    import tessera

    case = cases(family)
    spec = case.spec if str(case.spec).endswith(".tsr") else MODELS / f"{case.spec}.tsr"
    sets = dict(s.split("=", 1) for s in case.sets)
    prompts = case.prompts()
    new = 9
    res = generate(case.cached(), prompts, new)
    rep = tessera.load(spec, case.variant, **sets).report(batch=len(prompts), seq=max(map(len, prompts)) + new)
    reported = rep["memory"]["kv_cache_bytes"]
    assert abs(reported - res.stats.cache_bytes) <= 0.01 * res.stats.cache_bytes, (reported, res.stats.cache_bytes)


def test_fp16_cache_generates_close_to_fp32(cases):
    """An fp16 cached model (weights, computation and cache in half precision) decodes with logits
    within fp16 rounding of the fp32 recomputation, and its cache is half the fp32 bytes."""
    case = cases("llama3")
    built = case.built()
    weights = pipeline.weights_for(built, str(case.ckpt), 0)
    model16, info16 = compile_cached(built, weights, dtype="fp16")
    m16 = CachedModel(model16.SerializeToString(), info16)
    assert info16.dtype == "f16" and m16.np_dtype == np.float16
    prompts = case.prompts()
    full = case.full_session()
    check = Recomputation(full, prompts, relative=True)

    r16 = generate(m16, prompts, 16, on_logits=check)
    r32 = generate(case.cached(), prompts, 16)
    print(f"fp16 cache: max relative logit difference {check.worst:.2e}")
    assert check.worst <= 2e-2
    assert r16.stats.cache_bytes * 2 == r32.stats.cache_bytes
    agree = sum(a == b for ra, rb in zip(r16.tokens, r32.tokens) for a, b in zip(ra, rb))
    assert agree >= 0.75 * 32, f"fp16 and fp32 greedy tokens agree on only {agree} of 32"
