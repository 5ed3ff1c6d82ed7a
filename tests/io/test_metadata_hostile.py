"""issue 25, item 2: Tessera's own metadata in a compiled file is untrusted (runtime/metadata.py).

A file compiled here gets its ``tessera.kv_cache`` or ``tessera.input_limits`` value replaced by each
hostile value the issue measured (not JSON, 10,000 deep, null, a list, {}, a string context, a
negative head count, no layers, infinite limits, names the graph does not have); ``generate`` and
``run`` must say the file was not written by this version of Tessera, or was changed -- before
any of those values reaches numpy or onnxruntime. Random and text files get the same clean error
from generate as from run."""

from __future__ import annotations

import json

import onnx
import pytest

import tessera
from conftest import cli_error

CHANGED = "not written by this version of Tessera, or was changed"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    d = tmp_path_factory.mktemp("meta")
    m = tessera.load("gpt2", layers=1, d=32, heads=2, vocab=50, ctx=16)
    m.compile(d / "cached.onnx", kv_cache=True)
    m.compile(d / "full.onnx")
    return d


def _with_meta(folder, source: str, key: str, value: str, name: str):
    model = onnx.load(str(folder / source), load_external_data=False)
    for e in model.metadata_props:
        if e.key == key:
            e.value = value
    out = folder / f"{name}.onnx"
    onnx.save(model, str(out))
    return out


def _cache_meta(folder) -> dict:
    model = onnx.load(str(folder / "cached.onnx"), load_external_data=False)
    return json.loads(next(e.value for e in model.metadata_props if e.key == "tessera.kv_cache"))


def _edited(**changes):
    def edit(meta):
        meta = json.loads(json.dumps(meta))
        for k, v in changes.items():
            if k.startswith("layer0."):
                meta["layers"][0][k[7:]] = v
            else:
                meta[k] = v
        return json.dumps(meta)
    return edit


KV_CACHE = {  # name: the new value (a str, or a function of the written value), what the message says
    "not JSON": ("{layers: oops", "not JSON"),
    "nested 10,000 deep": ("[" * 10000 + "]" * 10000, "nested"),
    "null": ("null", "must be a JSON object"),
    "a list": ("[1, 2]", "must be a JSON object"),
    "empty object": ("{}", "has no 'tokens'"),
    "string context": (_edited(context="lots"), "context must be an integer"),
    "negative heads": (_edited(**{"layer0.kv_heads": -2}), "kv_heads must be an integer"),
    "huge head size": (_edited(**{"layer0.head_size": 10 ** 30}), "head_size must be an integer"),
    "no layers": (_edited(layers=[]), "layers must be a non-empty list"),
    "unknown input name": (_edited(**{"layer0.past_key": "no_such_input"}), "which the graph does not have"),
    "unknown output name": (_edited(logits="nope"), "which the graph does not have"),
    "bad mode": (_edited(mode="ring"), "mode must be one of"),
    "bool as context": (_edited(context=True), "context must be an integer"),
    "unknown field": (_edited(extra=1), "unknown field 'extra'"),
}


@pytest.mark.parametrize("case", KV_CACHE)
def test_generate_refuses_changed_cache_metadata(compiled, capsys, case):
    value, says = KV_CACHE[case]
    value = value(_cache_meta(compiled)) if callable(value) else value
    path = _with_meta(compiled, "cached.onnx", "tessera.kv_cache", value, f"kv-{case.replace(' ', '_')}")
    err = cli_error(capsys, "generate", path, "--input", "tokens=[[1, 2]]", "--max-new-tokens", "2")
    assert CHANGED in err and says in err, err


LIMITS = {
    "not JSON": ("nope", "not JSON"),
    "nested deep": ("{\"ids\": " + "[" * 5000 + "]" * 5000 + "}", "nested"),
    "a list": ("[]", "must be a JSON object"),
    "infinite rows": ('{"ids": {"tokens": [Infinity, "wte.weight"]}}', "rows must be an integer"),
    "unknown input": ('{"ids": {"tokenz": [50, "wte.weight"]}}', "which the graph does not have"),
    "not a pair": ('{"dims": {"T": [16]}}', "must be [rows, table]"),
}


@pytest.mark.parametrize("case", LIMITS)
def test_run_refuses_changed_input_limits(compiled, capsys, case):
    value, says = LIMITS[case]
    path = _with_meta(compiled, "full.onnx", "tessera.input_limits", value, f"lim-{case.replace(' ', '_')}")
    err = cli_error(capsys, "run", path, "--input", "tokens=[[1, 2]]")
    assert CHANGED in err and says in err, err


def test_the_files_as_written_still_work(compiled, capsys):
    """The schema accepts what this version writes (the checks cannot refuse everything)."""
    from conftest import cli

    rc, out, err = cli(capsys, "generate", compiled / "cached.onnx", "--input", "tokens=[[1, 2]]",
                       "--max-new-tokens", "2")
    assert rc == 0, err
    rc, out, err = cli(capsys, "run", compiled / "full.onnx", "--input", "tokens=[[1, 2]]")
    assert rc == 0, err


@pytest.mark.parametrize("content", [b"\x08\x96\x01" + bytes(range(256)) * 4, b"hello, this is text\n"],
                         ids=["random", "text"])
def test_generate_on_a_file_that_is_not_onnx(tmp_path, capsys, content):
    path = tmp_path / "m.onnx"
    path.write_bytes(content)
    err = cli_error(capsys, "generate", path, "--input", "tokens=[[1, 2]]", "--max-new-tokens", "2")
    assert "is not an ONNX model" in err


def test_serve_reads_files_through_the_same_checks(compiled, capsys, tmp_path):
    """`tessera serve` loads an .onnx through CachedModel.from_onnx too: random bytes and changed metadata
    are the same clean errors (--explain: no port is opened)."""
    pytest.importorskip("fastapi")
    (tmp_path / "r.onnx").write_bytes(bytes(range(256)) * 8)
    assert "is not an ONNX model" in cli_error(capsys, "serve", tmp_path / "r.onnx", "--explain")
    path = _with_meta(compiled, "cached.onnx", "tessera.kv_cache", "[" * 10000 + "]" * 10000, "serve-deep")
    assert CHANGED in cli_error(capsys, "serve", path, "--explain")


def test_the_cache_schema_is_declared_once_on_the_records():
    """Writer, reader and checker come from the dataclasses' fields (compiler/passes/cache_schema.py):
    every field has a schema, a record written is read back equal, and a field added with a schema
    is written and checked with no other change."""
    import dataclasses

    from tessera.compiler.passes import cache_schema
    from tessera.compiler.passes.kv_cache import CacheInfo, CacheKernel, CacheLayer, CacheState

    for cls in (CacheInfo, CacheLayer, CacheKernel, CacheState):
        assert all("json" in f.metadata for f in dataclasses.fields(cls)), cls
    info = CacheInfo("ids", "logits", [CacheLayer("n", "pk", "pv", "k", "v", 2, 8, 8, 4)], 64, True, "buffer", "f16",
                     [CacheKernel("s", "phased", "why")], "len", [CacheState("c", "conv", "ps", "s", [3, 4])])
    names_in, names_out = {"ids", "pk", "pv", "len", "ps"}, {"logits", "k", "v", "s"}
    assert cache_schema.read(CacheInfo, info.to_json(), names_in, names_out) == info
    assert CacheInfo.from_json(info.to_json()) == info

    @dataclasses.dataclass
    class Extended(CacheKernel):
        budget: int = cache_schema.json(cache_schema.Kind("int", 1), default=1)

    assert cache_schema.to_json(Extended("s", "i", "r", 5))["budget"] == 5
    with pytest.raises(cache_schema.SchemaError, match=r"budget must be an integer in \[1, "):
        cache_schema.read(Extended, {"site": "s", "impl": "i", "reason": "r", "budget": 0}, set(), set())

    @dataclasses.dataclass
    class Undeclared(CacheKernel):
        extra: int = 0

    with pytest.raises(TypeError, match="Undeclared.extra has no schema"):
        cache_schema.to_json(Undeclared("s", "i", "r"))
