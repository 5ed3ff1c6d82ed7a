"""Checkpoint buffers (issue 24): a tensor a checkpoint stores that is not trained (BART's
final_logits_bias, registered with register_buffer) loads through the .hf.toml mapping like a
parameter but is not counted as one, so the counts equal transformers' sum(p.numel())."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ort_run
from tessera.compiler.analysis.params import parameter_report
from tessera.compiler.ops import interpret
from tessera.runtime import pipeline
from tessera.runtime.io.weights import load_weights, name_map_for

torch = pytest.importorskip("torch")

SPEC = """
model Head(vocab = 23, d = 8) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = layernorm(embedding(tokens, vocab, d, name="embed"), name="ln")
  logits = linear(h, vocab, bias=false, name="head") + buffer([1, vocab], name="final_logits_bias")
}
"""

MAPPING = """
[names]
"model.shared.weight" = "embed.weight"
"model.ln.weight" = "ln.weight"
"model.ln.bias" = "ln.bias"
"lm_head.weight" = "head.weight"
"final_logits_bias" = "final_logits_bias"
"""


class Ref(torch.nn.Module):
    """BART's output end in miniature: a tied-free head plus its registered final_logits_bias."""

    def __init__(self, vocab=23, d=8):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.shared = torch.nn.Embedding(vocab, d)
        self.model.ln = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer("final_logits_bias", torch.randn(1, vocab))

    def forward(self, tokens):
        return self.lm_head(self.model.ln(self.model.shared(tokens))) + self.final_logits_bias


def test_a_buffer_loads_from_the_mapping_and_is_not_counted(tmp_path, rng):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = Ref().eval()
    ckpt = tmp_path / "head.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(ckpt))
    spec = tmp_path / "head.tsr"
    spec.write_text(SPEC)
    (tmp_path / "head.hf.toml").write_text(MAPPING)

    g = pipeline.build(spec).graph
    assert g.params["final_logits_bias"].buffer and not g.params["head.weight"].buffer
    want_count = sum(p.numel() for p in ref.parameters())
    assert want_count < sum(v.numel() for v in ref.state_dict().values())  # the buffer is in the checkpoint
    assert g.param_count() == want_count
    assert parameter_report(g)["total"] == want_count
    assert parameter_report(g)["table"][-1]["params"] == want_count

    loaded = load_weights(g, ckpt, name_map_for(spec))
    w = {p: np.asarray(loaded[p]) for p in g.params}
    np.testing.assert_array_equal(w["final_logits_bias"], ref.final_logits_bias.numpy())
    tokens = rng.integers(0, 23, (2, 5)).astype(np.int64)
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(interpret.run(g, w, {"tokens": tokens})["logits"], want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ort_run(g, w, {"tokens": tokens})["logits"], want, atol=1e-5, rtol=1e-5)
