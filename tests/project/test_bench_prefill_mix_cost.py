"""bench/prefill_mix_cost.py's ``goal_bounds``: issue #23's serving goals at their best case, from a
run's median costs. The expected figures are worked by hand here from the definition (a request of
P prompt tokens and N new ones: N - 1 decoding steps; a prompt token at its cheapest measured cost),
so a wrong formula in the bench (a step not shared over the rows, the first token counted as a
decoding step, the dearest token cost taken) fails."""

from __future__ import annotations

import pytest

from conftest import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("prefill_mix_cost")


MEDIANS = {  # ms: a 16-row step, one stream's step, and four ways a prompt token goes in
    "decode-16": 48.0, "decode-1": 24.0,
    "chunk 16 @0": 40.0,  # 2.5 ms a token
    "chunk 144 @0": 172.8,  # 1.2 ms a token: one stream's whole prompt
    "decode alone": 60.0,
    "one call 48 @0": 108.0,  # (108 - 60) / 48 = 1.0 ms a token: the cheapest
}


def test_the_bounds_from_a_runs_medians(bench):
    b = bench.goal_bounds(MEDIANS, "decode-16", rows=16, prompt=144, new=128)
    assert b["cheapest"] == "one call 48 @0 minus the step alone"
    assert b["prompt_token_ms"] == pytest.approx(1.0)
    # one stream: 127 steps of 24 ms and its 144-token prompt in one call of 172.8 ms
    one_s = (127 * 24.0 + 172.8) / 1e3
    assert b["one_stream_tok_s"] == pytest.approx(128 / 3.2208)
    # 16 streams: a request's 127 decoding rows at 48 / 16 ms each, its 144 prompt tokens at 1 ms
    assert b["rate_ratio"] == pytest.approx(one_s / 0.525)  # 6.135
    assert b["prompt_tokens_per_iteration"] == pytest.approx(16 * 144 / 127)  # 18.14
    assert b["iteration_steps"] == pytest.approx((48.0 + 16 * 144 / 127) / 24.0)  # 2.756


def test_without_a_whole_prompt_chunk_one_stream_takes_the_cheapest_cost(bench):
    med = {k: v for k, v in MEDIANS.items() if k != "chunk 144 @0"}
    b = bench.goal_bounds(med, "decode-16", rows=16, prompt=144, new=128)
    assert b["one_stream_prefill"] == "cheapest token cost x prompt"
    assert b["one_stream_tok_s"] == pytest.approx(128 / ((127 * 24.0 + 144 * 1.0) / 1e3))


def test_no_bounds_without_the_steps(bench):
    assert bench.goal_bounds({"chunk 16 @0": 40.0}, "decode-16", rows=16, prompt=144, new=128) is None
