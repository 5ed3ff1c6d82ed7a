"""The engine's combined call (issue #23): an iteration's decoding rows and a prompt chunk in ONE
onnxruntime call (compiler/backends/onnx/mixed_attention.py, runtime/serving/engine.py
``_combined_step``) gives the tokens of greedy decoding alone.

References, independent of the code under test: transformers' ``generate(do_sample=False)`` on the
same Hugging Face checkpoint (GPT-2, and a Llama with grouped-query attention: 4 query heads, 2
key/value heads), each prompt alone; for sampled requests, ``generate`` alone with the request's
seed (its own tests hold it to transformers). Prompts of many lengths arrive while others decode, so
iterations really mix (the engine counts its combined calls; counted, not timed).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import hf_greedy, tiny_hf
from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300



class Case:
    def __init__(self, family, root):
        self.hf = tiny_hf(family, VOCAB)
        self.hf.save_pretrained(root, safe_serialization=True)
        self.model = serving_model.load(str(root), threads=1)
        rng = np.random.default_rng(4)
        # lengths from 1 to past two chunks; max_tokens from 1 (the prompt's last chunk ends the request)
        self.requests = [Request(rng.integers(1, VOCAB, int(n)).tolist(), int(m))
                         for n, m in zip([37, 5, 61, 1, 18, 44, 9, 70, 26, 3, 52, 15, 33, 8],
                                         [20, 1, 12, 25, 7, 18, 1, 10, 22, 16, 9, 2, 14, 19])]
        self.reference = [hf_greedy(self.hf, [r.prompt], r.max_tokens)[0] for r in self.requests]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = Case(family, tmp_path_factory.mktemp(f"serve_combined_{family}"))
        return made[family]
    return get


def _staggered(engine: Engine, requests: list[Request], every: int = 3) -> list:
    """Submit three requests at once, then one more every ``every`` iterations, stepping the engine
    until all finish: prompts arrive while others decode."""
    waiting = list(requests)
    handles = [engine.submit(waiting.pop(0)) for _ in range(3)]
    i = 0
    while waiting or any(not h.finished for h in handles):
        if waiting and i % every == 0:
            handles.append(engine.submit(waiting.pop(0)))
        assert engine.step() or waiting
        i += 1
    return handles


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_combined_calls_give_transformers_greedy_tokens(cases, family):
    """14 prompts of 1-70 tokens arriving while others decode, 5 slots, a 16-token budget: the
    iterations that prefill beside decoding rows run as one call, and every request's tokens are
    transformers' greedy tokens of its prompt alone."""
    case = cases(family)
    engine = Engine(case.model, max_batch=5, max_queue=16, prefill_chunk=16)
    assert engine.combined
    assert "decoding rows and a prompt chunk in ONE onnxruntime call" in engine.describe()
    handles = _staggered(engine, [Request(list(r.prompt), r.max_tokens) for r in case.requests])
    assert engine.combined_calls > 0
    assert [h.tokens for h in handles] == case.reference
    assert all(h.finish_reason == "length" for h in handles)
    assert engine.running == 0 and engine.cache_allocations == 1


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_a_burst_of_prompts_goes_in_as_segments_of_one_call(cases, family):
    """A burst of five 1-61-token prompts with no row decoding yet, 10 slots, a 48-token budget: the first
    call takes the 5- and 1-token prompts and the first 42 tokens of the 61-token one, each a segment whose
    positions start at 0 and which attends to itself alone; the cut prompt goes on later with its past
    (as a first segment). The other nine prompts arrive while those decode (no segments beside decoding
    rows). Every request's tokens are still transformers' greedy tokens of its prompt alone, which they
    would not be if a segment saw another's keys or the first segment's past."""
    case = cases(family)
    engine = Engine(case.model, max_batch=10, max_queue=16, prefill_chunk=48)
    partial = []
    more = engine._more_first_chunks

    def spy(seq, room):
        chosen = more(seq, room)
        partial.extend(len(c) < len(s.handle.request.prompt) for s, c in chosen)
        return chosen
    engine._more_first_chunks = spy
    order = [1, 3, 2, 4, 0] + list(range(5, len(case.requests)))  # prompts of 5, 1, 61, 18, 37 tokens first
    assert [len(case.requests[i].prompt) for i in order[:3]] == [5, 1, 61]
    handles = {}
    for i in order[:5]:
        handles[i] = engine.submit(Request(list(case.requests[i].prompt), case.requests[i].max_tokens))
    assert engine.step() and engine.combined_calls == 1 and engine.prompts_in_combined_calls == 3
    assert partial == [False, True]  # the 1-token prompt whole, the 61-token prompt's first 42
    for i in order[5:]:
        handles[i] = engine.submit(Request(list(case.requests[i].prompt), case.requests[i].max_tokens))
    while any(not h.finished for h in handles.values()):
        assert engine.step()
    assert [handles[i].tokens for i in range(len(case.requests))] == case.reference


def test_combined_and_two_calls_agree_and_the_cache_is_never_reallocated(cases):
    """The same staggered run with the combined call switched off (two calls per iteration) gives the
    same tokens; with it on, the cache arrays stay the same memory and every iteration that had both
    a prompt chunk and decoding rows was one call (no two-call iteration among them)."""
    case = cases("llama_gqa")
    reqs = lambda: [Request(list(r.prompt), r.max_tokens) for r in case.requests]  # noqa: E731
    two = Engine(case.model, max_batch=4, max_queue=16, prefill_chunk=12)
    two.combined = False
    calls = []
    run = case.model.run
    case.model.run = lambda feeds, bound=None: calls.append(feeds[case.model.info.tokens].shape) or run(feeds, bound)
    try:
        one = Engine(case.model, max_batch=4, max_queue=16, prefill_chunk=12)
        before = {name: (a.ctypes.data, a.shape) for name, a in one.cache.items()}
        got = _staggered(one, reqs(), every=2)
        prefills_alone = len(calls)  # model.run: the prompt chunks run alone (no decoding row beside them)
        want = _staggered(two, reqs(), every=2)
    finally:
        case.model.run = run
    assert [h.tokens for h in got] == [h.tokens for h in want] == case.reference
    assert {name: (a.ctypes.data, a.shape) for name, a in one.cache.items()} == before
    assert one.combined_calls > 0 and two.combined_calls == 0
    assert prefills_alone < len(calls) - prefills_alone  # the two-call engine ran more chunks alone


def test_sampled_requests_in_combined_calls_equal_generate_alone(cases):
    """Sampled requests (temperature, top-k, top-p, repetition penalty, each its own seed) in combined
    calls give the tokens ``generate`` gives each alone with that seed."""
    case = cases("gpt2")
    rng = np.random.default_rng(2)
    reqs = []
    for i, r in enumerate(case.requests[:10]):
        s = gen.Sampling(temperature=0.9, top_k=int(rng.integers(0, 30)), top_p=0.95,
                         repetition_penalty=1.2 if i % 3 == 0 else 1.0, seed=i)
        reqs.append(Request(list(r.prompt), r.max_tokens, s))
    engine = Engine(case.model, max_batch=4, max_queue=16, prefill_chunk=16)
    handles = _staggered(engine, reqs)
    assert engine.combined_calls > 0
    for r, h in zip(reqs, handles):
        assert h.tokens == gen.generate(case.model, [r.prompt], r.max_tokens, r.sampling).tokens[0]


def test_models_without_the_combined_call_run_two_calls(cases, tmp_path):
    """A decoder with every position's logits (serve --speculative's) and one with the plain decoding
    branch have no combined call: the engine says so and runs two calls, with the same tokens."""
    case = cases("gpt2")
    root = tmp_path / "gpt2"
    case.hf.save_pretrained(root, safe_serialization=True)
    for model in (serving_model.load(str(root), threads=1, last_only=False),
                  serving_model.load(str(root), threads=1, decode="plain")):
        engine = Engine(model, max_batch=4, max_queue=16, prefill_chunk=16)
        assert not engine.combined
        assert "in two onnxruntime calls" in engine.describe()
        handles = _staggered(engine, [Request(list(r.prompt), r.max_tokens) for r in case.requests[:8]])
        assert engine.combined_calls == 0
        assert [h.tokens for h in handles] == case.reference[:8]


def test_generates_graph_has_no_combined_call(cases):
    """``generate``'s cached decoder (compiled without the engine's option) has none of the combined
    call's nodes or its metadata; the engine's variant has both."""
    from tessera.compiler.backends.onnx.mixed_attention import COMBINED_KEY
    from tessera.runtime import pipeline

    built = pipeline.build("llama", None, ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50"])
    w = pipeline.weights_for(built, None, 0)
    plain, _ = gen.compile_cached(built, w, mode="buffer")
    built = pipeline.build("llama", None, ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50"])
    mixed, _ = gen.compile_cached(built, w, mode="buffer", mixed=True)

    def names(m):
        from tessera.compiler.backends.onnx.walk import all_nodes
        return {n.output[0] for n in all_nodes(m.graph.node) if n.output}

    assert not any(n.startswith("mixed/") for n in names(plain))
    assert COMBINED_KEY not in {p.key for p in plain.metadata_props}
    assert any(n.startswith("mixed/") for n in names(mixed))
    assert COMBINED_KEY in {p.key for p in mixed.metadata_props}
    assert len(names(plain)) < len(names(mixed))  # at every level: the top level may be one If (bound_step.py)


def test_combined_calls_give_the_distributions_of_two_calls(cases):
    """Beyond the argmax: greedy requests asking for log-probabilities (every token's, the first one
    from a combined call's chunk among them) get, through combined calls, the log-probabilities the
    two-call engine gives (whose tokens are transformers', above), to float rounding."""
    case = cases("llama_gqa")
    reqs = lambda: [Request(list(r.prompt), r.max_tokens, gen.Sampling(logprobs=3))  # noqa: E731
                    for r in case.requests[:10]]
    one = Engine(case.model, max_batch=4, max_queue=16, prefill_chunk=16)
    two = Engine(case.model, max_batch=4, max_queue=16, prefill_chunk=16)
    two.combined = False
    got, want = _staggered(one, reqs()), _staggered(two, reqs())
    assert one.combined_calls > 0 and two.combined_calls == 0
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert len(g.logprobs) == len(w.logprobs) == len(g.tokens)
        for a, b in zip(g.logprobs, w.logprobs):
            assert a["token"] == b["token"]
            np.testing.assert_allclose([a["logprob"]] + [t["logprob"] for t in a["top"]],
                                       [b["logprob"]] + [t["logprob"] for t in b["top"]], atol=1e-4)


def test_compiled_file_with_combined_call_serves_in_one_call(cases, tmp_path):
    """`tessera compile --kv-cache --combined-call` writes a decoder whose served iterations are one call,
    with transformers' greedy tokens; without the flag the same file serves in two calls; the flag is
    refused where the combined call cannot be built (a clear error, nothing written)."""
    from tessera.runtime.cli import main

    case = cases("llama_gqa")
    root = tmp_path / "ckpt"
    case.hf.save_pretrained(root, safe_serialization=True)
    for flag, combined in ((["--combined-call"], True), ([], False)):
        out = tmp_path / f"m{int(combined)}.onnx"
        assert main(["compile", str(root), "--kv-cache", *flag, "-o", str(out), "-q"]) == 0
        model = serving_model.load(str(out), threads=1)
        assert serving_model.has_combined_call(model) is combined
        engine = Engine(model, max_batch=5, max_queue=16, prefill_chunk=16)
        handles = _staggered(engine, [Request(list(r.prompt), r.max_tokens) for r in case.requests])
        assert (engine.combined_calls > 0) is combined
        assert [h.tokens for h in handles] == case.reference
    bad = tmp_path / "bad.onnx"
    assert main(["compile", str(root), "--kv-cache", "--combined-call", "--decode", "plain", "-o", str(bad)]) == 2
    assert not bad.exists()
