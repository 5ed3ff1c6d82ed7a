"""Bundled specs by name: ``tessera report gpt2`` works from any folder, a path still wins, and a
name that is neither is a clear error (status 2, the bundled names, a did-you-mean)."""

from __future__ import annotations

import pytest
from conftest import MODELS, cli, cli_error

from tessera.models import bundled_names, bundled_spec
from tessera.runtime import pipeline
from tessera.runtime.cli import make_parser
from tessera.runtime.io.weights import name_map_for

TINY = ["--set", "layers=1", "--set", "d=8", "--set", "heads=2", "--set", "vocab=16", "--set", "ctx=8"]


def test_bundled_names_are_the_specs_on_disk():
    assert bundled_names() == sorted(p.stem for p in MODELS.glob("*.tsr"))
    assert {"gpt2", "worked_example"} <= set(bundled_names())


@pytest.mark.parametrize("name", ["worked_example", "worked_example.tsr"])
def test_ir_of_a_bundled_name_from_another_folder(capsys, monkeypatch, tmp_path, name):
    rc, want, _ = cli(capsys, "ir", MODELS / "worked_example.tsr", "--variant", "scaled")
    assert rc == 0
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(capsys, "ir", name, "--variant", "scaled")
    assert rc == 0, err
    assert out == want


def test_report_of_a_bundled_name(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(capsys, "report", "gpt2", *TINY, "--seq", "8", "--format", "csv")
    assert rc == 0, err
    assert "GPT2" in out


def test_compile_and_run_a_bundled_name(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(capsys, "compile", "gpt2", *TINY, "-o", "tiny.onnx")
    assert rc == 0, err
    assert (tmp_path / "tiny.onnx").exists()
    rc, out, err = cli(capsys, "run", "tiny.onnx", "--input", "tokens=[[1, 2, 3]]", "--provider", "cpu",
                       "--format", "json")
    assert rc == 0, err
    assert '"logits"' in out


def test_a_path_wins_over_a_bundled_name(capsys, monkeypatch, tmp_path):
    (tmp_path / "gpt2").write_text("model Mine() {\n  in x: f32[T, 2]\n  out y: f32[T, 2]\n  y = x\n}\n")
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(capsys, "ir", "gpt2")
    assert rc == 0, err
    assert out.startswith("graph Mine\n")


@pytest.mark.parametrize("command", ["ir", "report", "run", "compile"])
def test_unknown_name_lists_the_bundled_specs(capsys, monkeypatch, tmp_path, command):
    monkeypatch.chdir(tmp_path)
    extra = ["-o", tmp_path / "out.onnx"] if command == "compile" else []
    err = cli_error(capsys, command, "gtp2", *extra)
    assert err == ("error: no spec file or bundled spec named 'gtp2'; did you mean 'gpt2'? "
                   f"(bundled specs: {', '.join(bundled_names())})")


def test_unknown_name_without_a_close_match(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, "ir", "xyzzy.tsr")
    assert err == f"error: no spec file or bundled spec named 'xyzzy.tsr' (bundled specs: {', '.join(bundled_names())})"


def test_a_missing_path_is_not_looked_up_by_name(capsys, tmp_path):
    err = cli_error(capsys, "ir", tmp_path / "gpt2.tsr")
    assert err == f"error: spec file not found: {tmp_path / 'gpt2.tsr'}"


def test_checkpoint_mapping_of_a_bundled_spec_is_found(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with_map = sorted(p.name[: -len(".hf.toml")] for p in MODELS.glob("*.hf.toml"))
    assert with_map, "no .hf.toml files beside the bundled specs"
    for name in with_map:
        path = pipeline.resolve_spec(name)
        assert path == bundled_spec(name)
        nm = name_map_for(path)
        assert nm is not None and nm.rules, name


@pytest.mark.parametrize("command", [None, "compile", "run", "report", "ir"])
def test_help_says_a_bundled_name_is_accepted(capsys, command):
    with pytest.raises(SystemExit) as info:
        make_parser().parse_args([command, "--help"] if command else ["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "bundled spec" in text
    for name in bundled_names():
        assert name in text, (command, name)


# ---------------------------------------------------------------- --dtype spellings
@pytest.mark.parametrize("spec_spelling,cli_spelling", [("f16", "fp16"), ("f32", "fp32")])
def test_dtype_accepts_the_spec_spelling(capsys, tmp_path, spec_spelling, cli_spelling):
    """The language spells element types f16/f32, --dtype fp16/fp32: both mean the same."""
    outs = []
    for dtype in (spec_spelling, cli_spelling):
        rc, out, err = cli(capsys, "report", "gpt2", *TINY, "--seq", "8", "--dtype", dtype, "--format", "json")
        assert rc == 0, err
        outs.append(out)
    assert outs[0] == outs[1]
    files = []
    for dtype in (spec_spelling, cli_spelling):
        out = tmp_path / f"{dtype}.onnx"
        rc, _, err = cli(capsys, "compile", "gpt2", *TINY, "--dtype", dtype, "-o", out)
        assert rc == 0, err
        files.append(out.read_bytes())
    assert files[0] == files[1]
