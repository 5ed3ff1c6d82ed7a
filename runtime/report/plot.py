"""``tessera report --plot``: MACs, memory and roofline time against sequence length, fused and
unfused attention; with a deployment plan, the largest device's memory against the device's
(the curves come from compiler/analysis/deployment.curves).

matplotlib is an optional extra (``pip install 'tessera[plot]'``); without it
the command says how to get it instead of failing with an import error. The figure is written
atomically (compiler/backends/atomic.py), and its path is checked before the report is computed.
"""

from __future__ import annotations

from pathlib import Path

from tessera.compiler.analysis.costreport import sweep
from tessera.compiler.analysis.deployment import curves
from tessera.compiler.backends.atomic import OutputError, check_target, write_atomically
from tessera.compiler.ir.graph import Graph
from tessera.compiler.ir.signature import input_limits

from tessera.runtime.pipeline import UsageError


def _lengths(seq: int, crossover: float | None, context: int | None = None) -> list[int]:
    """Powers of two from 64 up to the model's context (its position table or rotary max_ctx) and N;
    a model without one (ALiBi, relative positions): to well past N, and past the crossover where it
    is within 2^17."""
    top = max(context, seq) if context else max(8 * seq, 8192, min(2 * (crossover or 0), 2**17))
    n, out = 64, [64]
    while n * 2 <= top:
        n *= 2
        out.append(n)
    return sorted(set(out) | {seq, top})


def model_context(graph: Graph, sequence_symbols: list[str]) -> tuple[int, str] | None:
    """(positions, where) of the longest sequence the model takes: the smallest position table (or rotary
    max_ctx) bounding one of its sequence symbols (compiler/ir/signature.input_limits); None if none does."""
    bounds = [v for sym, v in input_limits(graph).dims.items() if sym in sequence_symbols]
    return min(bounds) if bounds else None


def byte_label(value: float, _pos=None) -> str:
    """A memory axis tick in B, KB, MB, GB or TB (powers of 1000, as the report's table counts)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def _pyplot(option: str = "--plot"):
    try:
        import matplotlib  # optional (tessera[plot]) and slow to import: only a plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"{option} needs matplotlib: pip install 'tessera[plot]' (or pip install matplotlib)") from None
    return plt


def check_plot_path(path: str, option: str = "--plot", example: str = "report.png") -> tuple[Path, str]:
    """The target of a plot option (--plot, run's --plot-attention) and its image format (from the
    suffix), refused before any work is done when matplotlib is missing, the path cannot be
    written or the suffix names no format."""
    _pyplot(option)
    from matplotlib.backend_bases import FigureCanvasBase  # matplotlib: optional, checked by _pyplot above

    target = check_target(path, example)
    formats = FigureCanvasBase.get_supported_filetypes()
    fmt = target.suffix[1:].lower()
    if fmt not in formats:
        said = f"'{target.suffix}'" if target.suffix else "no suffix"
        raise OutputError(f"{option} {target}: {said} names no image format; end the name in one of "
                          f"{', '.join('.' + f for f in sorted(formats))} (e.g. {example})")
    return target, fmt


def plot(graph: Graph, rep: dict, path: str) -> None:
    target, fmt = check_plot_path(path)
    plt = _pyplot()
    fig = figure(graph, rep)
    try:
        write_atomically(target, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt), "report.png")
    finally:
        plt.close(fig)


def figure(graph: Graph, rep: dict):
    """The report's figure (matplotlib), not yet written: MACs, memory and (with a device) roofline
    time against N, each axis ending at the model's context, marked and named in the legend."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter  # matplotlib: optional (tessera[plot]), ~0.5 s

    s = rep["settings"]
    if not s["sequence_symbols"]:
        raise UsageError("--plot draws costs against N, but this spec has no sequence symbol")
    context = model_context(graph, s["sequence_symbols"])
    data = sweep(graph, _lengths(s["seq"], rep["macs"]["crossover_seq"], context and context[0]), s["batch"], s["dtype"])
    n = data["seq"]
    dev = curves(graph, rep, n)  # the plan's largest device and the roofline times (docs/report.md)
    timed = bool(dev["prefill_seconds"])
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(18 if timed else 12, 4.8), constrained_layout=True)
    ax1, ax2 = axes[0], axes[1]
    name = f"{rep['model']}{' (' + rep['variant'] + ')' if rep['variant'] else ''}"
    fig.suptitle(f"{name}, B={s['batch']}, {s['dtype']}: static cost against sequence length N")

    ax1.loglog(n, data["macs_unfused"], "o-", label="unfused: full N×N attention")
    ax1.loglog(n, data["macs_fused"], "s--", label="fused: causal mask exploited (N(N+1)/2 pairs)")
    if any(data["attention_unfused"]):
        ax1.loglog(n, data["attention_unfused"], ":", color="C0", label="  of which attention (N²·D part), unfused")
        ax1.loglog(n, data["attention_fused"], ":", color="C1", label="  of which attention, fused")
    ax1.set_xlabel("sequence length N")
    ax1.set_ylabel("multiply-adds (MACs), one forward pass")
    cross = rep["macs"]["crossover_seq"]
    if cross and n[0] <= cross <= n[-1]:
        ax1.axvline(cross, color="gray", linestyle=":", label=f"N² part overtakes the rest (N ≈ {cross:,.0f})")
    _mark_lengths(ax1, s["seq"], context, n)
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)

    ax2.loglog(n, data["peak_unfused"], "o-", label="peak activations, unfused (N×N scores held)")
    ax2.loglog(n, data["peak_fused"], "s--", label="peak activations, fused attention")
    if any(data["kv_cache"]):
        ax2.loglog(n, data["kv_cache"], "^-", label="KV cache")
    ax2.axhline(rep["memory"]["weights_bytes"], color="gray", linestyle=":", label=f"weights ({s['dtype']})")
    if dev["device_memory"]:
        p = rep["parallel"]["plan"]
        what = "training total" if rep["memory"]["training"].get("per_device") else "weights + KV + activations"
        ax2.loglog(n, dev["device_memory"], "d-", color="C3",
                   label=f"largest device, tp {p['tp']} pp {p['pp']} dp {p['dp']} ep {p['ep']}: {what}")
        if rep["roofline"] and rep["roofline"]["device"]["memory"]:
            ax2.axhline(rep["roofline"]["device"]["memory"], color="C3", linestyle="--",
                        label=f"memory of one {rep['roofline']['device']['name']}")
    _mark_lengths(ax2, s["seq"], context, n)
    ax2.set_xlabel("sequence length N")
    ax2.set_ylabel("memory")
    ax2.yaxis.set_major_formatter(FuncFormatter(byte_label))
    ax2.legend(fontsize=8)
    ax2.grid(True, which="both", alpha=0.3)
    if timed:
        ax3, split = axes[2], rep.get("parallel")
        per = f" (one of tp {split['plan']['tp']})" if split else ""
        ax3.loglog(n, dev["prefill_seconds"], "o-", label=f"prefill, attention fused{per}")
        if any(d is not None for d in dev["decode_seconds"]):
            ax3.loglog(n, dev["decode_seconds"], "s--", label=f"one decoding step at context N{per}")
        _mark_lengths(ax3, s["seq"], context, n)
        ax3.set_xlabel("sequence length N")
        ax3.set_ylabel(f"seconds, roofline on {rep['roofline']['device']['name']}")
        ax3.legend(fontsize=8)
        ax3.grid(True, which="both", alpha=0.3)
    return fig


def _mark_lengths(ax, seq: int, context: tuple[int, str] | None, n: list[int]) -> None:
    """The report's N, and the model's context (where the x axis ends), as labelled vertical lines."""
    ax.axvline(seq, color="black", linewidth=0.8, alpha=0.5, label=f"N = {seq:,} (this report)")
    if context:
        rows, where = context
        ax.axvline(rows, color="C2", linewidth=1.2, linestyle="-.", label=f"model's context: {rows:,} ({where})")
    ax.set_xlim(n[0], n[-1])
