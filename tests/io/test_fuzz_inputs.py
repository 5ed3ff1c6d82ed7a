"""issue 25, item 5: hypothesis fuzzing past the spec front end -- the Python API's arguments and the
files Tessera reads (its own ONNX metadata, mapping files, config.json, tokenizer.json, safetensors
headers). Each target feeds hostile values to the real entry point and accepts only the documented
errors (UsageError, SpecError, WeightsError, InputError, OutputError, ModelFileError); anything else
-- a TypeError, RecursionError, OverflowError from inside -- fails with hypothesis's minimal case.

CI: FUZZ_CASES (default 40) examples per target, about 40 s in all. The long run runs each target's
cases one by one in bounded workers (20 s, 4 GiB): ``python tests/fuzz_targets.py`` (docs/guarantees.md)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import tessera  # noqa: E402
from tessera.compiler.backends.atomic import OutputError  # noqa: E402
from tessera.compiler.ir.signature import InputError  # noqa: E402
from tessera.runtime.errors import ModelFileError, UsageError  # noqa: E402
from tessera.runtime.io.weights import WeightsError  # noqa: E402
from tessera.spec.diagnostics import SpecError  # noqa: E402

DOCUMENTED = (UsageError, SpecError, WeightsError, InputError, OutputError, ModelFileError)
CASES = int(os.environ.get("FUZZ_CASES", "40"))
SETTINGS = settings(max_examples=CASES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])
TINY = dict(layers=1, d=32, heads=2, vocab=50, ctx=16)

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                    st.integers(min_value=-3, max_value=20), st.floats(), st.text(max_size=8),
                    st.sampled_from(["", "\x00", "\ud800", "fp16", "int8", "mean", "auto", "cpu", "all"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=2)),
                      max_leaves=6)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                                     st.floats(allow_nan=False), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=8)
deep = st.integers(min_value=100, max_value=200_000).map(lambda n: "[" * n + "]" * n)


def _documented(call):
    try:
        call()
    except DOCUMENTED:
        pass


# ------------------------------------------------------------------ the Python API's arguments
def tiny_model():
    """The model the API targets call (also built by tests/fuzz_targets.py's workers)."""
    return tessera.load("gpt2", **TINY)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


REPORT = ["batch", "seq", "dtype", "device", "sparse_moe", "quantize", "quantize_block", "quantize_head",
          "quantize_activations"]
GENERATE = ["max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "stop_tokens",
            "tokenizer", "threads", "cache", "quantize", "quantize_block"]
RUN = ["provider", "attention", "target", "dtype", "quantize", "sparse_moe", "recurrence", "texts", "pool", "tokens",
       "tokenizer"]
ALIGNMENT = ["layer", "output", "head", "batch_index", "tokens"]
LOAD = ["variant", "weights", "seed", "allow_large", "layers", "d"]


def _kwargs(names):
    return st.dictionaries(st.sampled_from(names), values, min_size=1, max_size=3)


@SETTINGS
@given(kw=_kwargs(REPORT))
def test_fuzz_report_arguments(model, kw):
    _documented(lambda: model.report(**kw))


@SETTINGS
@given(prompt=st.one_of(values, st.lists(st.integers(min_value=-2, max_value=60), max_size=4)), kw=_kwargs(GENERATE))
def test_fuzz_generate_arguments(model, prompt, kw):
    kw.setdefault("max_new_tokens", 2)
    _documented(lambda: model.generate(prompt, **kw))


@SETTINGS
@given(kw=_kwargs(RUN))
def test_fuzz_run_arguments(model, kw):
    kw.setdefault("tokens", [[1, 2]])
    tokens = kw.pop("tokens")
    _documented(lambda: model.run(tokens=tokens, **kw))


@SETTINGS
@given(kw=_kwargs(ALIGNMENT))
def test_fuzz_alignment_arguments(model, kw):
    kw.setdefault("tokens", [[1, 2]])
    _documented(lambda: model.alignment(**kw))


@SETTINGS
@given(spec=st.one_of(values, st.sampled_from(["gpt2", "llama", "nope", "/dev/null", "gpt2.onnx"])), kw=_kwargs(LOAD))
def test_fuzz_load_arguments(spec, kw):
    _documented(lambda: tessera.load(spec, **kw))


# ------------------------------------------------------------------ Tessera's metadata in an ONNX file
def read_cache_meta(model, folder):
    """(the kv_cache metadata, graph inputs, graph outputs) of ``model`` compiled into ``folder``."""
    import onnx

    path = folder / "cached.onnx"
    model.compile(path, kv_cache=True)
    proto = onnx.load(str(path), load_external_data=False)
    meta = json.loads(next(e.value for e in proto.metadata_props if e.key == "tessera.kv_cache"))
    inits = {i.name for i in proto.graph.initializer}
    return meta, {i.name for i in proto.graph.input if i.name not in inits}, {o.name for o in proto.graph.output}


@pytest.fixture(scope="module")
def cache_meta(model, tmp_path_factory):
    return read_cache_meta(model, tmp_path_factory.mktemp("fuzzmeta"))


def _replace_at(meta, path: list, value):
    """``meta`` with the value at ``path`` (keys and list indices, as far as they go) replaced."""
    meta = json.loads(json.dumps(meta))
    node = meta
    for i, step in enumerate(path):
        key = step % len(node) if isinstance(node, list) and node else step if isinstance(node, dict) else None
        if isinstance(node, dict):
            key = sorted(node)[step % len(node)] if node else None
        if key is None:
            return value
        if i == len(path) - 1 or not isinstance(node[key], (dict, list)):
            node[key] = value
            return meta
        node = node[key]
    return value


@SETTINGS
@given(path=st.lists(st.integers(min_value=0, max_value=20), max_size=3),
       value=st.one_of(json_values, st.sampled_from(["", "tokens", "logits", "past_key.0", "nope"])),
       raw=st.one_of(st.none(), st.text(max_size=30), deep))
def test_fuzz_kv_cache_metadata(cache_meta, path, value, raw):
    from tessera.compiler.passes.kv_cache import CacheInfo
    from tessera.runtime import metadata

    meta, inputs, outputs = cache_meta
    text = raw if raw is not None else json.dumps(_replace_at(meta, path, value))
    try:
        info = metadata.cache_info(text, "m.onnx", inputs, outputs)
    except ModelFileError as e:
        assert "not written by this version of Tessera" in str(e)
        return
    assert isinstance(info, CacheInfo) and info.layers  # accepted: every field as the schema says
    assert info.tokens in inputs and info.logits in outputs
    assert all(isinstance(x, int) and x >= 1 for layer in info.layers
               for x in (layer.kv_heads, layer.head_size, layer.value_size))


@SETTINGS
@given(value=st.one_of(json_values, deep, st.text(max_size=30)))
def test_fuzz_input_limits_metadata(value):
    from tessera.compiler.ir.signature import InputLimits
    from tessera.runtime import metadata

    text = value if isinstance(value, str) else json.dumps(value)
    try:
        limits = metadata.input_limits(text, "m.onnx", {"tokens"})
    except ModelFileError:
        return
    assert isinstance(limits, InputLimits) and set(limits.ids) <= {"tokens"}


# ------------------------------------------------------------------ mapping files, config.json
SPEC = 'model Tiny(d = 4) {\n  in x: f32[B, T, d]\n  out y: f32[B, T, d]\n  y = linear(x, d, name="proj")\n}\n'
pattern_text = st.text(alphabet="{}*.ai0_Iproj.weightbias[]", max_size=24)
toml_value = st.one_of(
    pattern_text.map(json.dumps),
    st.builds(lambda to, ax, tr: "{ split = [%s, %s], axis = %d, transpose = %s }" % (
        json.dumps(to), json.dumps(to + "x"), ax, "true" if tr else "false"),
              pattern_text, st.integers(min_value=-1, max_value=5), st.booleans()),
    st.sampled_from(['{ to = "proj.weight" }', "3", "[1, 2]", '{ groups = 0, split = ["a", "b"] }']))
mapping = st.one_of(
    st.builds(lambda rules, ignore: "ignore = %s\n[names]\n%s" % (json.dumps(ignore), "\n".join(
        f"{json.dumps(k)} = {v}" for k, v in rules)), st.lists(st.tuples(pattern_text, toml_value), max_size=4),
        st.lists(pattern_text, max_size=2)),
    st.text(max_size=60), deep.map(lambda d: "x = " + d))


@SETTINGS
@given(text=mapping, names=st.lists(st.one_of(st.text(alphabet="a0.{}*iproj", max_size=30),
                                               st.just("a" * 5000)), min_size=1, max_size=3, unique=True))
def test_fuzz_mapping_files(tmp_path_factory, text, names):
    from safetensors.numpy import save_file

    from tessera.runtime.io.weights import NameMap

    d = tmp_path_factory.mktemp("map")
    (d / "m.hf.toml").write_text(text, encoding="utf-8", errors="surrogatepass")  # lone surrogates: not UTF-8
    try:
        m = NameMap.load(d / "m.hf.toml")
        m.plan({n: (4, 4) for n in names}, model_shapes={"proj.weight": (4, 4)})
    except WeightsError:
        pass
    (d / "tiny.tsr").write_text(SPEC)
    (d / "tiny.hf.toml").write_bytes((d / "m.hf.toml").read_bytes())
    save_file({n: np.zeros((4, 4), np.float32) for n in names}, str(d / "w.safetensors"))
    _documented(lambda: tessera.load(d / "tiny.tsr", weights=d / "w.safetensors"))


@settings(SETTINGS, max_examples=max(CASES // 4, 5))
@given(config=st.one_of(json_values, st.dictionaries(st.sampled_from(["hidden_size", "num_hidden_layers",
                                                                      "num_attention_heads", "vocab_size",
                                                                      "rope_theta", "rope_scaling"]),
                                                     json_values, max_size=4)),
       raw=st.one_of(st.none(), deep, st.binary(max_size=20).map(lambda b: b.decode("latin-1"))))
def test_fuzz_config_json(tmp_path_factory, config, raw):
    from safetensors.numpy import save_file

    from tessera.runtime import pipeline

    d = tmp_path_factory.mktemp("cfg")
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(raw if raw is not None else json.dumps(config), encoding="utf-8")
    _documented(lambda: pipeline.build("llama", None, [], str(d)))


# ------------------------------------------------------------------ tokenizer.json, safetensors headers
@SETTINGS
@given(data=st.one_of(json_values.map(json.dumps), deep, st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                      st.fixed_dictionaries({"model": json_values, "version": json_values}).map(json.dumps)))
def test_fuzz_tokenizer_json(tmp_path_factory, data):
    from tessera.runtime.io import text

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(data, encoding="utf-8")
    _documented(lambda: text.load_tokenizer(path))


sizes = st.integers(min_value=-1, max_value=2 ** 40)
header_entry = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "F16", "I64", "BOOL", "X"]), json_values),
    "shape": st.one_of(st.lists(sizes, max_size=3), json_values),
    "data_offsets": st.one_of(st.lists(sizes, min_size=2, max_size=2), json_values)})


@SETTINGS
@given(header=st.one_of(st.dictionaries(st.sampled_from(["proj.weight", "proj.bias", "__metadata__"]), header_entry,
                                        max_size=2), json_values),
       body=st.binary(max_size=64), length=st.one_of(st.none(), st.integers(min_value=0, max_value=2 ** 64 - 1)))
def test_fuzz_safetensors_headers(tmp_path_factory, header, body, length):
    from tessera.runtime.io.weights import read_safetensors

    d = tmp_path_factory.mktemp("st")
    h = json.dumps(header).encode()
    (d / "w.safetensors").write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + body)
    _documented(lambda: read_safetensors(d / "w.safetensors"))
    (d / "tiny.tsr").write_text(SPEC)
    _documented(lambda: tessera.load(d / "tiny.tsr", weights=d / "w.safetensors"))
