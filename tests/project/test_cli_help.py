"""--version, did-you-mean for misspelt flags and subcommands, and repr(Model)."""

from __future__ import annotations

import pytest

import tessera
from tessera.runtime.cli import main


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tessera {tessera.__version__}"


@pytest.mark.parametrize("argv,hint", [
    (["report", "gpt2", "--varient", "small"], "--varient: did you mean --variant?"),
    (["generate", "gpt2", "--temprature", "0.5"], "--temprature: did you mean --temperature?"),
    (["reprot", "gpt2"], "did you mean report?"),
    (["compile", "gpt2", "-o", "x.onnx", "--quantise", "int8"], "did you mean --quantize?"),
])
def test_a_misspelt_flag_or_command_gets_the_closest(capsys, argv, hint):
    err = _fails(capsys, *argv)
    assert hint in err and "Traceback" not in err


def test_nothing_close_gets_no_guess(capsys):
    err = _fails(capsys, "report", "gpt2", "--zzzzzz")
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_repr_of_a_model_says_what_it_is():
    m = tessera.load("gpt2", layers=1, d=32, heads=2, vocab=100, ctx=16)
    params = 100 * 32 + 16 * 32 + 1 * (4 * 32 * 32 + 4 * 32 + 2 * 4 * 32 * 32 + 4 * 32 + 32 + 2 * 2 * 32) + 2 * 32
    assert repr(m) == f"<tessera.Model GPT2: 'gpt2', layers=1, d=32, heads=2, vocab=100, ctx=16, seed=0 (seeded weights); {params:,} parameters>"


class _FakeOrt:
    """onnxruntime as onnxruntime-gpu presents itself on a machine without a GPU: CUDA listed."""

    def __init__(self):
        self.sessions = []

    class SessionOptions:
        log_severity_level = 0

    def get_available_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def set_default_logger_severity(self, level):
        pass

    def InferenceSession(self, src, opts, providers):
        self.sessions.append(providers)
        return self


def test_provider_auto_does_not_try_cuda_without_a_gpu(monkeypatch):
    from tessera.runtime import session

    fake = _FakeOrt()
    monkeypatch.setattr(session, "_ort", lambda: fake)
    monkeypatch.setattr(session, "gpu_present", lambda: False)
    session.open_session(b"model", "auto")
    assert fake.sessions == [["CPUExecutionProvider"]]
    monkeypatch.setattr(session, "gpu_present", lambda: True)  # with a device, auto tries CUDA first
    fake.sessions.clear()
    try:
        session.open_session(b"model", "auto")
    except Exception:
        pass
    assert fake.sessions[0] == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_the_parsers_import_no_compiler_and_no_onnx():
    """`tessera --help` builds every parser: none of them may import onnx, onnxruntime, sympy or networkx
    (docs/BENCHMARKS.md has the start-up times this keeps)."""
    import subprocess
    import sys

    code = ("import sys; from tessera.runtime.cli import make_parser; make_parser(); "
            "print(sorted(m for m in ('onnx', 'onnxruntime', 'sympy', 'networkx', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_quantize_choices_are_the_pipelines():
    from tessera.compiler.passes.quantize import HEADS, SCHEMES
    from tessera.runtime import options, pipeline

    assert options.QUANTIZE_CHOICES == pipeline.QUANTIZE_CHOICES == ("none", *SCHEMES)
    assert options.QUANT_HEADS == HEADS  # --quantize-head's choices


@pytest.mark.parametrize("argv", [["ir", "gpt2", "--set", "layers=1"], ["report", "gpt2", "--set", "layers=1"]])
def test_ir_and_report_do_not_import_onnx(argv):
    """`tessera ir` and `tessera report` work on the graph alone: onnx (with ml_dtypes, ~0.6 s of start-up)
    is imported only by the commands that export or run (docs/benchmarks/log.md, start-up)."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys; from tessera.runtime.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()): rc = main({argv!r})\n"
            "print(rc, sorted(m for m in ('onnx', 'ml_dtypes', 'onnxruntime', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0 []"


def test_the_report_says_its_gpu_device_is_not_this_machine(monkeypatch, capsys):
    """Issue 21: `report` defaults to --device h200 and prints "target cuda"; on a machine without a GPU a
    note on stderr says those figures are for that device (stdout, the report, stays machine-independent)."""
    from tessera.runtime import machine
    from tessera.runtime.cli.report import device_note

    monkeypatch.setattr(machine, "gpu_present", lambda: False)
    assert main(["report", "gpt2", "--set", "layers=1"]) == 0
    out, err = capsys.readouterr()
    assert "h200 (the default --device)" in err and "no GPU" in err and "--device cpu" in err
    assert "note: the roofline" not in out
    assert main(["report", "gpt2", "--set", "layers=1", "--format", "json"]) == 0  # a program's input: no note
    assert capsys.readouterr().err == ""
    assert "h100" in device_note("h100") and "default" not in device_note("h100")
    assert device_note("cpu") is None
    monkeypatch.setattr(machine, "gpu_present", lambda: True)
    assert device_note("h200") is None
