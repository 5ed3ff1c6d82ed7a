"""Where a decoding step's time goes: onnxruntime's per-node profile (SessionOptions.enable_profiling)
of one decoding step of Tessera's cached decoder (the serving engine's, GroupQueryAttention with
per-row lengths over the shared buffer) against onnxruntime-genai's model builder export of the same
weights, at B = 1 and B = 16 rows of the same cached length.

    python bench/decode_profile.py --genai-python /work/venvs/genai/bin/python
    python bench/decode_profile.py --genai-python PY --rows 1 16 --past 128 --steps 10 --threads 2 --json out.json

Why: at a static batch of 16, Tessera's step was 2-6 % slower than onnxruntime-genai's on equal
prompts, and the serving issue (#23) needs to know whether that is the matrix products (the same
work) or the graph around them (small nodes, subgraphs) before choosing what to change.

What runs: a Llama-shaped checkpoint (bench/generate.py ``make_weights``: hidden 768, 12 layers, 12
heads, intermediate 3072, vocab 32000, seeded), Tessera's cached decoder compiled from it as ``tessera
serve`` compiles it (runtime/serving/model.py: buffer mode, the default decoding kernel), and the
model builder's fp32 CPU export (``make_genai_model``, run in --genai-python). Both graphs run in
THIS Python's onnxruntime (the same version as onnxruntime-genai 0.18's where both are 1.32; the
bench prints both), with the same threads and a profiling session each:

- Tessera: the serving engine (``Engine.step``: IOBinding, the cache written in place) with B
  requests of --past prompt tokens each, prefilled, then --warmup decoding steps, then --steps
  profiled decoding steps;
- onnxruntime-genai's graph: ``session.run`` with B rows, a past of --past positions (zeros; the cost
  does not depend on the values), an attention mask of ones, one new token per row, --warmup runs
  then --steps profiled runs (the buffers genai passes: a past of P columns, a present of P + 1).

From the profile's events: the last --steps ``model_run`` events and the ``*_kernel_time`` node events
inside them. Reported per step: the run's time, the sum of the top-level nodes, the rest (the
executor between nodes), node counts, time and count per op type; an ``If`` node's time is split into
its own part (the If minus the nodes its branch ran, which are counted under their own types) and
those nodes. Profiling adds a small cost to each node, so the graph with more nodes is charged a
little more than it costs unprofiled: read small differences with that in mind.

Not a timed test: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import MODELS, make_genai_model, make_weights  # noqa: E402


def _session(source, threads: int, prefix: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4
    opts.enable_profiling = True
    opts.profile_file_prefix = prefix
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def summarise(events: list[dict], steps: int) -> dict:
    """Per step: the last ``steps`` model_run events and the node events inside them (see the module's
    docstring for how an If is split)."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-steps:]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_type: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    top_sum = 0.0
    top_nodes = 0
    for run in runs:
        lo, hi = run["ts"], run["ts"] + run["dur"]
        inside = sorted((e for e in nodes if lo <= e["ts"] <= hi), key=lambda e: e["ts"])
        ifs = [e for e in inside if e["args"].get("op_name") == "If"]
        nested = set()
        for f in ifs:  # the nodes its branch ran lie within its interval
            f_lo, f_hi = f["ts"], f["ts"] + f["dur"]
            kids = [e for e in inside if e is not f and f_lo <= e["ts"] and e["ts"] + e["dur"] <= f_hi]
            nested.update(id(e) for e in kids)
            per_type["If (own)"] += f["dur"] - sum(e["dur"] for e in kids if e["args"].get("op_name") != "If")
            count["If (own)"] += 1
        for e in inside:
            op = e["args"].get("op_name", "?")
            if op != "If":
                per_type[op] += e["dur"]
                count[op] += 1
            if id(e) not in nested:
                top_sum += e["dur"]
                top_nodes += 1
    n = max(len(runs), 1)
    run_us = sum(r["dur"] for r in runs) / n
    return {"steps": len(runs), "run_ms": run_us / 1e3, "nodes_ms": top_sum / n / 1e3,
            "between_ms": (run_us - top_sum / n) / 1e3, "top_nodes": top_nodes / n,
            "all_nodes": sum(c for k, c in count.items() if k != "If (own)") / n,
            "ops": {k: {"ms": v / n / 1e3, "count": count[k] / n} for k, v in per_type.items()}}


def profile_tessera(folder: Path, rows: int, past: int, warmup: int, steps: int, threads: int, tmp: Path) -> dict:
    from tessera.runtime import pipeline
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request

    m = MODELS["llama"]
    built = pipeline.build(Path(__file__).resolve().parents[1] / "models" / m["spec"], m["variant"], m["sets"])
    weights = pipeline.weights_for(built, str(folder / "model.safetensors"), 0)
    proto, info = gen.compile_cached(built, weights, mode="buffer", decode=serving_model.DECODE)
    data = proto.SerializeToString()
    del proto, weights
    model = gen.CachedModel(data, info, threads=threads)
    model.session = _session(data, threads, str(tmp / f"tessera-{rows}"))  # the same graph, profiled
    engine = Engine(model, max_batch=rows, max_queue=0, prefill_chunk=max(256, past))
    rng = np.random.default_rng(0)
    for _ in range(rows):
        engine.submit(Request(rng.integers(3, 32000, past).tolist(), warmup + steps + 4))
    while any(s.prefilling for s in engine.rows) or engine.queued:
        engine.step()
    for _ in range(warmup + steps):
        engine.step()
    events = json.loads(Path(model.session.end_profiling()).read_text())
    out = summarise(events, steps)
    out["kernel"] = serving_model.decode_kernel(info)
    return out


def profile_genai_graph(folder: Path, rows: int, past: int, warmup: int, steps: int, threads: int,
                        tmp: Path) -> dict:
    sess = _session(str(folder / "genai" / "model.onnx"), threads, str(tmp / f"genai-{rows}"))
    types = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16}
    feeds = {}
    for i in sess.get_inputs():
        dt = types[i.type]
        if i.name == "input_ids":
            feeds[i.name] = np.full((rows, 1), 5, dtype=dt)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((rows, past + 1), dtype=dt)
        elif i.name == "position_ids":
            feeds[i.name] = np.full((rows, 1), past, dtype=dt)
        elif i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((rows, i.shape[1], past, i.shape[3]), dtype=dt)
        else:
            raise SystemExit(f"onnxruntime-genai's graph has an input this bench does not know: {i.name} {i.shape}")
    for _ in range(warmup + steps):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    return summarise(events, steps)


def table(results: dict) -> str:
    cols = list(results)
    ops = sorted({op for r in results.values() for op in r["ops"]},
                 key=lambda op: -max(r["ops"].get(op, {}).get("ms", 0) for r in results.values()))
    head = f"{'ms per step (count)':<26}" + "".join(f"{c:>22}" for c in cols)
    lines = [head, "-" * len(head)]

    def row(name, fmt):
        lines.append(f"{name:<26}" + "".join(f"{fmt(results[c]):>22}" for c in cols))

    row("model_run", lambda r: f"{r['run_ms']:.2f}")
    row("  top-level nodes", lambda r: f"{r['nodes_ms']:.2f} ({r['top_nodes']:.0f})")
    row("  between nodes", lambda r: f"{r['between_ms']:.2f}")
    row("nodes run (all levels)", lambda r: f"{r['all_nodes']:.0f}")
    for op in ops:
        row(op, lambda r, op=op: (f"{r['ops'][op]['ms']:.3f} ({r['ops'][op]['count']:.0f})"
                                  if op in r["ops"] else "-"))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--genai-python", metavar="PYTHON", required=True,
                   help="a Python with onnxruntime-genai 0.18 and its builder's torch, transformers, onnx_ir")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--past", type=int, default=128, help="cached positions per row (default 128)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="profiled decoding steps per case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    import onnxruntime as ort

    genai_ort = subprocess.run([args.genai_python, "-c", "import onnxruntime as o, onnxruntime_genai as g; "
                                "print(o.__version__, g.__version__)"], capture_output=True, text=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, tmp = Path(tmp) / "ckpt", Path(tmp)
        folder.mkdir()
        make_weights(folder, "llama")
        make_genai_model(folder, args.genai_python)
        for b in args.rows:  # alternating per width: both graphs see about the same load
            results[f"tessera B={b}"] = profile_tessera(folder, b, args.past, args.warmup, args.steps,
                                                        args.threads, tmp)
            results[f"genai B={b}"] = profile_genai_graph(folder, b, args.past, args.warmup, args.steps,
                                                          args.threads, tmp)
    print(f"Llama-shaped fp32 (hidden 768, 12 layers, vocab 32000), {args.past} cached positions per row, "
          f"{args.steps} profiled steps, threads {args.threads}, load average {os.getloadavg()[0]:.1f}; "
          f"onnxruntime {ort.__version__} here, (onnxruntime, onnxruntime-genai) in --genai-python: "
          f"{genai_ort.stdout.strip() or genai_ort.stderr.strip()[-200:]}")
    print(table(results))
    for b in args.rows:
        t, g = results[f"tessera B={b}"], results[f"genai B={b}"]
        mm = lambda r: sum(v["ms"] for k, v in r["ops"].items() if k in ("MatMul", "MatMulNBits", "Gemm"))  # noqa: E731
        print(f"B={b}: model_run tessera / genai {t['run_ms'] / g['run_ms']:.3f}; matrix products "
              f"{mm(t):.2f} vs {mm(g):.2f} ms; the rest of the nodes {t['nodes_ms'] - mm(t):.2f} vs "
              f"{g['nodes_ms'] - mm(g):.2f} ms; between nodes {t['between_ms']:.2f} vs {g['between_ms']:.2f} ms; "
              f"top-level nodes {t['top_nodes']:.0f} vs {g['top_nodes']:.0f}")
    if args.json:
        path = Path(args.json)
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(results, indent=1))
        part.replace(path)


if __name__ == "__main__":
    main()
