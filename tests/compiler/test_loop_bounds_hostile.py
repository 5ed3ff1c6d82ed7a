"""issue 25, item 3: ``run`` bounds the steps of a graph's recurrences (Scan, and onnx's GRU op) when
their length comes from a user number -- a ``--set`` value that sizes the sequence, or an input's
sequence length -- before onnxruntime starts (runtime/loop_bounds.py). Before the check, ``--set
n=100000000`` on tests/hostile/run/long_scan.tsr ran for minutes inside onnxruntime, and 10^12 for
ever, with no way to stop it but killing the process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tessera
from conftest import cli, cli_error
from tessera.compiler.ir.signature import InputError

RUN = Path(__file__).resolve().parents[1] / "hostile" / "run"
BOUND = "more than the 10,000,000 that run allows"


@pytest.mark.parametrize("spec, op", [("long_scan.tsr", "Scan"), ("long_gru.tsr", "GRU")])
def test_a_recurrence_sized_by_a_set_value_is_refused_before_running(capsys, spec, op):
    inp = "x=[[1.0]]" if op == "Scan" else "x=[[1,2,3,4]]"
    err = cli_error(capsys, "run", RUN / spec, "--set", "n=100000000", "--input", inp)
    assert f"{op} " in err and "would run 100,000,000 steps" in err and BOUND in err, err


def test_a_compiled_file_is_checked_the_same_way(capsys, tmp_path):
    out = tmp_path / "long.onnx"
    rc, _, err = cli(capsys, "compile", RUN / "long_scan.tsr", "--set", "n=1000000000000", "-o", out)
    assert rc == 0, err
    err = cli_error(capsys, "run", out, "--input", "x=[[1.0]]")
    assert "would run 1,000,000,000,000 steps" in err and BOUND in err, err


def test_the_api_refuses_it_too():
    model = tessera.load(RUN / "long_scan.tsr", n=10 ** 8)
    with pytest.raises(InputError, match="would run 100,000,000 steps"):
        model.run(x=[[1.0]])


def test_a_short_scan_still_runs_and_adds_the_sequence(capsys):
    rc, out, err = cli(capsys, "run", RUN / "long_scan.tsr", "--set", "n=8", "--input", "x=[[1.5]]",
                       "--format", "json", "--full")
    assert rc == 0, err
    import json

    y = np.array(json.loads(out)["outputs"]["y"]["values"], dtype=np.float32)
    np.testing.assert_allclose(y, [[1.5 + np.arange(8).sum()]])


SEQ_SPEC = """block add_step(s: [B, 1], v: [B, 1]) {
  return s + v
}

model Seq() {
  in x: f32[B, T, 1]
  out y: f32[B, 1]
  r = scan(add_step, select(x, 1, 0), x)
  y = r[1]
}
"""


def test_an_input_sequence_past_the_bound_is_refused(tmp_path):
    """The length comes from the input itself; a zero-stride view gives the shape without 40 MB."""
    import onnx

    from tessera.runtime.loop_bounds import check_steps, has_recurrence, without_weights

    (tmp_path / "seq.tsr").write_text(SEQ_SPEC)
    model = tessera.load(tmp_path / "seq.tsr")
    model.compile(tmp_path / "seq.onnx")
    proto = without_weights(onnx.load(str(tmp_path / "seq.onnx"), load_external_data=False))
    assert has_recurrence(proto)
    check_steps(proto, {"x": np.broadcast_to(np.float32(0), (2, 10 ** 7, 1))}, "seq.onnx")  # at the bound: runs
    with pytest.raises(InputError, match=r"Scan .* would run 10,000,001 steps \(the length of 'x'"):
        check_steps(proto, {"x": np.broadcast_to(np.float32(0), (2, 10 ** 7 + 1, 1))}, "seq.onnx")
    np.testing.assert_allclose(model.run(x=[[[1.0], [2.0], [4.0]]])["y"], [[8.0]])  # x0 + x0 + x1 + x2


def test_rnnsearch_source_and_target_lengths_are_bounded(tmp_path):
    """The bundled recurrent encoder-decoder: its encoder GRU runs over the source (S), its decoder
    Scan over the target (T); either past the bound is refused, naming the op."""
    import onnx

    from tessera.runtime.loop_bounds import check_steps, without_weights

    tessera.load("rnnsearch", variant="small").compile(tmp_path / "rs.onnx")
    proto = without_weights(onnx.load(str(tmp_path / "rs.onnx"), load_external_data=False))

    def ids(n):
        return np.broadcast_to(np.int64(1), (1, n))

    check_steps(proto, {"src": ids(10 ** 7), "tgt_in": ids(10 ** 7)}, "rs.onnx")
    with pytest.raises(InputError, match=r"GRU .* would run 10,000,001 steps"):
        check_steps(proto, {"src": ids(10 ** 7 + 1), "tgt_in": ids(2)}, "rs.onnx")
    with pytest.raises(InputError, match=r"Scan .* would run 10,000,001 steps"):
        check_steps(proto, {"src": ids(3), "tgt_in": ids(10 ** 7 + 1)}, "rs.onnx")
