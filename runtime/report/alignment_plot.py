"""``tessera run --plot-attention FILE.png``: an alignment heatmap as in Bahdanau et al. (2015), fig. 3.

Source (key) tokens along the top, target (query) tokens down the left, each pixel one weight in
grey scale from 0 (black) to 1 (white). The matrix is an ``Alignment`` from runtime/report/alignment.py,
drawn as it is. The path checks, the matplotlib-missing message and the atomic write are those of
``tessera report --plot`` (runtime/report/plot.py, compiler/backends/atomic.py): the path is refused
before the model runs, and a failed write leaves any previous file in place.
"""

from __future__ import annotations

from pathlib import Path

from tessera.compiler.backends.atomic import write_atomically

from tessera.runtime.report.alignment import Alignment
from tessera.runtime.report.plot import _pyplot, check_plot_path

OPTION = "--plot-attention"
EXAMPLE = "alignment.png"
MAX_LABELS = 60  # more tokens than this on an axis: label every k-th, or the labels overlap into a blot


def check_path(path: str) -> tuple[Path, str]:
    """The plot's target and image format, checked before the model runs (see report_plot)."""
    return check_plot_path(path, OPTION, EXAMPLE)


def _ticks(labels: list[str]) -> tuple[list[int], list[str]]:
    step = max(1, -(-len(labels) // MAX_LABELS))
    at = list(range(0, len(labels), step))
    return at, [labels[i] for i in at]


def draw(al: Alignment, path: str, title: str = "") -> Path:
    """Draw ``al`` into ``path`` (format from its suffix), atomically; returns the file written."""
    target, fmt = check_path(path)
    plt = _pyplot(OPTION)
    tq, tk = al.matrix.shape
    cell = 0.32  # inches per token, within a figure of 4 to 16 inches a side
    fig, ax = plt.subplots(figsize=(min(16, max(4, 2.5 + cell * tk)), min(16, max(4, 2.0 + cell * tq))),
                           constrained_layout=True)
    try:
        image = ax.imshow(al.matrix, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
        at, labels = _ticks(al.cols)
        ax.set_xticks(at, labels, rotation=90, fontsize=8)
        at, labels = _ticks(al.rows)
        ax.set_yticks(at, labels, fontsize=8)
        ax.set_xlabel("source (keys)")
        ax.set_ylabel("target (queries)")
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02, label="attention weight")
        fig.suptitle(title or f"{al.output}: {al.what}", fontsize=9)
        write_atomically(target, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt), EXAMPLE)
    finally:
        plt.close(fig)
    return target


__all__ = ["OPTION", "check_path", "draw"]
