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
