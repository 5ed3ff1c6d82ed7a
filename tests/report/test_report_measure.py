"""`tessera report --measure` and `--calibrated` (runtime/report/measure.py, calibration.py).

Every derived figure is recomputed here from the fields the command prints (the signed error,
the achieved rates, the efficiency, the calibrated time from the efficiency stored in the file,
read here with json); the work of a decoding step is checked against a hand count of the tiny
GPT-2's matmuls. Nothing here asserts how fast anything ran: only that times are finite and
positive.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from conftest import cli, cli_error


@pytest.fixture(autouse=True)
def quiet_probe(monkeypatch):
    """The cpu probe judges itself quiet here (its copies' CPU time stands in as wall time), so these
    tests do not depend on what else the machine runs; the busy case is tested on its own."""
    import time as _time

    from tessera.compiler.analysis import roofline

    monkeypatch.setattr(roofline, "_cpu_time", _time.perf_counter)


# a tiny GPT-2: 2 layers, width 64, 4 heads, 100 tokens, 64 positions
L, D, V, CTX = 2, 64, 100, 64
TINY = ["gpt2", "--set", f"layers={L}", "--set", f"d={D}", "--set", "heads=4", "--set", f"vocab={V}",
        "--set", f"ctx={CTX}"]
B, N, R = 2, 24, 2


def measure(capsys, cal, *extra) -> dict:
    rc, out, err = cli(capsys, "report", *TINY, "--device", "cpu", "--measure", "--batch", B, "--seq", N,
                       "--repeats", R, "--calibration", cal, "--format", "json", *extra)
    assert rc == 0, err
    return json.loads(out)


def machine(cal) -> dict:
    data = json.loads(open(cal).read())
    (m,) = data["machines"].values()
    return m


def check_phase(f: dict) -> None:
    for k in ("measured_s", "measured_min_s", "estimated_s"):
        assert math.isfinite(f[k]) and f[k] > 0, (k, f[k])
    assert f["runs"] == R
    assert f["measured_min_s"] <= f["measured_s"]
    m, e = f["measured_s"], f["estimated_s"]
    assert f["error"] == pytest.approx((e - m) / m, rel=1e-12)
    assert f["efficiency"] == pytest.approx(e / m, rel=1e-12)
    assert f["achieved_flops_per_s"] == pytest.approx(f["flops"] / m, rel=1e-12)
    assert f["achieved_bytes_per_s"] == pytest.approx(f["bytes"] / m, rel=1e-12)


def test_measure_times_both_phases_and_records_the_calibration(capsys, tmp_path):
    cal = tmp_path / "sub" / "calibration.json"
    r = measure(capsys, cal)
    m = r["measure"]
    assert (m["batch"], m["seq"]) == (B, N)
    for phase in ("prefill", "decode"):
        check_phase(m[phase])
        # no calibration before this run: nothing to calibrate with, and the uncalibrated error is still given
        assert m[phase]["calibrated_s"] is None and m[phase]["calibrated_error"] is None
    roof = r["roofline"]
    assert m["prefill"]["estimated_s"] == roof["prefill_seconds"][m["prefill_estimate"]]
    assert m["decode"]["estimated_s"] == roof["decode_seconds_per_token"]
    assert m["decode"]["positions"] == [N - R, N - 1]
    # a decoding step's matmuls, counted by hand: per token 12·D² weights per layer (q, k, v, o: 4·D²;
    # MLP: 8·D²), the head D·V, and attention against N + 1 keys (scores and weighting, 2·D·(N+1) per
    # layer); 2 FLOPs per multiply-add, B tokens. The elementwise work (norms, GELU, softmax) comes on top.
    matmul = 2 * B * (L * 12 * D * D + D * V + L * 2 * D * (N + 1))
    assert matmul <= m["decode"]["flops"] <= 1.25 * matmul
    params = r["params"]["total"]
    assert m["decode"]["bytes"] >= 4 * (params - CTX * D)  # every weight read once (positions: one row)

    # the file: written whole (no temporary left beside it), one point per phase, and the probe kept
    assert sorted(os.listdir(cal.parent)) == ["calibration.json"]
    mach = machine(cal)
    assert mach["threads"] == r["measure"]["machine"]["threads"]
    assert mach["device"]["bandwidth"] == roof["device"]["bandwidth"]
    for phase in ("prefill", "decode"):
        (p,) = mach["phases"][phase]
        assert p["measured_s"] == m[phase]["measured_s"] and p["estimated_s"] == m[phase]["estimated_s"]
        assert p["efficiency"] == pytest.approx(p["estimated_s"] / p["measured_s"], rel=1e-12)
        assert (p["batch"], p["seq"], p["params"]) == (B, N, params)


def test_a_second_measure_is_calibrated_by_the_first(capsys, tmp_path):
    cal = tmp_path / "calibration.json"
    first = measure(capsys, cal)
    before = {ph: machine(cal)["phases"][ph][0]["efficiency"] for ph in ("prefill", "decode")}
    second = measure(capsys, cal)
    roof1, roof2 = first["roofline"], second["roofline"]
    # the stored probe is reused: the two runs estimate against the same roofline
    assert roof2["device"]["peak_flops"] == roof1["device"]["peak_flops"]
    assert roof2["prefill_seconds"] == roof1["prefill_seconds"]
    for phase in ("prefill", "decode"):
        f = second["measure"][phase]
        check_phase(f)
        assert f["calibrated_s"] == pytest.approx(f["estimated_s"] / before[phase], rel=1e-12)
        assert f["calibrated_error"] == pytest.approx((f["calibrated_s"] - f["measured_s"]) / f["measured_s"],
                                                      rel=1e-12)
        # the same model and shape: the new point replaces the old one
        (p,) = machine(cal)["phases"][phase]
        assert p["measured_s"] == f["measured_s"]


def test_calibrated_divides_the_roofline_by_the_stored_efficiency(capsys, tmp_path):
    cal = tmp_path / "calibration.json"
    measure(capsys, cal)
    rc, out, err = cli(capsys, "report", *TINY, "--device", "cpu", "--calibrated", "--batch", B, "--seq", N,
                       "--calibration", cal, "--format", "json")
    assert rc == 0, err
    roof = json.loads(out)["roofline"]
    mach = machine(cal)
    assert roof["device"]["peak_flops"] == mach["device"]["flops"]["fp32"]
    eff = {ph: mach["phases"][ph][0]["efficiency"] for ph in ("prefill", "decode")}
    c = roof["calibrated"]
    for variant in ("unfused", "fused"):  # one point per phase: both prefill variants use it
        assert c["prefill_seconds"][variant] == pytest.approx(roof["prefill_seconds"][variant] / eff["prefill"])
    assert c["decode_seconds_per_token"] == pytest.approx(roof["decode_seconds_per_token"] / eff["decode"])
    # the table and Markdown show the calibrated rows, CSV the same keys
    rc, md, _ = cli(capsys, "report", *TINY, "--device", "cpu", "--calibrated", "--batch", B, "--seq", N,
                    "--calibration", cal, "--format", "md")
    assert "decode step at N, calibrated" in md
    rc, csv, _ = cli(capsys, "report", *TINY, "--device", "cpu", "--calibrated", "--batch", B, "--seq", N,
                     "--calibration", cal, "--format", "csv")
    assert "roofline.calibrated.decode_seconds_per_token," in csv


def test_the_formats_show_the_measured_figures(capsys, tmp_path):
    cal = tmp_path / "calibration.json"
    measure(capsys, cal)
    rc, md, err = cli(capsys, "report", *TINY, "--device", "cpu", "--measure", "--batch", B, "--seq", N,
                      "--repeats", R, "--calibration", cal, "--format", "md")
    assert rc == 0, err
    section = md.split("## Measured on this machine")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| prefill") or line.startswith("| decode")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 10
        assert cells[4].startswith(("+", "-")) and cells[4].endswith("%")        # the signed error, always shown
        assert cells[6].startswith(("+", "-")) and cells[6].endswith("%")        # calibrated by the first run
    rc, csv, _ = cli(capsys, "report", *TINY, "--device", "cpu", "--measure", "--batch", B, "--seq", N,
                     "--repeats", R, "--calibration", cal, "--format", "csv")
    keys = {line.split(",")[0] for line in csv.splitlines()}
    for phase in ("prefill", "decode"):
        for k in ("measured_s", "estimated_s", "calibrated_s", "error", "calibrated_error"):
            assert f"measure.{phase}.{k}" in keys
    rc, table, _ = cli(capsys, "report", *TINY, "--device", "cpu", "--measure", "--batch", B, "--seq", N,
                       "--repeats", R, "--calibration", cal)
    assert rc == 0 and "Measured on this machine" in table


def test_the_api_measures_with_the_same_options(tmp_path):
    import tessera

    cal = tmp_path / "c.json"
    m = tessera.load("gpt2", layers=L, d=D, heads=4, vocab=V, ctx=CTX)
    r = m.report(batch=1, seq=16, device="cpu", measure=True, repeats=1, calibration=cal)
    check = r["measure"]["decode"]
    assert check["runs"] == 1 and check["error"] == pytest.approx(
        (check["estimated_s"] - check["measured_s"]) / check["measured_s"])
    assert cal.is_file()
    r = m.report(batch=1, seq=16, device="cpu", calibrated=True, calibration=cal)
    assert r["roofline"]["calibrated"]["decode_seconds_per_token"] > 0


def test_calibrated_without_a_calibration_says_how_to_make_one(capsys, tmp_path):
    err = cli_error(capsys, "report", *TINY, "--device", "cpu", "--calibrated", "--calibration",
                    tmp_path / "none.json")
    assert "no calibration for this machine" in err and "--measure" in err
    assert not (tmp_path / "none.json").exists()
    import tessera

    from tessera.runtime.options import UsageError

    with pytest.raises(UsageError, match="no calibration for this machine"):
        tessera.load("gpt2", layers=1, d=32, heads=2, vocab=50, ctx=16).report(
            device="cpu", calibrated=True, calibration=tmp_path / "none.json")


def test_the_environment_variable_names_the_file(capsys, tmp_path, monkeypatch):
    cal = tmp_path / "env.json"
    monkeypatch.setenv("TESSERA_CALIBRATION", str(cal))
    rc, _, err = cli(capsys, "report", *TINY, "--device", "cpu", "--measure", "--seq", N, "--repeats", 1,
                     "--format", "json")
    assert rc == 0, err
    assert set(machine(cal)["phases"]) == {"prefill", "decode"}


def test_an_interrupted_write_keeps_the_previous_calibration(capsys, tmp_path, monkeypatch):
    from tessera.compiler.backends.atomic import OutputError
    from tessera.runtime.report import calibration

    cal = tmp_path / "calibration.json"
    measure(capsys, cal)
    before = cal.read_bytes()
    point = {"model": "x", "params": 1, "batch": 1, "seq": 1, "dtype": "fp32", "flops": 1.0, "bytes": 1.0,
             "estimated_s": 1.0, "measured_s": 2.0}

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OutputError, match="No space left"):
        calibration.record(cal, {"prefill": point}, device=None)
    assert cal.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["calibration.json"]


@pytest.mark.parametrize("text", [
    "[1, 2, 3]", "{not json",
    '{"version": 1, "machines": {"m": {"phases": {"prefill": [{"flops": 1, "bytes": 1, "estimated_s": 1, '
    '"measured_s": 1, "efficiency": 0}]}}}}',                                    # an efficiency of 0
    '{"version": 1, "machines": {"m": {"phases": {}, "device": {"flops": {"fp32": "fast"}}}}}',
])
def test_a_file_that_is_no_calibration_is_refused_not_overwritten(capsys, tmp_path, text):
    cal = tmp_path / "calibration.json"
    cal.write_text(text)
    for flag in ("--measure", "--calibrated"):
        err = cli_error(capsys, "report", *TINY, "--device", "cpu", flag, "--seq", N, "--calibration", cal)
        assert "is not a Tessera calibration file" in err
    assert cal.read_text() == text


@pytest.mark.parametrize("args,message", [
    (["--measure"], "--measure times the model on this machine's CPU"),       # the default device is h200
    (["--calibrated", "--device", "h100"], "--calibrated applies the calibration of this machine's CPU"),
    (["--measure", "--device", "cpu", "--seq", "16,32"], "one --batch and one --seq"),
    (["--measure", "--device", "cpu", "--dtype", "fp16"], "--dtype fp32 only"),
    (["--repeats", "3"], "--repeats applies with --measure"),
    (["--measure", "--device", "cpu", "--repeats", "0"], "--repeats must be at least 1"),
    (["--calibration", "x.json"], "add one of them"),
    (["--measure", "--device", "cpu", "--seq", "4"], "--seq must be above 8"),
    (["--measure", "--device", "cpu", "--no-sparse-moe"], "does not take --no-sparse-moe"),
])
def test_bad_measure_options_are_usage_errors(capsys, tmp_path, args, message):
    assert message in cli_error(capsys, "report", *TINY, *args)


def test_measure_refuses_a_model_that_does_not_take_token_ids_alone(capsys, tmp_path):
    err = cli_error(capsys, "report", "bert", "--set", "layers=1", "--device", "cpu", "--measure", "--seq", 16,
                    "--calibration", tmp_path / "c.json")
    assert "--measure times decoder-only language models" in err
