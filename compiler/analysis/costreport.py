"""The static cost report of a graph as one JSON-able dict (documented in docs/report.md).

Everything is computed symbolically in the graph's own symbols, then shown two
ways: numbers at the requested batch B and sequence length N, and formulas in
B and N. The symbol named ``B`` is the batch; every other symbol (``T``, ``S``
for an encoder, ``N``...) is a sequence length and is bound to N, so a formula
like ``B·(a·N + b·N²)`` treats the source and target of an encoder-decoder as
equally long. No weights are allocated: only shapes are read.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tessera.compiler.analysis import cost, deployment, memory, roofline
from tessera.compiler.analysis.context import DTYPES, Context
from tessera.compiler.analysis.plan import Plan
from tessera.compiler.analysis.params import parameter_report
from tessera.compiler.ir.graph import Graph
from tessera.compiler.analysis.poly import Poly

SCHEMA = 1


def crossover(ctx: Context, quad: Poly, rest: Poly) -> float | None:
    """The sequence length N above which `quad` (the N² part) exceeds `rest`, per sequence (B = 1)."""
    if not ctx.seq_symbols:
        return None
    bind = {"B": 1} if ctx.batch_symbol else {}
    diff = (ctx.named(quad) - ctx.named(rest)).partial(bind)
    if diff.symbols - {"N"} or diff.degree("N") < 2:
        return None
    coeffs = diff.coefficients("N")
    deg = max(coeffs)
    poly = [float(coeffs.get(p, Poly()).evaluate({})) for p in range(deg, -1, -1)]
    if poly[0] <= 0:
        return None
    roots = [r.real for r in np.roots(poly) if abs(r.imag) < 1e-9 * max(1.0, abs(r.real)) and r.real > 0]
    return round(float(max(roots)), 2) if roots else 0.0


# ------------------------------------------------------------------ sections
def macs_section(ctx: Context) -> dict:
    c = ctx.costs
    total = cost.total(c)
    causal = cost.total(c, "macs_causal")
    weights = cost.total(c, kinds={"dense"})
    attention = cost.total(c, kinds={"attention"})
    attention_c = cost.total(c, "macs_causal", kinds={"attention"})
    head = cost.total(c, kinds={"head"})
    figures = {
        "total": total, "causal": causal, "without_head": total - head, "causal_without_head": causal - head,
        "weights": weights, "attention": attention, "attention_causal": attention_c, "head": head,
    }
    out = {k: ctx.value(v) for k, v in figures.items()}
    out["per_token"] = ctx.per_token_value(total)
    out["causal_per_token"] = ctx.per_token_value(causal)
    formulas = {k: ctx.formula(v) for k, v in figures.items()}
    formulas["per_token"] = ctx.per_token_formula(total)
    formulas["causal_per_token"] = ctx.per_token_formula(causal)
    # mixture of experts: what a sparse implementation would run
    active = total
    by_node = {nc.node: nc for nc in c}
    for e in ctx.st.experts:
        if e.sparse:  # a sparse_moe node already counts the active experts only
            continue
        branch = Poly.sum(by_node[n].macs for b in e.branches for n in b)
        active = active - branch * Fraction(e.count - e.top, e.count)
    out["active"] = ctx.value(active)
    out["active_per_token"] = ctx.per_token_value(active)
    formulas["active"] = ctx.formula(active)
    formulas["active_per_token"] = ctx.per_token_formula(active)
    # per layer
    parts: dict[str, dict[str, list[Poly]]] = {}
    for nc in c:
        if nc.layer is None or nc.macs.is_zero():
            continue
        d = parts.setdefault(nc.layer, {"total": [], "weights": [], "attention": [], "attention_causal": []})
        d["total"].append(nc.macs)
        if nc.split is not None:  # a scan: weights and attention in its step
            d["weights"] += [m for k, (m, _) in nc.split.items() if k == "dense"]
            d["attention"] += [m for k, (m, _) in nc.split.items() if k == "attention"]
            d["attention_causal"] += [mc for k, (_, mc) in nc.split.items() if k == "attention"]
        elif nc.kind == "dense":
            d["weights"].append(nc.macs)
        elif nc.kind == "attention":
            d["attention"].append(nc.macs)
            d["attention_causal"].append(nc.macs_causal)
    layers = {k: {f: Poly.sum(ps) for f, ps in d.items()} for k, d in parts.items()}
    out["per_layer"] = {k: {f: ctx.value(p) for f, p in d.items()} for k, d in layers.items()}
    if layers:
        first = next(iter(layers))
        formulas["one_layer"] = ctx.formula(layers[first]["total"])
    out["crossover_seq"] = crossover(ctx, attention, total - attention)
    out["crossover_seq_causal"] = crossover(ctx, attention_c, causal - attention_c)
    uncounted = sorted({f"{nc.op}" for nc in c if nc.kind == "uncounted"})
    out["uncounted_ops"] = [{"op": op, "nodes": [nc.node for nc in c if nc.op == op]} for op in uncounted]
    out["formulas"] = formulas
    return out


def flops_section(ctx: Context) -> dict:
    full = cost.flops_by_category(ctx.costs)
    causal = cost.flops_by_category(ctx.costs, causal=True)
    total = sum(full.values(), Poly())
    total_c = sum(causal.values(), Poly())
    other = {k: v for k, v in full.items() if k != "matmul"}
    out = {
        "total": ctx.value(total),
        "causal": ctx.value(total_c),
        "matmul": ctx.value(full.get("matmul", Poly())),
        "itemised": {k: ctx.value(v) for k, v in other.items()},
        "per_token": ctx.per_token_value(total),
        "formulas": {"total": ctx.formula(total), "causal": ctx.formula(total_c),
                     "matmul": ctx.formula(full.get("matmul", Poly())),
                     "per_token": ctx.per_token_formula(total),
                     **{f"itemised.{k}": ctx.formula(v) for k, v in other.items()}},
    }
    return out


def memory_section(ctx: Context) -> dict:
    g, st, b = ctx.graph, ctx.st, ctx.bytes
    kv = memory.kv_cache(g, st, ctx.kv_bytes)  # at --kv-cache-dtype's bytes where given
    peak_u = memory.peak_activations(g, st, ctx.bindings, b, fused=False)
    peak_f = memory.peak_activations(g, st, ctx.bindings, b, fused=True)
    tr = memory.training_memory(g, st, ctx.dtype)
    weights = memory.weights_bytes(g, b)
    train_u = tr.activations + tr.states
    train_f = tr.activations_fused + tr.states
    return {
        "weights_bytes": weights,
        "weights_bytes_by_dtype": {k: memory.weights_bytes(g, v) for k, v in DTYPES.items()},
        "constants_bytes": memory.constants_bytes(g),
        "kv_cache_bytes": ctx.value(kv.bytes),
        "kv_cache_bytes_per_token": ctx.per_token_value(kv.bytes),
        "kv_cache_attentions": kv.attentions,
        "activations_peak_bytes": {"unfused": peak_u.bytes, "fused": peak_f.bytes},
        "activations_peak_at": {"unfused": peak_u.node, "fused": peak_f.node},
        "training": {
            "weights": tr.weights, "gradients": tr.gradients, "optimizer": tr.optimizer,
            "master_weights": tr.master_weights,
            "activations": ctx.value(tr.activations), "activations_fused": ctx.value(tr.activations_fused),
            "total": ctx.value(train_u), "total_fused": ctx.value(train_f),
        },
        "formulas": {
            "kv_cache_bytes": ctx.formula(kv.bytes),
            "kv_cache_bytes_per_token": ctx.per_token_formula(kv.bytes),
            "activations_peak_bytes.unfused": ctx.formula(peak_u.live),
            "activations_peak_bytes.fused": ctx.formula(peak_f.live),
            "training.activations": ctx.formula(tr.activations),
            "training.activations_fused": ctx.formula(tr.activations_fused),
            "training.total": ctx.formula(train_u),
            "training.total_fused": ctx.formula(train_f),
        },
    }


def roofline_section(ctx: Context, device: roofline.Device) -> dict:
    """The roofline on ``device``, with ``work``, each phase's FLOPs and bytes moved (what --measure
    divides by a measured time, and --calibrated matches recorded points by; build_report keeps it
    only when asked)."""
    r = roofline.roofline(ctx.graph, ctx.st, ctx.costs, ctx.bindings, ctx.dtype, ctx.bytes, ctx.bytes, device)

    def row(o: roofline.OpRow) -> dict:
        return {"name": o.name, "op": o.op, "count": o.count, "flops": o.flops, "bytes": o.bytes,
                "intensity": round(o.intensity, 3), "bound": r.bound(o), "seconds": o.seconds}

    d = device
    batch = ctx.batch if ctx.batch_symbol else 1
    section = {
        "device": {"name": d.name, "label": d.label, "peak_flops": d.flops[ctx.dtype],
                   "vector_flops": d.vector_flops, "bandwidth": d.bandwidth, "memory": d.memory,
                   "source": d.source, "measured": d.measured},
        "ridge_intensity": round(r.ridge(True), 3),
        "prefill_seconds": {"unfused": r.prefill_unfused, "fused": r.prefill_fused},
        "decode_seconds_per_token": r.decode,
        "decode_tokens_per_second": (batch / r.decode) if r.decode else None,
        "decode_symbol": r.decode_symbol,
        "ops": [row(o) for o in r.ops],
        "fused_attention": row(r.fused_attention) if r.fused_attention else None,
    }
    section["work"] = {k: {"flops": f, "bytes": m} for k, (f, m) in (r.work or {}).items()}
    return section


def _notes(ctx: Context, rep: dict) -> list[str]:
    g, st = ctx.graph, ctx.st
    notes = []
    for p, users in rep["params"]["tied"].items():
        notes.append(f"tied: {p} is shared by {', '.join(users)} (counted once)")
    moe = rep["params"]["moe"]
    if moe and moe["dense_in_graph"]:
        notes.append(
            f"mixture of experts: the graph computes all {moe['experts']} experts for every token (dense), "
            f"and macs.total counts them all; a sparse implementation runs the top {moe['top']}: "
            f"params.active_per_token and macs.active_per_token are what it would use")
    elif moe:
        notes.append(
            f"mixture of experts: sparse: each token runs its top {moe['top']} of {moe['experts']} experts, "
            f"and macs.total counts those only (--no-sparse-moe: the dense form, all {moe['experts']})")
    if moe:
        if moe["branches_found"] != moe["experts"]:
            notes.append(f"mixture of experts: found {moe['branches_found']} expert branches for "
                         f"{moe['experts']} gates; active figures may be off")
    if len(ctx.seq_symbols) > 1:
        notes.append(f"sequence symbols {', '.join(ctx.seq_symbols)} are all bound to N = {ctx.seq}")
    if not ctx.seq_symbols:
        notes.append(f"no sequence symbol: the graph always processes {ctx.tokens_per_sequence} tokens, "
                     f"so --seq has no effect")
    if not ctx.batch_symbol:
        notes.append("no batch symbol B: figures are for one sequence, and --batch has no effect")
    if any(a.window for a in st.attention):
        notes.append("sliding-window attention: causal figures assume N >= window")
    if st.attention and not any(a.causal or a.cross for a in st.attention):
        notes.append("no causal or cross-attention: the model does not decode, so it keeps no KV cache")
    for n in g.nodes.values():
        if n.op == "embedding":
            ids = g.values[n.inputs[0]].producer
            if ids and g.nodes[ids].op == "arange":
                rows = g.type_of(n.inputs[1]).shape[0]
                if ctx.seq_symbols and int(rows) < ctx.seq:
                    notes.append(f"N = {ctx.seq} is longer than the {int(rows)} positions of {n.inputs[1]}: "
                                 f"the graph cannot run at this length (figures are extrapolated)")
    if rep["macs"]["uncounted_ops"]:
        ops = ", ".join(u["op"] for u in rep["macs"]["uncounted_ops"])
        notes.append(f"uncounted ops (no cost rule, counted as 0): {ops}")
    roof = rep.get("roofline")
    if roof and roof["device"]["memory"]:
        need = rep["memory"]["weights_bytes"] + rep["memory"]["kv_cache_bytes"]
        if need > roof["device"]["memory"]:
            notes.append(f"weights and KV cache ({need / 1e9:.1f} GB) do not fit in the "
                         f"{roof['device']['memory'] / 1e9:.0f} GB of {roof['device']['name']}")
    return notes


def build_report(graph: Graph, model: str, variant: str | None, hyperparams: dict, *, batch: int = 1,
                 seq: int = 1024, dtype: str = "fp32", device: roofline.Device | None = None,
                 plan: Plan | None = None, phase_work: bool = False, kv_cache_dtype: str = "auto") -> dict:
    """The report; with a ``plan`` (checked first: PlanError) also ``parallel``,
    ``memory.training.per_device`` (--train) and ``serving`` (--serve, on ``device``); ``phase_work``:
    ``roofline.work`` (--measure, --calibrated)."""
    ctx = Context(graph, batch, seq, dtype, kv_cache_dtype=kv_cache_dtype)
    dep = deployment.Deployment(ctx, plan) if plan is not None else None  # checks the plan first
    rep = {
        "schema": SCHEMA,
        "model": model,
        "variant": variant,
        "hyperparams": hyperparams,
        "settings": {
            "batch": ctx.batch, "seq": ctx.seq, "dtype": dtype, "bytes_per_element": ctx.bytes,
            "batch_symbol": ctx.batch_symbol, "sequence_symbols": ctx.seq_symbols,
            "bindings": dict(ctx.bindings), "tokens_per_sequence": ctx.tokens_per_sequence,
            "tokens": ctx.tokens,
            **({"kv_cache_bytes_per_element": ctx.kv_bytes} if ctx.kv_bytes != ctx.bytes else {}),
        },
        "params": parameter_report(graph, ctx.st),
        "macs": macs_section(ctx),
        "flops": flops_section(ctx),
        "memory": memory_section(ctx),
        "roofline": roofline_section(ctx, device) if device else None,
    }
    if rep["roofline"] and not phase_work:
        del rep["roofline"]["work"]
    if dep is not None:
        deployment.add_sections(rep, ctx, dep, device)
    rep["notes"] = _notes(ctx, rep)
    return rep


def sweep(graph: Graph, seqs: list[int], batch: int = 1, dtype: str = "fp32") -> dict[str, list]:
    """MACs and memory at several sequence lengths, for the --plot figure."""
    ctx = Context(graph, batch, seqs[0], dtype)
    total = cost.total(ctx.costs)
    causal = cost.total(ctx.costs, "macs_causal")
    att = cost.total(ctx.costs, kinds={"attention"})
    att_c = cost.total(ctx.costs, "macs_causal", kinds={"attention"})
    kv = memory.kv_cache(graph, ctx.st, ctx.bytes).bytes
    out = {"seq": [], "macs_unfused": [], "macs_fused": [], "attention_unfused": [], "attention_fused": [],
           "peak_unfused": [], "peak_fused": [], "kv_cache": []}
    for n in seqs:
        b = {s: n for s in ctx.seq_symbols}
        if ctx.batch_symbol:
            b["B"] = batch
        out["seq"].append(n)
        out["macs_unfused"].append(int(total.evaluate(b)))
        out["macs_fused"].append(int(causal.evaluate(b)))
        out["attention_unfused"].append(int(att.evaluate(b)))
        out["attention_fused"].append(int(att_c.evaluate(b)))
        out["peak_unfused"].append(memory.peak_activations(graph, ctx.st, b, ctx.bytes, fused=False).bytes)
        out["peak_fused"].append(memory.peak_activations(graph, ctx.st, b, ctx.bytes, fused=True).bytes)
        out["kv_cache"].append(int(kv.evaluate(b)))
    return out


__all__ = ["build_report", "sweep", "Context", "SCHEMA", "DTYPES"]
