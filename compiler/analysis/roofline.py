"""Roofline estimates: how long each op takes on a device, and whether memory or arithmetic limits it.

An op that does F FLOPs and moves M bytes takes at least max(F / peak, M / bandwidth);
its arithmetic intensity F / M against the device's ridge point (peak / bandwidth)
says which bound applies. Summing over the graph's ops gives a prefill time (the
graph as written, N x N scores in memory; or with attention fused, the scores
kept on chip and masked blocks skipped) and the time of one decoding step, which
reads every weight and the whole KV cache to produce one token per sequence.
These are lower bounds of an ideal implementation, not measurements.

Device figures come from devices.toml (datasheets, with sources); ``cpu`` is
measured here with a short numpy matmul and memory-copy probe.
"""

from __future__ import annotations

import math
import os
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.compiler.analysis.cost import MATMUL_OPS, NodeCost, score_pairs
from tessera.compiler.ir.graph import Graph
from tessera.compiler.analysis.memory import ALIAS_OPS, Sizer
from tessera.compiler.analysis.poly import Poly, numel
from tessera.compiler.analysis.structure import Structure

DEVICES_FILE = Path(__file__).with_name("devices.toml")


class DeviceError(Exception):
    pass


@dataclass
class Device:
    name: str
    label: str
    flops: dict[str, float]     # peak dense matmul FLOP/s by dtype
    vector_flops: float         # peak FP32 FLOP/s for element-wise work
    bandwidth: float            # bytes/s
    memory: float | None        # bytes
    source: str
    measured: bool = False
    busy: str = ""              # a probe's: why the machine was not quiet while it ran ("" = quiet)

    def peak(self, dtype: str, matmul: bool) -> float:
        return self.flops[dtype] if matmul else self.vector_flops


def load_devices() -> dict[str, dict]:
    with open(DEVICES_FILE, "rb") as f:
        return tomllib.load(f)


def device_names() -> list[str]:
    return [*load_devices(), "cpu"]


def get_device(name: str) -> Device:
    if name == "cpu":
        return probe_cpu()
    table = load_devices()
    if name not in table:
        raise DeviceError(f"unknown device '{name}' (known: {', '.join(device_names())})")
    d = table[name]
    return Device(name, d["label"], {k: float(v) for k, v in d["flops"].items()}, float(d["vector_flops"]),
                  float(d["bandwidth"]), float(d.get("memory", 0)) or None, d["source"])


QUIET_SHARE = 0.8  # a single-threaded copy that gets less than this share of a core ran beside other work
PROBE_ROUNDS = 4   # rounds a probe takes while the machine looks busy, keeping the best of them


def _cpu_time() -> float:
    """This process's CPU time (a function of its own so that a test can stand in for a busy machine)."""
    return time.process_time()


def probe_cpu(n: int = 1024, copy_mib: int = 64, repeats: int = 3, rounds: int = PROBE_ROUNDS) -> Device:
    """This machine's CPU: the best of a few float32 matmuls (numpy's BLAS, all threads) and
    array copies. Takes well under a second on a quiet machine. Whether it was quiet is checked, not
    assumed: the copies run on one thread, so their CPU time over wall time is the share of a core the
    probe got (the load average, kept with the probe, counts this process too, so it is shown, not
    judged); below QUIET_SHARE it probes again,
    up to ``rounds`` rounds a fifth of a second apart, keeping the best figures, and a probe still busy
    says why in ``busy`` (runtime/report/calibration.py keeps no busy probe). The result is used for
    every dtype."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    src = np.ones(copy_mib * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    a @ b  # warm up the BLAS threads
    np.copyto(dst, src)
    best_mm = best_copy = float("inf")
    cpus = os.cpu_count() or 1
    busy = ""
    for r in range(max(1, rounds)):
        if r:
            time.sleep(0.2)
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best_mm = min(best_mm, time.perf_counter() - t)
        wall = cpu = 0.0
        for _ in range(repeats):
            t, c = time.perf_counter(), _cpu_time()
            np.copyto(dst, src)
            dt, dc = time.perf_counter() - t, _cpu_time() - c
            best_copy, wall, cpu = min(best_copy, dt), wall + dt, cpu + dc
        share = cpu / wall if wall > 0 else 1.0
        busy = f"the probe's copies got {share:.2f} of a core" if share < QUIET_SHARE else ""
        if not busy:
            break
    flops = 2 * n**3 / best_mm
    bandwidth = 2 * src.nbytes / best_copy  # read and write
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = None
    load = load_average()
    at_load = f" at load {load:.2f} (1-minute average, {cpus} CPUs)" if load is not None else ""
    state = f"; busy after {rounds} rounds ({busy})" if busy else f"; quiet (the copies got {share:.2f} of a core)"
    return Device("cpu", f"this machine's CPU ({cpus} threads), measured", {k: flops for k in
                  ("fp32", "tf32", "fp16", "bf16")}, flops, bandwidth, memory,
                  f"measured on the spot{at_load}: best of {repeats} float32 {n}x{n} numpy matmuls and "
                  f"{copy_mib} MiB copies{state} (fp16/bf16 use the float32 figures)", measured=True, busy=busy)


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the platform has none): how busy it was
    when a probe ran, kept with the probe."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


# ------------------------------------------------------------------ per-op traffic
def _traffic(graph: Graph, node, weight_bytes: int, act_bytes: int, size, rows_gathered) -> float:
    """Bytes an op reads and writes: each distinct input once, then its outputs.
    A gather reads only the rows it takes (`rows_gathered` elements), not the whole table."""
    total = 0.0
    for v in dict.fromkeys(node.inputs):
        val = graph.values[v]
        if val.kind == "param":
            if node.op == "embedding":
                total += rows_gathered(node) * weight_bytes
            else:
                total += math.prod(graph.params[v].shape) * weight_bytes
        elif val.kind == "const":
            total += graph.consts[v].size * act_bytes
        else:
            total += size(v)
    for o in node.outputs:
        total += size(o)
    return total


@dataclass
class OpRow:
    name: str          # node name with layer numbers replaced by * (one row per repeated op)
    op: str
    count: int
    flops: int
    bytes: int
    seconds: float
    matmul: bool

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=[./]|$)", ".*", name)


def _time(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    return max(flops / peak, nbytes / bandwidth)


@dataclass
class Roofline:
    device: Device
    dtype: str
    prefill_unfused: float
    prefill_fused: float
    decode: float | None       # seconds per decoding step (one token per sequence)
    ops: list[OpRow]           # the graph as written (unfused), grouped by repeated op
    fused_attention: OpRow | None
    decode_symbol: str | None
    # (FLOPs, bytes moved) of each phase: "prefill_unfused", "prefill_fused", "decode" (what a measured
    # time is divided by to give the achieved FLOP/s and bandwidth, runtime/report/measure.py)
    work: dict[str, tuple[float, float]] | None = None

    def ridge(self, matmul: bool = True) -> float:
        return self.device.peak(self.dtype, matmul) / self.device.bandwidth

    def bound(self, row: OpRow) -> str:
        return "compute" if row.intensity >= self.ridge(row.matmul) else "memory"


def roofline(graph: Graph, st: Structure, costs: list[NodeCost], bindings: dict[str, int], dtype: str,
             act_bytes: int, weight_bytes: int, device: Device) -> Roofline:
    by_name = {c.node: c for c in costs}
    bw = device.bandwidth

    size = Sizer(graph, act_bytes, bindings)
    elements = Sizer(graph, 1, bindings)

    def gathered(node):
        return elements(node.outputs[0])

    def ev(p: Poly, b=bindings) -> float:
        return float(p.evaluate(b))

    memo: dict[int, float] = {}  # nodes repeated across layers share their flops dicts

    def flops_at(flops: dict[str, Poly]) -> float:
        v = memo.get(id(flops))
        if v is None:
            v = memo[id(flops)] = ev(Poly.sum(flops.values()))
        return v

    # ---------------------------------------------------------- prefill, as written
    groups: dict[tuple[str, str], OpRow] = {}
    per_node: dict[str, tuple[float, float, float]] = {}
    for n in graph.nodes.values():
        if n.op in ALIAS_OPS:
            continue
        c = by_name[n.name]
        f = flops_at(c.flops)
        m = _traffic(graph, n, weight_bytes, act_bytes, size, gathered)
        is_mm = n.op in MATMUL_OPS
        t = _time(f, m, device.peak(dtype, is_mm), bw)
        per_node[n.name] = (f, m, t)
        key = (_pattern(n.name), n.op)
        row = groups.get(key)
        if row is None:
            groups[key] = OpRow(key[0], n.op, 1, int(f), int(m), t, is_mm)
        else:
            row.count += 1
            row.flops += int(f)
            row.bytes += int(m)
            row.seconds += t
    prefill_unfused = sum(t for _, _, t in per_node.values())
    work = {"prefill_unfused": (sum(f for f, _, _ in per_node.values()), sum(m for _, m, _ in per_node.values()))}

    # ---------------------------------------------------------- prefill, attention fused
    cores = [a for a in st.attention if a.value is not None and (a.fused or a.fusable)]
    absorbed = {n for a in cores for n in (*a.core_nodes, *a.layout)}
    prefill_fused = sum(t for name, (_, _, t) in per_node.items() if name not in absorbed)
    kept = [v for name, v in per_node.items() if name not in absorbed]
    fused_flops, fused_bytes = sum(f for f, _, _ in kept), sum(m for _, m, _ in kept)
    fused_row = None
    for a in cores:
        f = sum(flops_at(by_name[n].flops_causal) for n in a.core_nodes)
        out = graph.nodes[a.value].outputs[0]
        m = size(a.q) + size(a.k) + size(a.v) + size(out)
        t = _time(f, m, device.peak(dtype, True), bw)
        prefill_fused += t
        fused_flops += f
        fused_bytes += m
        if fused_row is None:
            fused_row = OpRow(_pattern(graph.nodes[a.score].scope or a.score) + "/fused_attention",
                              "fused_attention", 0, 0, 0, 0.0, True)
        fused_row.count += 1
        fused_row.flops += int(f)
        fused_row.bytes += int(m)
        fused_row.seconds += t

    # ---------------------------------------------------------- one decoding step
    work["prefill_fused"] = (fused_flops, fused_bytes)
    decode, sym, decode_work = _decode(graph, st, costs, bindings, dtype, act_bytes, weight_bytes, device)
    if decode_work is not None:
        work["decode"] = decode_work
    ops = list(groups.values())
    return Roofline(device, dtype, prefill_unfused, prefill_fused, decode, ops, fused_row, sym, work)


def decode_symbol(st: Structure) -> str | None:
    """The sequence symbol that grows by one per generated token: the query length of causal attention."""
    for a in st.attention:
        syms = getattr(a.tq, "free_symbols", set())
        if a.causal and len(syms) == 1:
            return str(next(iter(syms)))
    return None


def _decode(graph, st, costs, bindings, dtype, act_bytes, weight_bytes, device):
    """Cost of extending every sequence by one token with a KV cache: each op's causal cost at
    N+1 minus at N (so a new query row against N+1 keys), plus every weight read once and the
    whole cached K and V read by the attention matmuls."""
    sym = decode_symbol(st)
    if sym is None:
        return None, None, None
    b0 = dict(bindings)
    b1 = dict(bindings)
    b1[sym] = bindings[sym] + 1
    rows = {}
    for a in st.attention:
        out = graph.type_of(graph.nodes[a.score].outputs[0])
        rows[a.score] = numel(out.shape[:-2]) * score_pairs(a) * act_bytes
    internal = {v: a for a in st.attention for v in a.internal}
    cache_operand = {}
    for a in st.attention:
        if a.fused and (a.causal or a.cross):
            cache_operand[(a.score, a.k)] = a.k
            cache_operand[(a.score, a.v)] = a.v
        elif a.causal or a.cross:
            cache_operand[(a.score, graph.nodes[a.score].inputs[1])] = a.k
            if a.value:
                cache_operand[(a.value, graph.nodes[a.value].inputs[1])] = a.v

    s0, s1 = Sizer(graph, act_bytes, b0), Sizer(graph, act_bytes, b1)
    e0, e1 = Sizer(graph, 1, b0), Sizer(graph, 1, b1)

    def delta(v) -> float:
        """Growth of a tensor when the sequence grows by one (causal score rows for N x N values)."""
        a = internal.get(v)
        if a is not None:
            p = rows[a.score]
            return float(p.evaluate(b1) - p.evaluate(b0))
        return float(s1(v) - s0(v))

    total = flops = moved = 0.0
    memo: dict[int, float] = {}
    by_name = {c.node: c for c in costs}
    layout = {x for a in st.attention for x in a.layout}
    for n in graph.nodes.values():
        if n.op in ALIAS_OPS or n.name in layout:
            continue
        fc = by_name[n.name].flops_causal
        f = memo.get(id(fc))
        if f is None:
            fp = Poly.sum(fc.values())
            f = memo[id(fc)] = float(fp.evaluate(b1) - fp.evaluate(b0)) if fp.symbols else 0.0
        m = 0.0
        for v in dict.fromkeys(n.inputs):
            val = graph.values[v]
            if val.kind == "param":
                m += (e1(n.outputs[0]) - e0(n.outputs[0]) if n.op == "embedding"
                      else math.prod(graph.params[v].shape)) * weight_bytes
            elif val.kind == "const":
                m += graph.consts[v].size * act_bytes
            elif (n.name, v) in cache_operand:
                m += s1(cache_operand[(n.name, v)])
            else:
                m += delta(v)
        for o in n.outputs:
            m += delta(o)
        if f == 0 and m == 0:
            continue
        total += _time(f, m, device.peak(dtype, n.op in MATMUL_OPS), device.bandwidth)
        flops += f
        moved += m
    return total, sym, (flops, moved)
