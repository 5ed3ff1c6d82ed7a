"""The KV cache stored at fp16 beside an fp32 model (``--kv-cache-dtype fp16``, compiler/passes/kv_cache_dtype.py).

References, none from the code under test: the fp32 cache's results (the same spec and weights compiled
without the option): greedy tokens equal on the tiny models (no near-tie: checked, the top two logits of
every step differ by far more than the tolerance) and logits within 1e-3 of their range; numpy's own
rounding of the fp32 cache's keys and values (the fp16 cache must hold exactly that); and the fp32
model's decoding step fed that rounded cache (the attention over the fp16-rounded cache computed in
fp32), against which the fp16 step differs only by GroupQueryAttention computing in fp16. The real
model's figure (SmolLM2-135M) is in test_kv_cache_dtype_real.py and docs/serve.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cli, cli_error
from tessera.runtime import pipeline as rt
from tessera.runtime.generation import cached as gen

GPT2 = ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=96"]
LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=96"]
CASES = {"gpt2": ("gpt2", GPT2, "auto"), "llama": ("llama", LLAMA, "auto"),  # llama: the packed q+k+v step
         "llama-unpacked": ("llama", LLAMA, "gqa-unpacked")}
PROMPTS = [[5, 9, 2, 31, 7, 7, 40, 3, 11, 18, 22], [4, 8], [17, 1, 30, 2, 9]]  # left-padded into one batch
RELATIVE = 1e-3  # max |logits(fp16 cache) - logits(fp32 cache)| over the fp32 logits' range, tiny models


def _compiled(spec, sets, decode, kv):
    built = rt.build(spec, None, sets)
    weights = rt.weights_for(built, None, 0)
    model, info = gen.compile_cached(built, weights, decode=decode, kv_cache_dtype=kv)
    return model, info


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(case, kv):
        if (case, kv) not in made:
            spec, sets, decode = CASES[case]
            model, info = _compiled(spec, sets, decode, kv)
            made[case, kv] = (model, info, gen.CachedModel(model.SerializeToString(), info, threads=1))
        return made[case, kv]
    return get


def _greedy(model, prompts, n):
    logits = []
    out = gen.generate(model, prompts, n, on_logits=lambda step, lg: logits.append(lg.copy()))
    return out.tokens, logits


def test_the_choices_are_the_compilers():
    from tessera.compiler.passes import kv_cache_dtype
    from tessera.runtime import options

    assert options.KV_CACHE_DTYPES == kv_cache_dtype.KV_CACHE_DTYPES


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_cache_gives_the_fp32_caches_tokens_and_logits(models, case):
    """Three prompts of uneven lengths (left-padded), 20 greedy steps: the cache buffers are fp16; every
    step's logits within RELATIVE of the fp32 cache's range, and the tokens equal -- unless the fp32
    cache's top two logits at a step lie within twice that tolerance (a near-tie, where either choice is
    right), after which the two continuations are different texts and are not compared."""
    _, info32, m32 = models(case, "auto")
    _, info16, m16 = models(case, "fp16")
    assert (info32.dtype, info16.dtype) == ("f32", "f16") and m16.np_dtype == np.float16
    want, ref = _greedy(m32, PROMPTS, 20)
    got, logits = _greedy(m16, PROMPTS, 20)
    compared = 0
    for step, (r, g) in enumerate(zip(ref, logits)):
        tol = RELATIVE * np.ptp(r)
        assert np.abs(g - r).max() <= tol, (case, step, np.abs(g - r).max(), np.ptp(r))
        top2 = np.sort(r, axis=-1)[:, -2:]
        differ = [i for i in range(len(PROMPTS)) if want[i][step] != got[i][step]]
        if differ:
            assert all(top2[i, 1] - top2[i, 0] <= 2 * tol for i in differ), (case, step, "tokens differ, no tie")
            break
        compared += 1
    assert compared >= 10, f"{case}: only {compared} steps compared before a near-tie"


def _prefill_feeds(info, prompt, past_dtype):
    t = len(prompt)
    feeds = {info.tokens: np.array([prompt], np.int64), "attention_mask": np.ones((1, t), np.int64),
             "position_ids": np.arange(t, dtype=np.int64)[None], info.length_input: np.array([0], np.int64)}
    for layer in info.layers:
        feeds[layer.past_key] = np.zeros((1, layer.kv_heads, 0, layer.head_size), past_dtype)
        feeds[layer.past_value] = np.zeros((1, layer.kv_heads, 0, layer.value_size), past_dtype)
    return feeds


def _step_feeds(info, cache, token, filled, capacity):
    mask = np.zeros((1, capacity + 1), np.int64)
    mask[0, :filled] = 1
    mask[0, -1] = 1
    return {info.tokens: np.array([[token]], np.int64), "attention_mask": mask,
            "position_ids": np.array([[filled]], np.int64), info.length_input: np.array([filled], np.int64),
            **cache}


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_the_cache_holds_numpys_rounding_and_a_step_reads_it_as_fp32_would(models, case):
    """A prompt's keys and values as the fp16 cache receives them equal numpy's fp16 rounding of the fp32
    cache's; one decoding step over them equals the fp32 model's step over the same rounded values
    (given to it in fp32) within 2e-3 of its logits' range (GroupQueryAttention computes in fp16)."""
    _, info32, m32 = models(case, "auto")
    _, info16, m16 = models(case, "fp16")
    prompt, capacity = PROMPTS[0], 32
    out32 = m32.run(_prefill_feeds(info32, prompt, np.float32))
    out16 = m16.run(_prefill_feeds(info16, prompt, np.float16))
    t = len(prompt)
    cache16, cache32 = {}, {}
    for layer in info16.layers:
        for past, new in ((layer.past_key, layer.present_key), (layer.past_value, layer.present_value)):
            assert out16[new].dtype == np.float16
            assert np.array_equal(out16[new], out32[new].astype(np.float16))  # numpy's rounding, exactly
            buf = np.zeros(out16[new].shape[:2] + (capacity,) + out16[new].shape[3:], np.float16)
            buf[:, :, :t] = out16[new]
            cache16[past], cache32[past] = buf, buf.astype(np.float32)
    token = int(np.argmax(out32[info32.logits][0, -1]))
    got = m16.run(_step_feeds(info16, cache16, token, t, capacity))[info16.logits][0, -1]
    ref = m32.run(_step_feeds(info32, cache32, token, t, capacity))[info32.logits][0, -1]
    assert np.abs(got - ref).max() <= 2e-3 * np.ptp(ref), (np.abs(got - ref).max(), np.ptp(ref))


def test_a_default_compile_has_no_cast_of_the_cache(models):
    """The default (fp32) cache's graph reads its past inputs as before: no Cast of a past anywhere; the
    fp16 cache's graph casts a past only inside the prompt's branch (never in the main graph or the
    decoding step)."""
    def casts(graph, depth=0):
        for n in graph.node:
            if n.op_type == "Cast" and any(i.startswith("past_") for i in n.input):
                yield depth
            for a in n.attribute:
                if a.g is not None and a.g.node:
                    yield from casts(a.g, depth + 1)

    model32, _, _ = models("llama", "auto")
    model16, _, _ = models("llama", "fp16")
    assert list(casts(model32.graph)) == []
    found = list(casts(model16.graph))
    assert found and min(found) >= 2  # bound step's If -> the phased If -> its prompt branch
    assert {i.name: i.type.tensor_type.elem_type for i in model16.graph.input}["past_key.0"] == 10  # FLOAT16


def test_speculative_generate_keeps_the_tokens(models):
    """generate --speculative ngram (the verifying call is the prompt branch, reading the fp16 past as fp32)
    gives the fp16 cache's plain greedy tokens."""
    from tessera.runtime.generation import speculative
    from tessera.runtime.generation.drafting import NgramDrafter

    spec, sets, decode = CASES["llama"]
    built = rt.build(spec, None, sets)
    model, info = gen.compile_cached(built, rt.weights_for(built, None, 0), kv_cache_dtype="fp16", last_only=False)
    verifier = gen.CachedModel(model.SerializeToString(), info, threads=1)
    prompt = [5, 9, 2, 31, 7, 5, 9, 2, 31, 7, 5, 9]
    plain = gen.generate(models("llama", "fp16")[2], [prompt], 16).tokens[0]
    stats = gen.Stats()
    got = [t[0] for t in speculative.steps(verifier, [prompt], 16, gen.Sampling(), NgramDrafter(), 4, stats=stats)
           if t[0] is not None]
    assert stats.rounds and got == plain


def test_refused_where_it_cannot_apply(capsys):
    """int8/int4 with the reason, a sliding-window model, a recurrent one, run, against --dtype fp16."""
    tiny = ["--set", "layers=1", "--input", "tokens=[[1,2,3]]", "--max-new-tokens", "2", "--no-compile-cache"]
    err = cli_error(capsys, "generate", "llama", *tiny, "--kv-cache-dtype", "int8")
    assert "fixed scales" in err and "not per token" in err
    assert "fixed scales" in cli_error(capsys, "generate", "llama", *tiny, "--kv-cache-dtype", "int4")
    err = cli_error(capsys, "generate", "gemma2", *tiny, "--kv-cache-dtype", "fp16")
    assert "a sliding window" in err and "GroupQueryAttention" in err
    err = cli_error(capsys, "generate", "mamba", *tiny, "--kv-cache-dtype", "fp16")
    assert "recurrent state" in err
    err = cli_error(capsys, "run", "gpt2", "--set", "layers=1", "--input", "tokens=[[1,2]]", "--kv-cache-dtype", "fp16")
    assert "run computes the full model" in err
    err = cli_error(capsys, "generate", "llama", *tiny, "--dtype", "fp16", "--kv-cache-dtype", "fp32")
    assert "keeps its cache at fp16" in err


def test_on_cuda_the_fp16_cache_comes_with_dtype_fp16():
    from tessera.runtime.errors import UsageError
    from tessera.runtime.options import EngineOptions, GenerateOptions

    with pytest.raises(UsageError, match="with --dtype fp16"):
        GenerateOptions(provider="cuda", kv_cache_dtype="fp16").check()
    with pytest.raises(UsageError, match="with --dtype fp16"):
        EngineOptions(spec="llama", provider="cuda", kv_cache_dtype="fp16").check()
    GenerateOptions(provider="cuda", dtype="fp16", kv_cache_dtype="fp16").check()  # agrees: the cache is fp16


def test_the_api_and_a_compiled_file(tmp_path):
    """Model.generate(kv_cache_dtype="fp16") gives the tokens of the default; a file compiled with
    kv_cache=True, kv_cache_dtype="fp16" declares an fp16 cache and generates them too."""
    import tessera

    m = tessera.load("llama", **dict(s.split("=") for s in LLAMA))
    want = m.generate(PROMPTS[:2], max_new_tokens=8, no_compile_cache=True)
    assert m.generate(PROMPTS[:2], max_new_tokens=8, kv_cache_dtype="fp16", no_compile_cache=True) == want
    path = tmp_path / "m.onnx"
    m.compile(path, kv_cache=True, kv_cache_dtype="fp16")
    loaded = gen.CachedModel.from_onnx(path, threads=1)
    assert loaded.info.dtype == "f16"
    assert gen.generate(loaded, PROMPTS[:2], 8).tokens == want


def test_the_compile_cache_keys_the_cache_dtype():
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime.compile_cache import options_fingerprint

    a, b = options_fingerprint(PipelineOptions()), options_fingerprint(PipelineOptions(kv_cache_dtype="fp16"))
    assert a != b and b["kv_cache_dtype"] == "fp16"


def test_compile_explains_where_the_cache_is_stored(capsys, tmp_path):
    rc, out, err = cli(capsys, "compile", "llama", *[a for s in LLAMA for a in ("--set", s)], "--kv-cache",
                       "--kv-cache-dtype", "fp16", "--explain", "-o", tmp_path / "m.onnx")
    assert rc == 0, err
    assert "KV cache (buffer mode, stored at fp16): 2 cached attention sites" in err
    err = cli_error(capsys, "compile", "llama", "--set", "layers=1", "--kv-cache-dtype", "fp16", "-o",
                       tmp_path / "n.onnx")
    assert "--kv-cache-dtype applies with --kv-cache" in err


def test_report_counts_two_bytes_an_element():
    """tessera report's memory figures and --serve's capacity at --kv-cache-dtype fp16: the cache's bytes
    are half the fp32 cache's (counted by the report at 4 bytes), and more sequences fit."""
    import tessera

    m = tessera.load("llama", **dict(s.split("=") for s in LLAMA))
    kw = dict(device="cpu", serve=True, context=64)
    r32, r16 = dict(m.report(**kw)), dict(m.report(kv_cache_dtype="fp16", **kw))
    assert r16["memory"]["kv_cache_bytes"] * 2 == r32["memory"]["kv_cache_bytes"]
    s32, s16 = r32["serving"], r16["serving"]
    assert s16["kv_cache_bytes_per_sequence"] * 2 == s32["kv_cache_bytes_per_sequence"]
    assert s16["max_batch"] > s32["max_batch"] and "2 bytes per element" in s16["note"]
