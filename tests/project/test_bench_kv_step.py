"""bench/kv_step_profile.py's reading of an onnxruntime profile (per-node minima summed, If excluded) and
bench/gqa_grouped_probe.py's grouped form of the decoding call against the form the compiler emits.

The profile events are written here by hand (onnxruntime's format: ``model_run`` session events and
``*_kernel_time`` node events, ts/dur in microseconds) with the expected sums worked out below. The
grouped form is checked against onnxruntime's GroupQueryAttention run in the compiled form (9 heads, one
row) on the same cache: the reference is the kernel's ordinary use, not the probe's rewrite.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from conftest import load_bench


@pytest.fixture(scope="module")
def step_profile():
    return load_bench("kv_step_profile")


@pytest.fixture(scope="module")
def grouped():
    return load_bench("gqa_grouped_probe")


def _run(ts, dur):
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "args": {}}


def _node(name, op, ts, dur):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_node_sums_take_each_nodes_minimum_and_leave_the_if_out(step_profile):
    gqa = "GroupQueryAttention"
    events = []
    # run 1 at 0: If 900 (its nodes inside), attention a 100, b 300, MatMul m 200
    # run 2 at 10000: If 950, a 400, b 120, m 150
    for t0, (a, b, m) in ((0, (100, 300, 200)), (10000, (400, 120, 150))):
        events += [_run(t0, 1000), _node("bound_step/If", "If", t0 + 10, 900), _node("l0/gqa", gqa, t0 + 20, a),
                   _node("l1/gqa", gqa, t0 + 200, b), _node("l0/m", "MatMul", t0 + 600, m)]
    events.append(_run(20000, 5000))  # a run not chosen
    runs = [e for e in events if e["name"] == "model_run"][:2]
    out = step_profile.node_sums(events, runs)
    assert out["GroupQueryAttention_node_min_sum_ms"] == pytest.approx((100 + 120) / 1e3)  # each node's minimum
    assert out["GroupQueryAttention_median_ms"] == pytest.approx((400 + 520) / 2 / 1e3)  # per-run sums 100 + 300, 400 + 120
    assert out["other_node_min_sum_ms"] == pytest.approx(150 / 1e3)  # the If is not counted
    assert out["run_min_ms"] == pytest.approx(1.0)


def _call(grouped, dt, form, qkv, caches, rope, filled, hide=True):
    heads, rows = (grouped.H, 1) if form == "heads" else (grouped.KV, grouped.G)
    s = ort.InferenceSession(grouped.model(dt, heads, rows), providers=["CPUExecutionProvider"])
    f = grouped.feeds(dt, form, qkv, filled)
    if not hide:  # the spare columns the grouped call writes, left visible to its later rows
        f["bias"][...] = 0
    pk, pv = (c.copy() for c in caches)
    io = grouped.run(s, f, pk, pv, rope)
    s.run_with_iobinding(io)
    return grouped.output(form, io.get_outputs()[0].numpy()), pk, pv


@pytest.mark.parametrize("dt", [np.float32, np.float16])
def test_grouped_call_gives_the_compiled_calls_output_and_columns(grouped, dt):
    r = np.random.default_rng(1)
    S, filled = 48, 30
    qkv = r.standard_normal((grouped.H + 2 * grouped.KV) * grouped.HD).astype(np.float32)
    caches = [r.standard_normal((1, grouped.KV, S, grouped.HD)).astype(dt) for _ in range(2)]
    rope = {k: r.standard_normal((8192, grouped.HD // 2)).astype(dt) for k in ("cos", "sin")}
    ref, rk, rv = _call(grouped, dt, "heads", qkv, caches, rope, filled)
    got, gk, gv = _call(grouped, dt, "grouped", qkv, caches, rope, filled)
    tol = 1e-5 if dt == np.float32 else 2e-3
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=tol, rtol=0)
    assert np.array_equal(gk[0, :, :filled + 1], rk[0, :, :filled + 1])  # the past and the new column
    assert np.array_equal(gv[0, :, :filled + 1], rv[0, :, :filled + 1])
    # the spare columns matter: left visible, the rows after the first attend to them
    bad, _, _ = _call(grouped, dt, "grouped", qkv, caches, rope, filled, hide=False)
    assert np.abs(bad.astype(np.float32) - ref.astype(np.float32)).max() > 20 * tol
