"""``tessera report --measure``: time prefill and decoding on this machine and set them beside the roofline.

Why in the report: the report's roofline (compiler/analysis/roofline.py) is a lower bound for
ideal kernels; nothing said how far a real run is from it. Here the model is compiled and run
the way ``tessera run`` and ``tessera generate`` do it (runtime/driver.time_phase, handed to
this module by the driver: CPU provider, onnxruntime's default threads), and each phase's measured
time is printed beside the estimate for the probed ``cpu`` device, with the signed relative
error ``(estimated - measured) / measured``, the FLOP/s and bandwidth achieved (the roofline's
FLOPs and bytes of the phase over the measured time) and the efficiency this implies
(estimated / measured: the share of the probed roofline onnxruntime reaches). The efficiencies
are recorded in the calibration file (runtime/report/calibration.py) that ``--calibrated`` reads.

- prefill (B, N): the full model (``tessera run``'s compile: every position's logits, as the
  roofline counts them) on B rows of N random token ids; one warm-up run, then ``repeats``.
- decode (B, at N): the KV-cached decoder (``tessera generate``'s compile) after a prompt of
  N - s tokens, s = warm-up + ``repeats`` single-token steps; the timed steps read a cache of
  N - ``repeats`` ... N - 1 positions, within ``repeats`` / N of the estimate's N (the model's
  context bounds the last position, so the steps cannot all start at N).

The measured time is the median of the runs (the minimum is given too). Only decoder-only
language models (one input: the token ids) are timed; the roofline of the others stays unmeasured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from tessera.compiler.ir.signature import input_limits
from tessera.runtime import pipeline
from tessera.runtime.errors import UsageError
from tessera.runtime.report import calibration

PREFILL_WARMUP = 1
DECODE_WARMUP = 3


@dataclass
class Timing:
    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def min(self) -> float:
        return min(self.runs)


# ------------------------------------------------------------------ running the model
def _token_input(ref) -> tuple[str, int]:
    """The model's single token input and its vocabulary (rows of the table it indexes)."""
    built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)
    g = built.graph
    t = g.type_of(g.inputs[0]) if len(g.inputs) == 1 else None
    if t is None or t.dtype not in ("i64", "i32") or t.rank != 2:
        given = ", ".join(f"{i} {g.type_of(i)}" for i in g.inputs)
        raise UsageError(f"--measure times decoder-only language models (one input: the token ids [B, T]); "
                         f"{g.name} takes {given}")
    ids = input_limits(g).ids.get(g.inputs[0])
    if ids is None:
        raise UsageError(f"--measure: {g.name}'s input {g.inputs[0]} indexes no embedding table (no vocabulary)")
    return g.inputs[0], ids[0]


def tokens(batch: int, length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(batch, length), dtype=np.int64)


def decode_steps(o) -> int:
    return DECODE_WARMUP + o.repeats


def check_measurable(o) -> None:
    """What --measure needs of the sizes, before anything is built."""
    steps = decode_steps(o)
    if o.seqs[0] <= steps:
        raise UsageError(f"--measure times {steps} decoding steps ({DECODE_WARMUP} warm-up and --repeats "
                         f"{o.repeats}) after a prompt of N - {steps} tokens: --seq must be above {steps}")


# ------------------------------------------------------------------ the figures
def calibrated(phase: str, estimated: float, flops: float, nbytes: float, points: dict[str, list[dict]]):
    """(calibrated seconds, the point used) for an estimate, or (None, None) without a point of the phase."""
    point = calibration.nearest(points.get(phase, []), flops, nbytes)
    if point is None:
        return None, None
    return estimated / point["efficiency"], point


def _error(estimated: float | None, measured: float) -> float | None:
    return None if estimated is None else (estimated - measured) / measured


def phase_figures(phase: str, timing: Timing, estimated: float, flops: float, nbytes: float, device: dict,
                  points: dict[str, list[dict]]) -> dict:
    measured = timing.median
    cal, point = calibrated(phase, estimated, flops, nbytes, points)
    achieved_flops, achieved_bytes = flops / measured, nbytes / measured
    return {
        "measured_s": measured, "measured_min_s": timing.min, "runs": len(timing.runs),
        "estimated_s": estimated, "error": _error(estimated, measured),
        "calibrated_s": cal, "calibrated_error": _error(cal, measured),
        "flops": flops, "bytes": nbytes,
        "achieved_flops_per_s": achieved_flops, "achieved_bytes_per_s": achieved_bytes,
        "efficiency": estimated / measured,
        "flops_efficiency": achieved_flops / device["peak_flops"],
        "bandwidth_efficiency": achieved_bytes / device["bandwidth"],
        "calibration_point": None if point is None else {k: point[k] for k in ("model", "batch", "seq", "efficiency")},
    }


def prefill_variant(rep: dict) -> str:
    """Which prefill estimate the CPU export matches: fused when the full pipeline fused every
    attention site for the cpu target (the report's attention section), else the graph as written."""
    att = rep.get("attention") or {}
    return "fused" if att.get("fused") and not att.get("not_fused") else "unfused"


def measure_section(rep: dict, ref, o, points: dict[str, list[dict]], timer) -> dict:
    """Run the model and return the ``measure`` section (points: the calibration before this run).
    ``timer(phase, ref, o, token_input, vocab)`` runs a phase and returns its Timing: runtime/driver.py's
    ``time_phase``, handed down by the driver (the report package does not import the driver, which
    imports it)."""
    roof = rep["roofline"]
    name, vocab = _token_input(ref)
    variant = prefill_variant(rep)
    work = roof["work"]
    out = {"batch": o.batches[0], "seq": o.seqs[0], "repeats": o.repeats, "prefill_estimate": variant}
    w = work[f"prefill_{variant}"]
    out["prefill"] = phase_figures("prefill", timer("prefill", ref, o, name, vocab), roof["prefill_seconds"][variant],
                                   w["flops"], w["bytes"], roof["device"], points)
    if roof["decode_seconds_per_token"] is not None and "decode" in work:
        w = work["decode"]
        out["decode"] = phase_figures("decode", timer("decode", ref, o, name, vocab), roof["decode_seconds_per_token"],
                                      w["flops"], w["bytes"], roof["device"], points)
        out["decode"]["positions"] = [o.seqs[0] - o.repeats, o.seqs[0] - 1]
    else:
        out["decode"] = None
    return out


def calibration_points(rep: dict, measure: dict) -> dict[str, dict]:
    """The measured phases as calibration points (runtime/report/calibration.record)."""
    s = rep["settings"]
    return {phase: {"model": rep["model"] + (f" ({rep['variant']})" if rep["variant"] else ""),
                    "params": rep["params"]["total"], "batch": s["batch"], "seq": s["seq"], "dtype": s["dtype"],
                    "flops": m["flops"],
                    "bytes": m["bytes"], "estimated_s": m["estimated_s"], "measured_s": m["measured_s"]}
            for phase in ("prefill", "decode") if (m := measure.get(phase)) is not None}


def calibrated_roofline(roof: dict, points: dict[str, list[dict]]) -> dict:
    """--calibrated: the roofline's phase times divided by the nearest recorded efficiency."""
    work = roof["work"]
    out = {"prefill_seconds": {}, "points": {}}
    for variant in ("unfused", "fused"):
        w = work[f"prefill_{variant}"]
        t, p = calibrated("prefill", roof["prefill_seconds"][variant], w["flops"], w["bytes"], points)
        out["prefill_seconds"][variant] = t
        out["points"][f"prefill_{variant}"] = p and {k: p[k] for k in ("model", "batch", "seq", "efficiency")}
    t = p = None
    if roof["decode_seconds_per_token"] is not None and "decode" in work:
        w = work["decode"]
        t, p = calibrated("decode", roof["decode_seconds_per_token"], w["flops"], w["bytes"], points)
    out["decode_seconds_per_token"] = t
    out["points"]["decode"] = p and {k: p[k] for k in ("model", "batch", "seq", "efficiency")}
    return out
