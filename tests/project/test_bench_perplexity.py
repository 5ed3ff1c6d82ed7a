"""bench/perplexity.py: its llama.cpp quantisers (q4_0, q4_1) against the gguf package's numpy ports
of llama.cpp's (quantize then dequantize), and its perturbation (off the 4-bit grid, seeded)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_bench

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def bench():
    return load_bench("perplexity")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_the_simulated_llama_cpp_quantisers_are_llama_cpps(bench, kind):
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 128)) * 0.05).astype(np.float32)
    w[rng.random(w.shape) < 0.02] *= 8
    t = gguf.GGMLQuantizationType[kind]
    want = dequantize(quantize(w, t), t).reshape(w.shape)
    got = bench.q4_0(w) if kind == "Q4_0" else bench.q4_1(w)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def test_the_perturbation_is_seeded_and_small(bench, tmp_path):
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    (tmp_path / "src").mkdir()
    save_file({"a.weight": w, "norm.weight": np.ones(64, np.float32)}, str(tmp_path / "src" / "m.safetensors"))
    (tmp_path / "src" / "config.json").write_text("{}")
    one = load_file(str(bench.perturbed_folder(tmp_path / "src", 0.05, tmp_path / "p1") / "m.safetensors"))
    two = load_file(str(bench.perturbed_folder(tmp_path / "src", 0.05, tmp_path / "p2") / "m.safetensors"))
    np.testing.assert_array_equal(one["a.weight"], two["a.weight"])
    np.testing.assert_array_equal(one["norm.weight"], np.ones(64, np.float32))  # vectors untouched
    step = (w.reshape(8, 2, 32).max(-1) - w.reshape(8, 2, 32).min(-1)) / 15
    moved = np.abs(one["a.weight"] - w).reshape(8, 2, 32).max(-1)
    assert np.all(moved > 0) and np.all(moved < 0.3 * step)
    assert (tmp_path / "p1" / "config.json").is_file()
