"""Where the serving engine's decoding step goes at long contexts: Python, onnxruntime's run, and within the
run GroupQueryAttention against every other node, per cache dtype and context.

    python bench/kv_step_profile.py $GGUF --positions 1024,4096 --steps 10 --rounds 3 --threads 2
    python bench/kv_step_profile.py $GGUF --positions 4096 --grouped      # + the grouped attention form, standalone
    python bench/kv_step_profile.py $GGUF --check-grouped codes-fp32      # the grouped form's logits on a real cache

Why (issue 40 item 2): the engine's step of SmolLM2-135M cost about 4x more at 4,096 positions than at
1,024 (docs/benchmarks/log.md kc2) while one GroupQueryAttention call alone (bench/kv_fp16_gqa_probe.py)
suggested 15-30 ms for the step's 30. What runs: each cache dtype's model compiled as
bench/kv_cache_dtype.py compiles it (its ``_load``), in a session with onnxruntime's profiling on; one
one-slot engine per P (runtime/serving/engine.py), prefilled, then --steps ``Engine.step`` calls of each,
alternating, --rounds times. Per step: the step's wall time, the run's (``run_with_iobinding``, the rest
is the engine's Python: mask, feeds, token choice) and, from the profile, the kernel time of the
GroupQueryAttention nodes and of all other nodes. The machine is shared: the sums are reported as the
sum over nodes of each node's minimum over the steps (a node stretched by another process's time slice
in one step does not count), beside the median of the per-step sums.

``--grouped``: the bound step's graph (compiler/backends/onnx/bound_step.py's else branch) run standalone
over caches of committed random values (the memory a step reads; np.zeros pages would all map the one
zero page and stay in the CPU's cache), as compiled and with every GroupQueryAttention in the grouped
form of bench/gqa_grouped_probe.py (each key/value head's queries as rows; the bias padded with G - 1
hidden columns); per-node minimum sums and run times, alternating. A prototype rewrite for measuring:
its batch dimension is 1, and it is not what the compiler emits. ``--check-grouped W``: its logits against
the compiled form's on an engine's real cache (W: the --gguf-weights to compile with; with ``codes`` the
products quantise their activations to int8, which turns rounding differences into larger ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_cache_dtype  # noqa: E402

GQA = "GroupQueryAttention"


def profiled_sessions(prefix: str):
    """Make every onnxruntime session opened from now on profile into ``prefix``; returns the model bytes
    each was opened with (a list, in order)."""
    import onnxruntime as ort

    opened, base = [], ort.InferenceSession

    class Profiled(base):
        def __init__(self, source, options=None, *a, **k):
            options = options or ort.SessionOptions()
            options.enable_profiling, options.profile_file_prefix = True, prefix
            opened.append(source)
            super().__init__(source, options, *a, **k)

    ort.InferenceSession = Profiled
    return opened


def node_sums(events: list, chosen: list) -> dict:
    """Over the model_run events ``chosen`` (of one session's profile ``events``): the run's min and median ms,
    and for GroupQueryAttention and the other nodes (If excluded: its nodes are counted) the sum over nodes
    of each node's minimum over the runs, and the median of the per-run sums."""
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
             and e["args"].get("op_name") != "If"]
    per_node, per_run = defaultdict(list), {GQA: [], "other": []}
    for run in chosen:
        inside = [e for e in nodes if run["ts"] <= e["ts"] <= run["ts"] + run["dur"]]
        sums = defaultdict(float)
        for e in inside:
            kind = GQA if e["args"].get("op_name") == GQA else "other"
            per_node[(kind, e["name"])].append(e["dur"])
            sums[kind] += e["dur"]
        for kind in per_run:
            per_run[kind].append(sums[kind])
    runs_ms = [r["dur"] / 1e3 for r in chosen]
    out = {"run_min_ms": min(runs_ms), "run_median_ms": statistics.median(runs_ms)}
    for kind in per_run:
        out[f"{kind}_node_min_sum_ms"] = sum(min(v) for k, v in per_node.items() if k[0] == kind) / 1e3
        out[f"{kind}_median_ms"] = statistics.median(per_run[kind]) / 1e3
    return out


def _tagged(session, tags: list, now: list, ort_time: list) -> None:
    """Wrap ``session``'s run and run_with_iobinding: each call appends ``now[0]`` to ``tags`` (one model_run
    event each, in order) and its time to ``ort_time``."""
    for name in ("run", "run_with_iobinding"):
        fn = getattr(session, name)

        def wrapped(*a, _fn=fn, **k):
            tags.append(now[0])
            t = time.perf_counter()
            r = _fn(*a, **k)
            ort_time.append(time.perf_counter() - t)
            return r
        setattr(session, name, wrapped)


def engine_steps(model_path: str, sets, positions, steps: int, rounds: int, threads: int, tmp: str):
    from tessera.runtime.serving.engine import Engine, Request

    opened = profiled_sessions(f"{tmp}/engine")
    models = {kv: kv_cache_dtype._load(model_path, kv, threads, sets) for kv in ("fp32", "fp16")}
    sources = {kv: src for kv, src in zip(models, opened[-2:])}
    ids = kv_cache_dtype._tokens(model_path, None, max(positions))
    tags, now, ort_time = {kv: [] for kv in models}, [None], []
    for kv, m in models.items():
        _tagged(m.session, tags[kv], now, ort_time)
    wall, run, widths = defaultdict(list), defaultdict(list), {}
    for p in positions:
        engines = {}
        for kv, m in models.items():
            e = Engine(m, max_batch=1, capacity=p + steps * rounds + 8, prefill_chunk=512)
            handle = e.submit(Request(ids[:p], steps * rounds + 4))
            while len(handle.tokens) < 2:
                e.step()
            engines[kv], widths[(p, kv)] = e, e.width
        for _ in range(rounds):
            for kv, e in engines.items():
                for _ in range(steps):
                    ort_time.clear()
                    now[0] = p
                    t = time.perf_counter()
                    e.step()
                    wall[(p, kv)].append(1e3 * (time.perf_counter() - t))
                    run[(p, kv)].append(1e3 * sum(ort_time))
                    now[0] = None
        del engines
    out = {}
    for kv, m in models.items():
        events = json.loads(Path(m.session.end_profiling()).read_text())
        runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
        if len(runs) != len(tags[kv]):
            raise SystemExit(f"{kv}: {len(runs)} model_run events for {len(tags[kv])} calls; cannot attribute them")
        for p in positions:
            w, r = wall[(p, kv)], run[(p, kv)]
            row = {"width": widths[(p, kv)], "step_min_ms": min(w), "step_median_ms": statistics.median(w),
                   "python_median_ms": statistics.median(a - b for a, b in zip(w, r)),
                   **node_sums(events, [e for e, tag in zip(runs, tags[kv]) if tag == p])}
            out[f"{p} {kv}"] = row
            print(f"P={p} {kv}: step min {row['step_min_ms']:.2f} med {row['step_median_ms']:.2f} ms (Python "
                  f"{row['python_median_ms']:.2f}); run min {row['run_min_ms']:.2f} med {row['run_median_ms']:.2f}; "
                  f"GroupQueryAttention {row[GQA + '_node_min_sum_ms']:.2f} (med {row[GQA + '_median_ms']:.2f}); "
                  f"other nodes {row['other_node_min_sum_ms']:.2f} (med {row['other_median_ms']:.2f})", flush=True)
    return out, sources


def grouped_form(source: bytes, dtype) -> bytes:
    """The model with every GroupQueryAttention of the bound step's branch (the top-level If's else branch)
    in the grouped form (bench/gqa_grouped_probe.py): q [1, 1, H*hd] as [1, G, KV*hd] (row j: head g*G + j
    of each key/value head g), k and v repeated over the G rows, positions repeated, seqlens_k and the total
    length + G - 1, the bias padded with G - 1 hidden columns and repeated over the rows; the output back
    in head order. Batch 1 only (the Reshapes say so)."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load_from_string(source)
    top = next(n for n in m.graph.node if n.op_type == "If")
    branch = next(a.g for a in top.attribute if a.name == "else_branch")
    lowest = np.array(np.finfo(dtype).min, dtype)

    def const(name, value):
        branch.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    nodes, shared = [], False
    for n in branch.node:
        if n.op_type != GQA:
            nodes.append(n)
            continue
        at = {a.name: a for a in n.attribute}
        heads, kv = at["num_heads"].i, at["kv_num_heads"].i
        if len(n.input) != 11 or not n.input[10] or n.input[1] or "local_window_size" in at:
            raise SystemExit(f"{n.name}: not the packed, biased, windowless step this prototype rewrites")
        g, hd = heads // kv, None
        p = n.name + "/grouped"
        if not shared:
            g_i32 = const("grouped/g-1", np.array(g - 1, np.int32))
            nodes += [helper.make_node("Add", [n.input[5], g_i32], ["grouped/seqlens_k"]),
                      helper.make_node("Add", [n.input[6], g_i32], ["grouped/total"]),
                      helper.make_node("Expand", [n.input[9], const("grouped/pos_shape", np.array([1, g], np.int64))],
                                       ["grouped/positions"]),
                      helper.make_node("Pad", [n.input[10], const("grouped/pads", np.array([0] * 7 + [g - 1], np.int64)),
                                               const("grouped/lowest", lowest)], ["grouped/bias_padded"]),
                      helper.make_node("Expand", ["grouped/bias_padded",
                                                  const("grouped/bias_shape", np.array([1, 1, g, 1], np.int64))],
                                       ["grouped/bias"])]
            shared = True
        hd = None
        for init in m.graph.input:  # the head size: the past key's last dimension
            if init.name == n.input[3]:
                hd = init.type.tensor_type.shape.dim[3].dim_value
        nodes += [
            helper.make_node("Slice", [n.input[0], const(p + "/0", [0]), const(p + "/q_end", [heads * hd]),
                                       const(p + "/axis", [2])], [p + "/q"]),
            helper.make_node("Reshape", [p + "/q", const(p + "/q4", np.array([1, kv, g, hd], np.int64))], [p + "/q4d"]),
            helper.make_node("Transpose", [p + "/q4d"], [p + "/qt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [p + "/qt", const(p + "/q3", np.array([1, g, kv * hd], np.int64))], [p + "/qg"]),
            helper.make_node("Slice", [n.input[0], p + "/q_end", const(p + "/kv_end", [(heads + 2 * kv) * hd]),
                                       p + "/axis"], [p + "/kv"]),
            helper.make_node("Expand", [p + "/kv", const(p + "/rows", np.array([1, g, 1], np.int64))], [p + "/kvg"]),
            helper.make_node("Concat", [p + "/qg", p + "/kvg"], [p + "/qkv"], axis=2)]
        out = n.output[0]
        for i, name in ((0, p + "/qkv"), (5, "grouped/seqlens_k"), (6, "grouped/total"), (9, "grouped/positions"),
                        (10, "grouped/bias")):
            n.input[i] = name
        at["num_heads"].i = kv
        n.output[0] = p + "/out"
        nodes += [n,
                  helper.make_node("Reshape", [p + "/out", const(p + "/o4", np.array([1, g, kv, hd], np.int64))],
                                   [p + "/o4d"]),
                  helper.make_node("Transpose", [p + "/o4d"], [p + "/ot"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [p + "/ot", const(p + "/o3", np.array([1, 1, heads * hd], np.int64))], [out])]
    del branch.node[:]
    branch.node.extend(nodes)
    return m.SerializeToString()


def standalone(sources: dict, positions, rounds: int, threads: int, tmp: str, spare: int = 2) -> dict:
    """The bound step over committed random caches of width P + spare (filled P - 1), as compiled and grouped,
    alternating; per-node minimum sums from each session's profile."""
    import onnxruntime as ort

    out = {}
    for kv, source in sources.items():
        dtype = np.float16 if kv == "fp16" else np.float32
        forms = {"compiled": source, "grouped": grouped_form(source, dtype)}
        sessions, tags = {}, {}
        for form, src in forms.items():
            o = ort.SessionOptions()
            o.intra_op_num_threads, o.inter_op_num_threads, o.log_severity_level = threads, 1, 4
            o.enable_profiling, o.profile_file_prefix = True, f"{tmp}/{kv}-{form}"
            sessions[form], tags[form] = ort.InferenceSession(src, o, providers=["CPUExecutionProvider"]), []
        rng = np.random.default_rng(0)
        bound = {}
        for p in positions:
            width, filled = p + spare, p - 1
            for form, s in sessions.items():
                io, keep = s.io_binding(), []
                io.bind_output("logits", "cpu")
                for i in s.get_inputs():
                    if i.name.startswith("past_"):
                        shape = [1, i.shape[1], width, i.shape[3]]
                        a = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
                        keep.append(a)
                        io.bind_input(i.name, "cpu", 0, a.dtype, shape, a.ctypes.data)
                        io.bind_output("cache_" + i.name[len("past_"):], "cpu", 0, a.dtype, shape, a.ctypes.data)
                flag = ort.OrtValue.ortvalue_from_numpy(np.array(False))
                keep.append(flag)
                io.bind_ortvalue_input("cache_columns", flag)
                mask = np.zeros((1, width + 1), np.int64)
                mask[0, :filled + 1] = 1
                mask[0, -1] = 1
                for name, v in (("tokens", [[5]]), ("attention_mask", mask), ("position_ids", [[filled]]),
                                ("cache_length", [filled])):
                    io.bind_cpu_input(name, np.asarray(v, np.int64))
                bound[(p, form)] = (io, keep)
        for _ in range(rounds):
            for p in positions:
                for form, s in sessions.items():
                    for _ in range(5):
                        s.run_with_iobinding(bound[(p, form)][0])
                        tags[form].append(p)
        for form, s in sessions.items():
            events = json.loads(Path(s.end_profiling()).read_text())
            runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
            for p in positions:
                row = node_sums(events, [e for e, tag in zip(runs, tags[form]) if tag == p])
                out[f"{p} {kv} {form}"] = row
                print(f"standalone P={p} {kv} {form}: run min {row['run_min_ms']:.2f} med {row['run_median_ms']:.2f}; "
                      f"GroupQueryAttention {row[GQA + '_node_min_sum_ms']:.2f}; other nodes "
                      f"{row['other_node_min_sum_ms']:.2f}", flush=True)
    return out


def check_grouped(model_path: str, sets, kv: str, gguf_weights: str, prompt: int = 600) -> float:
    """The grouped form's logits against the compiled form's on a real cache: an engine prefilled with
    ``prompt`` seeded tokens and two decoding steps, then the bound step run once in each form on copies
    of its cache (batch 1, the engine's mask and length). Returns max |logit difference|."""
    import onnxruntime as ort

    from tessera.runtime.generation import loop
    from tessera.runtime.io import checkpoint
    from tessera.runtime.options import GenerateOptions, ModelRef
    from tessera.runtime.serving.engine import Engine, Request

    opened = profiled_sessions(tempfile.mkdtemp())
    o = GenerateOptions(threads=2, kv_cache_dtype=kv, provider="cpu", no_compile_cache=True,
                        gguf_weights=gguf_weights).for_api()
    o.check()
    m = loop.load_model(checkpoint.resolve(ModelRef(spec=model_path, sets=list(sets))), o)
    source, dtype = opened[-1], (np.float16 if kv == "fp16" else np.float32)
    engine = Engine(m, max_batch=1, capacity=prompt + 64, prefill_chunk=512)
    handle = engine.submit(Request(kv_cache_dtype._tokens(model_path, None, prompt), 8))
    while len(handle.tokens) < 3:
        engine.step()
    seq, width, views = engine.rows[0], engine.width, engine._views()
    logits = []
    for form in (source, grouped_form(source, dtype)):
        s = ort.InferenceSession(form, providers=["CPUExecutionProvider"])
        io, keep = s.io_binding(), []
        io.bind_output("logits", "cpu")
        for name, view in views.items():
            a = view[:1].copy()
            keep.append(a)
            io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
            io.bind_output("cache_" + name[len("past_"):], "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        flag = ort.OrtValue.ortvalue_from_numpy(np.array(False))
        keep.append(flag)
        io.bind_ortvalue_input("cache_columns", flag)
        mask = np.concatenate([engine.slots[:1, :width], np.ones((1, 1), np.int64)], axis=1)
        mask[0, seq.filled] = 1
        for name, v in (("tokens", [[seq.next_token]]), ("attention_mask", mask), ("position_ids", [[seq.filled]]),
                        ("cache_length", [seq.filled])):
            io.bind_cpu_input(name, np.asarray(v, np.int64))
        s.run_with_iobinding(io)
        logits.append(io.get_outputs()[0].numpy()[0, -1].astype(np.float64))
    diff = float(np.abs(logits[0] - logits[1]).max())
    print(f"check {kv} --gguf-weights {gguf_weights}, {seq.filled} positions: max |logit grouped - compiled| "
          f"{diff:.3g} of the range {np.ptp(logits[0]):.3g}; argmax equal {logits[0].argmax() == logits[1].argmax()}")
    return diff


def main(argv=None) -> dict:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("model", nargs="?", default=os.environ.get("TESSERA_SMOLLM2_GGUF"),
                   help="a GGUF file, checkpoint folder or spec (default $TESSERA_SMOLLM2_GGUF)")
    a.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a spec's hyperparameter")
    a.add_argument("--positions", default="1024,4096")
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--grouped", action="store_true", help="also the bound step standalone, compiled and grouped")
    a.add_argument("--check-grouped", metavar="GGUF_WEIGHTS",
                   help="only compare the grouped form's logits with the compiled form's, each cache dtype, the model "
                        "compiled with this --gguf-weights (codes, codes-fp32, dequantize)")
    a.add_argument("--json", help="write the results here")
    o = a.parse_args(argv)
    if not o.model:
        a.error("give the model (or set TESSERA_SMOLLM2_GGUF)")
    if o.check_grouped:
        return {kv: check_grouped(o.model, o.set, kv, o.check_grouped) for kv in ("fp32", "fp16")}
    positions = [int(x) for x in o.positions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        result, sources = engine_steps(o.model, o.set, positions, o.steps, o.rounds, o.threads, tmp)
        if o.grouped:
            result["standalone"] = standalone(sources, positions, o.rounds, o.threads, tmp)
    if o.json:
        Path(o.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
