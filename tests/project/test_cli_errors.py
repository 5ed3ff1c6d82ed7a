"""Command-line errors for bad user input: exit status 2, one clear message, no traceback.

The commands run in-process through ``tessera.runtime.cli.main`` (stderr captured
with capsys); test_diagnostics.py has the end-to-end subprocess check.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cli, cli_error
from safetensors.numpy import save_file

from tessera.runtime import pipeline
from tessera.runtime.io.weights import init_weights

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.tsr"
WORKED = MODELS / "worked_example.tsr"
TINY_SETS = ["layers=1", "d=8", "heads=2", "vocab=16", "ctx=8"]
TINY = [arg for s in TINY_SETS for arg in ("--set", s)]
RUN_TINY = ["run", GPT2, *TINY, "--provider", "cpu"]


# ---------------------------------------------------------------- --set, --variant, the spec file
def test_set_without_equals_sign(capsys):
    err = cli_error(capsys, "ir", GPT2, "--set", "layers")
    assert err == "error: --set 'layers' must be NAME=VALUE, e.g. --set layers=2"


def test_set_given_twice(capsys):
    err = cli_error(capsys, "ir", GPT2, "--set", "layers=1", "--set", "layers=2")
    assert err == "error: --set layers is given twice"


def test_set_unknown_hyperparameter_with_did_you_mean(capsys):
    err = cli_error(capsys, "report", GPT2, "--set", "layres=2")
    assert err == ("error: unknown hyperparameter 'layres' for model GPT2; did you mean 'layers'? "
                   "(it has: vocab, ctx, d, layers, heads, eps)")


def test_set_wrong_type_points_at_the_hyperparameter(capsys):
    err = cli_error(capsys, "ir", GPT2, "--set", "layers=2.5")
    lines = err.splitlines()
    assert lines[0] == f"{GPT2}:5:48: error: 'layers' of GPT2 must be int, got float 2.5"
    assert lines[1].startswith("    5 | model GPT2(vocab = 50257, ctx = 1024, d = 768, layers = 12,")
    assert lines[2] == "      | " + " " * 47 + "^^^^^^"


def test_unknown_variant_with_did_you_mean(capsys):
    err = cli_error(capsys, "report", GPT2, "--variant", "smal")
    assert err == ("error: unknown variant 'smal'; did you mean 'small'? "
                   "(variants of GPT2: small, medium, large, xl, gpt3)")


@pytest.mark.parametrize("command", ["ir", "report", "run", "compile"])
def test_missing_spec_file(capsys, tmp_path, command):
    missing = tmp_path / "nope.tsr"
    extra = ["-o", tmp_path / "out.onnx"] if command == "compile" else []
    err = cli_error(capsys, command, missing, *extra)
    assert err == f"error: spec file not found: {missing}"


def test_spec_path_is_a_directory(capsys, tmp_path):
    err = cli_error(capsys, "ir", tmp_path)
    assert str(tmp_path) in err


def test_spec_file_that_is_not_utf8(capsys, tmp_path):
    spec = tmp_path / "bin.tsr"
    spec.write_bytes(b"\xff\xfe model M() {}\n")
    err = cli_error(capsys, "ir", spec)
    assert str(spec) in err


# ---------------------------------------------------------------- run inputs
def test_run_float_values_for_an_i64_input(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[1.5, 2.0]]")
    assert err == "error: input 'tokens' holds floating-point values but expects i64 (shape i64[B, T])"


def test_run_input_of_the_wrong_rank(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[1, 2]")
    assert err == "error: input 'tokens' has shape [2], expected i64[B, T] (rank 2)"


def test_run_input_with_a_wrong_fixed_axis(capsys):
    err = cli_error(capsys, "run", WORKED, "--provider", "cpu", "--input", "x=[[1,0,1],[0,1,1]]")
    assert err == "error: input 'x' has shape [2, 3], expected f32[T, 2] (axis 1 must be 2)"


def test_run_missing_input(capsys):
    err = cli_error(capsys, *RUN_TINY)
    assert err == "error: missing input 'tokens' (i64[B, T]); the model's inputs are: tokens: i64[B, T]"


def test_run_unknown_input_name(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[1, 2]]", "--input", "toks=[[1]]")
    assert err == "error: unknown input 'toks'; the model's inputs are: tokens: i64[B, T]"


def test_run_input_without_equals_sign(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens")
    assert err == "error: --input 'tokens' must be NAME=VALUE (VALUE: a JSON array or a .npy file)"


def test_run_input_that_is_not_valid_json(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[1, 2")
    assert err.startswith("error: input 'tokens': value is neither a JSON array nor a .npy path (")
    assert err.endswith("); expected i64[B, T]")
    assert "\n" not in err


def test_run_input_that_is_not_rectangular(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[1, 2], [3]]")
    assert err == "error: input 'tokens': the JSON array is not rectangular; expected i64[B, T]"


def test_run_input_npy_file_that_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "tokens.npy"
    err = cli_error(capsys, *RUN_TINY, "--input", f"tokens={missing}")
    assert err == f"error: input 'tokens': file not found: {missing}"


def test_run_input_npy_file_of_the_wrong_rank(capsys, tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.array([1, 2, 3], dtype=np.int64))
    err = cli_error(capsys, *RUN_TINY, "--input", f"tokens={path}")
    assert err == "error: input 'tokens' has shape [3], expected i64[B, T] (rank 2)"


def test_run_empty_input_is_not_reported_as_floating_point(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[]]")
    assert "tokens" in err and "i64[B, T]" in err
    assert "floating-point" not in err


def test_run_token_id_out_of_vocabulary(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[3, 100, 16]]")
    assert err == ("error: input 'tokens' holds 100 at [0, 1], but its values index the 16 rows of "
                   "'wte.weight': they must be in [0, 16) (2 values are out of range)")


def test_run_negative_token_id(capsys):
    """ONNX Gather would wrap -1 to the table's last row; Tessera refuses it."""
    err = cli_error(capsys, *RUN_TINY, "--input", "tokens=[[3, -1]]")
    assert err == ("error: input 'tokens' holds -1 at [0, 1], but its values index the 16 rows of "
                   "'wte.weight': they must be in [0, 16)")


def test_run_sequence_longer_than_context(capsys):
    err = cli_error(capsys, *RUN_TINY, "--input", f"tokens={[list(range(10))]}")
    assert err == "error: T=10 is longer than the 8 positions of 'wpe.weight'; the model takes at most T=8"


def test_compiled_onnx_file_keeps_the_limits(capsys, tmp_path):
    out = tmp_path / "tiny.onnx"
    rc, _, err = cli(capsys, "compile", GPT2, *TINY, "-o", out)
    assert rc == 0, err
    err = cli_error(capsys, "run", out, "--provider", "cpu", "--input", "tokens=[[1, 2, 3, 4, 5, 6, 7, 8, 9]]")
    assert err == "error: T=9 is longer than the 8 positions of 'wpe.weight'; the model takes at most T=8"
    err = cli_error(capsys, "run", out, "--provider", "cpu", "--input", "tokens=[[16]]")
    assert "input 'tokens' holds 16 at [0, 0]" in err and "[0, 16)" in err
    rc, _, err = cli(capsys, "run", out, "--provider", "cpu", "--input", "tokens=[[0, 15, 1, 2, 3, 4, 5, 6]]")
    assert rc == 0, err


def test_run_token_type_out_of_range(capsys):
    bert = ["run", MODELS / "bert.tsr", "--set", "layers=1", "--set", "d=8", "--set", "heads=2", "--set", "vocab=16",
            "--set", "ctx=8", "--set", "d_ff=16", "--provider", "cpu"]
    err = cli_error(capsys, *bert, "--input", "tokens=[[1, 2]]", "--input", "token_types=[[0, 2]]",
                    "--input", "mask=[[1, 1]]")
    assert err == ("error: input 'token_types' holds 2 at [0, 1], but its values index the 2 rows of "
                   "'token_type.weight': they must be in [0, 2)")


def test_run_onnx_file_that_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "model.onnx"
    err = cli_error(capsys, "run", missing, "--input", "tokens=[[1]]")
    assert err == f"error: model file not found: {missing}"


def test_run_onnx_file_rejects_set(capsys, tmp_path):
    err = cli_error(capsys, "run", tmp_path / "model.onnx", "--set", "layers=2")
    assert err == ("error: --variant, --set and --weights apply to .tsr specs; an .onnx file is "
                   "already compiled")


def test_run_worked_example_prints_json(capsys):
    rc, out, err = cli(capsys, "run", WORKED, "--input", "x=[[1,0],[0,1],[1,1]]", "--format", "json")
    assert rc == 0, err
    result = json.loads(out)
    outputs = result["outputs"]
    assert set(outputs) == {"y", "weights"}
    assert outputs["y"]["shape"] == [3, 2] and outputs["weights"]["shape"] == [3, 3]
    assert outputs["y"]["dtype"] == "float32"
    # Row 0: query x1 = (1, 0) -> q = (1, 1); keys (1, 0), (1, 1), (2, 1) -> scores (1, 2, 3).
    scores = np.array([1.0, 2.0, 3.0])
    expected = np.exp(scores) / np.exp(scores).sum()
    np.testing.assert_allclose(outputs["weights"]["values"][0], expected, rtol=1e-5)
    # v is the identity map, so y = weights @ x.
    x = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float64)
    np.testing.assert_allclose(outputs["y"]["values"], np.array(outputs["weights"]["values"]) @ x, rtol=1e-5)


# ---------------------------------------------------------------- weights
@pytest.fixture(scope="module")
def tiny_weights() -> dict[str, np.ndarray]:
    """A complete checkpoint for the tiny GPT-2, under Tessera's own parameter paths."""
    built = pipeline.build(GPT2, None, TINY_SETS)
    return init_weights(built.graph, seed=0)


def _hf_tiny(d: int = 8, vocab: int = 16, ctx: int = 8) -> dict[str, np.ndarray]:
    """A complete tiny GPT-2 checkpoint under Hugging Face names (mapped by models/gpt2.hf.toml)."""
    z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    t = {"transformer.wte.weight": z(vocab, d), "transformer.wpe.weight": z(ctx, d),
         "transformer.ln_f.weight": z(d), "transformer.ln_f.bias": z(d),
         "transformer.h.0.attn.c_attn.weight": z(d, 3 * d), "transformer.h.0.attn.c_attn.bias": z(3 * d),
         "transformer.h.0.attn.c_proj.weight": z(d, d), "transformer.h.0.attn.c_proj.bias": z(d),
         "transformer.h.0.mlp.c_fc.weight": z(d, 4 * d), "transformer.h.0.mlp.c_fc.bias": z(4 * d),
         "transformer.h.0.mlp.c_proj.weight": z(4 * d, d), "transformer.h.0.mlp.c_proj.bias": z(d),
         "transformer.h.0.attn.bias": z(1, 1, ctx, ctx)}  # ignored by the mapping
    for ln in ("ln_1", "ln_2"):
        t[f"transformer.h.0.{ln}.weight"] = z(d)
        t[f"transformer.h.0.{ln}.bias"] = z(d)
    return t


def _compile(capsys, tmp_path, weights_file):
    return cli(capsys, "compile", GPT2, *TINY, "--weights", weights_file, "-o", tmp_path / "tiny.onnx")


def test_complete_tessera_named_checkpoint_compiles(capsys, tmp_path, tiny_weights):
    path = tmp_path / "tiny.safetensors"
    save_file(tiny_weights, str(path))
    rc, out, err = _compile(capsys, tmp_path, path)
    assert rc == 0, err
    assert out.startswith(f"wrote {tmp_path / 'tiny.onnx'}: GPT2, 1,080 parameters")


def test_complete_hf_named_checkpoint_compiles(capsys, tmp_path):
    path = tmp_path / "hf.safetensors"
    save_file(_hf_tiny(), str(path))
    rc, _, err = _compile(capsys, tmp_path, path)
    assert rc == 0, err


def test_tessera_named_checkpoint_lists_missing_unexpected_and_misshaped(capsys, tmp_path, tiny_weights):
    bad = dict(tiny_weights)
    del bad["layers.0.mlp.fc.bias"]
    bad["layers.0.attn.extra"] = np.zeros(3, np.float32)
    bad["ln_f.weight"] = np.ones(9, np.float32)
    path = tmp_path / "bad.safetensors"
    save_file(bad, str(path))
    rc, _, err = _compile(capsys, tmp_path, path)
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"error: weights in {path} do not fit model GPT2")
    assert "  missing (1): layers.0.mlp.fc.bias" in lines
    assert "  unexpected (1): layers.0.attn.extra" in lines
    assert "  mis-shaped: ln_f.weight is [9], expected [8]" in lines
    assert not (tmp_path / "tiny.onnx").exists()


def test_hf_named_checkpoint_lists_missing_unexpected_and_misshaped(capsys, tmp_path):
    bad = _hf_tiny()
    del bad["transformer.h.0.mlp.c_fc.bias"]
    bad["transformer.h.0.attn.extra"] = np.zeros(2, np.float32)
    bad["transformer.ln_f.weight"] = np.zeros(9, np.float32)
    path = tmp_path / "bad.safetensors"
    save_file(bad, str(path))
    rc, _, err = _compile(capsys, tmp_path, path)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: weights in {path} do not fit model GPT2 (names mapped by {MODELS / 'gpt2.hf.toml'}):",
        "  missing (1): layers.0.mlp.fc.bias",
        "  unexpected (1): transformer.h.0.attn.extra",
        "  mis-shaped: ln_f.weight is [9], expected [8]",
    ]
    assert not (tmp_path / "tiny.onnx").exists()


def test_hf_fused_tensor_that_does_not_split_evenly(capsys, tmp_path):
    bad = _hf_tiny()
    bad["transformer.h.0.attn.c_attn.weight"] = np.zeros((8, 25), np.float32)
    path = tmp_path / "bad.safetensors"
    save_file(bad, str(path))
    err = cli_error(capsys, "compile", GPT2, *TINY, "--weights", path, "-o", tmp_path / "tiny.onnx")
    assert "transformer.h.0.attn.c_attn.weight" in err


def test_weights_file_not_found(capsys, tmp_path):
    missing = tmp_path / "nope.safetensors"
    err = cli_error(capsys, "compile", GPT2, *TINY, "--weights", missing, "-o", tmp_path / "tiny.onnx")
    assert err == f"error: weights file not found: {missing}"


def test_weights_file_that_is_not_safetensors(capsys, tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"this is not a safetensors file")
    err = cli_error(capsys, "compile", GPT2, *TINY, "--weights", path, "-o", tmp_path / "tiny.onnx")
    assert err.startswith(f"error: cannot read {path} as safetensors: ")
