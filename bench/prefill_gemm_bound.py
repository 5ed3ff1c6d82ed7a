"""The least time a prefill can take in onnxruntime on this machine: its matrix products alone, at MLAS's speed.

    python bench/prefill_gemm_bound.py FOLDER --tokens 2048 --rows 256 --threads 2 --rounds 5

Why (issue 40 item 4): at 16 streams the serving engine's decoding steps are at parity with OpenVINO GenAI's
continuous batching, and the gap is the prefill of the 16 prompts (docs/benchmarks/log.md, ob2). Whether batching
prompts can close it depends on where the prefill's time goes: if the linears' products alone, run as single
onnxruntime MatMuls at the call's rows, already take most of it, no scheduling of prompts closes the rest; what
remains is the GEMM kernel (onnxruntime's MLAS against OpenVINO's oneDNN) -- the bound this script computes.

FOLDER is a Hugging Face checkpoint folder of a Llama-shaped decoder (its config.json: hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size). The linears of one
layer as Tessera compiles them (q/k/v fused into one, gate/up fused, o, down; passes/fuse_linears.py), each an
fp32 MatMul of ``--rows`` rows (bench/matmul_probe.py's session: the models' own settings), are timed over
``--rounds`` (min); the bound for ``--tokens`` prompt tokens is layers x their sum x tokens / rows, plus the
head at one row per prompt (last-position logits, ``--prompts``). Attention, norms, rotary and the rest add to
it; the bound leaves them out. Printed: each product's GFLOP/s, the bound in seconds, and the throughput it
implies, which a measured prefill is compared with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matmul_probe import matmul_session  # noqa: E402


def linears(config: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of each fused linear of one layer, as Tessera compiles a Llama-shaped layer."""
    d, ffn = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    hd = config.get("head_dim", d // heads)
    return {"qkv": (d, (heads + 2 * kv) * hd), "o": (heads * hd, d), "gate_up": (d, 2 * ffn), "down": (ffn, d)}


def best_seconds(k: int, n: int, rows: int, threads: int, rounds: int) -> float:
    """The least time of one [rows, k] x [k, n] fp32 MatMul over ``rounds`` runs (after two warm-ups)."""
    rng = np.random.default_rng(0)
    session = matmul_session(rng.standard_normal((k, n), dtype=np.float32), rows, threads)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    for _ in range(2):
        session.run(None, {"x": x})
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a Llama-shaped Hugging Face checkpoint folder (its config.json is read)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens in all (16 prompts of 128: 2048)")
    p.add_argument("--prompts", type=int, default=16, help="prompts (the head runs at one row each)")
    p.add_argument("--rows", type=int, default=256, help="tokens a call (the engine's budget)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args()
    config = json.loads((Path(a.folder) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    rows = {}
    layer_s = 0.0
    flops = 0.0
    for name, (k, n) in linears(config).items():
        s = best_seconds(k, n, a.rows, a.threads, a.rounds)
        rows[name] = {"k": k, "n": n, "ms": 1e3 * s, "gflops": 2 * a.rows * k * n / s / 1e9}
        layer_s += s
        flops += 2 * a.rows * k * n
    head_s = best_seconds(config["hidden_size"], config["vocab_size"], a.prompts, a.threads, a.rounds)
    calls = a.tokens / a.rows
    bound = layers * layer_s * calls + head_s
    result = {"rows": a.rows, "threads": a.threads, "linears": rows, "layers": layers,
              "bound_s": bound, "head_ms": 1e3 * head_s,
              "gflops_overall": flops / layer_s / 1e9}
    if a.json:
        print(json.dumps(result))
        return
    print(f"{a.folder}: {layers} layers, {a.rows} rows a call, {a.threads} threads, min of {a.rounds}")
    print("| linear | K x N | ms | GFLOP/s |\n| --- | --- | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['k']} x {r['n']} | {r['ms']:.2f} | {r['gflops']:.1f} |")
    print(f"bound for {a.tokens} prompt tokens ({a.prompts} prompts): {bound:.2f} s of matrix products "
          f"({result['gflops_overall']:.1f} GFLOP/s; the head {result['head_ms']:.1f} ms)")


if __name__ == "__main__":
    main()
