"""The report is closed-form in B and N: huge sizes answer at once, with exact integers.

The attention-traffic estimate once looped over query tiles (``report --seq 10**9`` took
minutes); it is now a sum in closed form, checked here against a loop over the tiles written
in this test. How long the report takes at each N is measured by bench/report_scale.py.
"""

from __future__ import annotations

import json

import pytest

from conftest import cli
from tessera.compiler.analysis.attention_report import keys_read_by_tiles


def _keys_read_loop(tq: int, tk: int, br: int, causal: bool) -> int:
    """Tile by tile: a tile's last query row (1-based) ``end`` sees keys up to ``end + tk - tq``."""
    total = 0
    for start in range(0, tq, br):
        end = min(start + br, tq)
        total += max(0, min(tk, end + tk - tq)) if causal else tk
    return total


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("br", [1, 7, 64, 128])
def test_closed_form_equals_the_tile_loop(causal, br):
    lengths = list(range(1, 300)) + [511, 512, 513, 1000, 1023, 1024, 1025, 4097]
    for tq in lengths:
        for tk in {tq, tq + 1, tq + 37, 1, max(1, tq - 5), max(1, tq // 2), 3 * tq}:
            assert keys_read_by_tiles(tq, tk, br, causal) == _keys_read_loop(tq, tk, br, causal), (tq, tk)


def test_a_decoding_step_reads_every_past_key_once():
    # One new query over 999 past positions: a single tile reading all 1000 keys.
    assert keys_read_by_tiles(1, 1000, 64, True) == 1000


def test_report_at_a_trillion_tokens_is_exact(capsys):
    n, b = 10**12, 10**8
    rc, out, err = cli(capsys, "report", "gpt2", "--variant", "small", "--seq", n, "--batch", b,
                       "--format", "json")
    assert rc == 0, err
    rep = json.loads(out)
    sites = [s for s in rep["attention"]["sites"] if s["fused"]]
    assert len(sites) == 12
    h, d, e = 12, 64, 4  # GPT-2 small: 12 heads of 64, fp32
    for s in sites:
        br = s["q_tile"]
        assert n % br == 0
        keys = n * (n // br + 1) // 2  # tiles end at br, 2br, ..., n; causal: each reads up to its end
        assert s["traffic_bytes"]["fused"] == e * b * (2 * h * n * d + h * keys * 2 * d)
        scores = n * n
        passes = 3  # scale, causal mask, softmax
        assert s["traffic_bytes"]["unfused"] == e * b * h * (2 * n * d + scores * (2 + 2 * passes) + 2 * n * d)
    # The multiply-adds are the published GPT-2 small formula evaluated exactly, not a float.
    assert isinstance(rep["macs"]["total"], int)
