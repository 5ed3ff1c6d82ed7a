"""--explain groups the attention sites (and mixtures of experts) that share a verdict on one line
(issue 21: GPT-2's twelve lines repeated one 300-character reason). Expected names are written by hand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tessera.compiler.passes.site_groups import compact_names, grouped_lines
from tessera.runtime.cli import main


@pytest.mark.parametrize("names,expected", [
    ([f"layers.{i}.attn.sdpa" for i in range(12)], "layers.{0-11}.attn.sdpa"),
    (["layers.0.a", "layers.2.a", "layers.4.a", "layers.5.a", "layers.6.a"], "layers.{0,2,4-6}.a"),
    (["enc.1.x", "dec.1.x"], "enc.1.x, dec.1.x"),                # text differs: listed
    (["b.0.h.1", "b.1.h.2"], "b.0.h.1, b.1.h.2"),                # two numbers differ: listed
    (["a.3", "a.3"], "a.3, a.3"),                                # a name twice is not hidden
    (["<model>"], "<model>"),
])
def test_compact_names(names, expected):
    assert compact_names(names) == expected


@dataclass
class Site:
    scope: str
    pos: str | None
    says: str

    def verdict(self) -> str:
        return self.says

    def describe(self) -> str:
        return f"{self.scope} ({self.pos}): {self.says}"


def test_one_line_per_verdict_in_first_seen_order_a_lone_site_as_before():
    sites = [Site("l.0.s", "m.tsr:1:1", "fused -> portable: why"), Site("l.1.s", "m.tsr:1:1", "not fused: because"),
             Site("l.2.s", "m.tsr:1:1", "fused -> portable: why"), Site("l.3.s", "m.tsr:2:1", "fused -> portable: why")]
    assert grouped_lines(sites) == [
        "3 sites l.{0,2-3}.s (m.tsr:1:1, m.tsr:2:1): fused -> portable: why",
        "l.1.s (m.tsr:1:1): not fused: because",
    ]


def test_gpt2_explain_reads_one_line_for_its_twelve_sites(tmp_path, capsys):
    out = tmp_path / "g.onnx"
    assert main(["compile", "gpt2", "--set", "d=32", "--set", "heads=2", "--set", "vocab=50", "--set", "ctx=16",
                 "--no-fuse", "--explain", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0] == "attention sites: 12 (0 fused, 12 not fused)"
    assert err[1].startswith("  12 sites layers.{0-11}.attn.sdpa (")
    assert err[1].endswith("gpt2.tsr:12:10): not fused: fusion disabled (--no-fuse / --attention unfused)")
    assert len(err) == 3 and err[2].startswith("writing the weights: ") and captured.out.startswith("wrote ")
