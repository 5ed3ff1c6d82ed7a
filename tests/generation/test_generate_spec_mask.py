"""Generation from a decoder spec that takes its own key padding mask (issue #39 item 1): ``in mask:
i64[B, N]`` beside the token ids, handed to the attention as ``mask=mask`` (compiler/passes/spec_mask.py;
the cache's attention_mask takes its place, the runtime feeds it).

References, independent of the code under test: transformers' GPT-2 and Llama (grouped-query attention)
built here (small configs, seeded, tests/conftest.py ``tiny_hf``), their weights saved and read by the
specs written below: their logits over a left-padded batch with its attention_mask, and their greedy
``generate`` of a left-padded batch of two prompts of different lengths. The refusals are checked by the
node and the reason their message names.
"""

from __future__ import annotations

import json
import os
import tomllib

import numpy as np
import pytest

from conftest import MODELS, cli, hf_greedy, tiny_hf
import tessera
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

VOCAB = 300

GPT2_MASKED = """
model GPT2Masked(vocab = 300, ctx = 256, d = 64, layers = 2, heads = 4, eps = 1e-5) {
  in ids: i64[B, N]
  in mask: i64[B, N]                 # 1 for a real token, 0 for padding (transformers' attention_mask)
  out logits: f32[B, N, vocab]

  h = embedding(ids, vocab, d, name="wte") + embedding(arange(N), ctx, d, name="wpe")
  repeat layers as i {
    h += attention(layernorm(h, eps, name="ln_1"), heads, causal=true, mask=mask, name="attn")
    h += mlp(layernorm(h, eps, name="ln_2"), 4 * d, act="gelu_tanh", name="mlp")
  }
  h = layernorm(h, eps, name="ln_f")
  logits = linear(h, vocab, bias=false, weight=weight("wte.weight"), name="head")
}
"""

LLAMA_MASKED = """
model LlamaMasked(vocab = 300, d = 64, layers = 2, heads = 4, kv_heads = 2, d_ff = 96, eps = 1e-5,
                  theta = 10000.0) {
  in mask: i64[B, T]                 # declared first: the token ids are the input the embedding reads
  in ids: i64[B, T]
  out logits: f32[B, T, vocab]

  h = embedding(ids, vocab, d, name="embed")
  repeat layers as i {
    h += attention(rmsnorm(h, eps, name="attn_norm"), heads, kv_heads, causal=true, mask=mask,
                   rope_theta=theta, bias=false, name="attn")
    h += swiglu(rmsnorm(h, eps, name="mlp_norm"), d_ff, name="mlp")
  }
  h = rmsnorm(h, eps, name="norm")
  logits = linear(h, vocab, bias=false, name="head")
}
"""


def _llama_names() -> str:
    """The bundled Llama mapping's [names] (its [config] names hyperparameters this spec does not have)."""
    names = tomllib.loads((MODELS / "llama.hf.toml").read_text())["names"]
    return "[names]\n" + "".join(f'"{k}" = "{v}"\n' for k, v in names.items())


class Case:
    """A transformers model saved to ``root``, and the masked spec (with its mapping) that reads it."""

    def __init__(self, family, root):
        self.hf = tiny_hf(family, VOCAB)
        self.weights = root / "hf"
        self.hf.save_pretrained(self.weights, safe_serialization=True)
        self.spec = root / f"{family}_masked.tsr"
        self.spec.write_text(GPT2_MASKED if family == "gpt2" else LLAMA_MASKED)
        mapping = (MODELS / "gpt2.hf.toml").read_text() if family == "gpt2" else _llama_names()
        self.spec.with_suffix(".hf.toml").write_text(mapping)
        self.model = tessera.load(str(self.spec), weights=str(self.weights))
        rng = np.random.default_rng(3)
        self.prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 4)]
        self.reference = hf_greedy(self.hf, self.prompts, 12)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = Case(family, tmp_path_factory.mktemp(f"spec_mask_{family}"))
        return made[family]
    return get


FAMILIES = ["gpt2", "llama"]


def _left_padded(prompts):
    t = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), t), dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, t - len(p):], mask[r, t - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_full_sequence_logits_equal_transformers_with_its_attention_mask(cases, family):
    """The uncached spec over a left-padded batch (prompts of 9 and 4 tokens) equals transformers' forward
    with the same attention_mask at every real position (a padded query's row is not a token's)."""
    case = cases(family)
    ids, mask = _left_padded(case.prompts)
    got = case.model.run(ids=ids, mask=mask)["logits"]
    with torch.no_grad():
        want = case.hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    real = mask.astype(bool)
    assert np.abs(got[real] - want[real]).max() < 1e-4
    # the mask matters: the short row's real positions differ from the same ids run without it
    unmasked = case.model.run(ids=ids, mask=np.ones_like(mask))["logits"]
    assert np.abs(unmasked[1][real[1]] - want[1][real[1]]).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_api_equals_transformers_greedy(cases, family):
    """`generate` (the API) of a left-padded batch of two prompts of different lengths: transformers'
    greedy tokens, token for token; the runtime feeds the mask (the spec's input is not asked for)."""
    case = cases(family)
    assert case.reference[0] != case.reference[1]
    assert case.model.generate(case.prompts, max_new_tokens=12) == case.reference


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("speculative", [(), ("--speculative", "ngram", "--draft-tokens", 3)])
def test_generate_cli_equals_transformers_greedy(cases, family, speculative, capsys):
    """`tessera generate` with --input ids=... (the mask is the runtime's), plainly and with speculative
    decoding (n-gram drafts, verified by the target over the same left-padded batch)."""
    case = cases(family)
    rc, out, err = cli(capsys, "generate", str(case.spec), "--weights", str(case.weights), "--input",
                       f"ids={case.prompts}", "--max-new-tokens", 12, "--format", "json", *speculative)
    assert rc == 0, err
    assert [row["tokens"] for row in json.loads(out)["outputs"]] == case.reference


@pytest.mark.parametrize("family", FAMILIES)
def test_serving_engine_gives_the_same_tokens(cases, family):
    """The serving engine (`tessera serve` / `tessera batch`'s model and engine) gives each prompt
    transformers' greedy tokens of that prompt alone (its rows fill their columns from 0)."""
    case = cases(family)
    model = serving_model.load(str(case.spec), weights=str(case.weights), threads=1)
    engine = Engine(model, max_batch=2, max_queue=4, capacity=64, prefill_chunk=16)
    handles = [engine.submit(Request(list(p), 12)) for p in case.prompts]
    while any(not h.finished for h in handles):
        assert engine.step()
    alone = [hf_greedy(case.hf, [p], 12)[0] for p in case.prompts]
    assert [h.tokens for h in handles] == alone


# ---- refusals: a spec's extra per-token input that is not a key padding mask the cache can replace
REFUSED = """
model Refused(vocab = 50, d = 16, heads = 2) {
  in ids: i64[B, N]
  in mask: INPUT_TYPE
  out logits: f32[B, N, vocab]

  h = embedding(ids, vocab, d, name="embed")
  EXTRA
  h += attention(layernorm(h, 1e-5, name="ln"), heads, causal=true, ATTENTION name="attn")
  logits = linear(h, vocab, name="head")
}
"""

REFUSALS = {
    # a query mask: the padding multiplied into the activations
    "query mask": ("i64[B, N]", 'h = h * cast(reshape(mask, [B, N, 1]), "f32")', "mask=mask,",
                   r"the input mask of Refused has no cached form: reshape at .* reads it as its operand, not as a "
                   r"key padding mask"),
    # positions counted over the real tokens (OPT's): the cache's positions are not derived from it here
    "positions": ("i64[B, N]", 'h = h + embedding(mask_positions(mask) + 2, 66, d, name="pos")', "mask=mask,",
                  r"the input mask of Refused has no cached form: cumsum at .*mask_positions.* reads it as its "
                  r"operand"),
    # the padding as an additive score bias built by the spec (not the attention's mask)
    "additive bias": ("i64[B, N]", 'bias = (1.0 - cast(reshape(mask, [B, 1, 1, N]), "f32")) * -1e9', "score_bias=bias,",
                      r"the input mask of Refused has no cached form: reshape at .* reads it as its operand"),
    # a per-token input of another kind: floats
    "per-token floats": ("f32[B, N]", 'h = h * reshape(mask, [B, N, 1])', "",
                         r"the input mask of Refused has no cached form: it is f32\[B, N\], not a mask \[B, N\]"),
    # a second token input (segment ids) read by an embedding: the runtime has nothing to feed it from
    "second ids": ("i64[B, N]", 'h = h + embedding(mask, 2, d, name="segment")', "",
                   r"Refused takes ids: i64\[B, N\], mask: i64\[B, N\]: the inputs ids, mask are all read by an "
                   r"embedding as ids"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_input_and_the_reason(case, tmp_path, capsys):
    """Every use of the extra input but the key padding of a fused causal attention is refused, naming the
    input and the node that reads it otherwise, with `tessera generate` (status 2, no traceback) and the API;
    the same spec runs uncached (the refusal is the cache's, not the spec's)."""
    input_type, extra, attention, message = REFUSALS[case]
    spec = tmp_path / "refused.tsr"
    spec.write_text(REFUSED.replace("INPUT_TYPE", input_type).replace("EXTRA", extra)
                    .replace("ATTENTION", attention))
    model = tessera.load(str(spec))
    ids = np.array([[0, 1, 2, 3]], dtype=np.int64)
    extra_value = np.ones((1, 4), dtype=np.float32 if input_type.startswith("f32") else np.int64)
    assert model.run(ids=ids, mask=extra_value)["logits"].shape == (1, 4, 50)
    with pytest.raises(Exception, match=message):
        model.generate([[1, 2, 3]], max_new_tokens=2)
    rc, out, err = cli(capsys, "generate", str(spec), "--input", "ids=[[1, 2, 3]]", "--max-new-tokens", 2)
    assert rc == 2 and "Traceback" not in err
    assert __import__("re").search(message, err), err


def test_mask_of_an_attention_that_is_not_causal_is_refused(tmp_path):
    """A bidirectional attention with the spec's mask is no cache site: refused as before, saying so."""
    spec = tmp_path / "bidirectional.tsr"
    spec.write_text(REFUSED.replace("INPUT_TYPE", "i64[B, N]").replace("EXTRA", "")
                    .replace("causal=true, ATTENTION", "mask=mask,"))
    with pytest.raises(Exception, match=r"the attention at attn.* is not causal"):
        tessera.load(str(spec)).generate([[1, 2, 3]], max_new_tokens=2)


