"""One int4 decoding step, Tessera's compiled graph against onnxruntime-genai's export, each run by
plain onnxruntime in one process, alternating, with the cache bound in place; and the same with
Tessera's gate and up linears left as two MatMulNBits (genai's layout) instead of one fused
MatMulNBits and a Split.

    python bench/int4_step.py --genai-python /work/venvs/genai/bin/python --folder DIR
    python bench/int4_step.py --genai-python PY --folder DIR --rounds 10 --also PY2   # PY2's onnxruntime too

Why: bench/generate.py times each engine's whole loop in its own process, so two runs differ by the
machine's state between them as well as by the graphs, and by the onnxruntime each brings (genai 0.18
bundles onnxruntime 1.32, Tessera's environment has 1.31). Here both graphs run in the same
onnxruntime, in the same process, step after step in alternating rounds: what differs is the graph
alone. The decoding loop around the step is not timed (Tessera's Python loop costs about 20 µs a
token without the onnxruntime call: docs/benchmarks/log.md, "Decode: the int4 step against genai's").

What runs (the Llama-shaped checkpoint of bench/generate.py ``make_weights``, 162 M; B = 1, 128 cached
positions of a 256-slot buffer, one new token; --threads intra-op threads, 1 inter-op):

- ``tessera``: the cached decoder as ``bench/generate.py --quantize int4 --quantize-head`` compiles it
  (``compile_tessera``: int4 block 32, accuracy level 4, the head quantised), bound as
  ``generate``'s BoundStep binds it (past_key.i and the buffer outputs cache_key.i one memory,
  ``cache_columns`` False, the 257-column decode mask, cache_length, position_ids);
- ``tessera-separate``: the same, but with compiler/passes/fuse_linears.py not fusing gate and up
  (q, k and v still fused), so each MLP runs two MatMulNBits and no Split, as genai's graph does (a
  measurement only: the pass is patched in this process, no option of the compiler);
- ``tessera-unwrapped``: Tessera's graph with its bound-step branch (compiler/backends/onnx/bound_step.py)
  lifted out of the top-level If into a model of its own (the branch's nodes, the main graph's
  initializers, the top-level nodes the branch reads): what the If itself costs a step (a measurement only:
  the product would need a second session sharing the weights);
- ``genai``: onnxruntime-genai's model builder export (``-p int4``, its head quantised), bound as
  its generator binds it on CPU (past_key_values.i and present.i one memory, the mask of the filled
  positions and the new one).

Per case and round: 3 warm-up steps, then 40 timed steps; the round's figure is their median. Per case:
min and median over rounds, CPU/wall of the timed steps. ``--profile``: instead, each case's session
with onnxruntime's profiler, 33 steps, and per step (median of the last 30) the time per op type, the
MatMulNBits split by the linear they are (qkv, o, gate+up or gate and up, down, head), the If whole. Not a test: the figures depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jsonout import write_json  # noqa: E402

LAYERS, HEADS, HEAD_SIZE, VOCAB = 12, 12, 64, 32000
CAPACITY, FILLED = 256, 128


def compile_variants(folder: Path, genai_python: str) -> None:
    """The checkpoint, genai's int4 export and Tessera's two graphs in folder (kept when present)."""
    from generate import compile_tessera, make_genai_model, make_weights

    os.environ.update(BENCH_QUANTIZE="int4", BENCH_QUANTIZE_HEAD="1")
    if not (folder / "model.safetensors").exists():
        make_weights(folder, "llama")
    if not (folder / "genai" / "model.onnx").exists():
        make_genai_model(folder, genai_python, "int4")
    for variant in ("tessera", "tessera-separate"):
        sub = folder / variant
        if (sub / "tessera-buffer.onnx").exists():
            continue
        sub.mkdir(exist_ok=True)
        link = sub / "model.safetensors"
        if not link.exists():
            link.symlink_to(folder / "model.safetensors")
        if variant == "tessera":
            compile_tessera(sub, "llama", "buffer", "int4")
            continue
        from tessera.compiler.passes import fuse_linears

        original = fuse_linears.FuseSharedInputLinears._key

        def no_mlp(self, graph, node):  # gate and up stay two linears; q, k, v are still fused
            return None if ".mlp" in node.name else original(self, graph, node)

        fuse_linears.FuseSharedInputLinears._key = no_mlp
        try:
            compile_tessera(sub, "llama", "buffer", "int4")
        finally:
            fuse_linears.FuseSharedInputLinears._key = original
    unwrapped = folder / "tessera-unwrapped" / "tessera-buffer.onnx"
    if not unwrapped.exists():
        unwrapped.parent.mkdir(exist_ok=True)
        unwrap_bound_step(folder / "tessera" / "tessera-buffer.onnx", unwrapped)


def unwrap_bound_step(src: Path, dst: Path) -> None:
    """The else branch of the graph's last node (the bound step's If) as the main graph of dst, with the
    top-level nodes, inputs and initializers it reads (not the If's condition: cache_columns); its
    outputs take the If's names, outputs no branch node makes (the empty cache columns) are dropped."""
    import onnx
    from onnx import helper

    m = onnx.load(str(src))
    top = m.graph.node[-1]
    if top.op_type != "If":
        raise SystemExit(f"{src}: the last node is {top.op_type}, not the bound step's If")
    branch = next(a.g for a in top.attribute if a.name == "else_branch")
    inner = {o for n in branch.node for o in n.output}  # a branch output may also be an outer value
    rename = {b.name: o for b, o in zip(branch.output, top.output) if b.name in inner}
    for n in branch.node:
        n.output[:] = [rename.get(o, o) for o in n.output]
        n.input[:] = [rename.get(x, x) for x in n.input]
    made = {o for n in branch.node for o in n.output}
    outputs = []
    for b, o in zip(branch.output, top.output):
        if o in made:
            vi = onnx.ValueInfoProto()
            vi.CopyFrom(b)
            vi.name = o
            outputs.append(vi)
    read = {x for n in branch.node for x in n.input}
    before = []
    for n in reversed(m.graph.node[:-1]):  # the top-level nodes the branch reads, and what they read
        if any(o in read for o in n.output):
            before.insert(0, n)
            read.update(n.input)
    graph = helper.make_graph(before + list(branch.node), "bound_step",
                              [i for i in m.graph.input if i.name in read], outputs,  # not the If's condition's
                              [i for i in m.graph.initializer if i.name in read] + list(branch.initializer))
    onnx.save(helper.make_model(graph, opset_imports=m.opset_import, ir_version=m.ir_version), str(dst),
              save_as_external_data=True, location=dst.name + ".data")


ROLES = [(r"q\+k\+v|qkv_proj", "qkv"), (r"attn\.o\b|o_proj", "o"), (r"gate\+up", "gate+up"), (r"gate", "gate"),
         (r"up_proj|mlp\.up", "up"), (r"down", "down"), (r"head", "head")]


def _role(node: str) -> str:
    import re

    return next((r for pattern, r in ROLES if re.search(pattern, node)), "other")


def profile_steps(folder: Path, threads: int, tmp: Path, steps: int = 30) -> dict:
    """Each case profiled (its own session, onnxruntime's profiler): ms per step by op type, median of
    the last ``steps`` runs; MatMulNBits also by role; an If counted whole (its branch's nodes are
    counted under their own types as well)."""
    import onnxruntime as ort
    from decode_profile import step_windows

    out = {}
    for case in ("tessera", "tessera-unwrapped", "tessera-separate", "genai"):
        rng, keep = np.random.default_rng(0), []
        opts = _options(threads)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(tmp / case)
        s, io = (genai_step(folder / "genai" / "model.onnx", threads, rng, keep, opts) if case == "genai"
                 else tessera_step(folder / case / "tessera-buffer.onnx", threads, rng, keep, opts))
        for _ in range(steps + 3):
            s.run_with_iobinding(io)
        events = json.loads(Path(s.end_profiling()).read_text())
        per_step = []
        for run, inside in step_windows(events, steps):
            t: dict[str, float] = {"model_run": run["dur"]}
            for e in inside:
                op = e["args"].get("op_name", "?")
                key = f"MatMulNBits {_role(e['name'])}" if op == "MatMulNBits" else ("If (whole)" if op == "If" else op)
                t[key] = t.get(key, 0.0) + e["dur"]
                if op not in ("MatMulNBits", "GroupQueryAttention", "If"):
                    t["small nodes (all)"] = t.get("small nodes (all)", 0.0) + e["dur"]
            per_step.append(t)
        keys = {k for t in per_step for k in t}
        out[case] = {k: float(np.median([t.get(k, 0.0) for t in per_step])) / 1e3 for k in keys}
    return {"onnxruntime": ort.__version__, "load": os.getloadavg()[0], "profile": out}


def _options(threads: int):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.log_severity_level = 3
    return o


def _bind(io, keep: list, name: str, value: np.ndarray) -> None:
    keep.append(value)
    io.bind_cpu_input(name, value)


def _buffers(io, keep: list, rng, past: str, present: str) -> None:
    for i in range(LAYERS):
        for kind in ("key", "value"):
            buf = (rng.standard_normal((1, HEADS, CAPACITY, HEAD_SIZE)) * 0.5).astype(np.float32)
            _bind(io, keep, past.format(i=i, kind=kind), buf)
            io.bind_output(present.format(i=i, kind=kind), "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    logits = np.empty((1, 1, VOCAB), np.float32)
    keep.append(logits)
    io.bind_output("logits", "cpu", 0, np.float32, [1, 1, VOCAB], logits.ctypes.data)


def tessera_step(path: Path, threads: int, rng, keep: list, opts=None):
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), opts or _options(threads), providers=["CPUExecutionProvider"])
    io = s.io_binding()
    _buffers(io, keep, rng, "past_{kind}.{i}", "cache_{kind}.{i}")
    mask = np.zeros((1, CAPACITY + 1), np.int64)  # the buffer's slots, then the new token's column
    mask[:, :FILLED] = 1
    mask[:, -1] = 1
    for name, value in (("tokens", np.array([[5]], np.int64)), ("attention_mask", mask),
                        ("position_ids", np.array([[FILLED]], np.int64)), ("cache_length", np.array([FILLED], np.int64))):
        _bind(io, keep, name, value)
    if "cache_columns" in {i.name for i in s.get_overridable_initializers()}:
        value = ort.OrtValue.ortvalue_from_numpy(np.array(False))
        keep.append(value)
        io.bind_ortvalue_input("cache_columns", value)
    return s, io


def genai_step(path: Path, threads: int, rng, keep: list, opts=None):
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), opts or _options(threads), providers=["CPUExecutionProvider"])
    io = s.io_binding()
    _buffers(io, keep, rng, "past_key_values.{i}.{kind}", "present.{i}.{kind}")
    _bind(io, keep, "input_ids", np.array([[5]], np.int64))
    _bind(io, keep, "attention_mask", np.ones((1, FILLED + 1), np.int64))
    return s, io


def time_steps(folder: Path, rounds: int, threads: int) -> dict:
    """In this Python's onnxruntime: the cases alternating, ``rounds`` times."""
    import onnxruntime as ort

    rng, keep = np.random.default_rng(0), []
    cases = {c: tessera_step(folder / c / "tessera-buffer.onnx", threads, rng, keep)
             for c in ("tessera", "tessera-unwrapped", "tessera-separate")}
    cases["genai"] = genai_step(folder / "genai" / "model.onnx", threads, rng, keep)
    ms: dict[str, list[float]] = {c: [] for c in cases}
    busy: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for c, (s, io) in cases.items():
            for _ in range(3):
                s.run_with_iobinding(io)
            steps = []
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(40):
                t0 = time.perf_counter()
                s.run_with_iobinding(io)
                steps.append(time.perf_counter() - t0)
            busy[c].append((time.process_time() - c0) / (time.perf_counter() - w0))
            ms[c].append(float(np.median(steps)) * 1e3)
    return {"onnxruntime": ort.__version__, "load": os.getloadavg()[0],
            "cases": {c: {"min": min(v), "median": float(np.median(v)), "rounds": v,
                          "cpu_per_wall": float(np.median(busy[c]))} for c, v in ms.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--genai-python", metavar="PYTHON", required=True,
                   help="a Python with onnxruntime-genai 0.18 (its model builder makes the int4 export)")
    p.add_argument("--folder", metavar="DIR", required=True, help="the checkpoint and the three graphs (kept)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--also", metavar="PYTHON", nargs="*", default=[],
                   help="time the same graphs in these Pythons' onnxruntime too (e.g. --genai-python's 1.32)")
    p.add_argument("--profile", action="store_true", help="a per-op profile of each case instead of the timing")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--_time", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._time:
        folder, rounds, threads = args._time
        if args.profile:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                print(json.dumps(profile_steps(Path(folder), int(threads), Path(tmp))))
        else:
            print(json.dumps(time_steps(Path(folder), int(rounds), int(threads))))
        return
    folder = Path(args.folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    compile_variants(folder, args.genai_python)
    results = []
    for python in [sys.executable] + args.also:
        done = subprocess.run([python, __file__, "--_time", str(folder), str(args.rounds), str(args.threads),
                               "--genai-python", args.genai_python, "--folder", str(folder)]
                              + (["--profile"] if args.profile else []), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"timing in {python} failed:\n{done.stderr[-3000:]}")
        res = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(res)
        if args.profile:
            prof = res["profile"]
            keys = sorted({k for v in prof.values() for k in v}, key=lambda k: -max(v.get(k, 0) for v in prof.values()))
            print(f"onnxruntime {res['onnxruntime']} (load average {res['load']:.1f}), ms per step, profiled:")
            print(f"  {'':<26}" + "".join(f"{c:>19}" for c in prof))
            for k in keys:
                print(f"  {k:<26}" + "".join(f"{prof[c][k]:>19.3f}" if k in prof[c] else f"{'-':>19}" for c in prof))
            continue
        print(f"onnxruntime {res['onnxruntime']} (load average {res['load']:.1f}), one int4 step, B=1, "
              f"{FILLED} cached positions, ms (min / median of {args.rounds} rounds):")
        g = res["cases"]["genai"]
        for c, r in res["cases"].items():
            print(f"  {c:<18} {r['min']:.3f} / {r['median']:.3f}   genai ÷ it (above 1: faster than genai) {g['min'] / r['min']:.3f} / "
                  f"{g['median'] / r['median']:.3f}   CPU/wall {r['cpu_per_wall']:.2f}")
    if args.json:
        write_json(args.json, results, indent=1)


if __name__ == "__main__":
    main()
