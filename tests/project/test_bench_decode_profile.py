"""bench/decode_profile.py's reading of an onnxruntime profile: which events belong to the profiled
steps, how an If's time is split between its own part and its branch's nodes, medians over steps.

The events are written here by hand (onnxruntime's profile format: ``model_run`` session events and
``*_kernel_time`` node events with ``ts``/``dur`` in microseconds), with the expected figures
worked out by hand below, so the test does not depend on onnxruntime's timings.
"""

from __future__ import annotations

import pytest

from conftest import load_bench


@pytest.fixture(scope="module")
def profile():
    return load_bench("decode_profile")


def _run(ts, dur):
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "args": {}}


def _node(name, op, ts, dur):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def _step(t0, matmul, if_total, branch):
    """One run at t0 of 1000 us: a MatMul, then an If of ``if_total`` us whose branch ran one Add of
    ``branch`` us, plus the fence events onnxruntime also writes (not kernel time)."""
    return [_run(t0, 1000),
            _node("mm", "MatMul", t0 + 10, matmul),
            {"cat": "Node", "name": "mm_fence_before", "ts": t0 + 9, "dur": 0, "args": {"op_name": "MatMul"}},
            _node("if", "If", t0 + 600, if_total),
            _node("add", "Add", t0 + 610, branch)]


def test_summarise_splits_if_and_takes_medians(profile):
    # a warm-up step (left out: only the last 3 runs count), then three profiled steps
    events = _step(0, 900, 50, 20) + _step(10_000, 500, 100, 60) + _step(20_000, 700, 200, 50) + \
        _step(30_000, 600, 120, 100)
    got = profile.summarise(events, steps=3)
    assert got["steps"] == 3
    # per step: MatMul 500/700/600, If own 40/150/20, Add 60/50/100; top-level = MatMul + If
    assert got["ops"]["MatMul"]["ms"] == pytest.approx(0.600)
    assert got["ops"]["If (own)"]["ms"] == pytest.approx(0.040)
    assert got["ops"]["Add"]["ms"] == pytest.approx(0.060)
    assert got["ops"]["Add"]["count"] == 1
    assert got["run_ms"] == pytest.approx(1.0)
    # top-level sums 600, 900, 720 -> median 720; between = 1000 - that, median 280
    assert got["nodes_ms"] == pytest.approx(0.720)
    assert got["between_ms"] == pytest.approx(0.280)
    assert got["top_nodes"] == 2  # the Add ran inside the If: not a top-level node
    assert got["all_nodes"] == 2  # MatMul and Add (the If is counted by its own part)


def test_summarise_without_if(profile):
    events = [_run(0, 300), _node("a", "MatMul", 5, 100), _node("b", "Split", 120, 30)]
    got = profile.summarise(events, steps=5)  # fewer runs than asked: what there is
    assert got["steps"] == 1
    assert "If (own)" not in got["ops"]
    assert got["nodes_ms"] == pytest.approx(0.130)
    assert got["between_ms"] == pytest.approx(0.170)
    assert got["ops"]["Split"] == {"ms": pytest.approx(0.030), "count": 1}
