"""Mamba (models/mamba.tsr) against transformers' MambaForCausalLM, and the cached form of a
recurrence over time (compiler/passes/recurrent_state.py) that generation runs.

The references are transformers' own model (its slow path on CPU) with the same weights: logits,
parameter count (sum of p.numel()), greedy generate. A checkpoint folder written by
save_pretrained is the model (runtime/io/checkpoint.py's folder table), so nothing is set by hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli, cli_error  # noqa: E402

VOCAB = 128
NEW = 12


@pytest.fixture(scope="module")
def hf():
    """A tiny Mamba, its weights moved well away from the initialisation so tokens differ per step."""
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                   conv_kernel=4, time_step_rank=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.MambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("mamba") / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path


def _greedy(hf, prompt: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_logits_and_parameter_count_equal_transformers(hf, folder):
    import tessera

    m = tessera.load(str(folder))
    ids = [[5, 17, 42, 99, 3, 7, 8], [1, 2, 3, 4, 5, 6, 7]]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(m.run(tokens=ids)["logits"], want, atol=1e-4, rtol=0)
    assert sum(int(np.prod(w.shape)) for w in m.weights.values()) == sum(p.numel() for p in hf.parameters())


def test_generate_a_batch_of_two_equals_transformers(hf, folder, capsys):
    """`tessera generate FOLDER`: one length (batched in transformers too) and two lengths (each row
    alone in transformers: its Mamba has no left-padding mask of its own in generate)."""
    for prompts in ([[5, 17, 42, 99, 3], [9, 8, 7, 6, 5]], [[5, 17, 42, 99, 3], [9, 8]]):
        rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps(prompts)}",
                           "--max-new-tokens", NEW, "--format", "json", "-q")
        assert rc == 0, err
        got = [o["tokens"] for o in json.loads(out)["outputs"]]
        assert got == [_greedy(hf, p) for p in prompts]
        assert len({tuple(g) for g in got}) == 2
    with torch.no_grad():  # and transformers' own batch of two
        both = hf.generate(torch.tensor([[5, 17, 42, 99, 3], [9, 8, 7, 6, 5]]), max_new_tokens=NEW,
                           do_sample=False, eos_token_id=None)[:, 5:].tolist()
    assert both == [_greedy(hf, [5, 17, 42, 99, 3]), _greedy(hf, [9, 8, 7, 6, 5])]


def test_each_step_equals_recomputing_the_whole_sequence(folder):
    """The carried state is exact: every step's logits equal the full model's on prompt + tokens so far."""
    import tessera

    m = tessera.load(str(folder))
    prompt, seen = [5, 17, 42], []
    got = m.generate(prompt, max_new_tokens=6)
    for k in range(len(got)):
        full = m.run(tokens=[prompt + got[:k]])["logits"][0, -1]
        seen.append(int(full.argmax()))
    assert seen == got


def test_a_compiled_cached_mamba_generates_the_same(folder, tmp_path, capsys):
    rc, _, err = cli(capsys, "compile", folder, "--kv-cache", "-o", tmp_path / "m.onnx")
    assert rc == 0, err
    ids = [[5, 17, 42, 99, 3], [9, 8]]
    outs = []
    for model in (tmp_path / "m.onnx", folder):
        rc, out, err = cli(capsys, "generate", model, "--input", f"tokens={json.dumps(ids)}", "--max-new-tokens", 6,
                           "--format", "json", "-q")
        assert rc == 0, err
        outs.append([o["tokens"] for o in json.loads(out)["outputs"]])
    assert outs[0] == outs[1]


def test_the_cached_graph_carries_every_scan_state_and_conv_window():
    from tessera.compiler.passes.kv_cache import add_kv_cache
    from tessera.runtime import pipeline

    g = pipeline.build("models/mamba.tsr", "tiny", [], None).graph
    info = add_kv_cache(g, last_only=True)
    assert info.layers == []
    assert [(s.kind, s.shape) for s in info.states] == [("scan", [32, 4])] * 2 + [("conv", [32, 3])] * 2
    assert {s.past for s in info.states} <= set(g.inputs) and {s.present for s in info.states} <= set(g.outputs)
    assert "attention_mask" not in g.inputs


def _graph(tmp_path, body: str, name="m.tsr"):
    from tessera.runtime import pipeline

    p = tmp_path / name
    p.write_text(body)
    return pipeline.build(str(p), None, [], None).graph


HEAD = """
block acc(h: [B, d], x: [B, d]) {
  return h + x
}
model M(d = 4, vocab = 16) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  x = embedding(tokens, vocab, d, name="emb")
"""


@pytest.mark.parametrize("line, why", [
    ("y = scan(acc, zero_state(x, d), x, reverse=true)[0]", "runs backwards over time"),
    ("y = scan(acc, tanh(select(x, 1, 0)), x)[0]", "starts from a state computed from the input"),
    ("y = transpose(conv1d(transpose(x), d, 3, padding=1, name=\"c\"))", "is not causal"),
])
def test_recurrences_without_a_cached_form_are_refused_clearly(tmp_path, line, why):
    from tessera.compiler.passes.kv_cache import CacheError, add_kv_cache

    g = _graph(tmp_path, HEAD + f"  {line}\n  logits = linear(y, vocab, name=\"head\")\n}}\n")
    with pytest.raises(CacheError, match=why):
        add_kv_cache(g)


def test_a_forward_scan_from_zeros_generates_like_the_full_model(tmp_path):
    """A spec of one running-sum scan (not Mamba): its cached form, run step by step, equals running the
    whole sequence again at every step (the uncached model, in numpy-free onnxruntime)."""
    import tessera

    spec = tmp_path / "acc.tsr"
    spec.write_text(HEAD + "  y = scan(acc, zero_state(x, d), x)[0]\n  logits = linear(y, vocab, name=\"head\")\n}\n")
    m = tessera.load(str(spec), seed=3)
    prompt = [3, 1, 4, 1, 5]
    got = m.generate(prompt, max_new_tokens=5)
    full = []
    for k in range(5):
        full.append(int(m.run(tokens=[prompt + got[:k]])["logits"][0, -1].argmax()))
    assert full == got


def test_a_model_with_nothing_to_cache_says_so(tmp_path):
    from tessera.compiler.passes.kv_cache import CacheError, add_kv_cache

    g = _graph(tmp_path, HEAD + "  logits = linear(x, vocab, name=\"head\")\n}\n")
    with pytest.raises(CacheError, match="no fused attention and no recurrence over time"):
        add_kv_cache(g)


def test_generate_refuses_a_scan_with_no_cached_form_without_a_traceback(tmp_path, capsys):
    spec = tmp_path / "rev.tsr"
    spec.write_text(HEAD + "  y = scan(acc, zero_state(x, d), x, reverse=true)[0]\n"
                           "  logits = linear(y, vocab, name=\"head\")\n}\n")
    err = cli_error(capsys, "generate", spec, "--input", "tokens=[[1,2]]", "--max-new-tokens", 2)
    assert "runs backwards over time" in err


def test_the_serving_engine_refuses_recurrent_state_clearly():
    """Its slots hold keys and values only: a Mamba served would lose its state, so it is refused."""
    from tessera.runtime import pipeline
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.serving.engine import Engine

    built = pipeline.build("models/mamba.tsr", "tiny", [], None)
    model, info = gen.compile_cached(built, pipeline.weights_for(built, None, 0, False))
    with pytest.raises(gen.UsageError, match="does not carry recurrent state"):
        Engine(gen.CachedModel(model.SerializeToString(), info), capacity=64)


def test_packaging_for_onnxruntime_genai_refuses_recurrent_state(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "w2"}')
    err = cli_error(capsys, "compile", "mamba", "-V", "tiny", "--genai", "--tokenizer", tmp_path / "tokenizer.json",
                    "--context-length", 64, "-o", tmp_path / "genai")
    assert "carries recurrent state" in err


HYBRID = """
block acc(h: [B, d], x: [B, d]) {
  return 0.5 * h + x
}
model Hybrid(d = 16, vocab = 32) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  x = embedding(tokens, vocab, d, name="emb")
  x += attention(x, 2, causal=true, name="attn")
  x += scan(acc, zero_state(x, d), x, name="rec")[0]
  logits = linear(x, vocab, name="head")
}
"""


def test_attention_and_recurrent_state_together(tmp_path):
    """Both caches in one decoder (the decoding step's attention writes its buffer in place, the state
    comes back beside it): each step equals the whole sequence recomputed, for prompts of one length
    and of three lengths left-padded in one batch (the padding kept out of the state)."""
    import tessera

    spec = tmp_path / "hybrid.tsr"
    spec.write_text(HYBRID)
    m = tessera.load(str(spec), seed=2)
    for prompts in ([[3, 1, 4, 1], [5, 9, 2, 6]], [[3, 1, 4, 1, 5, 9], [5], [2, 6, 5]]):
        got = m.generate(prompts, max_new_tokens=6)
        for p, row in zip(prompts, got):
            full = [int(m.run(tokens=[p + row[:k]])["logits"][0, -1].argmax()) for k in range(6)]
            assert full == row


GRU_HYBRID = """
model GruHybrid(d = 8, vocab = 32) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  x = embedding(tokens, vocab, d, name="emb")
  x += attention(x, 2, causal=true, name="attn")
  x += transpose(slice(conv1d(transpose(x), d, 3, padding=2, groups=d, name="conv"), -1, 0, T))
  x += gru(x, d, name="rnn")
  logits = linear(x, vocab, name="head")
}
"""


def test_a_hybrid_batch_of_uneven_prompts_scores_each_row_as_alone(tmp_path):
    """A GRU (whose step from a zero state and a zero input is not zero: zeroing inputs alone would not
    keep the padding out) and a causal conv1d beside attention: the cached decoder's scores for every
    row of a left-padded batch equal the uncached model's over that row alone, unpadded, at every step."""
    import tessera
    from tessera.runtime.generation import cached as gen

    spec = tmp_path / "gru.tsr"
    spec.write_text(GRU_HYBRID)
    m = tessera.load(str(spec), seed=4)
    prompts = [[3, 1, 4, 1, 5, 9], [5], [2, 6, 5]]
    scores = []
    tokens = gen.generate(m.cached(), prompts, 4, on_logits=lambda step, s: scores.append(s.copy())).tokens
    for r, p in enumerate(prompts):
        for k in range(4):
            alone = m.run(tokens=[p + tokens[r][:k]])["logits"][0, -1]
            np.testing.assert_allclose(scores[k][r], alone, atol=1e-5, rtol=0)


def _state_edit(**changes):
    def edit(meta):
        meta = json.loads(json.dumps(meta))
        for k, v in changes.items():
            if k.startswith("state0."):
                meta["states"][0][k[7:]] = v
            else:
                meta[k] = v
        return json.dumps(meta)
    return edit


STATES = {  # a compiled Mamba's tessera.kv_cache with its states changed: what the message says
    "no states and no layers": (_state_edit(states=[]), "layers must be a non-empty list"),
    "bad kind": (_state_edit(**{"state0.kind": "lstm"}), "states[0].kind must be one of scan, conv"),
    "negative shape": (_state_edit(**{"state0.shape": [-3, 4]}), "shape[0] must be an integer"),
    "unknown past": (_state_edit(**{"state0.past": "nope"}), "which the graph does not have"),
    "unknown initial": (_state_edit(**{"state0.initial": "nope"}), "which the graph does not have"),
    "unknown field": (_state_edit(**{"state0.extra": 1}), "unknown field 'extra'"),
}


@pytest.mark.parametrize("case", STATES)
def test_generate_refuses_changed_state_metadata(tmp_path_factory, capsys, case):
    import onnx

    from test_metadata_hostile import CHANGED, _with_meta

    d = tmp_path_factory.getbasetemp() / "mamba_cached"
    if not (d / "cached.onnx").exists():
        d.mkdir(exist_ok=True)
        rc, _, err = cli(capsys, "compile", "mamba", "-V", "tiny", "--kv-cache", "-o", d / "cached.onnx")
        assert rc == 0, err
    model = onnx.load(str(d / "cached.onnx"), load_external_data=False)
    meta = json.loads(next(e.value for e in model.metadata_props if e.key == "tessera.kv_cache"))
    value, says = STATES[case]
    path = _with_meta(d, "cached.onnx", "tessera.kv_cache", value(meta), f"st-{case.replace(' ', '_')}")
    err = cli_error(capsys, "generate", path, "--input", "tokens=[[1, 2]]", "--max-new-tokens", "2")
    assert CHANGED in err and says in err, err
