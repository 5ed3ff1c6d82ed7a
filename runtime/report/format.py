"""Render a cost report (the dict of compiler/analysis/costreport.py) as a terminal table, Markdown or CSV.

All three show the same rows, built once by ``sections`` from the one registry ``SECTIONS`` (each
section's JSON keys, the module that computes them, its renderer): exact values with thousands
separators, a short SI form, and the formula in B and N where the figure depends on them. Sizes use
decimal units (1 MB = 10^6 bytes).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from typing import Callable

SI = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]


def si(x, unit: str = "") -> str:
    """145824153600 -> '145.82 G'; bytes get their unit: '75.50 MB'."""
    if x is None:
        return ""
    ax = abs(x)
    for scale, prefix in SI:
        if ax >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.4g} {unit}".rstrip() if isinstance(x, float) else f"{x} {unit}".rstrip()


def exact(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.2f}"
    return f"{x:,}"


def seconds(t: float | None) -> str:
    if t is None:
        return "n/a"
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    if t >= 1e-6:
        return f"{t * 1e6:.2f} µs"
    return f"{t * 1e9:.2f} ns"


def op_label(name: str, op: str) -> str:
    """A roofline row's node: ``layers.*.mlp.fc (linear)``, but ``layers.*.attn.sdpa/matmul_1`` alone when
    the name already says the op (``(matmul)`` after it only pushed the row past 100 columns)."""
    last = re.split(r"[./]", name)[-1]
    return name if re.fullmatch(rf"{re.escape(op)}(_\d+)?", last) else f"{name} ({op})"


def _site_names(names: list[str]) -> str:
    """Sites sharing a row, as --explain names them (``layers.{0-11}.attn.sdpa``), else first … last."""
    from tessera.compiler.passes.site_groups import compact_names

    compact = compact_names(names)
    return compact if "{" in compact else f"{names[0]} … {names[-1]}"


def title(rep: dict) -> str:
    s = rep["settings"]
    name = f"{rep['model']}{' (' + rep['variant'] + ')' if rep['variant'] else ''}"
    dev = rep["roofline"]["device"]["name"] if rep.get("roofline") else "none"
    return f"{name}: B={s['batch']}, N={s['seq']}, {s['dtype']}, device {dev}"


# ------------------------------------------------------------------ the rows, shared by every format
Rows = tuple[str, list[str], list[list[str]]]  # (section title, column names, rows); every cell a string


def _parameters(rep: dict) -> list[Rows]:
    p = rep["params"]
    total = p["total"] or 1
    rows = []
    for r in p["table"]:
        share = f"{100 * r['params'] / total:.1f}%" if r["kind"] in ("stack", "component", "total") else ""
        rows.append([r["label"], exact(r["params"]), share])
    if p["moe"]:
        moe = p["moe"]
        rows.append([f"active per token (top {moe['top']} of {moe['experts']} experts)",
                     exact(p["active_per_token"]), f"{100 * p['active_per_token'] / total:.1f}%"])
    for path, users in p["tied"].items():
        rows.append([f"tied: {path} shared by {', '.join(users)} (counted once)", "", ""])
    return [("Parameters", ["component", "parameters", "share"], rows)]


def _macs(rep: dict) -> list[Rows]:
    p, m = rep["params"], rep["macs"]
    fm = m["formulas"]
    rows = [
        ["total (full attention, head included)", exact(m["total"]), si(m["total"]), fm["total"]],
        ["  weights: projections, MLP (N·D²)", exact(m["weights"]), si(m["weights"]), fm["weights"]],
        ["  attention: scores, weighting (N²·D)", exact(m["attention"]), si(m["attention"]), fm["attention"]],
        ["  output head", exact(m["head"]), si(m["head"]), fm["head"]],
        ["causal mask exploited (N(N+1)/2 pairs)", exact(m["causal"]), si(m["causal"]), fm["causal"]],
        ["  attention, causal", exact(m["attention_causal"]), si(m["attention_causal"]), fm["attention_causal"]],
        ["without the head", exact(m["without_head"]), si(m["without_head"]), fm["without_head"]],
        ["per token", exact(m["per_token"]), si(m["per_token"]), fm["per_token"]],
        ["per token, causal", exact(m["causal_per_token"]), si(m["causal_per_token"]), fm["causal_per_token"]],
    ]
    if m["per_layer"]:
        first = next(iter(m["per_layer"]))
        v = m["per_layer"][first]["total"]
        rows.append([f"one layer ({first})", exact(v), si(v), fm.get("one_layer", "")])
    if p["moe"]:
        rows.append([f"active per token (sparse top {p['moe']['top']})", exact(m["active_per_token"]),
                     si(m["active_per_token"]), fm["active_per_token"]])
    if m["crossover_seq"] is not None:
        rows.append(["N² part overtakes the rest at N ≈", f"{m['crossover_seq']:,.0f}", "", ""])
    if m["crossover_seq_causal"] is not None:
        rows.append(["  with the causal mask exploited", f"{m['crossover_seq_causal']:,.0f}", "", ""])
    for u in m["uncounted_ops"]:
        rows.append([f"uncounted op {u['op']} (×{len(u['nodes'])})", "0", "", ""])
    return [("Multiply-adds (MACs), one forward pass", ["figure", "MACs", "≈", "formula"], rows)]



def _flops(rep: dict) -> list[Rows]:
    f = rep["flops"]
    ff = f["formulas"]
    rows = [["total = 2 × MACs + the rest", exact(f["total"]), si(f["total"]), ff["total"]],
            ["  matmul (2 × MACs)", exact(f["matmul"]), si(f["matmul"]), ff["matmul"]]]
    for k, v in f["itemised"].items():
        rows.append([f"  {k} (estimate)", exact(v), si(v), ff[f"itemised.{k}"]])
    rows.append(["causal mask exploited", exact(f["causal"]), si(f["causal"]), ff["causal"]])
    rows.append(["per token", exact(f["per_token"]), si(f["per_token"]), ff["per_token"]])
    return [("FLOPs", ["figure", "FLOPs", "≈", "formula"], rows)]



def _memory(rep: dict) -> list[Rows]:
    mem = rep["memory"]
    mf = mem["formulas"]
    t = mem["training"]
    dt = rep["settings"]["dtype"]
    by_size: dict[int, list[str]] = {}
    for k, v in mem["weights_bytes_by_dtype"].items():
        by_size.setdefault(v, []).append(k)
    rows = [[f"weights ({' / '.join(names)})", exact(v), si(v, "B"), ""]
            for v, names in sorted(by_size.items(), key=lambda kv: dt not in kv[1])]
    rows += [
        [f"KV cache at N ({mem['kv_cache_attentions']} attention{'' if mem['kv_cache_attentions'] == 1 else 's'})",
         exact(mem["kv_cache_bytes"]),
         si(mem["kv_cache_bytes"], "B"), mf["kv_cache_bytes"]],
        ["KV cache per token", exact(mem["kv_cache_bytes_per_token"]), si(mem["kv_cache_bytes_per_token"], "B"),
         mf["kv_cache_bytes_per_token"]],
        ["peak activations, inference, unfused (N×N scores held)", exact(mem["activations_peak_bytes"]["unfused"]),
         si(mem["activations_peak_bytes"]["unfused"], "B"), mf["activations_peak_bytes.unfused"]],
        ["peak activations, inference, fused attention", exact(mem["activations_peak_bytes"]["fused"]),
         si(mem["activations_peak_bytes"]["fused"], "B"), mf["activations_peak_bytes.fused"]],
        ["training: weights + gradients", exact(t["weights"] + t["gradients"]),
         si(t["weights"] + t["gradients"], "B"), ""],
        ["training: Adam moments (fp32)" + (" + fp32 master weights" if t["master_weights"] else ""),
         exact(t["optimizer"] + t["master_weights"]), si(t["optimizer"] + t["master_weights"], "B"), ""],
        ["training: activations kept for backward, unfused", exact(t["activations"]), si(t["activations"], "B"),
         mf["training.activations"]],
        ["training: activations kept for backward, fused", exact(t["activations_fused"]),
         si(t["activations_fused"], "B"), mf["training.activations_fused"]],
        ["training total, unfused", exact(t["total"]), si(t["total"], "B"), mf["training.total"]],
        ["training total, fused attention", exact(t["total_fused"]), si(t["total_fused"], "B"),
         mf["training.total_fused"]],
    ]
    return [(f"Memory ({dt}, bytes)", ["figure", "bytes", "≈", "formula"], rows)]


def _roofline(rep: dict) -> list[Rows]:
    dt = rep["settings"]["dtype"]
    r = rep.get("roofline")
    if not r:
        return []
    d = r["device"]
    head = (f"Roofline on {d['name']}: {d['label']}; {si(d['peak_flops'], 'FLOP/s')} {dt} matmul, "
            f"{si(d['bandwidth'], 'B/s')}; ridge {r['ridge_intensity']:.1f} FLOP/B")
    rows = [["prefill, graph as written (N×N scores in memory)", seconds(r["prefill_seconds"]["unfused"]),
             "", "", "", ""],
            ["prefill, attention fused", seconds(r["prefill_seconds"]["fused"]), "", "", "", ""]]
    if r["decode_seconds_per_token"] is not None:
        rows.append([f"decode step at N (one token per sequence; {r['decode_tokens_per_second']:,.0f} tokens/s)",
                     seconds(r["decode_seconds_per_token"]), "", "", "", ""])
    cal = r.get("calibrated")
    if cal:
        for label, t in (("prefill, graph as written, calibrated", cal["prefill_seconds"]["unfused"]),
                         ("prefill, attention fused, calibrated", cal["prefill_seconds"]["fused"]),
                         ("decode step at N, calibrated", cal["decode_seconds_per_token"])):
            if t is not None or "decode" not in label:
                rows.append([label, seconds(t), "", "", "", ""])
    ops = sorted(r["ops"], key=lambda o: -o["seconds"])[:10]
    total_t = r["prefill_seconds"]["unfused"] or 1
    for o in ops:
        rows.append([f"  {op_label(o['name'], o['op'])} ×{o['count']}", seconds(o["seconds"]),
                     f"{100 * o['seconds'] / total_t:.1f}%", si(o["flops"]), f"{o['intensity']:.1f}", o["bound"]])
    fa = r["fused_attention"]
    if fa:
        rows.append([f"  fused attention ×{fa['count']} (if fused)", seconds(fa["seconds"]), "",
                     si(fa["flops"]), f"{fa['intensity']:.1f}", fa["bound"]])
    return [(head, ["estimate (ideal kernels)", "time", "share", "FLOPs", "FLOP/B", "bound"], rows)]


def _measured(rep: dict) -> list[Rows]:
    return [measure_section(rep["measure"])] if rep.get("measure") else []


def _attention(rep: dict) -> list[Rows]:
    att = rep.get("attention")
    if not (att and att["sites"]):
        return []
    from tessera.compiler.analysis.attention_report import group_sites

    rows = []
    for count, first, names in group_sites(att):
        where = names[0] if count == 1 else f"{_site_names(names)} ({count} sites)"
        if first["fused"]:
            t = first["traffic_bytes"]
            rows.append([where, f"fused: {first['kernel']}", si(t["unfused"] * count) + "B",
                         si(t["fused"] * count) + "B"])
            rows.append([f"  why {first['kernel']}: {first['why']}", "", "", ""])
        else:
            rows.append([where, "not fused", "", ""])
            rows.append([f"  why: {first['reason']}", "", "", ""])
    t = att["traffic_bytes"]
    if t["fused"]:
        rows.append(["total memory traffic of attention", f"{att['traffic_ratio']:.1f}× less fused",
                     si(t["unfused"]) + "B", si(t["fused"]) + "B"])
    return [(f"Attention sites ({att['fused']} fused, {att['not_fused']} not; target {att['target']})",
             ["site", "kernel", "traffic unfused", "traffic fused"], rows)]


def _quantization(rep: dict) -> list[Rows]:
    q = rep.get("quantization")
    if not q:
        return []
    rows = [["weights, quantised", exact(q["weights_bytes"]), si(q["weights_bytes"]) + "B"],
            ["weights, float", exact(q["float_weights_bytes"]), si(q["float_weights_bytes"]) + "B"],
            [f"  {q['ratio']:.2f}× smaller; {q['quantized_linears']} linears quantised, "
             f"{q['float_linears']} kept in float", "", ""]]
    rows += [[f"  kept: {k['node']}: {k['reason']}", "", ""] for k in q["kept_in_float"][:8]]
    if len(q["kept_in_float"]) > 8:
        rows.append([f"  ... and {len(q['kept_in_float']) - 8} more kept in float", "", ""])
    head = f"head at {q['head_bits']} bits" if q.get("head_bits") else "head float"
    if q.get("head_tied_float_table"):
        rows.append(["  the head is tied: the embedding gathers from its float table, the head reads the codes", "", ""])
    if q.get("embedding_shares_head_codes"):
        rows.append(["  the head is tied: the head and the embedding read one set of 8-bit codes", "", ""])
    if q.get("quantized_embeddings"):
        rows.append([f"  {q['quantized_embeddings']} embedding table(s) stored at {q['embedding_bits']} bits", "", ""])
    rows += [[f"  kept: {e['node']} (embedding): {e['reason']}", "", ""] for e in q.get("embeddings_in_float", [])]
    if q.get("activations_in_words"):
        rows.append([f"  activations: {q['activations_in_words']}", "", ""])
    embedding = f"embedding at {q['embedding_bits']} bits" if q.get("embedding_bits") else "embedding float"
    return [(f"Quantisation ({q['scheme']}, {q['granularity']}, {head}, {embedding})", ["", "bytes", ""], rows)]


def _gguf_codes(rep: dict) -> list[Rows]:
    g = rep.get("gguf_codes")
    if not g:
        return []
    held = ", ".join(f"{k}: {v}" for k, v in g["held"].items())
    rows = [[f"parameters the file holds as codes: {sum(g['held'].values())} ({held})", "", ""]]
    if g["mode"] == "dequantize":
        rows.append(["  --gguf-weights dequantize: every tensor read as fp32", "", ""])
    else:
        by = ", ".join(f"{k}: {v}" for k, v in g["by_type"].items())
        rows.append([f"linears reading the file's own codes (MatMulNBits, no requantisation): "
                     f"{g['codes_linears']}" + (f" ({by})" if by else ""), "", ""])
        rows += [[f"  {x['node']} ({x['weight']}): {x['type']}" + (f", {x['activations']} activations"
                                                                  if x.get("activations") else ""), "", ""]
                 for x in g["linears"][:8]]
        if len(g["linears"]) > 8:
            rows.append([f"  ... and {len(g['linears']) - 8} more", "", ""])
        if g["read_as_fp32"]:
            rows.append([f"linears over 8-bit codes read as fp32 (codes-fp32): {len(g['read_as_fp32'])}", "", ""])
        rows += [["weights, codes kept", exact(g["weights_bytes"]), si(g["weights_bytes"]) + "B"],
                 ["weights, all fp32", exact(g["float_weights_bytes"]), si(g["float_weights_bytes"]) + "B"],
                 ["  (the memory and roofline sections count every weight at --dtype)", "", ""]]
    if g.get("source"):
        rows.append([f"conversion: {g['source']}", "", ""])
    return [(f"GGUF codes (--gguf-weights {g['mode']})", ["", "bytes", ""], rows)]


def percent(x: float | None) -> str:
    """A signed relative error or a share: +12.3%; n/a when there is none (no calibration yet)."""
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def measure_section(m: dict) -> tuple[str, list[str], list[list[str]]]:
    """--measure: each phase's measured time beside its estimate; the uncalibrated error always shown."""
    rows = []
    for phase, label in (("prefill", f"prefill (B={m['batch']}, N={m['seq']}; {m['prefill_estimate']} estimate)"),
                         ("decode", f"decode step (B={m['batch']}, at N={m['seq']})")):
        f = m.get(phase)
        if f is None:
            continue
        rows.append([label, seconds(f["measured_s"]), seconds(f["measured_min_s"]), seconds(f["estimated_s"]),
                     percent(f["error"]), seconds(f["calibrated_s"]), percent(f["calibrated_error"]),
                     si(f["achieved_flops_per_s"], "FLOP/s"), si(f["achieved_bytes_per_s"], "B/s"),
                     f"{100 * f['efficiency']:.1f}%"])
    mach = m.get("machine") or {}
    title_ = (f"Measured on this machine ({mach.get('cpu', '?')}, {mach.get('threads', '?')} threads; onnxruntime "
              f"CPU, median of {m['repeats']} runs); error = (estimated − measured) / measured; efficiency = "
              f"estimated / measured; calibration recorded in {m.get('calibration_file', '?')}"
              + "".join(f"\nnote: {n}" for n in m.get("notes", [])))
    return (title_, ["phase", "measured", "min", "estimated", "error", "calibrated", "calibrated error",
                     "achieved FLOP/s", "achieved B/s", "efficiency"], rows)


def _bytes_row(label: str, v, formula: str = "") -> list[str]:
    return [label, exact(v), si(v, "B"), formula]


SWEEP_LABELS = {"macs_total": "MACs", "flops_total": "FLOPs", "kv_cache_bytes": "KV cache B",
                "activations_peak_bytes_fused": "peak act. B (fused)", "prefill_seconds_fused": "prefill (fused)",
                "decode_seconds_per_token": "decode step", "per_device_weights_bytes": "dev. weights B",
                "per_device_kv_cache_bytes": "dev. KV B", "per_device_activations_bytes": "dev. act. B",
                "comm_bytes_per_step": "dev. sent B", "training_per_device_total": "dev. training B"}


def deployment_sections(rep: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """Parallel split, training per device, serving capacity and the sweep, when the report has them."""
    out = []
    par = rep.get("parallel")
    if par:
        pl, d, c, f = par["plan"], par["per_device"], par["comm_bytes_per_step"], par["formulas"]
        rows = [["parameters", exact(d["params"]), si(d["params"]), ""],
                _bytes_row("weights", d["weights_bytes"]),
                _bytes_row("KV cache at N", d["kv_cache_bytes"], f["per_device.kv_cache_bytes"]),
                _bytes_row("activations (graph as written)", d["activations_bytes"],
                           f["per_device.activations_bytes"]),
                _bytes_row("activations, fused attention", d["activations_bytes_fused"],
                           f["per_device.activations_bytes_fused"])]
        for k in ("tensor_parallel", "pipeline", "data_parallel", "expert_parallel", "total"):
            rows.append(_bytes_row(f"sent per step: {k.replace('_', ' ')}", c[k], f[f"comm_bytes_per_step.{k}"]))
        out.append((f"Parallel split: tp {pl['tp']} × pp {pl['pp']} × dp {pl['dp']}, ep {pl['ep']} "
                    f"({pl['devices']} devices; layers per stage {', '.join(map(str, pl['layers_per_stage']))}); "
                    f"the largest device", ["figure", "bytes", "≈", "formula"], rows))
    t = rep["memory"]["training"].get("per_device")
    if t:
        f = t["formulas"]
        rows = [_bytes_row("weights", t["weights"]), _bytes_row("gradients", t["gradients"]),
                _bytes_row("optimizer (Adam moments, fp32)", t["optimizer"]),
                _bytes_row("master weights (fp32)", t["master_weights"]),
                _bytes_row("activations (Korthikanti et al. 2022)", t["activations"], f["activations"]),
                _bytes_row("activations, fused attention", t["activations_fused"], f["activations_fused"]),
                _bytes_row("total", t["total"], f["total"]),
                _bytes_row("total, fused attention", t["total_fused"], f["total_fused"])]
        out.append((f"Training per device (ZeRO {t['zero']}, recompute {t['recompute']})",
                    ["figure", "bytes", "≈", "formula"], rows))
    sv = rep.get("serving")
    if sv:
        rows = [_bytes_row("device memory", int(sv["device_memory"]))[:3],
                _bytes_row(f"usable after {100 * sv['headroom']:.0f}% headroom and the weights",
                           sv["usable_bytes"])[:3],
                _bytes_row("weights per device", sv["weights_bytes"])[:3],
                _bytes_row("KV cache per sequence at the context", sv["kv_cache_bytes_per_sequence"])[:3],
                _bytes_row("activations per sequence (one decoding step)",
                           sv["activations_bytes_per_sequence"])[:3],
                ["max batch", exact(sv["max_batch"]), ""],
                ["decode tokens/s at max batch", exact(sv["decode_tokens_per_s"]), ""],
                ["decode tokens/s per sequence", exact(sv["decode_tokens_per_s_per_sequence"]), ""],
                ["decode step", seconds(sv["decode_step_s"]), ""],
                ["time to first token (prompt of the context)", seconds(sv["ttft_s"]), ""]]
        out.append((f"Serving on {sv['device']} at context {sv['context']:,}", ["figure", "value", "≈"], rows))
    sw = rep.get("sweep")
    if sw:
        cols = list(sw[0])
        rows = [[exact(r[c]) if c in ("batch", "seq") else seconds(r[c]) if "seconds" in c
                 else si(r[c]) for c in cols] for r in sw]
        out.append(("Sweep: one row per (B, N); the JSON keys of sweep[i]",
                    [SWEEP_LABELS.get(c, c) for c in cols], rows))
    return out


# ------------------------------------------------------------------ the one registry of sections
@dataclass(frozen=True)
class Section:
    """One section of the report: the key(s) of the report's JSON it renders, who computes them, and its
    renderer (the rows every format shares: rich, Markdown, HTML). A new section is a row here."""

    keys: str
    built_by: str
    render: Callable[[dict], list[Rows]]


SECTIONS: tuple[Section, ...] = (
    Section("params", "compiler/analysis/params.py via costreport.py", _parameters),
    Section("macs", "compiler/analysis/cost.py via costreport.py", _macs),
    Section("flops", "compiler/analysis/cost.py via costreport.py", _flops),
    Section("memory", "compiler/analysis/memory.py via costreport.py", _memory),
    Section("parallel, memory.training.per_device, serving, sweep",
            "compiler/analysis/deployment.py (--plan, --serve-device, --sweep)", deployment_sections),
    Section("roofline", "compiler/analysis/roofline.py via costreport.py", _roofline),
    Section("measure", "runtime/report/measure.py (--measure)", _measured),
    Section("attention", "compiler/report.py attention_section", _attention),
    Section("quantization", "compiler/report.py quantization_section (--quantize)", _quantization),
    Section("gguf_codes", "compiler/report.py stored_codes_section (a GGUF file, --gguf-weights)", _gguf_codes),
)


def sections(rep: dict) -> list[Rows]:
    """[(section title, column names, rows)] of every section the report has, in ``SECTIONS``' order."""
    return [rows for section in SECTIONS for rows in section.render(rep)]


# ------------------------------------------------------------------ formats
def print_table(rep: dict, console) -> None:
    from rich.table import Table

    console.print(title(rep), style="bold")
    for name, cols, rows in sections(rep):
        table = Table(title=name, title_justify="left", show_edge=True)
        for i, c in enumerate(cols):  # a label too long for its line folds, never cut: two cut ones could read alike
            table.add_column(c, justify="left" if i == 0 or c in ("formula", "bound") else "right",
                             overflow="fold" if i == 0 else "ellipsis")
        for row in rows:
            style = "bold" if row[0] in ("total", "total (full attention, head included)") else None
            table.add_row(*row, style=style)
        console.print(table)
    for note in _notes(rep):
        console.print(f"note: {note}", markup=False, highlight=False)


def _notes(rep: dict) -> list[str]:
    """Notes not already shown as a row (ties are listed under the parameter table)."""
    return [n for n in rep["notes"] if not n.startswith("tied: ")]


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("*", "\\*")


def _md_first(s: str) -> str:
    """First column: keep the indent of sub-rows visible (Markdown drops leading spaces)."""
    body = s.lstrip(" ")
    return "&nbsp;&nbsp;" * ((len(s) - len(body)) // 2) + _md_cell(body)


def markdown(rep: dict) -> str:
    lines = [f"# {title(rep)}", ""]
    for name, cols, rows in sections(rep):
        lines += [f"## {name}", "", "| " + " | ".join(cols) + " |",
                  "| " + " | ".join("---" if i == 0 or c in ("formula", "bound") else "---:"
                                    for i, c in enumerate(cols)) + " |"]
        lines += ["| " + " | ".join(_md_first(c) if j == 0 else _md_cell(c) for j, c in enumerate(row))
                  + " |" for row in rows]
        lines.append("")
    if _notes(rep):
        lines += ["## Notes", ""] + [f"- {n}" for n in _notes(rep)] + [""]
    return "\n".join(lines)


def flatten(rep: dict) -> list[tuple[str, object, str]]:
    """(dotted key, value, formula) for every scalar of the report; list items get [i]."""
    out: list[tuple[str, object, str]] = []

    def walk(prefix: str, node, formulas: dict):
        if isinstance(node, dict):
            here = {k: v for k, v in formulas.items() if k}
            if isinstance(node.get("formulas"), dict):
                here.update(node["formulas"])
            for k, v in node.items():
                if k == "formulas":
                    continue
                walk(f"{prefix}.{k}" if prefix else k, v, {**{kk[len(k) + 1:]: vv for kk, vv in here.items()
                                                           if kk.startswith(k + ".")},
                                                        **({"": here[k]} if k in here else {})})
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(f"{prefix}[{i}]", v, {})
        else:
            out.append((prefix, node, formulas.get("", "")))

    walk("", rep, {})
    return out


def csv_text(rep: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["key", "value", "formula"])
    for key, value, formula in flatten(rep):
        w.writerow([key, "" if value is None else value, formula])
    return buf.getvalue()
