"""The deployment sections of the cost report: ``parallel``, ``memory.training.per_device``,
``serving`` and the ``sweep`` rows (docs/report.md, "Parallel splits, training, serving").

The rules live in plan.py (what may be asked), parallel.py (where parameters and caches go,
what is sent), training.py (ZeRO states, Korthikanti activations) and capacity.py (the
largest batch); this module binds them to a report's Context (its graph, B, N and dtype)
and turns their polynomials into numbers and formulas, as costreport.py does for the rest.
"""

from __future__ import annotations

from tessera.compiler.analysis import capacity, cost, memory, parallel, roofline, training
from tessera.compiler.analysis.context import Context
from tessera.compiler.analysis.plan import Plan, PlanError, check, model_shape
from tessera.compiler.analysis.poly import Poly
from tessera.compiler.ir.graph import Graph


class Deployment:
    """The plan checked against the graph, and the split every deployment figure starts from."""

    def __init__(self, ctx: Context, plan: Plan):
        self.plan = plan
        self.shape = model_shape(ctx.graph, ctx.st)
        check(plan, self.shape)
        self.split = parallel.split(ctx.graph, ctx.st, self.shape, plan, ctx.bytes, ctx.kv_bytes)
        self.params = max(self.split.params)
        self.b = Poly.symbol("B") if ctx.batch_symbol else Poly.const(1)
        self.s = Poly.symbol(ctx.seq_symbols[0]) if ctx.seq_symbols else Poly.const(ctx.tokens_per_sequence)

    def train_activations(self, ctx: Context, fused: bool) -> Poly:
        return training.activations(self.shape, self.plan, self.split.layers, self.split.moe_layers,
                                    self.b, self.s, ctx.bytes, fused, ctx.bindings)


def parallel_section(ctx: Context, dep: Deployment) -> dict:
    plan = dep.plan
    kv = max(dep.split.kv_cache, key=ctx.value)
    if plan.train:
        act = {f: dep.train_activations(ctx, f) for f in (False, True)}
    else:
        act = {f: memory.peak_activations(ctx.graph, ctx.st, ctx.bindings, ctx.bytes, fused=f).live / plan.tp
               for f in (False, True)}
    comm = parallel.comm_bytes(dep.split, dep.shape, plan, dep.b, dep.s, ctx.bytes, dep.params)
    return {
        "plan": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "ep": plan.ep, "devices": plan.devices,
                 "layers_per_stage": dep.split.layers},
        "per_device": {
            "params": dep.params,
            "weights_bytes": dep.params * ctx.bytes,
            "kv_cache_bytes": ctx.value(kv),
            "activations_bytes": ctx.value(act[False]),
            "activations_bytes_fused": ctx.value(act[True]),
        },
        "comm_bytes_per_step": {k: ctx.value(v) for k, v in comm.items()},
        "formulas": {
            "per_device.kv_cache_bytes": ctx.formula(kv),
            "per_device.activations_bytes": ctx.formula(act[False]),
            "per_device.activations_bytes_fused": ctx.formula(act[True]),
            **{f"comm_bytes_per_step.{k}": ctx.formula(v) for k, v in comm.items()},
        },
    }


def training_per_device(ctx: Context, dep: Deployment) -> dict:
    st = training.states(dep.params, dep.plan, ctx.bytes)
    act = {f: dep.train_activations(ctx, f) for f in (False, True)}
    total = {f: act[f] + st.total for f in act}
    return {
        "zero": dep.plan.zero, "recompute": dep.plan.recompute,
        "weights": st.weights, "gradients": st.gradients, "optimizer": st.optimizer,
        "master_weights": st.master_weights,
        "activations": ctx.value(act[False]), "activations_fused": ctx.value(act[True]),
        "total": ctx.value(total[False]), "total_fused": ctx.value(total[True]),
        "formulas": {"activations": ctx.formula(act[False]), "activations_fused": ctx.formula(act[True]),
                     "total": ctx.formula(total[False]), "total_fused": ctx.formula(total[True])},
    }


def serving_section(ctx: Context, dep: Deployment, device: roofline.Device) -> dict:
    plan, n = dep.plan, dep.plan.context
    if not device.memory:
        raise PlanError(f"--serve: the memory of device {device.name} is not known")
    one = {s: n for s in ctx.seq_symbols}
    if ctx.batch_symbol:
        one["B"] = 1
    kv_seq = int(max(p.evaluate(one) for p in dep.split.kv_cache))
    step = dict(one) | {s: 1 for s in ctx.seq_symbols}
    act_seq = -(-memory.peak_activations(ctx.graph, ctx.st, step, ctx.bytes, fused=True).bytes // plan.tp)
    weights = dep.params * ctx.bytes
    cap = capacity.capacity(device.memory, plan.headroom, weights, kv_seq, act_seq)
    ttft = roofline.roofline(ctx.graph, ctx.st, ctx.costs, one, ctx.dtype, ctx.bytes, ctx.bytes,
                             device).prefill_fused / plan.tp
    decode_s = None
    if cap.max_batch and ctx.batch_symbol:
        at = dict(one) | {"B": cap.max_batch}
        d = roofline.roofline(ctx.graph, ctx.st, ctx.costs, at, ctx.dtype, ctx.bytes, ctx.bytes, device).decode
        decode_s = d / plan.tp if d else None
    return {
        "context": n, "device": device.name, "device_memory": device.memory, "headroom": plan.headroom,
        "weights_bytes": weights, "kv_cache_bytes_per_sequence": kv_seq,
        **({"kv_cache_bytes_per_element": ctx.kv_bytes,
            "note": f"the KV cache counted at {ctx.kv_bytes} bytes per element (--kv-cache-dtype); the decode "
                    f"step's roofline still reads it at {ctx.bytes}"} if ctx.kv_bytes != ctx.bytes else {}),
        "activations_bytes_per_sequence": act_seq, "usable_bytes": cap.usable_bytes,
        "max_batch": cap.max_batch,
        "decode_step_s": decode_s,
        "decode_tokens_per_s": cap.max_batch / decode_s if decode_s else None,
        "decode_tokens_per_s_per_sequence": 1 / decode_s if decode_s else None,
        "ttft_s": ttft,
    }


def add_sections(rep: dict, ctx: Context, dep: Deployment, device: roofline.Device | None) -> None:
    rep["parallel"] = parallel_section(ctx, dep)
    if dep.plan.train:
        rep["memory"]["training"]["per_device"] = training_per_device(ctx, dep)
    if dep.plan.serve:
        if device is None:
            raise PlanError("--serve needs a device")
        rep["serving"] = serving_section(ctx, dep, device)


def sweep_rows(graph: Graph, batches: list[int], seqs: list[int], dtype: str = "fp32",
               device: roofline.Device | None = None, plan: Plan | None = None,
               kv_cache_dtype: str = "auto") -> list[dict]:
    """One row per (B, N) combination, batch-major: the headline figures of the report, and of the
    plan's split and training where a plan is given (``sweep`` in the JSON)."""
    first = Context(graph, batches[0], seqs[0], dtype, kv_cache_dtype=kv_cache_dtype)
    analysed = (first.costs, first.st)
    total, flops = cost.total(first.costs), sum(cost.flops_by_category(first.costs).values(), Poly())
    kv = memory.kv_cache(graph, first.st, first.kv_bytes).bytes
    rows = []
    for b in batches:
        for n in seqs:
            ctx = Context(graph, b, n, dtype, analysed, kv_cache_dtype)
            row = {"batch": b, "seq": n, "macs_total": ctx.value(total), "flops_total": ctx.value(flops),
                   "kv_cache_bytes": ctx.value(kv),
                   "activations_peak_bytes_fused": memory.peak_activations(graph, ctx.st, ctx.bindings, ctx.bytes,
                                                                           fused=True).bytes}
            if device is not None:
                r = roofline.roofline(graph, ctx.st, ctx.costs, ctx.bindings, dtype, ctx.bytes, ctx.bytes, device)
                row["prefill_seconds_fused"] = r.prefill_fused
                row["decode_seconds_per_token"] = r.decode
            if plan is not None and (plan.parallel or plan.train):
                dep = Deployment(ctx, plan)
                par = parallel_section(ctx, dep)
                row.update({f"per_device_{k}": par["per_device"][k]
                            for k in ("weights_bytes", "kv_cache_bytes", "activations_bytes")})
                row["comm_bytes_per_step"] = par["comm_bytes_per_step"]["total"]
                if plan.train:
                    row["training_per_device_total"] = training_per_device(ctx, dep)["total"]
            rows.append(row)
    return rows


def plan_of(rep: dict) -> Plan | None:
    """The split and training plan a report was built with (from its ``parallel`` and
    ``memory.training.per_device`` entries), or None without one; serving is left out."""
    par = rep.get("parallel")
    if par is None:
        return None
    p, tr = par["plan"], rep["memory"]["training"].get("per_device")
    return Plan(tp=p["tp"], pp=p["pp"], dp=p["dp"], ep=p["ep"], train=tr is not None,
                zero=tr["zero"] if tr else 0, recompute=tr["recompute"] if tr else "none")


def device_of(rep: dict) -> roofline.Device | None:
    """The roofline device a report used, rebuilt from its ``roofline.device`` entry (the CPU is not re-probed)."""
    r = rep.get("roofline")
    if not r:
        return None
    d = r["device"]
    return roofline.Device(d["name"], d["label"], {rep["settings"]["dtype"]: d["peak_flops"]}, d["vector_flops"],
                           d["bandwidth"], d["memory"], d["source"], d["measured"])


def curves(graph: Graph, rep: dict, seqs: list[int]) -> dict[str, list]:
    """Against N at the report's B, for --plot: the largest device's memory under the report's plan
    (training total with --train, else weights + KV cache + activations) and the roofline times of
    one device (prefill with attention fused, one decoding step), divided by T under a split."""
    s, plan, device = rep["settings"], plan_of(rep), device_of(rep)
    rows = sweep_rows(graph, [s["batch"]], seqs, s["dtype"], device, plan)
    tp = plan.tp if plan else 1
    out: dict[str, list] = {"seq": seqs, "device_memory": [], "prefill_seconds": [], "decode_seconds": []}
    for r in rows:
        if plan is not None:
            out["device_memory"].append(r["training_per_device_total"] if plan.train else
                                        r["per_device_weights_bytes"] + r["per_device_kv_cache_bytes"]
                                        + r["per_device_activations_bytes"])
        if device is not None:
            out["prefill_seconds"].append(r["prefill_seconds_fused"] / tp)
            d = r["decode_seconds_per_token"]
            out["decode_seconds"].append(d / tp if d is not None else None)
    return out
