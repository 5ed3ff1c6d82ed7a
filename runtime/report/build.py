"""Building the cost report of a spec: elaborate it and ask compiler/analysis for the numbers.

The numbers come from compiler/analysis/costreport.py (symbolic, from the graph alone; no weights
are allocated); this module picks the device, counts mixtures of experts as compile builds them,
passes the deployment plan and the sweep on (compiler/analysis/deployment.py), adds the attention
and quantisation sections, times the model with --measure (runtime/report/measure.py), applies
the calibration with --calibrated (runtime/report/calibration.py) and draws --plot (runtime/report/plot.py).
runtime/report/format.py renders the result.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path

from tessera.compiler.analysis import costreport, deployment, roofline
from tessera.compiler.analysis.roofline import probe_cpu
from tessera.compiler.build import model_metadata
from tessera.compiler.passes.pipeline import run_report
from tessera.compiler.report import attention_section, quantization_section, stored_codes_section
from tessera.runtime import pipeline
from tessera.runtime.io import gguf_file
from tessera.runtime.options import plan_errors
from tessera.runtime.report import calibration, measure
from tessera.runtime.report.calibration import default_path, stored_device
from tessera.runtime.report.measure import calibrated_roofline, check_measurable
from tessera.runtime.report.plot import check_plot_path, plot


@contextmanager
def _no_gc():
    """Elaboration and the report build many long-lived objects and free almost none; the cyclic
    garbage collector would rescan them over and over (half the run time for GPT-3)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_report(ref, o, timer=None) -> dict:
    """The report of ``ref`` (runtime/options.ModelRef) as ``o`` (ReportOptions) asks, a JSON-able dict;
    ``timer``: what times a phase for --measure (runtime/driver.time_phase)."""
    if o.plot is not None:  # a bad path fails now, not after the report
        check_plot_path(str(o.plot))
    cal_file = calibration_file(o)
    points = _calibration(o, cal_file)
    device = kept = None
    if o.measure or o.calibrated:  # the probe the calibration was made against (calibration.py says why)
        device = kept = stored_device(cal_file)
    try:
        device = device or roofline.get_device(o.device)
    except roofline.DeviceError as e:
        raise pipeline.UsageError(str(e)) from None
    options = o.pipeline_options()
    config = options.quantize
    with _no_gc():
        built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)  # a folder's config.json
        with pipeline.compiler_errors():  # as compile builds it, on a copy (built.graph is left as written)
            graph = run_report(built.graph, options).graph
        batches, seqs, plan = o.batches, o.seqs, o.plan
        with plan_errors():  # the plan against this model: heads, layers, experts, positions
            rep = costreport.build_report(
                graph, built.info.model, built.info.variant, model_metadata(built.info)["tessera.hyperparams"],
                batch=batches[0], seq=seqs[0], dtype=o.dtype, device=device, plan=plan,
                phase_work=o.measure or o.calibrated, kv_cache_dtype=o.kv_cache_dtype)
            if o.sweep:
                rep["sweep"] = deployment.sweep_rows(graph, batches, seqs, o.dtype, device, plan, o.kv_cache_dtype)
    if o.plot is not None:
        with _no_gc():
            plot(graph, rep, str(o.plot))
    with _no_gc():  # fuses a copy: built.graph is left as written
        rep["attention"] = attention_section(graph, rep["settings"]["bindings"],
                                             rep["settings"]["bytes_per_element"], device.name, o.dtype)
    stored = stored_codes_section(built.graph, o.gguf_weights)  # a GGUF file's codes (--gguf-weights)
    if stored is not None:
        stored["source"] = gguf_file.source_note(ref.weights)
        rep["gguf_codes"] = stored
    if config is not None:
        with _no_gc():  # quantises a copy (the linears over a GGUF file's codes read those first)
            rep["quantization"] = quantization_section(built.graph, config, o.gguf_weights)
    if o.calibrated:
        rep["roofline"]["calibrated"] = {**calibrated_roofline(rep["roofline"], points),
                                         "file": str(cal_file)}
    if o.measure:
        if timer is None:
            raise pipeline.UsageError("--measure runs through runtime/driver.report, which times the phases")
        rep["measure"] = measure.measure_section(rep, ref, o, points, timer)
        try:
            if not _check_probe(rep["measure"], device, kept, cal_file):
                rep["measure"]["calibration_file"] = str(calibration.record(
                    cal_file, measure.calibration_points(rep, rep["measure"]), device))
        except calibration.BusyProbe as e:  # nothing kept: a busy probe would poison every later estimate
            rep["measure"].setdefault("notes", []).append(str(e))
        rep["measure"]["machine"] = calibration.fingerprint()
    return rep


def _check_probe(m: dict, device, kept, cal_file) -> bool:
    """A phase measured faster than the probe's roofline (efficiency above 1) says the probe
    understates this machine -- typically one taken while the machine was busy, which the
    calibration would otherwise keep for good. Then probe again (best of 5): when the fresh probe is
    REPROBE_GAIN faster than the kept one, keep it instead and drop the points measured against the
    old one (this run's too: they were estimated against it), and say so; else say why the
    efficiency may exceed 1. Returns whether the calibration was restarted (nothing to record)."""
    fast = [phase for phase in ("prefill", "decode") if (m.get(phase) or {}).get("efficiency", 0) > 1]
    if not fast:
        return False
    notes = m.setdefault("notes", [])
    what = ", ".join(f"{p} {100 * m[p]['efficiency']:.0f}%" for p in fast)
    if kept is None:  # probed just now, for this run
        notes.append(f"efficiency above 100% ({what}): measured faster than the roofline of the probe taken for "
                     f"this run ({device.source}); the machine was likely busy while it was probed")
        return False
    fresh = probe_cpu(repeats=5)
    gain = max(fresh.vector_flops / kept.vector_flops, fresh.bandwidth / kept.bandwidth)
    if gain >= calibration.REPROBE_GAIN:
        m["calibration_file"] = str(calibration.replace_device(cal_file, fresh))
        m["reprobed"] = {"gain": gain, "kept": kept.label, "bandwidth": fresh.bandwidth,
                         "peak_flops": fresh.vector_flops}
        notes.append(f"efficiency above 100% ({what}): the kept probe ({kept.label}) understates this machine; a "
                     f"fresh probe is {gain:.1f}x faster, so it is kept instead and the calibration restarts "
                     f"(its earlier points, and this run's, were measured against the old probe): run --measure "
                     f"again to calibrate")
        return True
    notes.append(f"efficiency above 100% ({what}) although a fresh probe is no faster than the kept one "
                 f"({kept.label}): the roofline's work for this shape is more than onnxruntime does (e.g. "
                 f"traffic that stays in cache)")
    return False


def calibration_file(o):
    """--calibration, else $TESSERA_CALIBRATION, else the user cache's (runtime/report/calibration.py)."""
    return Path(o.calibration) if o.calibration is not None else default_path()


def _calibration(o, cal_file) -> dict:
    """This machine's recorded calibration points by phase (read before anything is measured, so a
    --measure run's calibrated figures come from the earlier calibration); --calibrated without any is
    a UsageError saying how to make one."""
    if not (o.measure or o.calibrated):
        return {}
    points = calibration.points_for(cal_file)
    if o.calibrated and not points:
        raise pipeline.UsageError(calibration.missing_message(cal_file))
    if o.measure:
        check_measurable(o)
    return points
