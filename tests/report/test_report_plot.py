"""`report --plot`'s axes (issue 21): the x axis ends at the model's context (its position table, here
GPT-2's wpe with ctx rows), a line there is named in the legend, and the memory axis reads in
KB/MB/GB, not "bytes". Expected values are the --set values and hand-written labels."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from tessera.runtime.report.plot import byte_label, figure, model_context

TINY = ["layers=2", "d=32", "heads=2", "vocab=50", "ctx=128"]


def _figure(spec: str, sets: list[str], seq: int):
    from tessera.runtime import pipeline
    from tessera.runtime.driver import report
    from tessera.runtime.options import ModelRef, ReportOptions

    rep = report(ModelRef(spec=spec, sets=sets), ReportOptions(seq=seq))
    graph = pipeline.build(spec, None, sets).graph
    return graph, rep, figure(graph, rep)


def test_the_x_axis_ends_at_the_context_which_the_legend_names():
    import matplotlib.pyplot as plt

    graph, rep, fig = _figure("gpt2", TINY, 64)
    try:
        assert model_context(graph, rep["settings"]["sequence_symbols"]) == (128, "wpe.weight")
        for ax in fig.axes:
            assert ax.get_xlim()[1] == pytest.approx(128)
            labels = ax.get_legend_handles_labels()[1]
            assert "model's context: 128 (wpe.weight)" in labels
            assert "N = 64 (this report)" in labels
        memory = fig.axes[1]
        assert memory.get_ylabel() == "memory"
        assert memory.yaxis.get_major_formatter()(2e9, 0) == "2 GB"
    finally:
        plt.close(fig)


def test_a_model_without_a_position_table_keeps_the_long_axis():
    import matplotlib.pyplot as plt

    sets = ["layers=1", "d=32", "heads=2", "vocab=50"]
    graph, rep, fig = _figure("bloom", sets, 256)
    try:
        assert model_context(graph, rep["settings"]["sequence_symbols"]) is None  # ALiBi: no positions table
        assert fig.axes[0].get_xlim()[1] == pytest.approx(8192)
        assert not any("context" in label for label in fig.axes[0].get_legend_handles_labels()[1])
    finally:
        plt.close(fig)


@pytest.mark.parametrize("value,text", [(512, "512 B"), (1500, "1.5 KB"), (2e6, "2 MB"), (3.5e9, "3.5 GB"),
                                        (1e12, "1 TB")])
def test_byte_labels(value, text):
    assert byte_label(value) == text
