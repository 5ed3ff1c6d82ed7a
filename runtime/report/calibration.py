"""The calibration of the ``cpu`` roofline: measured efficiencies, per machine, kept in a user cache file.

Why: the roofline is a lower bound for ideal kernels at the probe's peak; onnxruntime on a real
CPU reaches a fraction of it, and that fraction (the efficiency, estimated / measured time)
depends on the phase (prefill is compute-bound, a decoding step memory-bound) and on the size
and arithmetic intensity of the work. ``tessera report --measure`` records one point per phase
and shape measured; ``--device cpu --calibrated`` divides each estimate by the efficiency of the
recorded point of that phase nearest in (log FLOPs, log bytes), so a calibration made at the
shapes one cares about is used for them, and a shape in between borrows its nearest neighbour's.

Points are kept per machine fingerprint (CPU model and the threads onnxruntime uses): another
machine, or the same one with another thread count, has its own calibration. With the points the
machine keeps the ``cpu`` probe (compiler/analysis/roofline.probe_cpu) of its first calibration,
and --measure and --calibrated use that probe instead of probing again: the probe is a short
numpy run that varies with the load (threefold on a shared machine), and an efficiency only
means something against the roofline it was measured against. Delete the file to probe afresh. The file is JSON,
at $TESSERA_CALIBRATION, else ~/.cache/tessera/calibration.json (``--calibration FILE`` names
another); it is replaced atomically (compiler/backends/atomic.py), so an interrupted write
leaves the previous calibration whole.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

from tessera.compiler.analysis.roofline import Device, load_average
from tessera.compiler.backends.atomic import write_atomically
from tessera.runtime.errors import UsageError

ENV = "TESSERA_CALIBRATION"
VERSION = 1
PHASES = ("prefill", "decode")


def default_path() -> Path:
    env = os.environ.get(ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tessera" / "calibration.json"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def threads() -> int:
    """The threads onnxruntime's CPU provider uses by default (one per core the process may run on)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fingerprint() -> dict:
    return {"cpu": cpu_model(), "threads": threads()}


def machine_key(fp: dict) -> str:
    return f"{fp['cpu']} | {fp['threads']} threads"


def read(path: Path) -> dict:
    """The calibration file's contents; an empty calibration when there is none. A file that is not
    one (corrupt, another format) is a UsageError naming it: it is never silently overwritten."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"version": VERSION, "machines": {}}
    except OSError as e:
        raise UsageError(f"cannot read the calibration file {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("machines"), dict):
            raise ValueError("not a Tessera calibration")
        for machine in data["machines"].values():
            _check_machine(machine)
    except ValueError as e:
        raise UsageError(f"{path} is not a Tessera calibration file ({e}); delete it or name another with "
                         f"--calibration FILE") from None
    return data


NUMBERS = ("flops", "bytes", "estimated_s", "measured_s", "efficiency")


def _check_machine(machine) -> None:
    """A machine's entry as --calibrated reads it (a hand-edited or truncated file fails here, by name)."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0

    if not isinstance(machine, dict) or not isinstance(machine.get("phases"), dict):
        raise ValueError("a machine without phases")
    d = machine.get("device")
    if d is not None and not (isinstance(d, dict) and isinstance(d.get("flops"), dict)
                              and all(number(v) for v in d["flops"].values())
                              and number(d.get("vector_flops")) and number(d.get("bandwidth"))
                              and isinstance(d.get("label"), str) and isinstance(d.get("source"), str)
                              and isinstance(d.get("probed_at"), str)):
        raise ValueError("a malformed cpu probe")
    for phase, points in machine["phases"].items():
        if not isinstance(points, list) or not all(isinstance(p, dict) and all(number(p.get(k)) for k in NUMBERS)
                                                   for p in points):
            raise ValueError(f"a malformed {phase} point")


def write(path: Path, data: dict) -> Path:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return write_atomically(path, lambda tmp: tmp.write_text(text), "calibration.json")


def device_fields(device) -> dict:
    """A roofline.Device as stored with the machine's calibration, with when and under what load
    (1-minute load average, CPUs) it was probed."""
    return {"label": device.label, "flops": dict(device.flops), "vector_flops": device.vector_flops,
            "bandwidth": device.bandwidth, "memory": device.memory, "source": device.source,
            "probed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load": load_average(),
            "cpus": os.cpu_count()}


REPROBE_GAIN = 1.25  # a fresh probe this much faster (FLOP/s or bandwidth) than the kept one replaces it


class BusyProbe(Exception):
    """A probe taken while the machine was busy (roofline.probe_cpu's ``busy``): never kept."""


def check_quiet(device) -> None:
    """Refuse to keep a probe taken beside other work: its roofline would understate the machine for
    every later estimate (issue 38: a probe at 5.4 GB/s on a machine that reaches 30 GB/s quiet)."""
    if getattr(device, "busy", ""):
        raise BusyProbe(f"the machine was busy while it was probed ({device.busy}): the calibration was not "
                        f"recorded; run --measure again when the machine is quiet")


def replace_device(path: Path, device, fp: dict | None = None) -> Path:
    """Keep ``device`` as this machine's probe and drop its recorded points: their efficiencies were
    measured against the old probe's roofline (measure.py's check found it slower than the machine).
    Raises BusyProbe for a probe taken while the machine was busy."""
    check_quiet(device)
    fp = fp or fingerprint()
    data = read(path)
    machine = data["machines"].setdefault(machine_key(fp), {**fp, "phases": {}})
    machine["device"] = device_fields(device)
    machine["phases"] = {}
    return write(path, data)


def stored_device(path: Path, fp: dict | None = None):
    """The cpu probe kept with this machine's calibration as a roofline.Device, None without one."""
    machine = read(path)["machines"].get(machine_key(fp or fingerprint()))
    d = machine and machine.get("device")
    if not d:
        return None
    load = d.get("load")
    under = f" at load {load:.2f} on {d.get('cpus', '?')} CPUs" if isinstance(load, (int, float)) else ""
    return Device("cpu", d["label"].replace(", measured", "") + f", probed {d['probed_at']}{under}",
                  {k: float(v) for k, v in d["flops"].items()}, float(d["vector_flops"]), float(d["bandwidth"]),
                  d["memory"], f"{d['source']}; probed {d['probed_at']} and kept with the calibration in {path} "
                               f"(delete it to probe afresh)", measured=True)


def record(path: Path, points: dict[str, dict], device, fp: dict | None = None) -> Path:
    """Add the measured ``points`` (phase -> {model, params, batch, seq, dtype, flops, bytes, estimated_s,
    measured_s}) to this machine's calibration, with ``device`` (the cpu probe they were estimated on) when
    the machine has none yet; a point of the same model (and size), shape and dtype replaces the older
    one. Read, merged and written back atomically. Raises BusyProbe (nothing written) when the machine
    has no probe yet and ``device`` was taken while it was busy."""
    fp = fp or fingerprint()
    data = read(path)
    machine = data["machines"].setdefault(machine_key(fp), {**fp, "phases": {}})
    if "device" not in machine:  # the probe the points' efficiencies refer to: kept only if taken quietly
        check_quiet(device)
        machine["device"] = device_fields(device)
    for phase, p in points.items():
        kept = [q for q in machine["phases"].get(phase, []) if not _same(q, p)]
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        point = {**p, "efficiency": p["estimated_s"] / p["measured_s"], "at": at}
        machine["phases"][phase] = kept + [point]
    return write(path, data)


def _same(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("model", "params", "batch", "seq", "dtype"))


def points_for(path: Path, fp: dict | None = None) -> dict[str, list[dict]]:
    """This machine's recorded points by phase ({} when it has none)."""
    fp = fp or fingerprint()
    machine = read(path)["machines"].get(machine_key(fp))
    return machine["phases"] if machine else {}


def nearest(points: list[dict], flops: float, nbytes: float) -> dict | None:
    """The recorded point whose work is nearest in (log10 FLOPs, log10 bytes)."""
    def distance(p):
        return math.hypot(_log(p["flops"]) - _log(flops), _log(p["bytes"]) - _log(nbytes))

    return min(points, key=distance) if points else None


def _log(x: float) -> float:
    return math.log10(max(float(x), 1.0))


def missing_message(path: Path, fp: dict | None = None) -> str:
    fp = fp or fingerprint()
    return (f"no calibration for this machine ({machine_key(fp)}) in {path}: make one with "
            f"'tessera report SPEC --device cpu --measure' (at the batch and sequence length you care about), "
            f"then add --calibrated")
