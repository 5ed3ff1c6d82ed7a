"""The deployment sections of the cost report: ``parallel``, ``memory.training.per_device``,
``serving`` and the ``sweep`` rows (docs/report.md, "Parallel splits, training, serving").

The rules live in plan.py (what may be asked), parallel.py (where parameters and caches go,
what is sent), training.py (ZeRO states, Korthikanti activations) and capacity.py (the
largest batch); this module binds them to a report's Context (its graph, B, N and dtype)
and turns their polynomials into numbers and formulas, as costreport.py does for the rest.
"""

from __future__ import annotations

from tessera.compiler.analysis import capacity, cost, memory, parallel, roofline, training
from tessera.compiler.analysis.costreport import Context
from tessera.compiler.analysis.plan import Plan, PlanError, check, model_shape
from tessera.compiler.analysis.poly import Poly
from tessera.compiler.ir.graph import Graph


class Deployment:
    """The plan checked against the graph, and the split every deployment figure starts from."""

    def __init__(self, ctx: Context, plan: Plan):
        self.plan = plan
        self.shape = model_shape(ctx.graph, ctx.st)
        check(plan, self.shape)
        self.split = parallel.split(ctx.graph, ctx.st, self.shape, plan, ctx.bytes)
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
               device: roofline.Device | None = None, plan: Plan | None = None) -> list[dict]:
    """One row per (B, N) combination, batch-major: the headline figures of the report, and of the
    plan's split and training where a plan is given (``sweep`` in the JSON)."""
    first = Context(graph, batches[0], seqs[0], dtype)
    analysed = (first.costs, first.st)
    total, flops = cost.total(first.costs), sum(cost.flops_by_category(first.costs).values(), Poly())
    kv = memory.kv_cache(graph, first.st, first.bytes).bytes
    rows = []
    for b in batches:
        for n in seqs:
            ctx = Context(graph, b, n, dtype, analysed)
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
