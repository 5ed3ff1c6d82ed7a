"""Serving the models the KV-cache Engine cannot batch (issue 24): runtime/serving/row_engine.py.

References: transformers' own models with the same weights (tiny checkpoints written here by
``save_pretrained``, served as folders). Checked: the greedy tokens of a served BART (the prompt is
the source, the decoder starts from the checkpoint's decoder_start_token_id) and of a served Mamba
(recurrent state, batched with per-slot state) equal transformers' greedy ``generate``; requests of
different lengths in flight together give what each gives alone; the repetition penalty of the
recurrent loop equals transformers'; a source too long for BART's position table (read at
arange(S) + 2: compiler/ir/affine_index.py) is HTTP 400 on the server and a clear error on the
command line; a Whisper (float features) is refused at start with the reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from conftest import cli_error, perturbed  # noqa: E402

VOCAB, NEW, CTX = 64, 8, 32
BART_START, BART_EOS = 2, 2
SOURCES = [[5, 17, 42, 9, 3, 30, 2], [7, 11, 21, 2], [33, 8, 2]]


_perturbed = perturbed


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                  decoder_ffn_dim=40, max_position_embeddings=CTX, forced_eos_token_id=None,
                                  decoder_start_token_id=BART_START, eos_token_id=BART_EOS)
    model = _perturbed(transformers.BartForConditionalGeneration(cfg), 0.2)
    folder = tmp_path_factory.mktemp("bart")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                   conv_kernel=4, time_step_rank=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.MambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    folder = tmp_path_factory.mktemp("mamba") / "ckpt"
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _bart_greedy(model, src: list[int]) -> list[int]:
    """transformers' greedy generate for one unpadded source, up to and with its first eos."""
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(model, input_ids=torch.tensor([src]), max_new_tokens=NEW,
                                                    do_sample=False, num_beams=1)
    row = out[0, 1:].tolist()  # the decoder start token first
    return row[:row.index(BART_EOS) + 1] if BART_EOS in row else row


def _mamba_greedy(model, prompt: list[int], new: int, penalty: float = 1.0) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def _engine(folder, **kw):
    """The engine `tessera serve` builds for the folder (an encoder-decoder's start token: its checkpoint's)."""
    from tessera.runtime.serving import model as served
    from tessera.runtime.serving.row_engine import engine_for

    loaded = served.load(str(folder))
    start = served.decoder_start(None, str(folder)) if hasattr(loaded, "s2s") else None
    return engine_for(loaded, start_token=start, **kw)


def _run(engine, requests):
    """Submit every request at once, step until all finish; each one's tokens."""
    handles = [engine.submit(r) for r in requests]
    while engine.step():
        pass
    assert all(h.finished and h.error is None for h in handles), [h.error for h in handles]
    return [h.tokens for h in handles]


# ------------------------------------------------------------------ BART: an encoder-decoder
def test_served_bart_equals_transformers_alone_and_concurrently(bart):
    from tessera.runtime.serving.engine import Request
    from tessera.runtime.serving.row_engine import RowEngine

    model, folder = bart
    want = [_bart_greedy(model, s) for s in SOURCES]
    assert len({tuple(w) for w in want}) == len(want) and len(set(want[0])) > 1  # rows and steps tell apart
    engine = _engine(folder, max_batch=4)
    assert isinstance(engine, RowEngine) and engine.start_token == BART_START  # the checkpoint's start token
    assert "one onnxruntime call per row" in engine.describe()
    alone = [_run(engine, [Request(list(s), NEW)])[0] for s in SOURCES]
    together = _run(engine, [Request(list(s), NEW) for s in SOURCES])
    assert alone == want and together == want


def test_served_bart_over_http_and_a_too_long_source_is_400(bart):
    from fastapi.testclient import TestClient

    from tessera.runtime.serving.app import create_app
    from tessera.runtime.serving.server import ServeOptions, build_server

    model, folder = bart
    engine, server = build_server(ServeOptions(spec=str(folder)))
    engine.start()
    try:
        with TestClient(create_app(server)) as client:
            r = client.post("/v1/completions", json={"prompt": SOURCES[1], "max_tokens": NEW, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == _bart_greedy(model, SOURCES[1])
            r = client.post("/v1/completions", json={"prompt": [5] * (CTX + 1), "max_tokens": 2})
            assert r.status_code == 400, r.text
            msg = r.json()["error"]["message"]
            assert f"S={CTX + 1} is longer than the {CTX} positions" in msg and "position + 2" in msg, msg
            r = client.post("/v1/completions", json={"prompt": [VOCAB + 3], "max_tokens": 2})
            assert r.status_code == 400 and "must be in [0, 64)" in r.json()["error"]["message"], r.text
    finally:
        engine.close()


def test_a_too_long_bart_source_is_a_clear_error_on_the_command_line(bart, capsys):
    """Before issue 24's affine input check, the position table's Gather failed inside onnxruntime."""
    _, folder = bart
    src = json.dumps([[5] * (CTX + 1)])
    err = cli_error(capsys, "generate", folder, "--input", f"src={src}", "--input", f"src_mask={json.dumps([[1] * (CTX + 1)])}",
                    "--max-new-tokens", 2)
    assert f"S={CTX + 1} is longer than the {CTX} positions" in err and "Traceback" not in err, err
    err = cli_error(capsys, "run", folder, "--input", f"src={src}", "--input", f"src_mask={json.dumps([[1] * (CTX + 1)])}",
                    "--input", "tgt=[[2]]")
    assert f"S={CTX + 1} is longer than the {CTX} positions" in err, err


def test_input_limits_follow_affine_position_tables_as_numpy_counts(tmp_path):
    """The bound is the number of positions p with a * p + c < rows, counted here by numpy."""
    from conftest import build
    from tessera.compiler.ir.signature import input_limits

    for index, a, c in [("arange(T) + 2", 1, 2), ("2 * arange(T) + 3", 2, 3), ("arange(T)", 1, 0)]:
        spec = tmp_path / "p.tsr"
        spec.write_text(f"""
model P(vocab = 11, d = 4) {{
  in tokens: i64[B, T]
  out h: f32[B, T, d]
  h = embedding(tokens, vocab, d, name="embed") + embedding({index}, 20, d, name="pos")
}}
""")
        want = int(np.sum(a * np.arange(100) + c < 20))
        assert input_limits(build(str(spec))).dims["T"][0] == want, index


# ------------------------------------------------------------------ Mamba: recurrent state
def test_served_mamba_batches_rows_of_different_lengths_like_transformers(mamba):
    from tessera.runtime.serving.engine import Request
    from tessera.runtime.serving.row_engine import RowEngine

    model, folder = mamba
    prompts = [[5, 17, 42, 99, 3], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    want = [_mamba_greedy(model, p, 10) for p in prompts]
    assert len({tuple(w) for w in want}) == len(want) and len(set(want[0])) > 1
    engine = _engine(folder, max_batch=2)  # three requests, two slots: one waits and joins later
    assert isinstance(engine, RowEngine) and engine.batched
    assert "one onnxruntime call per step" in engine.describe()
    together = _run(engine, [Request(p, 10) for p in prompts])
    assert together == want
    assert engine.steps < sum(len(w) for w in want) - len(want)  # rows shared steps (one call each)
    assert [_run(engine, [Request(p, 10)])[0] for p in prompts] == want


def test_repetition_penalty_in_the_recurrent_loop_equals_transformers(mamba, capsys):
    """Served (the row engine's own token choice) and through ``tessera generate`` (the cached loop)."""
    from conftest import cli
    from tessera.runtime.generation.sampling import Sampling
    from tessera.runtime.serving.engine import Request

    model, folder = mamba
    prompt = [5, 17, 42, 99, 3]
    want = {p: _mamba_greedy(model, prompt, 12, p) for p in (1.0, 1.8)}
    assert want[1.0] != want[1.8]  # the penalty changes the tokens here
    engine = _engine(folder)
    for penalty, tokens in want.items():
        assert _run(engine, [Request(prompt, 12, Sampling(repetition_penalty=penalty))])[0] == tokens
        rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps([prompt])}",
                           "--max-new-tokens", 12, "--repetition-penalty", penalty, "--ignore-eos",
                           "--format", "json", "-q")
        assert rc == 0, err
        assert json.loads(out)["outputs"][0]["tokens"] == tokens


# ------------------------------------------------------------------ Whisper: float features
def test_whisper_is_refused_by_the_server_with_the_reason(tmp_path_factory, capsys):
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                     decoder_ffn_dim=16, max_source_positions=12, max_target_positions=16,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
                                     suppress_tokens=[], begin_suppress_tokens=[])
    folder = tmp_path_factory.mktemp("whisper")
    transformers.WhisperForConditionalGeneration(cfg).save_pretrained(folder, safe_serialization=True)
    capsys.readouterr()  # transformers' progress bar
    err = cli_error(capsys, "serve", folder, "--explain")
    assert "float features" in err and "HTTP API carries text or token prompts" in err, err
    assert "tessera generate --input" in err and "Traceback" not in err, err


def test_tessera_batch_serves_bart_rows_like_transformers(bart, capsys, tmp_path):
    """`tessera batch` picks its engine as the server does: the sources, as rows, give transformers'
    greedy tokens (the decoder started from the checkpoint's decoder_start_token_id)."""
    from conftest import cli

    model, folder = bart
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": s, "max_tokens": NEW}) + "\n" for s in SOURCES))
    rc, _, err = cli(capsys, "batch", folder, "--input", rows, "--output", tmp_path / "out.jsonl")
    assert rc == 0, err
    got = [json.loads(line)["tokens"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got == [_bart_greedy(model, s) for s in SOURCES]


def test_start_token_is_refused_for_a_decoder_only_model(capsys):
    err = cli_error(capsys, "serve", "mamba", "--variant", "tiny", "--start-token", "1", "--explain")
    assert "--start-token applies to encoder-decoders" in err, err


def test_a_hybrid_of_attention_and_state_is_served_row_by_row(tmp_path):
    """Attention and recurrent state in one decoder (test_mamba.py's HYBRID): `generate` refuses prompts
    of different lengths in one batch; the row engine serves them together, one decoder per row, each
    step's token the argmax of the whole sequence recomputed by the uncached model."""
    import tessera
    from test_mamba import HYBRID

    from tessera.runtime.serving import model as served
    from tessera.runtime.serving.engine import Request
    from tessera.runtime.serving.row_engine import RowEngine, engine_for

    spec = tmp_path / "hybrid.tsr"
    spec.write_text(HYBRID)
    engine = engine_for(served.load(str(spec), seed=2), max_batch=4)
    assert isinstance(engine, RowEngine) and not engine.batched
    prompts = [[3, 1, 4, 1], [5], [9, 2, 6, 5, 3, 5]]
    got = _run(engine, [Request(p, 6) for p in prompts])
    m = tessera.load(str(spec), seed=2)
    for p, row in zip(prompts, got):
        assert row == [int(m.run(tokens=[p + row[:k]])["logits"][0, -1].argmax()) for k in range(6)]


def test_served_bart_repetition_penalty_is_over_the_decoder_input_as_transformers(bart):
    """An encoder-decoder's penalty covers the start token and the tokens chosen, not the source."""
    from tessera.runtime.generation.sampling import Sampling
    from tessera.runtime.serving.engine import Request

    model, folder = bart
    src = SOURCES[0]
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(model, input_ids=torch.tensor([src]), max_new_tokens=NEW,
                                                    do_sample=False, num_beams=1, repetition_penalty=2.5)
    row = out[0, 1:].tolist()
    want = row[:row.index(BART_EOS) + 1] if BART_EOS in row else row
    assert want != _bart_greedy(model, src)  # the penalty changes the tokens here
    engine = _engine(folder)
    assert _run(engine, [Request(list(src), NEW, Sampling(repetition_penalty=2.5))])[0] == want
