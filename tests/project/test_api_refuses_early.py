"""docs/python.md: the API's bad values raise UsageError before anything is compiled. Each call
below gets one bad value; the pass manager (every pipeline, cached or not) and the ONNX writer are
replaced by a function that fails the test, so a check that only happens after a compile fails here."""

from __future__ import annotations

import pytest

import tessera
from tessera.runtime.pipeline import UsageError

BAD_CALLS = {  # name: (method, args, keywords, what the message names)
    "generate max_new_tokens=0": ("generate", ([1, 2, 3],), dict(max_new_tokens=0), "max_new_tokens"),
    "generate temperature<0": ("generate", ([1, 2, 3],), dict(temperature=-1.0), "temperature"),
    "generate top_p>1": ("generate", ([1, 2, 3],), dict(top_p=2.0), "top_p"),
    "generate cache": ("generate", ([1, 2, 3],), dict(cache="ring"), "cache"),
    "generate quantize": ("generate", ([1, 2, 3],), dict(quantize="int3"), "quantize"),
    "generate text without tokenizer": ("generate", ("hello",), {}, "tokenizer"),
    "cached threads<0": ("cached", (), dict(threads=-1), "threads"),
    "compile kv_cache with attention": ("compile", ("{out}",), dict(kv_cache=True, attention="block"), "attention"),
    "compile dtype": ("compile", ("{out}",), dict(dtype="fp8"), "dtype"),
    "compile quantize_block without quantize": ("compile", ("{out}",), dict(quantize_block=64), "quantize"),
    "compile decode without kv_cache": ("compile", ("{out}",), dict(decode="gqa"), "decode"),
    "run attention": ("run", (), dict(attention="nope"), "attention"),
    "report batch=0": ("report", (), dict(batch=0), "batch"),
}


@pytest.fixture(scope="module")
def model():
    return tessera.load("gpt2", layers=1, d=32, heads=2, vocab=50, ctx=16)


@pytest.mark.parametrize("name", BAD_CALLS)
def test_a_bad_value_raises_before_anything_is_compiled(model, name, monkeypatch, tmp_path):
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes import base

    def compiled(*a, **k):
        raise AssertionError(f"{name}: the model was compiled before the bad value was refused")

    monkeypatch.setattr(base.PassManager, "__call__", compiled)
    for writer in ("to_onnx", "to_bytes", "write"):
        monkeypatch.setattr(onnx_export, writer, compiled)
    method, args, kw, names = BAD_CALLS[name]
    args = tuple(a.format(out=tmp_path / "m.onnx") if isinstance(a, str) and "{" in a else a for a in args)
    with pytest.raises(UsageError, match=names):
        getattr(model, method)(*args, **kw)
