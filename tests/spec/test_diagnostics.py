"""Spec errors: one test per error class, checking the exact rendered diagnostic.

Every test writes a small spec into tmp_path, loads and elaborates it, and checks
the compiler-style report of the SpecError it raises:

    /tmp/.../m.tsr:4:17: error: unknown name 'hedas'; did you mean 'heads'?
        4 |   y = linear(x, hedas)
          |                 ^^^^^

i.e. the exact "file:line:col: error: message" line, the quoted source line and
the caret line under the offending token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tessera.compiler.frontend.elaborate import elaborate
from tessera.runtime.cli import main
from tessera.spec import SpecError, load_program

MODELS = Path(__file__).resolve().parents[2] / "models"

# A model with one 3-D input and output; {body} is inserted as line 4.
MODEL = """model M(d = 8, heads = 2) {{
  in x: f32[B, T, d]
  out y: f32[B, T, d]
{body}
}}
"""

# A block with a typed tensor parameter, a typed scalar and a defaulted scalar (lines 1-3);
# MODEL follows, so the model's body statement is on line 7.
SCALE_BLOCK = """block scale(x: [B, T, d], factor: float, times = 1) -> [B, T, d] {
  return x * factor
}
"""


# ---------------------------------------------------------------- helpers
def write(tmp_path: Path, source: str, name: str = "m.tsr", files: dict[str, str] | None = None) -> Path:
    for fname, text in (files or {}).items():
        (tmp_path / fname).write_text(text)
    path = tmp_path / name
    path.write_text(source)
    return path


def spec_error(tmp_path: Path, source: str, *, name: str = "m.tsr", files: dict[str, str] | None = None,
               variant: str | None = None, overrides: dict | None = None) -> tuple[str, SpecError]:
    """Write a spec, load and elaborate it, and return (its path as shown in errors, the SpecError)."""
    path = write(tmp_path, source, name, files)
    with pytest.raises(SpecError) as info:
        elaborate(load_program(path), variant, overrides)
    return str(path), info.value


def expect_at(err: SpecError, file: str, source: str, line: int, col: int, message: str, token: str) -> None:
    """The rendered error is exactly: the header, the quoted line `line`, carets under `token` at `col`."""
    src_line = source.splitlines()[line - 1]
    # Sanity check of the test itself: `token` really sits at line:col of the source we wrote.
    assert src_line[col - 1:col - 1 + len(token)] == token, (src_line, col, token)
    rendered = err.render()
    lines = rendered.splitlines()
    assert lines[0] == f"{file}:{line}:{col}: error: {message}", rendered
    assert lines[1] == f"{line:>5} | {src_line}", rendered
    assert lines[2] == "      | " + " " * (col - 1) + "^" * len(token), rendered
    assert len(lines) == 3, rendered


# ---------------------------------------------------------------- syntax
def test_syntax_error_unexpected_token_says_what_was_expected(tmp_path):
    src = "model M(d = 8) {\n  in x f32[B, T]\n}\n"
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 2, 8, "unexpected 'f32'; expected ':'", "f32")


def test_syntax_error_unexpected_token_in_expression(tmp_path):
    src = "model M(d = 8) {\n  let a = = 3\n}\n"
    file, err = spec_error(tmp_path, src)
    head = err.render().splitlines()[0]
    assert head.startswith(f"{file}:2:11: error: unexpected '='; expected ")
    for what in ("'('", "'['", "a name", "a number", "a string"):
        assert what in head, head
    expect_at(err, file, src, 2, 11, head.split(": error: ", 1)[1], "=")


def test_syntax_error_unexpected_character(tmp_path):
    src = "model M(d = 8) {\n  in x: f32[B, T, d]\n  out y: f32[B, T, d]\n  y = x $ 2\n}\n"
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 9, "unexpected character '$'", "$")


def test_syntax_error_unexpected_end_of_file(tmp_path):
    src = "model M(d = 8) {\n  in x: f32[B, T, d]\n  y = x +\n"
    file, err = spec_error(tmp_path, src)
    lines = err.render().splitlines()
    assert lines[0].startswith(f"{file}:3:"), lines
    assert lines[0].endswith(": error: unexpected end of file; expected "
                             "'(', '-', '[', 'false', 'none', 'true', ..."), lines
    assert lines[1] == "    3 |   y = x +"


def test_unexpected_end_of_file_points_past_the_last_token(tmp_path):
    src = "model M(d = 8) {\n  in x: f32[B, T, d]\n  y = x +\n"
    file, err = spec_error(tmp_path, src)
    lines = err.render().splitlines()
    assert lines[0] == (f"{file}:3:10: error: unexpected end of file; expected "
                        "'(', '-', '[', 'false', 'none', 'true', ...")
    assert lines[1] == "    3 |   y = x +"
    assert lines[2] == "      |          ^"


def test_syntax_error_names_expected_terminals_in_words(tmp_path):
    src = "model M(d = 8) {\n  in x: f32[B, d]\n  out y: f32[B, d]\n  y = x\n}\nvariant = M(d=4)\n"
    file, err = spec_error(tmp_path, src)
    head = err.render().splitlines()[0]
    assert head.startswith(f"{file}:6:9: error: unexpected '='; expected "), head
    assert "variant_name" not in head and "__" not in head, head


def test_positional_argument_after_keyword_argument(tmp_path):
    src = MODEL.format(body="  y = linear(x, bias=false, 8)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 29, "positional argument after a keyword argument", "8")


def test_keyword_argument_given_twice(tmp_path):
    src = MODEL.format(body="  y = linear(x, 8, bias=false, bias=true)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 32, "argument 'bias' given twice", "bias")


# ---------------------------------------------------------------- names and arguments
def test_unknown_name_with_did_you_mean(tmp_path):
    src = MODEL.format(body="  y = merge_heads(split_heads(x, hedas))")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 34, "unknown name 'hedas'; did you mean 'heads'?", "hedas")


def test_unknown_function_name_suggests_the_builtin(tmp_path):
    src = MODEL.format(body="  y = lienar(x, 8)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 7, "unknown name 'lienar'; did you mean 'linear'?", "lienar")


def test_unknown_argument_to_builtin_with_did_you_mean(tmp_path):
    src = MODEL.format(body="  y = linear(x, 4, biass=false)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 20, "unknown argument 'biass' for linear; did you mean 'bias'? "
                                     "(it takes: x, out, bias, weight)", "biass")


def test_unknown_argument_to_block_with_did_you_mean(tmp_path):
    src = SCALE_BLOCK + MODEL.format(body="  y = scale(x, 2.0, tims=2)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 7, 21, "unknown argument 'tims' for block scale; did you mean 'times'? "
                                     "(it takes: x, factor, times)", "tims")


def test_unknown_argument_to_block_without_close_match(tmp_path):
    src = SCALE_BLOCK + MODEL.format(body="  y = scale(x, 2.0, zzz=2)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 7, 21, "unknown argument 'zzz' for block scale (it takes: x, factor, times)", "zzz")


def test_missing_required_argument_to_builtin(tmp_path):
    src = MODEL.format(body="  y = linear(x)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 7, "linear() is missing argument 'out'", "linear(x)")


def test_missing_required_argument_to_block(tmp_path):
    src = SCALE_BLOCK + MODEL.format(body="  y = scale(x)")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 7, 7, "block scale is missing argument 'factor'", "scale(x)")


def test_wrong_argument_type_string_for_int(tmp_path):
    src = MODEL.format(body='  y = linear(x, "four")')
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 17, "linear: 'out' must be an int, got string 'four'", '"four"')


def test_rope_scaling_factor_below_one(tmp_path):
    src = MODEL.format(body='  y = merge_heads(rope(split_heads(x, heads), 500000.0, factor=0.5))')
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 57, "rope: 'factor' must be at least 1.0 (1.0 is no scaling), got 0.5", "factor")


def test_rope_scaling_with_bands_in_the_wrong_order(tmp_path):
    src = MODEL.format(body='  y = merge_heads(rope(split_heads(x, heads), factor=8.0, low_freq=4.0, high_freq=1.0))')
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 73, "rope: rope scaling needs 0 < low_freq <= high_freq, got low_freq=4.0, "
              "high_freq=1.0", "high_freq")


def test_wrong_argument_type_for_typed_block_parameter(tmp_path):
    src = SCALE_BLOCK + MODEL.format(body='  y = scale(x, "big")')
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 7, 16, "'factor' of block scale must be float, got string 'big'", '"big"')


# ---------------------------------------------------------------- shapes
def test_shape_mismatch_in_matmul(tmp_path):
    src = MODEL.format(body="  y = matmul(x, linear(x, 4, bias=false))")
    file, err = spec_error(tmp_path, src)
    lines = err.render().splitlines()
    assert lines[0] == f"{file}:4:7: error: matmul inner dimensions differ: [B, T, 8] @ [B, T, 4]", lines
    assert lines[1] == "    4 |   y = matmul(x, linear(x, 4, bias=false))"
    assert lines[2] == "      |       " + "^" * len("matmul(x, linear(x, 4, bias=false))")


def test_shape_mismatch_message_does_not_stutter(tmp_path):
    src = MODEL.format(body="  y = matmul(x, linear(x, 4, bias=false))")
    _, err = spec_error(tmp_path, src)
    assert "matmul: matmul" not in err.message


def test_block_parameter_gets_the_wrong_dimension(tmp_path):
    src = ("block f(x: [B, T, 4]) -> [B, T, 4] {\n  return x\n}\n"
           + MODEL.format(body="  y = f(x)"))
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 7, 9, "argument 'x' of block f: dimension 2 is 8, expected 4 (type f32[B, T, 8])",
              "x")


def test_block_parameter_dimension_bound_from_hyperparameter(tmp_path):
    src = ("block g(x: [B, T, n], n) -> [B, T, n] {\n  return x\n}\n"
           + MODEL.format(body="  y = g(x, 6)"))
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 7, 9, "argument 'x' of block g: dimension 2 is 8, expected n = 6 "
                                    "(type f32[B, T, 8])", "x")


def test_error_inside_a_stdlib_block_names_the_call_site(tmp_path):
    src = "model M(d = 10) {\n  in x: f32[B, T, d]\n  out y: f32[B, T, d]\n  y = attention(x, 3)\n}\n"
    file, err = spec_error(tmp_path, src)
    rendered = err.render()
    assert rendered.startswith("<stdlib>/nn.tsr:")
    assert f"{file}:4:7" in rendered, rendered


# ---------------------------------------------------------------- asserts and arithmetic
def test_failed_assert_interpolates_its_message(tmp_path):
    src = MODEL.format(body='  assert d % heads == 1 : "d={d} is not odd over heads={heads}"\n  y = x')
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 4, 10, "assertion failed: d=8 is not odd over heads=2", "d % heads == 1")


def test_failed_assert_without_message(tmp_path):
    src = MODEL.format(body="  assert heads > 4\n  y = x")
    file, err = spec_error(tmp_path, src)
    lines = err.render().splitlines()
    assert lines[0] == f"{file}:4:10: error: assertion failed", lines
    assert lines[1] == "    4 |   assert heads > 4"
    assert lines[2] == "      |          ^^^^^^^^^"


def test_failed_assert_without_message_does_not_stutter(tmp_path):
    src = MODEL.format(body="  assert heads > 4\n  y = x")
    _, err = spec_error(tmp_path, src)
    assert err.message.startswith("assertion failed")
    assert "assertion failed: assertion failed" not in err.message


def test_inexact_integer_division(tmp_path):
    src = ("model M(d = 10, heads = 3) {\n  let hd = d / heads\n  in x: f32[B, T, d]\n"
           "  out y: f32[B, T, d]\n  y = x\n}\n")
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 2, 12, "inexact division: 10 / 3 leaves remainder 1 (use // to round down)",
              "d / heads")


# ---------------------------------------------------------------- files, variants, overrides
def test_cyclic_use_is_reported_at_the_use_that_closes_it(tmp_path):
    a = 'use "b.tsr"\n\nblock fa(x) {\n  return x\n}\n'
    b = '# b.tsr uses a.tsr back\nuse "a.tsr"\nblock fb(x) {\n  return x\n}\n'
    main_src = 'use "a.tsr"\nmodel M(d = 8) {\n  in x: f32[B, d]\n  out y: f32[B, d]\n  y = x\n}\n'
    _, err = spec_error(tmp_path, main_src, files={"a.tsr": a, "b.tsr": b})
    expect_at(err, str(tmp_path / "b.tsr"), b, 2, 1, "cyclic use: a.tsr -> b.tsr -> a.tsr", 'use "a.tsr"')


def test_file_that_uses_itself(tmp_path):
    src = 'use "m.tsr"\nmodel M(d = 8) {\n  in x: f32[B, d]\n  out y: f32[B, d]\n  y = x\n}\n'
    file, err = spec_error(tmp_path, src)
    expect_at(err, file, src, 1, 1, "cyclic use: m.tsr -> m.tsr", 'use "m.tsr"')


VARIANTS = ("model M(d = 8, layers = 2) {\n  in x: f32[B, d]\n  out y: f32[B, d]\n  y = x\n}\n"
            "variant small = M(d=4)\nvariant large = M(d=16)\n")


def test_unknown_variant_with_did_you_mean(tmp_path):
    _, err = spec_error(tmp_path, VARIANTS, variant="smal")
    # A variant name comes from the command line, so the error has no source position.
    assert err.pos is None
    assert err.render() == "error: unknown variant 'smal'; did you mean 'small'? (variants of M: small, large)"


def test_unknown_variant_without_close_match(tmp_path):
    _, err = spec_error(tmp_path, VARIANTS, variant="xyz")
    assert err.render() == "error: unknown variant 'xyz' (variants of M: small, large)"


def test_variant_with_unknown_hyperparameter_points_into_the_file(tmp_path):
    src = VARIANTS + "variant wide = M(dd=32)\n"
    file, err = spec_error(tmp_path, src, variant="wide")
    expect_at(err, file, src, 8, 18,
              "unknown hyperparameter 'dd' for model M; did you mean 'd'? (it has: d, layers)", "dd")


def test_unknown_override_with_did_you_mean(tmp_path):
    _, err = spec_error(tmp_path, VARIANTS, overrides={"layres": 3})
    assert err.render() == ("error: unknown hyperparameter 'layres' for model M; did you mean 'layers'? "
                            "(it has: d, layers)")


def test_wrong_typed_override_points_at_the_hyperparameter(tmp_path):
    file, err = spec_error(tmp_path, VARIANTS, overrides={"layers": 2.5})
    expect_at(err, file, VARIANTS, 1, 16, "'layers' of M must be int, got float 2.5", "layers")


def test_negative_override_for_int_hyperparameter(tmp_path):
    file, err = spec_error(tmp_path, VARIANTS, overrides={"layers": -1})
    expect_at(err, file, VARIANTS, 1, 16, "'layers' of M must not be negative, got -1", "layers")


# ---------------------------------------------------------------- golden
def test_golden_full_rendering(tmp_path):
    src = MODEL.format(body="  y = merge_heads(split_heads(x, hedas))")
    path = write(tmp_path, src)
    with pytest.raises(SpecError) as info:
        elaborate(load_program(path))
    assert info.value.render() == (
        f"{path}:4:34: error: unknown name 'hedas'; did you mean 'heads'?\n"
        "    4 |   y = merge_heads(split_heads(x, hedas))\n"
        "      |                                  ^^^^^"
    )


# ---------------------------------------------------------------- through the command line
def test_cli_spec_error_exits_2_with_position(tmp_path, capsys):
    path = write(tmp_path, MODEL.format(body="  y = linear(x, 4, biass=false)"))
    assert main(["ir", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (f"{path}:4:20: error: unknown argument 'biass' for linear; "
                                   "did you mean 'bias'? (it takes: x, out, bias, weight)")
    assert "      |                    ^^^^^" in err.splitlines()
    assert "Traceback" not in err


def test_cli_failed_model_assert_via_set(capsys):
    gpt2 = MODELS / "gpt2.tsr"
    assert main(["ir", str(gpt2), "--set", "heads=5"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"{gpt2}:6:10: error: assertion failed: d=768 is not divisible by heads=5"
    assert lines[1] == '    6 |   assert d % heads == 0 : "d={d} is not divisible by heads={heads}"'
    assert lines[2] == "      |          " + "^" * len("d % heads == 0")


def test_cli_spec_error_end_to_end_has_no_traceback(tmp_path):
    path = write(tmp_path, MODEL.format(body="  y = merge_heads(split_heads(x, hedas))"))
    proc = subprocess.run([sys.executable, "-m", "tessera.runtime.cli", "compile", str(path),
                           "-o", str(tmp_path / "out.onnx")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0] == f"{path}:4:34: error: unknown name 'hedas'; did you mean 'heads'?"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.onnx").exists()


# ---------------------------------------------------------------- builtins hidden by hyperparameters (issue 24)
SHADOW = """model M(expand = 2, d = 8) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = linear(linear(x, d * expand, name="up"), d, name="down") + expand([[0.0]], [1, 1, d])
}
"""


def test_a_hyperparameter_hiding_a_called_builtin_is_an_error_at_its_definition(tmp_path):
    file, err = spec_error(tmp_path, SHADOW)
    message = ("hyperparameter 'expand' of model M hides the builtin expand(), which its body calls: "
               "rename the hyperparameter (e.g. 'expand_')")
    lines = err.render().splitlines()
    assert lines[0] == f"{file}:1:9: error: {message}"
    assert lines[1:3] == ["    1 | model M(expand = 2, d = 8) {", "      |         ^^^^^^"]
    assert lines[3] == f"note: expand(...) is called at {file}:4:66"
    assert SHADOW.splitlines()[3][65:72] == "expand("


def test_the_same_in_a_block_and_an_uncalled_builtin_name_is_fine(tmp_path):
    block = """block up(x: [B, T, d], max = 2) {
  return linear(x, d * max(max, 1), name="fc")
}
model M(d = 8) {
  in x: f32[B, T, d]
  out y: f32[B, T, 2 * d]
  y = up(x)
}
"""
    file, err = spec_error(tmp_path, block)
    assert err.render().splitlines()[0].startswith(f"{file}:1:24: error: hyperparameter 'max' of block up hides")
    fine = """model M(max = 2, d = 8, weight = 1.5) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = linear(x, d, name="fc") * weight + float(max)
}
"""
    elaborate(load_program(write(tmp_path, fine, "fine.tsr")))


@pytest.mark.parametrize("line,word", [("  out = x", "out"), ("  in = x", "in"), ("  y = x\n  repeat = y", "repeat")])
def test_a_keyword_used_as_a_name_is_called_a_keyword(line, word):
    """issue 39: `out = x` said only "unexpected '='; expected a name"."""
    from tessera.spec.parser import parse_text

    text = "model M(d = 4) {\n  in x: f32[B, d]\n  out y: f32[B, d]\n" + line + "\n}\n"
    with pytest.raises(SpecError, match=f"unexpected '='; expected .*\\('{word}' is a keyword"):
        parse_text(text, "kw.tsr")


def test_the_parser_knows_every_keyword_of_the_grammar():
    import re

    from tessera.spec import parser

    grammar = (Path(parser.__file__).parent / "grammar.lark").read_text()
    assert set(re.findall(r'"([a-z_]+)"', grammar)) == parser.KEYWORDS


def test_a_name_that_only_starts_like_a_keyword_gets_no_keyword_hint():
    from tessera.spec.parser import parse_text

    with pytest.raises(SpecError) as e:
        parse_text("model M(d = 4) {\n  in x: f32[B, d]\n  out y: f32[B, d]\n  y = x +\n}\n", "kw.tsr")
    assert "keyword" not in str(e.value)
