"""Progress on long work (issue 21): compile's weight streaming and generate's decoder compilation draw
a rich progress bar when stderr is a terminal, print one summary line when it is not, and nothing with
-q. The figures checked come from the file written (its size) and the stage names, not from the bar."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from tessera.runtime.cli import main
from tessera.runtime.progress import Progress

TINY = ["--set", "layers=2", "--set", "d=32", "--set", "heads=2", "--set", "vocab=50", "--set", "ctx=16"]


def _compile(capsys, tmp_path, *extra):
    out = tmp_path / "g.onnx"
    assert main(["compile", "gpt2", *TINY, "-o", str(out), *extra]) == 0
    return capsys.readouterr(), out


def test_compile_not_on_a_terminal_prints_one_summary_line(capsys, tmp_path):
    captured, out = _compile(capsys, tmp_path)
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    m = re.fullmatch(r"writing the weights: ([\d.]+) (KB|MB) in [\d.]+ s", lines[0])
    assert m, lines[0]
    # the bytes streamed are the weights: 4 bytes (fp32) per parameter of the "wrote" line, to the line's rounding
    params = int(re.search(r"([\d,]+) parameters", captured.out).group(1).replace(",", ""))
    shown = float(m.group(1)) * (1e3 if m.group(2) == "KB" else 1e6)
    assert abs(shown - 4 * params) <= 0.05 * (1e3 if m.group(2) == "KB" else 1e6)
    assert "━" not in captured.err


def test_compile_quiet_prints_nothing_on_stderr(capsys, tmp_path):
    captured, _ = _compile(capsys, tmp_path, "-q")
    assert captured.err == "" and captured.out.startswith("wrote ")


def test_compile_on_a_terminal_draws_a_bar(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich then treats stderr as a terminal
    captured, out = _compile(capsys, tmp_path)
    assert "━" in captured.err and "writing the weights" in captured.err
    assert not re.search(r"writing the weights: [\d.]+ (KB|MB) in", captured.err)  # a bar, not the line
    assert "/" in captured.err  # done/total bytes


def test_generate_from_a_spec_summarises_the_decoder_compile(capsys):
    argv = ["generate", "gpt2", *TINY, "--input", "tokens=[[1, 2, 3]]", "--max-new-tokens", "2"]
    assert main(argv) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert re.fullmatch(r"compiling the cached decoder in [\d.]+ s \(graph [\d.]+ s, weights [\d.]+ s, "
                        r"passes and ONNX [\d.]+ s, onnxruntime session [\d.]+ s\)", first), first
    assert main(argv + ["-q"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("terminal", [False, True])
def test_the_stage_bar_and_line(terminal):
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=100)
    with Progress("compiling", "stages", console=console) as p:
        p(0, 2, "first")
        p(1, 2, "second")
        p(2, 2)
    text = out.getvalue()
    if terminal:
        assert "2/2" in text and "compiling" in text and " in " not in text
    else:
        assert re.fullmatch(r"compiling in [\d.]+ s \(first [\d.]+ s, second [\d.]+ s\)\n", text), text


def test_no_line_after_a_failure_or_when_nothing_ran():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("writing", console=Console(file=out, force_terminal=False)) as p:
            p(10, 100)
            raise RuntimeError("boom")
    with Progress("writing", console=Console(file=out, force_terminal=False)):
        pass
    assert out.getvalue() == ""
