"""The report's table at 80 and 100 columns (issue 21): no line wider than the terminal, and every row
label shown whole (folded over lines, never cut with an ellipsis), so two labels cannot read alike,
as ``layers.*.attn.sdpa/matm… (matmul) ×12`` did twice. The labels are the format's own rows
(runtime/report/format.sections); the check is on what rich printed."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tessera.runtime.report.format import op_label, print_table, sections


@pytest.fixture(scope="module")
def gpt2_report():
    from tessera.runtime.driver import report
    from tessera.runtime.options import ModelRef, ReportOptions

    return report(ModelRef(spec="gpt2", variant="small"), ReportOptions())


def _first_column(text: str) -> str:
    """The first cell of every table line, concatenated without spaces."""
    return "".join(line.split("│")[1].replace(" ", "") for line in text.splitlines()
                   if line.startswith("│") and line.count("│") > 2)


@pytest.mark.parametrize("width", [80, 100])
def test_every_label_is_shown_whole_within_the_width(gpt2_report, width):
    out = io.StringIO()
    print_table(gpt2_report, Console(file=out, width=width, no_color=True))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    shown = _first_column(text)
    at = 0
    for _, _, rows in sections(gpt2_report):
        for row in rows:
            label = row[0].replace(" ", "")
            found = shown.find(label, at)
            assert found >= 0, f"row label {row[0]!r} is not shown whole at {width} columns"
            at = found + len(label)
    labels = [row[0].strip() for _, _, rows in sections(gpt2_report) for row in rows if row[0].startswith("  layers.")]
    assert "layers.{0-11}.attn.sdpa (12 sites)" in [row[0] for _, _, rows in sections(gpt2_report) for row in rows]
    assert "layers.*.attn.sdpa/matmul ×12" in labels and "layers.*.attn.sdpa/matmul_1 ×12" in labels


def test_op_label_drops_the_op_only_when_the_name_says_it():
    assert op_label("layers.*.attn.sdpa/matmul_1", "matmul") == "layers.*.attn.sdpa/matmul_1"
    assert op_label("layers.*.attn.sdpa/softmax", "softmax") == "layers.*.attn.sdpa/softmax"
    assert op_label("layers.*.mlp.fc", "linear") == "layers.*.mlp.fc (linear)"
    assert op_label("layers.*.attn.matmulx", "matmul") == "layers.*.attn.matmulx (matmul)"
    assert op_label("head", "linear") == "head (linear)"
