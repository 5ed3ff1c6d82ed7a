"""BART and Whisper, bundled encoder-decoders (issue 24), against transformers.

Each tiny checkpoint is made here by transformers (``save_pretrained``) and given to Tessera as a
folder, with no spec and no --set (runtime/io/checkpoint.py picks models/bart.tsr or whisper.tsr).
Checked: the parameter count equals ``sum(p.numel())`` (BART's final_logits_bias is a buffer, not
counted; Whisper's frozen encoder position table is a parameter, counted); ``tessera run`` logits
equal transformers' within 1e-4; ``tessera generate`` and the API's ``generate`` give transformers'
greedy tokens for a batch of two (BART: two source sentences of uneven length, right-padded with a
source mask; Whisper: two float feature arrays, as a .npy file and as a JSON literal). BART's
decoder reads its position table at arange(T) + 2, which the KV cache reads at position_ids + 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli, cli_error, perturbed  # noqa: E402

VOCAB, NEW = 64, 8
BART_SRC = [[5, 17, 42, 9, 3, 30, 2], [7, 11, 21, 2, 1, 1, 1]]  # the second padded with pad id 1
BART_MASK = [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
BART_START, WHISPER_START = 2, 3


_perturbed = perturbed


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                  decoder_ffn_dim=40, max_position_embeddings=32, forced_eos_token_id=None)
    model = _perturbed(transformers.BartForConditionalGeneration(cfg), 0.2)
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.1)  # a buffer: loaded, not counted
    folder = tmp_path_factory.mktemp("bart")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                     decoder_ffn_dim=40, max_source_positions=12, max_target_positions=32,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=WHISPER_START, suppress_tokens=[], begin_suppress_tokens=[])
    model = _perturbed(transformers.WhisperForConditionalGeneration(cfg), 0.2)
    folder = tmp_path_factory.mktemp("whisper")
    model.save_pretrained(folder, safe_serialization=True)
    features = np.random.default_rng(0).standard_normal((2, 8, 24)).astype(np.float32)  # 2 * max_source_positions
    np.save(folder.parent / "features.npy", features)
    return model, folder, features


def _greedy(model, eos: int, **inputs) -> list[list[int]]:
    """transformers' greedy generate (GenerationMixin's: Whisper's own generate adds its task and language
    logic), each row's new tokens up to and with its first end-of-sequence token."""
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(model, **inputs, max_new_tokens=NEW, do_sample=False, num_beams=1)
    rows = []
    for row in out[:, 1:].tolist():  # the decoder start token first
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows


def _json_tokens(printed: str) -> list[list[int]]:
    return [o["tokens"] for o in json.loads(printed)["outputs"]]


def _saved_logits(capsys, folder, out, *inputs) -> np.ndarray:
    rc, _, err = cli(capsys, "run", folder, *[a for i in inputs for a in ("--input", i)], "--save", out)
    assert rc == 0, err
    return np.load(out / "logits.npy")


def _report_total(capsys, folder) -> int:
    rc, printed, err = cli(capsys, "report", folder, "--format", "json")
    assert rc == 0, err
    return json.loads(printed)["params"]["total"]


# ------------------------------------------------------------------ BART
def test_bart_parameter_count_equals_transformers(bart, capsys):
    model, folder = bart
    assert _report_total(capsys, folder) == sum(p.numel() for p in model.parameters())


def test_bart_forward_equals_transformers(bart, capsys, tmp_path):
    model, folder = bart
    tgt = [[2, 0, 9, 33, 12], [2, 0, 40, 5, 6]]
    got = _saved_logits(capsys, folder, tmp_path / "out", f"src={BART_SRC}", f"src_mask={BART_MASK}", f"tgt={tgt}")
    with torch.no_grad():
        want = model(input_ids=torch.tensor(BART_SRC), attention_mask=torch.tensor(BART_MASK),
                     decoder_input_ids=torch.tensor(tgt)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_bart_generate_equals_transformers_greedy_for_two_uneven_sources(bart, capsys):
    model, folder = bart
    want = _greedy(model, 2, input_ids=torch.tensor(BART_SRC), attention_mask=torch.tensor(BART_MASK))
    assert want[0] != want[1] and len(set(want[0])) > 1  # a test that could tell rows and steps apart
    rc, printed, err = cli(capsys, "generate", folder, "--input", f"src={BART_SRC}", "--input",
                           f"src_mask={BART_MASK}", "--start-token", BART_START, "--max-new-tokens", NEW,
                           "--format", "json", "-q")
    assert rc == 0, err
    assert _json_tokens(printed) == want
    # without --start-token: the checkpoint's decoder_start_token_id (2, in its config.json)
    rc, printed, err = cli(capsys, "generate", folder, "--input", f"src={BART_SRC}", "--input",
                           f"src_mask={BART_MASK}", "--max-new-tokens", NEW, "--format", "json", "-q")
    assert rc == 0, err
    assert _json_tokens(printed) == want and json.loads(printed)["outputs"][0]["prompt_tokens"] == [BART_START]
    import tessera

    m = tessera.load(folder)
    assert m.generate(inputs={"src": BART_SRC, "src_mask": np.array(BART_MASK)}, start_token=BART_START,
                      max_new_tokens=NEW) == want
    assert m.generate(inputs={"src": BART_SRC, "src_mask": BART_MASK}, max_new_tokens=NEW) == want
    # the target prompt as the API's prompt: one row per source row
    assert m.generate([[BART_START], [BART_START]], inputs={"src": BART_SRC, "src_mask": BART_MASK},
                      max_new_tokens=NEW) == want


# ------------------------------------------------------------------ Whisper
def test_whisper_parameter_count_equals_transformers(whisper, capsys):
    model, folder, _ = whisper
    assert _report_total(capsys, folder) == sum(p.numel() for p in model.parameters())


def test_whisper_forward_equals_transformers(whisper, capsys, tmp_path):
    model, folder, features = whisper
    tgt = [[3, 9, 33, 12], [3, 40, 5, 6]]
    got = _saved_logits(capsys, folder, tmp_path / "out", f"features={folder.parent / 'features.npy'}", f"tgt={tgt}")
    with torch.no_grad():
        want = model(input_features=torch.from_numpy(features), decoder_input_ids=torch.tensor(tgt)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_whisper_generate_from_float_features_equals_transformers_greedy(whisper, capsys):
    model, folder, features = whisper
    want = _greedy(model, 2, input_features=torch.from_numpy(features))
    assert want[0] != want[1] and len(set(want[0])) > 1
    npy = folder.parent / "features.npy"
    for value in (str(npy), json.dumps(features.tolist())):  # a .npy file and a JSON literal
        rc, printed, err = cli(capsys, "generate", folder, "--input", f"features={value}", "--start-token",
                               WHISPER_START, "--max-new-tokens", NEW, "--format", "json", "-q")
        assert rc == 0, err
        assert _json_tokens(printed) == want
    import tessera

    m = tessera.load(folder)
    assert m.generate(inputs={"features": features}, start_token=WHISPER_START, max_new_tokens=NEW) == want
    assert m.generate(inputs={"features": str(npy)}, start_token=WHISPER_START, max_new_tokens=NEW) == want


@pytest.mark.parametrize("value, message", [
    ("[[[1, 2]]]", "axis 1 must be 8"),                   # the wrong number of mel bins
    ("FEATURES_SHORT", "axis 2 must be 24"),              # not 2 * max_source_positions frames
    ("/nonexistent/features.npy", "file not found"),
    ("[[0.5, 1.5], [2.5]]", "rows must have one length"),
    ("0.5", "has shape [], expected f32[B, 8, 24] (rank 3)"),  # a scalar: the wrong rank
])
def test_whisper_bad_features_are_clear_errors(whisper, capsys, value, message):
    _, folder, features = whisper
    if value == "FEATURES_SHORT":
        value = json.dumps(features[:, :, :20].tolist())
    err = cli_error(capsys, "generate", folder, "--input", f"features={value}", "--start-token", WHISPER_START,
                    "--max-new-tokens", 2)
    assert message in err and "Traceback" not in err


def test_float_values_for_token_sources_and_inputs_for_a_decoder_are_refused(bart, capsys):
    _, folder = bart
    err = cli_error(capsys, "generate", folder, "--input", "src=[[1.5, 2.0]]", "--input", "src_mask=[[1, 1]]",
                    "--start-token", BART_START, "--max-new-tokens", 2)
    assert "floating-point values" in err and "src" in err
    import tessera

    from tessera.runtime.errors import UsageError

    with pytest.raises(UsageError, match="decoder-only"):
        tessera.load("gpt2", layers=1, d=16, heads=2, vocab=50, ctx=16).generate(
            [1, 2], max_new_tokens=2, inputs={"src": [[1]]})
