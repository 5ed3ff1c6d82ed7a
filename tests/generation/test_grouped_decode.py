"""The bound decoding step's GroupQueryAttention over an fp16 cache in the grouped form
(compiler/backends/onnx/grouped_decode.py: each key/value head's G queries as G rows of one head).

References, none from the rewrite under test:
- the same decoder compiled without it (grouped_decode=False: the bound step as compiled, held to
  transformers by tests/generation/test_bound_step.py and test_kv_cache_dtype.py), run on the same feeds
  and caches: logits within TOL of their range (onnxruntime's fp16 kernel sums in another order), the new
  key/value column equal bit for bit, every other column of the buffers as the test wrote it but for the
  G - 1 spare columns the grouped kernel writes (copies of the new column);
- a numpy statement, written here, of which key columns a query may see in a decoding step (its row's filled
  slots and its new column), against the columns the grouped kernel's rows see (causal rule and bias);
- transformers' greedy tokens (fp32) for a tiny Llama with 6 query heads over 2 key/value heads (G = 3),
  through ``generate`` and the serving engine, at --kv-cache-dtype fp16, with onnxruntime's profile counting
  the grouped kernels that ran (so the tokens are the grouped form's, not only the fallback's).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import hf_greedy
from tessera.compiler.backends.onnx.bound_step import _ancestors
from tessera.compiler.backends.onnx.grouped_decode import group_bound_step, grouped_branch
from tessera.runtime import pipeline as rt
from tessera.runtime.generation import cached as gen

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETS = ["layers=2", "d=96", "heads=6", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=96"]  # G = 3, head size 16
G = 3
TOL = 1e-4  # max |logits grouped - compiled| over the compiled logits' range (seen: 0 on these models)
LOWEST = np.finfo(np.float16).min


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(grouped: bool, decode: str = "auto"):
        if (grouped, decode) not in made:
            built = rt.build("llama", None, SETS)
            model, info = gen.compile_cached(built, rt.weights_for(built, None, 0), kv_cache_dtype="fp16",
                                             grouped_decode=grouped, decode=decode)
            made[grouped, decode] = (model, info)
        return made[grouped, decode]
    return get


def _step(model, info, cache: dict, filled: np.ndarray, width: int):
    """One bound decoding step (BoundStep: the buffers bound in place) of rows filled to ``filled`` (the serving
    engine's layout: each row from column 0, its own cache_length, the mask its filled slots and its new
    column); returns the logits and the buffers after the step."""
    b = len(filled)
    mask = np.zeros((b, width + 1), np.int64)
    for r, f in enumerate(filled):
        mask[r, :f + 1] = 1  # its filled slots and, at column f, its new token's (engine.py _decode_step)
    mask[:, -1] = 1
    bufs = {k: v.copy() for k, v in cache.items()}
    step = gen.BoundStep(gen.CachedModel(model.SerializeToString(), info, threads=1), bufs)
    feeds = {info.tokens: (np.arange(b)[:, None] * 7 + 3) % 50, "position_ids": filled[:, None],
             "attention_mask": mask, info.length_input: filled}
    feeds = {k: v for k, v in feeds.items() if k in step.model.input_names}
    return step.run(feeds)[info.logits], bufs


def _caches(info, rows: int, width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((rows, layer.kv_heads, width, size)).astype(np.float16)
            for layer in info.layers
            for name, size in ((layer.past_key, layer.head_size), (layer.past_value, layer.value_size))}


def test_the_graph_has_the_grouped_form_and_says_so(models):
    model, info = models(True)
    branch = grouped_branch(model)
    assert branch is not None
    gqa = [n for n in branch.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all({a.name: a.i for a in n.attribute}["num_heads"] == 2 for n in gqa)
    assert "2 GroupQueryAttention grouped" in info.explain()
    off, info_off = models(False)
    assert grouped_branch(off) is None and "not grouped (off" in info_off.explain()


@pytest.mark.parametrize("decode", ["auto", "gqa-unpacked"])  # the packed q+k+v step (rotary inside) and not
@pytest.mark.parametrize("filled,width,grouped", [
    (1, 20, True),        # one past column
    (10, 20, True),
    (17, 20, True),       # the last spare column is the buffer's last (filled + G == width)
    (18, 20, False),      # one column short: the general branch runs, nothing written past the new column
    (19, 20, False),      # the new column is the buffer's last
])
def test_one_row_against_the_compiled_step(models, decode, filled, width, grouped):
    ref, cache_ref = _step(*models(False, decode), _caches(models(False, decode)[1], 1, width), np.array([filled]), width)
    got, cache_got = _step(*models(True, decode), _caches(models(True, decode)[1], 1, width), np.array([filled]), width)
    assert np.abs(got - ref).max() <= TOL * np.ptp(ref), (np.abs(got - ref).max(), np.ptp(ref))
    before = _caches(models(True, decode)[1], 1, width)
    for name, buf in cache_got.items():
        new = cache_ref[name][:, :, filled]
        assert np.array_equal(buf[:, :, filled], new), name  # the new key/value column, bit for bit
        spare = range(filled + 1, min(filled + G, width))
        for c in range(width):
            if c == filled:
                continue
            if grouped and c in spare:  # the grouped kernel's spare columns: the same key and value again
                assert np.array_equal(buf[:, :, c], new), (name, c)
            else:  # nothing else written (no column past the buffer: the fallback at its end)
                assert np.array_equal(buf[:, :, c], before[name][:, :, c]), (name, c)


def test_rows_of_different_fill_run_the_compiled_step(models):
    """Three rows filled to 12, 11 and 9 (the engine's layout): onnxruntime's kernel takes the grouped rows at
    batch 1 only, so this step runs the general branch: the compiled step's logits and buffers, bit for bit."""
    filled, width = np.array([12, 11, 9]), 24
    ref, cache_ref = _step(*models(False), _caches(models(False)[1], 3, width), filled, width)
    got, cache_got = _step(*models(True), _caches(models(True)[1], 3, width), filled, width)
    np.testing.assert_array_equal(got, ref)
    for name in cache_ref:
        np.testing.assert_array_equal(cache_got[name], cache_ref[name], err_msg=name)


def _bias_graph(model):
    """The grouped branch's nodes computing the first GroupQueryAttention's seqlens_k, total_sequence_length and
    attention_bias, as a model of their own over attention_mask and cache_length."""
    branch = grouped_branch(model)
    gqa = next(n for n in branch.node if n.op_type == "GroupQueryAttention")
    producer = {o: n for n in branch.node for o in n.output if o}
    wanted = [gqa.input[5], gqa.input[6], gqa.input[10]]
    chosen = {id(n) for x in wanted for n in _ancestors(producer, x)}
    nodes = [n for n in branch.node if id(n) in chosen]
    made = {o for n in nodes for o in n.output}
    inits = {i.name: i for i in list(model.graph.initializer) + list(branch.initializer)}
    reads = {x for n in nodes for x in n.input if x and x not in made}
    assert reads - set(inits) == {"attention_mask", "cache_length"}, reads
    graph = helper.make_graph(
        nodes, "bias", [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [None, None]),
                        helper.make_tensor_value_info("cache_length", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info(x, t, None) for x, t in zip(wanted, (TensorProto.INT32, TensorProto.INT32,
                                                                         TensorProto.FLOAT16))],
        [inits[x] for x in sorted(reads & set(inits))])
    m = helper.make_model(graph, opset_imports=model.opset_import)
    m.ir_version = model.ir_version
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("filled", [[12, 11, 9], [5, 12, 12, 11], [7]])
def test_each_row_sees_what_the_compiled_step_sees(models, filled):
    """The grouped kernel's row j of batch row b sees key column c where c <= seqlens_k'[b] - (G - 1) + j (its
    causal rule, seqlens_k' the grouped one) and the bias there is above fp16's lowest (hidden: the lowest or -inf, the compiled bias's fp32 lowest
    cast to fp16). For every row j that
    must be exactly the compiled step's columns (numpy, here): c <= filled[b] and the mask's column (slot c, or
    the new column at c == filled[b]). Rows shorter than the longest included: their spare columns reach the
    longest row's new column, which the step's mask shows (the last mask column); only each row's own
    length hides it. Checked on the graph's bias nodes for batches the kernel itself runs at one row only."""
    session = _bias_graph(models(True)[0])
    filled = np.array(filled)
    width = 16
    mask = np.zeros((len(filled), width + 1), np.int64)
    for r, f in enumerate(filled):
        mask[r, :f] = 1
        mask[r, f] = 1
    mask[:, -1] = 1
    mask[0, 2] = 0  # a hidden slot among the filled ones (a padded position) stays hidden
    seqlens, total, bias = session.run(None, {"attention_mask": mask, "cache_length": filled})
    longest = filled.max()
    assert seqlens.tolist() == (filled + G - 1).tolist() and int(total) == longest + G
    assert bias.shape == (len(filled), 1, G, longest + G) and bias.dtype == np.float16
    for b, f in enumerate(filled):
        want = [c <= f and (mask[b, c] == 1 if c < longest else True) for c in range(longest + G)]
        for j in range(G):
            sees = [c <= seqlens[b] - (G - 1) + j and bias[b, 0, j, c] > LOWEST for c in range(longest + G)]
            assert sees == want, (b, j, sees, want)
            assert all(bias[b, 0, j, c] == 0 or bias[b, 0, j, c] <= LOWEST for c in range(longest + G))


# ---- transformers' greedy tokens, through generate and the serving engine
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
VOCAB = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                                   num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.08)
    root = tmp_path_factory.mktemp("grouped_llama")
    hf.eval().save_pretrained(root, safe_serialization=True)
    return hf, str(root)


class Profiled:
    """onnxruntime sessions opened meanwhile profile their runs; ``grouped()`` counts the grouped kernels run."""

    def __init__(self, monkeypatch, tmp_path):
        self.sessions, base = [], ort.InferenceSession
        outer = self

        class Session(base):
            def __init__(self, source, options=None, *a, **k):
                options = options or ort.SessionOptions()
                options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
                super().__init__(source, options, *a, **k)
                outer.sessions.append(self)
        monkeypatch.setattr(ort, "InferenceSession", Session)

    def grouped(self) -> int:
        import json

        count = 0
        for s in self.sessions:
            with open(s.end_profiling()) as f:
                count += sum(1 for e in json.load(f) if e.get("cat") == "Node" and e["name"].startswith(
                    "grouped_decode/") and e["name"].endswith("GroupQueryAttention_kernel_time"))
        return count


def _load_generate(root):
    from tessera.runtime.generation import loop
    from tessera.runtime.io import checkpoint as ckpt
    from tessera.runtime.options import GenerateOptions, ModelRef

    o = GenerateOptions(threads=1, kv_cache_dtype="fp16", provider="cpu", no_compile_cache=True).for_api()
    o.check()
    return loop.load_model(ckpt.resolve(ModelRef(spec=root)), o)


PROMPTS = [[5, 9, 2, 31, 7, 7, 40, 3, 11, 18, 22, 120, 250, 17], [4, 8], [17, 1, 30, 2, 9, 77, 203]]


def test_generate_gives_transformers_greedy_tokens(checkpoint, monkeypatch, tmp_path):
    """Each prompt alone (one row: the grouped step, but at the buffer's last two columns, where it falls back)
    and the three left-padded into one batch (the general branch): transformers' tokens."""
    hf, root = checkpoint
    profile = Profiled(monkeypatch, tmp_path)
    model = _load_generate(root)
    assert "2 GroupQueryAttention grouped" in model.info.explain() and model.info.dtype == "f16"
    new = 12
    for p in PROMPTS:
        assert gen.generate(model, [p], new).tokens == hf_greedy(hf, [p], new)
    # one row, capacity len(p) + new: steps at filled len(p) .. len(p) + new - 2; the grouped form where
    # filled + G <= capacity, so all but the last; 2 layers each
    assert profile.grouped() == 2 * len(PROMPTS) * (new - 2)
    assert gen.generate(model, PROMPTS, new).tokens == hf_greedy(hf, PROMPTS, new)


def test_serving_engine_gives_transformers_greedy_tokens(checkpoint, monkeypatch, tmp_path):
    """Prompts of uneven lengths through the engine at --kv-cache-dtype fp16: one slot (every step one row: the
    grouped form) and three slots (rows of different fill: the general branch), transformers' tokens."""
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request

    hf, root = checkpoint
    profile = Profiled(monkeypatch, tmp_path)
    model = serving_model.load(root, threads=1, kv_cache_dtype="fp16", no_compile_cache=True)
    assert "GroupQueryAttention grouped" in model.info.explain()
    rng = np.random.default_rng(3)
    requests = [(rng.integers(1, VOCAB, n).tolist(), m) for n, m in ((37, 9), (5, 14), (61, 6), (1, 11), (18, 8))]
    want = [hf_greedy(hf, [p], m)[0] for p, m in requests]
    for slots in (1, 3):
        engine = Engine(model, max_batch=slots, max_queue=len(requests), prefill_chunk=16)
        handles = [engine.submit(Request(list(p), m)) for p, m in requests]
        while any(not h.finished for h in handles):
            assert engine.step()
        assert [h.tokens for h in handles] == want, slots
        if slots == 1:
            assert profile.grouped() > 0


@pytest.mark.parametrize("edit,reason", [
    (lambda n: n.attribute.append(helper.make_attribute("softcap", 30.0)), "softcap"),
    (lambda n: n.attribute.append(helper.make_attribute("local_window_size", 8)), "local_window_size"),
    (lambda n: n.attribute.append(helper.make_attribute("smooth_softmax", 1)), "smooth_softmax"),
    (lambda n: n.input.extend([""] * (11 - len(n.input)) + ["sinks"]), "head_sink"),
    (lambda n: n.input.__setitem__(9, ""), "rotary without position_ids"),
])
def test_refused_where_the_semantics_are_not_kept(models, edit, reason):
    """The compiled fp16 step with one kernel edited as a model using that feature would be: left as it is,
    the reason returned (the pass puts it in --explain's note)."""
    model = copy.deepcopy(models(False)[0])
    branch = next(a.g for n in model.graph.node if n.name == "bound_step/If" for a in n.attribute
                  if a.name == "else_branch")
    edit(next(n for n in branch.node if n.op_type == "GroupQueryAttention"))
    before = model.SerializeToString()
    got = group_bound_step(model)
    assert isinstance(got, str) and reason in got, got
    assert model.SerializeToString() == before


@pytest.mark.parametrize("sets,kv,reason", [
    (SETS, "auto", None),                                                      # an fp32 cache: no word of it
    (["layers=1", "d=64", "heads=4", "kv_heads=4", "vocab=50"], "fp16", "G == 1"),  # one query head per kv head
])
def test_refused_for_fp32_caches_and_one_query_head_per_group(sets, kv, reason):
    built = rt.build("llama", None, sets)
    model, info = gen.compile_cached(built, rt.weights_for(built, None, 0), kv_cache_dtype=kv, grouped_decode=True)
    explain = info.explain()
    assert grouped_branch(model) is None, explain
    assert (reason in explain) if reason else ("decoding step bound in place" in explain
                                               and "grouped" not in explain), explain
    if reason is None:  # the reason is still given to a caller that asks the rewrite itself
        assert "is FLOAT, not FLOAT16" in group_bound_step(copy.deepcopy(model))


def test_the_compile_cache_keys_the_option(monkeypatch):
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime.compile_cache import options_fingerprint

    assert options_fingerprint(PipelineOptions())["grouped_decode"] is True
    monkeypatch.setenv("TESSERA_GROUPED_DECODE", "0")
    assert options_fingerprint(PipelineOptions())["grouped_decode"] is False


def test_the_engines_variant_without_a_mask(models):
    """The serving engine's ``prefix_keys`` variant (its step has no attention_bias: each row's keys are its
    columns 0..cache_length): the grouped step builds a bias of its own, hiding the spare columns; one row
    against the compiled step, where the grouped branch runs and where it has no room."""
    import dataclasses

    made = {}
    for grouped in (False, True):
        built = rt.build("llama", None, SETS)
        options = dataclasses.replace(gen.cached_options(kv_cache_dtype="fp16", grouped_decode=grouped),
                                      prefix_keys=True)
        made[grouped] = gen.compile_cached(built, rt.weights_for(built, None, 0), options)
    branch = grouped_branch(made[True][0])
    assert branch is not None
    gqa = next(n for n in branch.node if n.op_type == "GroupQueryAttention")
    assert gqa.input[10].startswith("grouped_decode/")  # a bias of its own: the compiled step has none
    compiled = next(a.g for n in made[False][0].graph.node if n.name == "bound_step/If" for a in n.attribute
                    if a.name == "else_branch")
    assert all(len(n.input) < 11 or not n.input[10] for n in compiled.node if n.op_type == "GroupQueryAttention")
    for filled, width, ran in ((10, 20, True), (18, 20, False)):
        ref, cache_ref = _step(*made[False], _caches(made[False][1], 1, width), np.array([filled]), width)
        got, cache_got = _step(*made[True], _caches(made[True][1], 1, width), np.array([filled]), width)
        assert np.abs(got - ref).max() <= TOL * np.ptp(ref), (filled, np.abs(got - ref).max())
        k = made[True][1].layers[0].past_key
        assert np.array_equal(cache_got[k][:, :, filled], cache_ref[k][:, :, filled])
        assert np.array_equal(cache_got[k][:, :, filled + 1], cache_ref[k][:, :, filled]) == ran
