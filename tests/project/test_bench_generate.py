"""bench/generate.py's --quantize-block: taken only with --quantize int4 (it sets the block of both
Tessera's compile and onnxruntime-genai's builder), refused otherwise before any model is built,
rather than ignored while the run goes on at fp32."""

from __future__ import annotations

import sys

import pytest

from conftest import load_bench


def test_a_block_without_int4_is_refused(monkeypatch):
    bench = load_bench("generate")
    monkeypatch.setattr(sys, "argv", ["generate.py", "--quantize-block", "64"])
    monkeypatch.setattr(bench, "make_weights", lambda *a: pytest.fail("a model was built before the refusal"))
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == "--quantize-block needs --quantize int4"
