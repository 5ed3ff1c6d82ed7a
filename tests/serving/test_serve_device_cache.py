"""The serving engine's device cache (runtime/serving/device_cache.py), checked on the CPU.

On CUDA the engine keeps its KV cache in OrtValues on the device and does every cache operation
(a chunk's columns into a row, a leaving row's replacement, widening and narrowing the view,
speculation's checked columns, the prefix cache's blocks) with small onnxruntime graphs there. The
same graphs run on the CPU provider over CPU OrtValues, so ``Engine(..., device_cache=True)`` on a CPU
session runs that whole path here; these tests hold it to the numpy cache's engine: the same tokens,
token for token, and the same cache contents (every active row's filled columns, bit for bit) after
every iteration of a mix of concurrent requests. What copies on CUDA are bounded under the CUDA stub in
tests/cuda/test_cuda_stub.py (``test_the_serving_engine_on_cuda``); device values cannot be computed there.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_engines_agree
from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.device_cache import DeviceCache
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.serving.prefix_cache import PrefixCache
from tessera.runtime.serving.speculation import Speculation

GPT2 = ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=192"]
LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=192"]


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(family, last_only=True):
        key = (family, last_only)
        if key not in made:
            made[key] = serving_model.load(family, sets=GPT2 if family == "gpt2" else LLAMA, threads=1,
                                           last_only=last_only)
        return made[key]
    return get


def _requests(seed: int, speculative: bool = False) -> list[Request]:
    """Prompts of 1 to ~100 tokens (several prefill chunks; some sharing a 40-token start, for the prefix
    cache; with ``speculative`` some repeating a phrase, for prompt lookup), up to 70 new tokens (rows
    outgrow the first 64-column view and leave at different steps), greedy and seeded sampling."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50, 40).tolist()
    out = []
    for i in range(14):
        prompt = rng.integers(0, 50, int(rng.integers(1, 60))).tolist()
        if i % 3 == 0:
            prompt = shared + prompt
        if speculative and i % 2:
            prompt = (prompt[:6] * 8)[:int(rng.integers(8, 48))]
        sampling = gen.Sampling(temperature=0.8, top_k=10, seed=i) if i % 4 == 3 and not speculative else \
            gen.Sampling()
        out.append(Request(prompt, int(rng.integers(1, 70)), sampling))
    if not speculative:
        out[1] = Request([7], 80)  # a one-token prompt (the decoding branch for its only chunk), long output
    return out


def _lockstep(model, reqs, speculation: bool = False, **engine_args) -> tuple[Engine, Engine]:
    """The numpy-cache engine and the device-cache one over the same requests, stepped together: after
    every iteration the same rows, lengths, slot masks and cache columns."""
    engines = []
    for device in (False, True):
        e = Engine(model, device_cache=device, **engine_args)
        PrefixCache.for_engine(e, 1)
        if speculation:
            Speculation(adaptive=False).attach(e)
        e.handles = [e.submit(Request(list(r.prompt), r.max_tokens, r.sampling)) for r in reqs]
        engines.append(e)
    host, device = engines
    assert host.device_cache is None and device.device_cache is not None and device.cache is None
    while any(not h.finished for h in host.handles):
        assert host.step() and device.step()
        assert host.width == device.width
        assert_engines_agree(host, device)
    assert all(h.finished for h in device.handles)
    for a, b in zip(host.handles, device.handles):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert a.finish_reason == "length", a.error
    return host, device


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_device_cache_engine_gives_the_numpy_engines_tokens_and_cache(models, family):
    """14 concurrent requests in 4 slots, 16-token chunks: joins, leaves (the last row moved into the freed
    slot), widening past 64 columns and narrowing back, chunked prefill, the combined call (a chunk and the
    decoding rows in one call, written in from the call's cache outputs), the prefix cache (blocks stored
    from the device, reused into a row): tokens and cache columns equal the numpy cache's at every step."""
    host, device = _lockstep(models(family), _requests(3), max_batch=4, max_queue=16, prefill_chunk=16)
    assert device.combined and device.combined_calls == host.combined_calls > 0
    assert device.relayouts == host.relayouts >= 2  # widened and narrowed again
    assert device.prefix_cache.hits == host.prefix_cache.hits > 0
    assert device.prefix_cache.stored_blocks == host.prefix_cache.stored_blocks
    assert device.metrics.finished["length"] == 14 and device.device_cache.moved_rows > 0
    assert device.cache_bytes == host.cache_bytes and device.memory_bytes == host.memory_bytes


def test_speculation_with_the_device_cache(models):
    """Speculative decoding (every draft checked in one call, each row's kept columns written at its end
    and the rejected ones left masked) on the device cache: the numpy engine's tokens and cache."""
    host, device = _lockstep(models("gpt2", last_only=False), _requests(5, speculative=True), speculation=True,
                             max_batch=4, max_queue=16, prefill_chunk=16)
    assert device.speculation.calls == host.speculation.calls > 0
    assert device.speculation.accepted == host.speculation.accepted > 0
    assert device.prefix_cache.hits == host.prefix_cache.hits


def test_two_calls_an_iteration_with_the_device_cache(models):
    """A model without the combined call runs a chunk and the decoding step as two calls: the chunk's
    keys and values from the prompt branch's outputs on the device."""
    model = models("llama")
    host = Engine(model, device_cache=False)
    host.combined = False  # as a model without the combined call (on CUDA: no lowering of it)
    device = Engine(model, device_cache=True)
    device.combined = False
    reqs = _requests(11)[:6]
    for e in (host, device):
        e.handles = [e.submit(Request(list(r.prompt), r.max_tokens, r.sampling)) for r in reqs]
        while any(not h.finished for h in e.handles):
            e.step()
        assert e.combined_calls == 0
    assert [h.tokens for h in host.handles] == [h.tokens for h in device.handles]


def test_which_cache_the_engine_takes(models, tmp_path):
    """The default on a CPU session is the numpy cache; device_cache=True there runs the device path on
    CPU OrtValues, and --explain says where the cache is; a model decoding with the plain branch (the
    engine writes its new columns after each step) is refused the device cache, with the reason."""
    model = models("gpt2")
    auto = Engine(model, max_batch=2)
    assert auto.device_cache is None and auto.cache is not None
    assert "the KV cache in host memory" in auto.placement()
    forced = Engine(model, max_batch=2, device_cache=True)
    assert "CPU OrtValues" in forced.placement() and forced.device_cache.device == "cpu"
    assert "the KV cache in OrtValues on the model's device" in forced.describe()
    assert "OrtValues" not in auto.describe()
    plain = serving_model.load("gpt2", sets=GPT2, threads=1, decode="plain")
    assert not plain.info.length_input
    assert Engine(plain, max_batch=2).device_cache is None
    forced = Engine(plain, max_batch=2, device_cache=True)  # fp32 on CUDA: the plain branch over device buffers
    assert "plain MatMul/Softmax branch" in forced.placement() and "CPU OrtValues" in forced.placement()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_plain_branch_with_the_device_cache(family):
    """The decoder whose steps run the plain MatMul/Softmax branch (fp32 on CUDA: no fp32 CUDA GroupQueryAttention)
    with the device cache: each step reads the bound buffers and gives the rows' new columns as OrtValues, which
    the cache's graphs write into their rows (engine.py ``_decode_step``): the numpy cache's tokens and cache
    columns, bit for bit, after every iteration (joins, leaves, widening and narrowing, chunks, the prefix cache)."""
    model = serving_model.load(family, sets=GPT2 if family == "gpt2" else LLAMA, threads=1, decode="plain")
    assert not model.info.length_input
    host, device = _lockstep(model, _requests(9), max_batch=4, max_queue=16, prefill_chunk=16)
    assert not device.combined and device.relayouts == host.relayouts >= 2
    assert device.prefix_cache.hits == host.prefix_cache.hits > 0 and device.device_cache.moved_rows > 0


class _Cpu:
    def get_providers(self):
        return ["CPUExecutionProvider"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_each_cache_operation_equals_its_numpy_form(dtype):
    """DeviceCache's operations against the numpy engine's (engine.py ``_put``, ``_release``,
    ``_relayout``), on buffers of two shapes: columns from a host array and from an OrtValue into a row,
    a row moved, the view widened (rows whose new place overlaps the old go through the scratch row,
    the others straight) and narrowed, columns read back. The columns a relayout does not keep are
    zeros here and stale in numpy (masked either way): compared over the kept ones. bfloat16 (--dtype bf16 on
    CUDA): the same graphs over bf16 buffers, host arrays as ml_dtypes' bfloat16 words (runtime/bfloat16.py)."""
    from tessera.runtime.bfloat16 import ortvalue

    if dtype == "bfloat16":
        from ml_dtypes import bfloat16 as dtype

    dims = {"k": (2, 4), "v": (3, 2)}
    rows, capacity = 5, 24
    dc = DeviceCache(_Cpu(), dims, rows, capacity, dtype)
    flat = {n: np.zeros(rows * kv * capacity * hd, dtype) for n, (kv, hd) in dims.items()}

    def view(n, w):
        kv, hd = dims[n]
        return flat[n][:rows * kv * w * hd].reshape(rows, kv, w, hd)

    def same(w, cols=None):
        got = dc.host_view(rows, w)
        for n in dims:
            np.testing.assert_array_equal(got[n][:, :, :cols], view(n, w)[:, :, :cols], err_msg=n)

    rng = np.random.default_rng(0)
    src = {n: rng.standard_normal((3, kv, 6, hd)).astype(dtype) for n, (kv, hd) in dims.items()}
    same(4)  # zeros at start
    for r in range(rows):
        dc.put(r, 4, r % 2, src, r % 3, 1, 4)
        for n in dims:
            view(n, 4)[r, :, r % 2:r % 2 + 3] = src[n][r % 3, :, 1:4]
    same(4)
    values = {n: ortvalue(a) for n, a in src.items()}  # OrtValues, as a call's outputs reach _put
    dc.put(2, 4, 2, values, 1, 4, 6)
    for n in dims:
        view(n, 4)[2, :, 2:4] = src[n][1, :, 4:6]
    same(4)

    def relayout(old, new):
        keep = min(old, new)
        for n, (kv, hd) in dims.items():
            before = flat[n][:rows * kv * old * hd].reshape(rows, kv, old, hd)[:, :, :keep].copy()
            view(n, new)[:, :, :keep] = before

    dc.relayout(rows, 4, 20)  # rows 0-4 overlap their old places up to 4 * (20 - 4) < 4: only row 0 does
    relayout(4, 20)
    same(20, 4)
    dc.put(4, 20, 12, src, 0, 0, 6)
    for n in dims:
        view(n, 20)[4, :, 12:18] = src[n][0]
    same(20, 4)
    dc.move_row(4, 1, 20)
    for n in dims:
        view(n, 20)[1] = view(n, 20)[4]
    np.testing.assert_array_equal(dc.host_view(rows, 20)["k"][1], view("k", 20)[1])
    for r in range(rows):  # columns 4-8 of every row filled: the narrowed view keeps them
        dc.put(r, 20, 4, src, r % 3, 2, 6)
        for n in dims:
            view(n, 20)[r, :, 4:8] = src[n][r % 3, :, 2:6]
    dc.relayout(rows, 20, 8)
    relayout(20, 8)
    same(8)
    got = dc.read(3, 8, 1, 5)
    for n in dims:
        np.testing.assert_array_equal(got[n], view(n, 8)[3, :, 1:5])


def _rows_from_zero(engine: Engine) -> None:
    """The layout the mask-less decoding step assumes (CacheOptions.prefix_keys): every row's slot mask is 1
    exactly on its columns 0..filled-1."""
    for s in engine.rows:
        row = engine.slots[s.slot]
        assert row[:s.filled].all() and not row[s.filled:].any(), (s.slot, s.filled, np.flatnonzero(row))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_decoding_step_without_its_mask_gives_the_same_tokens(models, family):
    """The engine's variant of the decoder (prefix_keys: GroupQueryAttention with seqlens_k alone, no
    attention_bias; the default on CUDA, built here on the CPU) against the masked one (the CPU default),
    stepped together over 14 concurrent requests of 1 to ~100 prompt tokens in 4 slots (joins, leaves,
    widening, 16-token chunks, the combined call, the prefix cache, greedy and seeded sampling), each with
    the numpy cache and with the device cache's path on CPU OrtValues: after every iteration the same rows,
    slot masks and cache columns (bit for bit), every row's keys at its columns 0..filled-1; at the end the
    same tokens, token for token."""
    masked = models(family)
    unmasked = serving_model.load(family, sets=GPT2 if family == "gpt2" else LLAMA, threads=1, prefix_keys=True)
    assert not masked.info.prefix_keys and unmasked.info.prefix_keys
    assert serving_model.decode_kernel(unmasked.info) == "gqa-prefix"
    reqs = _requests(7)
    engines = []
    for model in (masked, unmasked):
        for device in (False, True):
            e = Engine(model, device_cache=device, max_batch=4, max_queue=16, prefill_chunk=16)
            PrefixCache.for_engine(e, 1)
            e.handles = [e.submit(Request(list(r.prompt), r.max_tokens, r.sampling)) for r in reqs]
            engines.append(e)
    want = engines[0]
    while any(not h.finished for h in want.handles):
        for e in engines:
            assert e.step()
            _rows_from_zero(e)
        for e in engines[1:]:
            assert_engines_agree(want, e)
    for e in engines[1:]:
        assert all(h.finished for h in e.handles)
        assert [(h.tokens, h.finish_reason) for h in e.handles] == [(h.tokens, h.finish_reason) for h in want.handles]
        assert e.combined_calls == want.combined_calls > 0 and e.relayouts == want.relayouts > 0
    assert all(h.finish_reason == "length" for h in want.handles)
    assert "seqlens_k" in engines[2].describe() and "no attention_bias" in engines[2].describe()
    assert "no mask of its own" in engines[3].placement() and "no mask of its own" not in engines[1].placement()
