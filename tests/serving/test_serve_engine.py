"""The continuous-batching engine (runtime/serving/engine.py), in process.

The reference for every token is ``generate`` run alone on the request (one prompt, its own
sampling), over the same compiled decoder; chunked prefill is checked against one unchunked prompt
(tokens and logits). Scheduling (joins, leaves, cancellation, bounds) is checked by stepping the
engine by hand, so nothing depends on timing.
"""

from __future__ import annotations

import numpy as np
import pytest

from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import (IDLE_PREFILL_CHUNK, Engine, Overloaded, Request, RequestError,
                                           Unavailable)

GPT2 = ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=128"]
LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=128"]


@pytest.fixture(scope="module")
def gpt2():
    return serving_model.load("gpt2", sets=GPT2, threads=1)


@pytest.fixture(scope="module")
def llama():
    return serving_model.load("llama", sets=LLAMA, threads=1)


def _alone(model, req: Request) -> list[int]:
    return gen.generate(model, [req.prompt], req.max_tokens, req.sampling, req.stop_tokens).tokens[0]


def _requests(n: int, seed: int, vocab: int = 50, longest: int = 60, sampled: bool = False) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, int(rng.integers(1, longest))).tolist()
        sampling = gen.Sampling()
        if sampled and i % 2:
            sampling = gen.Sampling(temperature=0.8, top_k=int(rng.integers(0, 20)), top_p=0.9,
                                    repetition_penalty=1.3 if i % 4 == 1 else 1.0, seed=i)
        out.append(Request(prompt, int(rng.integers(1, 40)), sampling))
    return out


def _run_all(engine: Engine, handles) -> None:
    while any(not h.finished for h in handles):
        assert engine.step()


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_32_concurrent_requests_each_equal_generate_alone(which, request):
    """Different prompt lengths (some longer than a prefill chunk) and max_tokens, 8 slots: every
    request's tokens equal generate run on it alone, greedy and sampled (each with its own seed)."""
    model = request.getfixturevalue(which)
    reqs = _requests(32, seed=7, sampled=True)
    engine = Engine(model, max_batch=8, max_queue=32, prefill_chunk=16)
    handles = [engine.submit(r) for r in reqs]
    _run_all(engine, handles)
    for r, h in zip(reqs, handles):
        assert h.finish_reason == "length"
        assert h.tokens == _alone(model, r), r
    assert engine.running == 0 and engine.queued == 0


def test_threaded_engine_streams_the_same(gpt2):
    """The engine's own thread, requests iterated as they stream (the server's way)."""
    reqs = _requests(12, seed=3)
    engine = Engine(gpt2, max_batch=4, prefill_chunk=8).start()
    try:
        handles = [engine.submit(r) for r in reqs]
        streamed = [list(h) for h in handles]
    finally:
        engine.close()
    assert streamed == [_alone(gpt2, r) for r in reqs]


def test_cache_allocated_once(gpt2):
    """The cache arrays are the same memory from start to end, however the live view is widened and
    narrowed (rows of up to 100 positions against a view 64 columns wide at first)."""
    engine = Engine(gpt2, max_batch=4, prefill_chunk=8)
    before = {name: (id(a), a.ctypes.data, a.shape) for name, a in engine.cache.items()}
    budget = engine.memory_bytes
    assert budget == sum(a.nbytes for a in engine.cache.values()) + engine.slots.nbytes
    # the stated budget is what it holds: 4 slots x 128 positions x 2 layers x (key + value) x 64 floats
    assert engine.cache_bytes == 4 * 128 * 2 * 2 * 64 * 4
    reqs = _requests(16, seed=11) + [Request(list(range(1, 50)) * 2, 20)]
    handles = [engine.submit(r) for r in reqs]
    _run_all(engine, handles)
    assert engine.relayouts >= 2  # widened past 64 columns, narrowed when the long rows left
    assert {name: (id(a), a.ctypes.data, a.shape) for name, a in engine.cache.items()} == before
    assert engine.cache_allocations == 1 and engine.memory_bytes == budget
    assert [h.tokens for h in handles] == [_alone(gpt2, r) for r in reqs]


def test_chunked_prefill_equals_unchunked(gpt2, llama):
    """A prompt of 100 tokens in chunks of 7 (T > 1 against a filled past) gives the logits of the
    whole prompt at once (to float rounding) and the same tokens."""
    for model in (gpt2, llama):
        prompt = np.random.default_rng(5).integers(0, 50, 100).tolist()
        whole = []
        want = gen.generate(model, [prompt], 5, on_logits=lambda s, lg: whole.append(lg.copy())).tokens[0]
        info = model.info
        engine = Engine(model, max_batch=2, prefill_chunk=7)
        engine.idle_chunk = 7  # alone too: chunks of 7 against the filled past
        seen = []
        run = model.run

        def spy(feeds, bound=None):
            out = run(feeds)
            if feeds[info.tokens].shape[1] > 1 or len(seen) < 1:
                seen.append((feeds[info.tokens].shape[1], out[info.logits][:, -1].copy()))
            return out

        model.run = spy
        try:
            h = engine.submit(Request(prompt, 5))
            _run_all(engine, [h])
        finally:
            del model.run
        assert [t for t, _ in seen][:15] == [7] * 14 + [2]  # 100 = 14 chunks of 7 and one of 2
        np.testing.assert_allclose(seen[14][1], whole[0], atol=1e-5)
        assert h.tokens == want


@pytest.mark.parametrize("combined", [False, True])
def test_short_request_after_long_one_finishes_first(gpt2, combined):
    """Continuous, not static: a short request submitted while a long one decodes joins at the next
    step and leaves when done, long before the long one ends."""
    engine = Engine(gpt2, max_batch=4)
    assert engine.combined
    engine.combined = combined
    long = engine.submit(Request([1, 2, 3], 100))
    for _ in range(5):
        engine.step()
    assert len(long.tokens) == 6  # the first iteration prefills, then decodes the new row at once
    short = engine.submit(Request([4, 5], 3))
    steps = 0
    while not short.finished:
        engine.step()
        steps += 1
    # joined at once: two calls, its prefill (first token) and a decoding step, then one more step;
    # the combined call, its prefill beside the long one's step (first token), then two steps
    assert steps == (3 if combined else 2)
    assert not long.finished and len(long.tokens) == 6 + steps
    _run_all(engine, [long])
    assert long.tokens == _alone(gpt2, Request([1, 2, 3], 100))
    assert short.tokens == _alone(gpt2, Request([4, 5], 3))


def test_cancel_frees_the_slot_at_the_next_step(gpt2):
    engine = Engine(gpt2, max_batch=1, max_queue=4)
    a = engine.submit(Request([1, 2, 3], 100))
    b = engine.submit(Request([6, 7], 4))
    for _ in range(3):
        engine.step()
    assert engine.running == 1 and engine.queued == 1 and not b.tokens
    a.cancel()
    engine.step()  # a leaves, b joins and is prefilled in the same iteration
    assert a.finish_reason == "cancelled" and len(a.tokens) == 4
    assert len(b.tokens) == 2
    _run_all(engine, [b])
    assert b.tokens == _alone(gpt2, Request([6, 7], 4))


def test_cancel_while_queued(gpt2):
    engine = Engine(gpt2, max_batch=1, max_queue=2)
    a = engine.submit(Request([1, 2, 3], 10))
    b = engine.submit(Request([4], 10))
    c = engine.submit(Request([5], 3))
    engine.step()
    b.cancel()
    engine.step()
    assert b.finish_reason == "cancelled" and not b.tokens and engine.queued == 1
    assert engine.metrics.finished["cancelled"] == 1
    _run_all(engine, [a, c])
    assert c.tokens == _alone(gpt2, Request([5], 3))


def test_a_leaving_row_moves_without_changing_the_others(gpt2):
    """Rows finish in the middle of the slots: the last row moves into the freed slot and goes on."""
    engine = Engine(gpt2, max_batch=3)
    reqs = [Request([1, 2], 30), Request([3, 4, 5], 2), Request([6], 25)]
    hs = [engine.submit(r) for r in reqs]
    _run_all(engine, hs)
    assert [h.tokens for h in hs] == [_alone(gpt2, r) for r in reqs]


def test_admission_bounds_and_drain(gpt2):
    engine = Engine(gpt2, max_batch=1, max_queue=1)
    engine.submit(Request([1], 5))
    engine.submit(Request([2], 5))
    with pytest.raises(Overloaded, match="capacity"):
        engine.submit(Request([3], 5))
    assert engine.metrics.rejected == 1
    engine.drain()
    with pytest.raises(Unavailable):
        engine.submit(Request([3], 5))
    assert engine.wait_idle(timeout=0) is False
    while engine.step():
        pass
    assert engine.wait_idle(timeout=0)


def test_stop_tokens_and_end_of_sequence(gpt2):
    free = _alone(gpt2, Request([9, 8, 7], 20))
    stop = free[4]
    first = free.index(stop)
    engine = Engine(gpt2, max_batch=2, eos_ids=[stop])
    h1 = engine.submit(Request([9, 8, 7], 20, stop_tokens=(stop,)))
    h2 = engine.submit(Request([9, 8, 7], 20, ignore_eos=True))
    _run_all(engine, [h1, h2])
    assert h1.tokens == free[:first + 1] and h1.finish_reason == "stop"
    assert h2.tokens == free and h2.finish_reason == "length"
    engine3 = Engine(gpt2, max_batch=2, eos_ids=[stop])
    h3 = engine3.submit(Request([9, 8, 7], 20))
    _run_all(engine3, [h3])
    assert h3.tokens == free[:first + 1] and h3.finish_reason == "stop"


@pytest.mark.parametrize("req, message", [
    (Request([], 5), "empty"),
    (Request([1, 50], 5), "outside the vocabulary"),
    (Request(list(range(1, 50)) * 3, 5), "context is 128"),
    (Request([1, 2], 127), "at most 126"),
    (Request([1, 2], 0), "max_tokens must be"),
    (Request([1, 2], 4, gen.Sampling(temperature=-1)), "temperature"),
    (Request([1, 2], 4, stop_tokens=(99,)), "unknown stop token"),
    (Request([1, 2], 4, stop_strings=("x",)), "need the server to have a tokenizer"),
])
def test_bad_requests_are_refused_before_they_queue(gpt2, req, message):
    engine = Engine(gpt2, max_batch=1, max_queue=0)
    with pytest.raises(RequestError, match=message):
        engine.submit(req)
    assert engine.queued == 0


def test_engine_options_and_compiled_files(gpt2, tmp_path):
    from tessera.runtime.pipeline import UsageError

    with pytest.raises(UsageError, match="past the model's context"):
        Engine(gpt2, capacity=1000)
    with pytest.raises(UsageError, match="max_batch"):
        Engine(gpt2, max_batch=0)
    import tessera

    import onnx

    path = tmp_path / "gqa.onnx"
    tessera.load("models/gpt2.tsr", layers=2, d=64, heads=4, vocab=50, ctx=128).compile(path, kv_cache=True)
    # compiled with the default (GroupQueryAttention) decoding: one cache length per row, so it serves
    loaded = serving_model.load(str(path), threads=1)
    assert serving_model.decode_kernel(loaded.info) == "gqa"
    reqs = _requests(6, seed=4)
    engine = Engine(loaded, max_batch=3, prefill_chunk=16)
    handles = [engine.submit(r) for r in reqs]
    _run_all(engine, handles)
    assert [h.tokens for h in handles] == [_alone(gpt2, r) for r in reqs]
    # a file whose cache_length is one length for every row ([1], as compiled before) cannot serve
    proto = onnx.load(str(path))
    (length,) = [i for i in proto.graph.input if i.name == "cache_length"]
    length.type.tensor_type.shape.dim[0].Clear()
    length.type.tensor_type.shape.dim[0].dim_value = 1
    old = tmp_path / "one_length.onnx"
    onnx.save(proto, str(old))
    with pytest.raises(UsageError, match="--decode plain"):
        serving_model.load(str(old))


def test_a_file_compiled_with_plain_decoding_serves_the_same(gpt2, tmp_path, capsys):
    from conftest import cli

    path = tmp_path / "plain.onnx"
    rc, out, err = cli(capsys, "compile", "gpt2", *[a for x in GPT2 for a in ("--set", x)], "--kv-cache",
                       "--decode", "plain", "-o", path)
    assert rc == 0, err
    loaded = serving_model.load(str(path), threads=1)
    reqs = _requests(6, seed=2)
    engine = Engine(loaded, max_batch=3, prefill_chunk=16)
    handles = [engine.submit(r) for r in reqs]
    _run_all(engine, handles)
    assert [h.tokens for h in handles] == [_alone(gpt2, r) for r in reqs]


@pytest.fixture(scope="module")
def llama_plain():
    return serving_model.load("llama", sets=LLAMA, threads=1, decode="plain")


def test_decoding_kernels_per_row(llama, llama_plain):
    """The engine's default decoding is GroupQueryAttention with one cache length per row (the kernel
    writes each row's new column into the engine's cache in place); the plain branch is the other.
    Stepped side by side on the same requests (uneven lengths, joins and leaves, prompts of 17 and 33
    tokens whose last chunk of 1 token runs the decoding branch): after every step the two caches hold
    the same keys and values in the same slots (to float rounding), and both give generate's tokens."""
    assert serving_model.decode_kernel(llama.info) == "gqa"
    assert serving_model.decode_kernel(llama_plain.info) == "plain"
    reqs = _requests(10, seed=21) + [Request(list(range(1, 18)), 9), Request(list(range(2, 35)), 5)]
    engines = [Engine(m, max_batch=4, max_queue=16, prefill_chunk=16) for m in (llama, llama_plain)]
    assert engines[0].in_place and not engines[1].in_place
    engines[0].combined = False  # the same iterations as the plain branch's two calls (test_serve_combined.py)
    assert "GroupQueryAttention" in engines[0].describe() and "seqlens_k" in engines[0].describe()
    assert "plain MatMul/Softmax" in engines[1].describe()
    handles = [[e.submit(r) for r in reqs] for e in engines]
    steps = 0
    while any(not h.finished for h in handles[0]):
        assert all(e.step() for e in engines)
        steps += 1
        assert [(s.handle.request.prompt, s.filled) for s in engines[0].rows] == \
            [(s.handle.request.prompt, s.filled) for s in engines[1].rows]
        assert engines[0].width == engines[1].width
        views = [e._views() for e in engines]
        for seq in engines[0].rows:  # every filled column of every live row
            r, f = seq.slot, seq.filled
            for name in views[0]:
                np.testing.assert_allclose(views[0][name][r, :, :f], views[1][name][r, :, :f], rtol=1e-4, atol=1e-5)
    assert all(h.finished for h in handles[1]) and steps > 20
    want = [_alone(llama_plain, r) for r in reqs]
    assert [h.tokens for h in handles[0]] == want
    assert [h.tokens for h in handles[1]] == want


def test_a_prompt_with_no_stream_decoding_goes_in_by_the_idle_chunk(llama):
    """A small budget cuts a prompt only while streams decode: alone, a 40-token prompt runs in one
    call of 40 under a budget of 8 (then decoding steps of one token), and with the idle chunk set
    to 16, in calls of 16, 16 and 8; the tokens are generate's either way."""
    prompt = np.random.default_rng(4).integers(0, 50, 40).tolist()
    run = llama.run
    for idle, want in ((IDLE_PREFILL_CHUNK, [40]), (16, [16, 16, 8])):
        engine = Engine(llama, max_batch=2, prefill_chunk=8)
        engine.idle_chunk = idle
        sizes = []

        def spy(feeds, bound=None):
            sizes.append(feeds[llama.info.tokens].shape[1])
            return run(feeds)

        llama.run = spy
        try:
            h = engine.submit(Request(prompt, 4))
            _run_all(engine, [h])
        finally:
            llama.run = run
        assert [t for t in sizes if t > 1] == want
        assert h.tokens == _alone(llama, Request(prompt, 4))


def test_the_help_states_the_engines_idle_chunk():
    """`serve --help` and `batch --help` write the bound as a number (the parsers import no numpy, so
    not the engine's constant): it must be the engine's."""
    from tessera.runtime.serving.server import prefill_chunk_help

    assert f"max(N, {IDLE_PREFILL_CHUNK})" in prefill_chunk_help(256)


@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("budget, chunks", [(40, [35, 35, 30]), (20, [16] * 6 + [4])])
def test_prefill_chunk_is_the_iterations_token_budget(llama, budget, chunks, combined):
    """With 5 streams decoding, a 100-token prompt goes in chunks of budget - 5 (40: 35, 35, 30), never
    under 16 (20: six of 16 and the rest); with none decoding, by up to IDLE_PREFILL_CHUNK tokens (no
    stream waits for it). Every iteration that prefills also runs the decoding step (in a call of its
    own, or in the combined call), and the tokens are generate's. While no stream decodes, a burst's short
    prompts share combined calls (each prompt's first chunk a segment) within the budget where the model
    has the call, else go in one a call."""
    engine = Engine(llama, max_batch=8, prefill_chunk=budget)
    engine.combined = combined
    assert engine.chunk_for(0) == IDLE_PREFILL_CHUNK and engine.chunk_for(5) == max(16, budget - 5)
    assert Engine(llama, max_batch=2, prefill_chunk=600).chunk_for(0) == 600  # a budget above it stands
    sizes = []
    run = llama.run

    def spy(feeds, bound=None):
        sizes.append(feeds[llama.info.tokens].shape[1])
        return run(feeds)

    step = engine._combined_step  # the combined call's chunk: the prompt tokens it takes
    engine._combined_step = lambda seq, size: sizes.append(
        min(size, len(seq.handle.request.prompt) - seq.filled)) or step(seq, size)

    short = [Request([3 + i, 4, 5], 60) for i in range(5)]
    long = Request(np.random.default_rng(9).integers(0, 50, 100).tolist(), 8)
    llama.run = spy
    try:
        handles = [engine.submit(r) for r in short]
        while engine.queued or any(s.prefilling for s in engine.rows):
            engine.step()
        if combined:  # the burst's prompts as segments of a call while none decodes, within the budget (20: two)
            first_calls = 1 if budget == 40 else 4
            assert sizes == [3] * first_calls and engine.combined_calls == first_calls
            assert engine.prompts_in_combined_calls == 5
        else:
            assert sizes == [3] * 5
        sizes.clear()
        handles.append(engine.submit(long))
        before = engine.steps
        engine.step()
        while engine.rows[-1].prefilling:
            engine.step()
        assert sizes == chunks
        assert engine.steps - before == len(chunks)  # the streams decoded at every one of those iterations
        assert engine.combined_calls == (len(chunks) + first_calls if combined else 0)  # and the short prompts' burst
        _run_all(engine, handles)
    finally:
        llama.run = run
    assert [h.tokens for h in handles] == [_alone(llama, r) for r in short + [long]]


def test_a_w8a8_model_serves_each_request_as_generate_alone():
    """--quantize w8a8 quantises each activation row with its own scale, so a request's tokens do not
    depend on what runs beside it: 12 concurrent requests (prompts in chunks, beside decoding rows in
    the combined call) each equal generate run alone on the same quantised decoder."""
    from tessera.runtime.serving.model import has_combined_call

    model = serving_model.load("llama", sets=LLAMA, threads=1, quantize="w8a8", quantize_head=True)
    assert has_combined_call(model)
    reqs = _requests(12, seed=3)
    engine = Engine(model, max_batch=4, max_queue=12, prefill_chunk=16)
    engine.idle_chunk = 7  # a lone prompt in chunks too
    handles = [engine.submit(r) for r in reqs]
    _run_all(engine, handles)
    for r, h in zip(reqs, handles):
        assert h.tokens == _alone(model, r), r


def test_quantize_options_of_serve_and_batch():
    from tessera.runtime.serving.batch import BatchOptions
    from tessera.runtime.serving.server import ServeOptions

    ServeOptions(spec="gpt2", quantize="w8a8", quantize_head=True).check()
    with pytest.raises(serving_model.UsageError, match="apply to int8 and int4"):
        ServeOptions(spec="gpt2", quantize="w8a8", quantize_block=64).check()
    with pytest.raises(serving_model.UsageError, match="quantize must be one of"):
        BatchOptions(spec="gpt2", input="a", output="b", quantize="int3").check()
    with pytest.raises(serving_model.UsageError, match="--quantize apply to .tsr specs"):
        serving_model.load("compiled.onnx", quantize="int4")


def test_provider_and_dtype_options_of_serve_and_batch():
    """Issue 37: --provider and --dtype on the engine's options (generate's); bf16 off CUDA and w8a8 on CUDA refused,
    --dtype refused for a compiled file; cpu compiles for the CPU."""
    from tessera.runtime.serving.batch import BatchOptions
    from tessera.runtime.serving.server import ServeOptions

    o = ServeOptions(spec="gpt2", provider="cpu", dtype="fp16")
    o.check()
    assert o.device == "cpu" and o.engine_pipeline_options().target.device == "cpu"
    assert ServeOptions(spec="gpt2", provider="cuda").engine_pipeline_options().target.device == "cuda"
    assert not ServeOptions(spec="gpt2", provider="cuda").engine_pipeline_options().mixed  # no CUDA lowering
    with pytest.raises(serving_model.UsageError, match="no\\s+bfloat16"):
        BatchOptions(spec="gpt2", input="a", output="b", dtype="bf16").check()
    with pytest.raises(serving_model.UsageError, match="provider must be one of|invalid choice|one of"):
        ServeOptions(spec="gpt2", provider="tpu").check()
    with pytest.raises(serving_model.UsageError, match="w8a8"):
        ServeOptions(spec="gpt2", provider="cuda", quantize="w8a8").check()
    with pytest.raises(serving_model.UsageError, match="--dtype and --quantize apply to .tsr specs"):
        serving_model.load("compiled.onnx", dtype="fp16")


def test_an_fp16_engine_on_the_cpu_provider_equals_generate():
    """--provider cpu --dtype fp16: the engine's model compiled at fp16, its cache fp16, and a request's greedy
    tokens those of generate's fp16 cached decoder alone (``_alone``)."""
    model = serving_model.load("gpt2", sets=GPT2, threads=1, provider="cpu", dtype="fp16")
    assert model.np_dtype == np.float16 and model.session.get_providers()[0] == "CPUExecutionProvider"
    engine = Engine(model, max_batch=2, capacity=64)
    assert next(iter(engine.cache.values())).dtype == np.float16
    req = Request([1, 2, 3, 4, 5], 6)
    h = engine.submit(req)
    while not h.finished:
        engine.step()
    assert h.tokens == _alone(model, req)
