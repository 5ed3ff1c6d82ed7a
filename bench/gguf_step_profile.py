"""Where the decoding step of a compiled cached decoder goes, by onnxruntime's own profiler, as ``tessera generate``
runs it (issue 42 item 3: "find where the rest of the step goes"; bench/decode_profile.py profiles the serving
engine's step against onnxruntime-genai's on a seeded checkpoint instead).

    tessera compile MODEL.gguf --kv-cache -o smol.onnx
    python bench/gguf_step_profile.py smol.onnx --threads 2 --prompt 128 --steps 64

Runs ``generate`` (greedy, one row, ``--prompt`` seeded ids, ``--steps`` new tokens) on the compiled cached decoder
with onnxruntime's profiling on, then sums the kernels' times over the decoding steps (every run after the prompt's)
by operator type and by node: a step's time (``model_run``), its nodes, and the heaviest operators. The profiler
adds its own cost to every node (a step here takes 1.5x its unprofiled time): read the shares, not the
milliseconds. An ``If``'s time holds its branch's nodes (the decoding branch of the cached graph), which are also
listed by their own types; the shares are of the kernels' sum, the ``If`` itself left out.

Where the rest of a step goes (issue 42 item 3): the step's wall time a token (``generate``'s decoding rate) is
split into onnxruntime's run (``model_run``), the kernels inside it (their sum), the run's time outside its
kernels divided by the nodes a step (what onnxruntime spends per node between kernels: scheduling, allocation,
the If), and the time outside the run (the Python loop: sampling, binding, the next step's inputs); and the nodes
a step per layer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import numpy as np


def profile(path: str, threads: int, prompt: int, steps: int) -> dict:
    import onnxruntime as ort

    from tessera.runtime.generation import cached as gen

    model = gen.CachedModel.from_onnx(path, threads=threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.enable_profiling = True
    model.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])  # the same graph, profiled
    ids = [int(x) for x in np.random.default_rng(0).integers(10, min(model.vocab or 1000, 49000), prompt)]
    result = gen.generate(model, [ids], steps)
    profile_file = model.session.end_profiling()
    try:
        events = json.load(open(profile_file))
    finally:
        os.remove(profile_file)
    runs = [e for e in events if e.get("name") == "model_run"]
    prompt_end = runs[0]["ts"] + runs[0]["dur"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["ts"] > prompt_end and e["name"].endswith("_kernel_time")]
    n = len(runs) - 1
    by_op, count, by_node = collections.Counter(), collections.Counter(), collections.Counter()
    for e in nodes:
        op = e["args"].get("op_name", "?")
        by_op[op] += e["dur"]
        count[op] += 1
        by_node[e["name"].removesuffix("_kernel_time")] += e["dur"]
    inner = sum(us for op, us in by_op.items() if op != "If")
    step_ms = sum(r["dur"] for r in runs[1:]) / n / 1000
    nodes_per_step = sum(c for op, c in count.items() if op != "If") // n
    token_ms = 1000 / result.stats.decode_tokens_per_s
    layers = count["GroupQueryAttention"] // n or 1  # one attention node a layer in the decoding branch
    return {"token_ms": token_ms, "kernels_ms": inner / n / 1000, "outside_run_ms": token_ms - step_ms,
            "per_node_us": (step_ms - inner / n / 1000) * 1000 / max(nodes_per_step, 1),
            "nodes_per_layer": nodes_per_step / layers, "layers": layers,
            "steps": n, "step_ms": step_ms, "nodes_per_step": nodes_per_step,
            "tokens_per_s": result.stats.decode_tokens_per_s,
            "ops": [(op, us / n / 1000, us / inner, count[op] // n) for op, us in by_op.most_common() if op != "If"],
            "nodes": [(name, us / n / 1000) for name, us in by_node.most_common(8) if not name.endswith("/If")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a cached decoder compiled with --kv-cache")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    a = p.parse_args()
    r = profile(a.model, a.threads, a.prompt, a.steps)
    print(f"{a.model}: {r['steps']} decoding steps, {r['step_ms']:.2f} ms a step profiled, {r['nodes_per_step']} nodes "
          f"a step, {r['tokens_per_s']:.1f} tokens/s profiled")
    print("| operator | ms a step | share of the kernels | nodes a step |\n| --- | ---: | ---: | ---: |")
    for op, ms, share, c in r["ops"][:12]:
        print(f"| {op} | {ms:.3f} | {100 * share:.1f} % | {c} |")
    print(f"a token {r['token_ms']:.2f} ms (profiled): onnxruntime's run {r['step_ms']:.2f} ms, of which its kernels "
          f"{r['kernels_ms']:.2f} ms and {r['per_node_us']:.1f} us a node between them ({r['nodes_per_step']} nodes, "
          f"{r['nodes_per_layer']:.1f} a layer over {r['layers']} layers); outside the run (the Python loop) "
          f"{r['outside_run_ms']:.2f} ms")
    print("heaviest nodes: " + "; ".join(f"{name} {ms:.3f} ms" for name, ms in r["nodes"][:5]))


if __name__ == "__main__":
    main()
