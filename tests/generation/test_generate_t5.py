"""T5 generates (issue 39, item 1): a score bias computed from the positions in the KV cache.

T5's relative position bias is computed in the spec from ``arange(T)`` as the query and the key
positions; the cached decoder computes it at ``position_ids`` and at the keys' positions
(compiler/passes/position_bias.py). The reference is transformers' ``T5ForConditionalGeneration``
with the same weights (a tiny checkpoint written here, through the bundled t5 mapping): greedy tokens
of ``tessera generate`` and the API, and at every step the cached decoder's logits against
transformers' and against Tessera's own uncached graph over each row's whole target, for two
sources of uneven length and left-padded target prompts of uneven length. 8 buckets with
max_distance 6: the decoder's buckets saturate after 6 positions, well within the 16-20 steps,
and the encoder's (bidirectional) within the 9-token source. Decoder-only specs with a relative
bias, ALiBi from arange(T) and a hand-written distance check the same rewrite against their own
recomputation; biases that are not a function of the positions are refused with the reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cached_equals_recomputation, cli, cli_error, compile_written_cached, perturbed  # noqa: E402

VOCAB, NEW, START, EOS = 64, 16, 0, 1
SRC = [[5, 17, 42, 9, 3, 30, 2, 8, 11], [7, 11, 21, 2, 0, 0, 0, 0, 0]]  # the second right-padded
SRC_MASK = [[1] * 9, [1, 1, 1, 1, 0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """A 2-layer T5 v1.0 (ReLU, tied head) whose weights are moved from their initialisation, the decoder's
    relative table most (normal, std 3), so that the bias decides the tokens and each row's differ."""
    torch.manual_seed(1)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=START,
                                pad_token_id=0, eos_token_id=EOS)
    model = perturbed(transformers.T5ForConditionalGeneration(cfg), 0.5, seed=1)
    with torch.no_grad():
        model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 3.0)
    folder = tmp_path_factory.mktemp("t5")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _greedy(model) -> list[list[int]]:
    """transformers' greedy generate, each row's new tokens up to and with its first end-of-sequence token."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(SRC), attention_mask=torch.tensor(SRC_MASK), max_new_tokens=NEW,
                             do_sample=False, num_beams=1)
    return [row[:row.index(EOS) + 1] if EOS in row else row for row in out[:, 1:].tolist()]


def test_t5_generate_equals_transformers_greedy_for_two_uneven_sources(t5, capsys):
    model, folder = t5
    want = _greedy(model)
    assert want[0] != want[1] and all(len(set(row)) > 2 for row in want)  # rows and steps told apart
    for start in ([], ["--start-token", START]):  # the checkpoint's decoder_start_token_id, or given
        rc, printed, err = cli(capsys, "generate", folder, "--input", f"src={SRC}", "--input", f"src_mask={SRC_MASK}",
                               *start, "--max-new-tokens", NEW, "--format", "json", "-q")
        assert rc == 0, err
        assert [o["tokens"] for o in json.loads(printed)["outputs"]] == want
    import tessera

    assert tessera.load(folder).generate(inputs={"src": SRC, "src_mask": SRC_MASK}, max_new_tokens=NEW) == want


def test_t5_cached_logits_equal_transformers_and_the_uncached_graph_at_every_step(t5):
    """Target prompts of 3 and 1 tokens (left-padded in one batch): at each of 20 steps, each row's logits
    equal transformers' over that row's whole target so far and Tessera's uncached graph's (1e-4)."""
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes.pipeline import PipelineOptions, pipeline
    from tessera.runtime import pipeline as rt
    from tessera.runtime.generation.cached import CachedModel, Seq2Seq, compile_seq2seq, generate

    model, folder = t5
    built = rt.build("t5", None, [], folder)
    weights = rt.weights_for(built, str(folder), 0)
    enc, dec, info, boundary = compile_seq2seq(built, weights, "tgt", max_positions=128)
    s2s = Seq2Seq(enc.SerializeToString(), CachedModel(dec.SerializeToString(), info), boundary)
    full = rt.build("t5", None, [], folder)
    pipeline("full", PipelineOptions(attention="unfused"))(full.graph)
    uncached = ort.InferenceSession(onnx_export.to_onnx(full.graph, weights).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    src, src_mask = np.array(SRC), np.array(SRC_MASK)
    prompts = [[START, 12, 40], [START]]
    so_far = [list(p) for p in prompts]
    worst = {"transformers": 0.0, "uncached": 0.0}

    def check(step, logits):
        for r in range(2):
            feeds = {"src": src[r:r + 1], "src_mask": src_mask[r:r + 1], "tgt": np.array([so_far[r]])}
            with torch.no_grad():
                ref = model(input_ids=torch.from_numpy(feeds["src"]), attention_mask=torch.from_numpy(feeds["src_mask"]),
                            decoder_input_ids=torch.from_numpy(feeds["tgt"])).logits[0, -1].numpy()
            ours = uncached.run(None, feeds)[0][0, -1]
            worst["transformers"] = max(worst["transformers"], float(np.abs(logits[r] - ref).max()))
            worst["uncached"] = max(worst["uncached"], float(np.abs(logits[r] - ours).max()))
            so_far[r].append(int(np.argmax(ref)))

    got = generate(s2s.decoder, prompts, 20, extra_feeds=s2s.encode({"src": src, "src_mask": src_mask}),
                   on_logits=check).tokens
    assert worst["transformers"] <= 1e-4 and worst["uncached"] <= 1e-4, worst
    assert got == [row[len(p):] for row, p in zip(so_far, prompts)]


DECODER = """
model Biased(vocab = 50, d = 32, layers = 2, heads = 4) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed")
  bias = BIAS
  repeat layers as i {
    h += attention(rmsnorm(h, 1e-5, name="attn_norm"), heads, causal=true, bias=false, score_bias=bias, name="attn")
    h += mlp(rmsnorm(h, 1e-5, name="mlp_norm"), 48, act="relu", bias=false, name="mlp")
  }
  logits = linear(rmsnorm(h, 1e-5, name="norm"), vocab, bias=false, name="head")
}
"""
BIASES = {
    # T5's decoder bias, 8 buckets saturating past 6 positions
    "relative": 'relative_position_bias(heads, T, T, bidirectional=false, buckets=8, max_distance=6, name="rel")',
    # ALiBi's key-only form from arange(T): [1, heads, 1, T]
    "alibi": "alibi(heads, T)",
    # one arange read as both query and key positions: a distance penalty [T, T]
    "distance": "cast(reshape(arange(T), [T, 1]) - reshape(arange(T), [1, T]), \"f32\") * -0.3",
}


def _compile_biased(tmp_path, bias: str, cache: str = "auto"):
    return compile_written_cached(tmp_path / "biased.tsr", DECODER.replace("BIAS", bias), cache)


@pytest.mark.parametrize("cache", ["auto", "concat"])
@pytest.mark.parametrize("kind", sorted(BIASES))
def test_decoders_with_a_bias_from_the_positions_generate_as_they_recompute(tmp_path, kind, cache):
    """Prompts of 7 and 2 tokens, left-padded, then 10 greedy steps: at each, the cached decoder's logits
    equal the unfused graph over the row's whole sequence (conftest.cached_equals_recomputation), so the
    keys' positions count each row's real tokens, in the buffer and in the concatenated cache."""
    path, weights, done = _compile_biased(tmp_path, BIASES[kind], cache)
    assert len(done.info.layers) == 2 and all(k.impl == "phased" for k in done.info.kernels)
    cached_equals_recomputation(path, weights, done, 10)


@pytest.mark.parametrize("bias, reason", [
    # a running sum over the key axis: the score at (i, j) depends on every key before j
    ('reshape(cumsum(cast(arange(T), "f32"), 0), [1, 1, 1, T])', "read by cumsum"),
    # the tokens, not the positions
    ('reshape(cast(tokens, "f32"), [B, 1, 1, T]) * 0.1', "not computed from the positions arange(T) alone"),
])
def test_a_bias_that_is_not_a_function_of_the_positions_is_refused(tmp_path, capsys, bias, reason):
    from tessera.compiler.passes.base import PassError

    with pytest.raises(PassError, match="has no known cached form|its cached form is not known") as e:
        _compile_biased(tmp_path, bias)
    assert reason in str(e.value)
    err = cli_error(capsys, "generate", tmp_path / "biased.tsr", "--input", "tokens=[[1, 2, 3]]", "--max-new-tokens", 2)
    assert reason in err
