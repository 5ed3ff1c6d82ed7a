"""Where a decoding step's time goes: onnxruntime's per-node profile (SessionOptions.enable_profiling)
of one decoding step of Tessera's cached decoder (the serving engine's, GroupQueryAttention with
per-row lengths over the shared buffer) against onnxruntime-genai's model builder export of the same
weights, at B = 1 and B = 16 rows of the same cached length.

    python bench/decode_profile.py --genai-python /work/venvs/genai/bin/python
    python bench/decode_profile.py --genai-python PY --rows 1 16 --past 128 --steps 10 --threads 2 --json out.json
    python bench/decode_profile.py --genai-python PY --rows 1 --quantize int4 --folder DIR   # int4, head included

Why: at a static batch of 16, Tessera's step was 2-6 % slower than onnxruntime-genai's on equal
prompts, and the serving issue (#23) needs to know whether that is the matrix products (the same
work) or the graph around them (small nodes, subgraphs) before choosing what to change.

What runs: a Llama-shaped checkpoint (bench/generate.py ``make_weights``: hidden 768, 12 layers, 12
heads, intermediate 3072, vocab 32000, seeded), with --threads intra-op threads and a profiling
session each:

- Tessera: its cached decoder compiled from the checkpoint as ``tessera serve`` compiles it
  (runtime/serving/model.py: buffer mode, the default decoding kernel), run by the serving engine
  (``Engine.step``: IOBinding, the cache written in place) with B requests of --past prompt tokens
  each, prefilled, then --warmup decoding steps, then --steps profiled ones, in this Python's
  onnxruntime;
- onnxruntime-genai: the model builder's fp32 CPU export of the same checkpoint (``make_genai_model``)
  run by onnxruntime-genai itself in a child process of --genai-python (its Generator, ``batch_size``
  B, B prompts of --past tokens, then decoding steps; its config shares past and present on CPU),
  profiled through genai_config's ``enable_profiling``, in the onnxruntime it brings (the bench
  prints both versions).

From the profile's events: the last --steps ``model_run`` events and the ``*_kernel_time`` node events
inside them. Reported per step, each the median over the profiled steps: the run's time, the sum of
the top-level nodes, the rest (the executor between nodes), node counts, time and count per op
type; an ``If`` node's time is split into its own part (the If minus the nodes its branch ran) and
those nodes, counted under their own types. Profiling adds a small cost to each node, so the graph
with more nodes is charged a little more than it costs unprofiled: read small differences with that
in mind.

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
from jsonout import write_json  # noqa: E402
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


def step_windows(events: list[dict], steps: int) -> list[tuple[dict, list[dict]]]:
    """The last ``steps`` model_run events of an onnxruntime profile, each with the node kernel events
    that lie within it (in time order): one step's nodes."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-steps:]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    return [(run, sorted((e for e in nodes if run["ts"] <= e["ts"] <= run["ts"] + run["dur"]), key=lambda e: e["ts"]))
            for run in runs]


def summarise(events: list[dict], steps: int) -> dict:
    """Per step, the median over the last ``steps`` model_run events (a busy machine stretches some
    nodes of some steps: the median of each figure over the steps is what a quiet step would show
    most nearly) of the run's time and of each op type's time within it (see the module's docstring
    for how an If is split)."""
    per_step: list[tuple[float, float, int, int, dict, dict]] = []
    for run, inside in step_windows(events, steps):
        per_type: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        nested = set()
        for f in (e for e in inside if e["args"].get("op_name") == "If"):  # its branch's nodes lie within it
            f_lo, f_hi = f["ts"], f["ts"] + f["dur"]
            kids = [e for e in inside if e is not f and f_lo <= e["ts"] and e["ts"] + e["dur"] <= f_hi]
            nested.update(id(e) for e in kids)
            per_type["If (own)"] += f["dur"] - sum(e["dur"] for e in kids if e["args"].get("op_name") != "If")
            count["If (own)"] += 1
        top = [e for e in inside if id(e) not in nested]
        for e in inside:
            op = e["args"].get("op_name", "?")
            if op != "If":
                per_type[op] += e["dur"]
                count[op] += 1
        per_step.append((run["dur"], sum(e["dur"] for e in top), len(top),
                         sum(c for k, c in count.items() if k != "If (own)"), per_type, count))
    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    ops = {op for *_, t, _ in per_step for op in t}
    return {"steps": len(per_step), "run_ms": med([r[0] for r in per_step]) / 1e3,
            "nodes_ms": med([r[1] for r in per_step]) / 1e3,
            "between_ms": med([r[0] - r[1] for r in per_step]) / 1e3,
            "top_nodes": med([r[2] for r in per_step]), "all_nodes": med([r[3] for r in per_step]),
            "ops": {op: {"ms": med([r[4].get(op, 0.0) for r in per_step]) / 1e3,
                         "count": med([r[5].get(op, 0) for r in per_step])} for op in ops}}


def profile_tessera(folder: Path, rows: int, past: int, warmup: int, steps: int, threads: int, tmp: Path,
                    quantize: str = "none", before_step_passes: bool = False) -> dict:
    from tessera.runtime import pipeline
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request

    m = MODELS["llama"]
    built = pipeline.build(Path(__file__).resolve().parents[1] / "models" / m["spec"], m["variant"], m["sets"])
    weights = pipeline.weights_for(built, str(folder / "model.safetensors"), 0)
    config = None if quantize == "none" else pipeline.quant_config(quantize, head=True)  # as genai's builder
    proto, info = gen.compile_cached(built, weights, mode="buffer", decode=serving_model.DECODE, quantize=config,
                                     skip_norm=not before_step_passes, bound_step=not before_step_passes)
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


def profile_genai(args, folder: Path, rows: int, tmp: Path) -> dict:
    """onnxruntime-genai's own run, profiled by its session (genai_config's ``enable_profiling``), in
    a child process of --genai-python: its Generator with ``batch_size`` = rows over rows prompts of
    --past tokens, then decoding steps (each generate_next_token runs the model on one token per row,
    the cache shared between past and present as its config says for CPU)."""
    out = tmp / f"genai-{rows}"
    out.mkdir()
    cmd = [args.genai_python, __file__, "--_genai", str(folder / "genai"), str(rows), str(args.past),
           str(args.warmup + args.steps), str(args.threads), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if done.returncode:
        raise SystemExit(f"onnxruntime-genai failed:\n{done.stderr[-3000:]}")
    found = sorted(out.glob("*.json"))
    if not found:
        raise SystemExit(f"onnxruntime-genai wrote no profile in {out}")
    return summarise(json.loads(found[-1].read_text()), args.steps)


def genai_child(folder: str, rows: int, past: int, steps: int, threads: int, out: str) -> None:
    import onnxruntime_genai as og

    cfg = og.Config(folder)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1, "enable_profiling": str(Path(out) / "genai")}}}}))
    model = og.Model(cfg)
    params = og.GeneratorParams(model)
    length = past + steps + 2
    params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=rows)
    g = og.Generator(model, params)
    g.append_tokens(np.random.default_rng(0).integers(3, 32000, (rows, past)).astype(np.int32))
    for _ in range(steps + 1):
        g.generate_next_token()
    del g, model  # the session writes its profile when it is destroyed


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


GENAI_PRECISION = {"none": "fp32", "int4": "int4", "w8a8": "int8"}  # the builder's nearest precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--genai-python", metavar="PYTHON",
                   help="a Python with onnxruntime-genai 0.18 and its builder's torch, transformers, onnx_ir")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--past", type=int, default=128, help="cached positions per row (default 128)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="profiled decoding steps per case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantize", choices=["none", "int4", "w8a8"], default="none",
                   help="int4: Tessera's --quantize int4 with the head quantised, genai's builder -p int4; w8a8: "
                        "Tessera's --quantize w8a8 with the head quantised, genai's builder -p int8 (use a --folder "
                        "of its own: the export is kept there)")
    p.add_argument("--before-step-passes", action="store_true",
                   help="compile Tessera's decoder without the skip-norm and bound-step passes (the step before them)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--folder", metavar="DIR",
                   help="keep the checkpoint and onnxruntime-genai's export here (reused when present)")
    p.add_argument("--_genai", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._genai:
        folder, rows, past, steps, threads, out = args._genai
        genai_child(folder, int(rows), int(past), int(steps), int(threads), out)
        return
    if not args.genai_python:
        raise SystemExit("--genai-python PYTHON is required (a Python with onnxruntime-genai 0.18)")
    import onnxruntime as ort

    genai_ort = subprocess.run([args.genai_python, "-c", "import onnxruntime as o, onnxruntime_genai as g; "
                                "print(o.__version__, g.__version__)"], capture_output=True, text=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, tmp = Path(args.folder or Path(tmp) / "ckpt"), Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "model.safetensors").exists():
            make_weights(folder, "llama")
        if not (folder / "genai" / "model.onnx").exists():
            make_genai_model(folder, args.genai_python, GENAI_PRECISION[args.quantize])
        for b in args.rows:  # alternating per width: both graphs see about the same load
            results[f"tessera B={b}"] = profile_tessera(folder, b, args.past, args.warmup, args.steps,
                                                        args.threads, tmp, args.quantize, args.before_step_passes)
            results[f"genai B={b}"] = profile_genai(args, folder, b, tmp)
    print(f"Llama-shaped {'fp32' if args.quantize == 'none' else args.quantize + ' weights'} (hidden 768, 12 layers, vocab 32000), {args.past} cached positions per row, "
          f"{args.steps} profiled steps, threads {args.threads}, load average {os.getloadavg()[0]:.1f}; "
          f"onnxruntime {ort.__version__} here, (onnxruntime, onnxruntime-genai) in --genai-python: "
          f"{genai_ort.stdout.strip() or genai_ort.stderr.strip()[-200:]}")
    print(table(results))
    for b in args.rows:
        t, g = results[f"tessera B={b}"], results[f"genai B={b}"]
        products = ("MatMul", "FusedMatMul", "MatMulNBits", "Gemm", "MatMulIntegerToFloat")
        mm = lambda r: sum(v["ms"] for k, v in r["ops"].items() if k in products)  # noqa: E731
        print(f"B={b}: model_run tessera / genai {t['run_ms'] / g['run_ms']:.3f}; matrix products "
              f"{mm(t):.2f} vs {mm(g):.2f} ms; the rest of the nodes {t['nodes_ms'] - mm(t):.2f} vs "
              f"{g['nodes_ms'] - mm(g):.2f} ms; between nodes {t['between_ms']:.2f} vs {g['between_ms']:.2f} ms; "
              f"top-level nodes {t['top_nodes']:.0f} vs {g['top_nodes']:.0f}")
    if args.json:
        write_json(args.json, results, indent=1)


if __name__ == "__main__":
    main()
