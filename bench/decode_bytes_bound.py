"""The least time a decoding step can take on this machine: the weight bytes one token reads, at the measured bandwidth.

    python bench/decode_bytes_bound.py --onnx int4=smol-int4.onnx --gguf q4_0=smol-q4_0.gguf --threads 2 --rounds 20

Why (issue 42 item 3): at one row a decoding step reads every weight matrix once, and on a small CPU that
stream, not the arithmetic, sets the floor. Two engines whose weights differ in bytes a token cannot be equally
fast once both are near that floor, whatever their kernels; this prints each one's bytes and floor, which the
measured steps (bench/gguf_llama_cpp.py) are compared with.

Bytes a token, counted from the files:

- a compiled Tessera file (``--onnx NAME=FILE``; a graph's nodes are counted before its subgraphs', so a
  Transpose of an initializer must sit in the same or an enclosing graph): every MatMulNBits as onnxruntime 1.31's MLAS packs it for its
  int8-activation kernels (accuracy_level 4, the CompInt8 layout of ``SQ4BitGemmPackQuantBDataSize``): per block
  of ``block_size`` weights, the codes (bits x block / 8 bytes), one fp32 scale and one fp32 block sum (the zero
  point folded in) -- 6 bits a weight at 4 bits and block 32 -- whether the file stores zero points or not; the
  same layout is assumed at 8 bits (10 bits a weight at block 32: not read from MLAS's source here); every fp32 MatMul weight at 4 bytes a value; gathers (the embedding) read one
  row a token and are left out;
- a GGUF file (``--gguf NAME=FILE``): each tensor's stored bytes (its type's block layout: Q4_0 4.5 bits a
  weight, Q8_0 8.5, Q6_K 6.56) for every tensor a token reads: all but ``token_embd`` (gathered by row), unless
  the file has no ``output`` tensor (a tied head reads the embedding table whole); the norms' F32 vectors count.

The bandwidth: bench/generate.py's measure (one [1, 768] x [768, 131072] fp32 MatMul in onnxruntime at
``--threads``, 400 MB streamed once a call), best and median of ``--rounds`` calls; on a shared machine the
median is the load's. Attention over the cache (a few hundred KB a token at 128 positions) and the
activations are left out: the floor is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matmul_probe import matmul_session  # noqa: E402


def onnx_bytes(path: str) -> dict:
    """Bytes a token of a compiled file's linears, MatMulNBits at MLAS's CompInt8 packing (module docstring)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    graphs, packed, fp32, count = [model.graph], 0, 0, 0
    seen: set[str] = set()
    while graphs:
        g = graphs.pop()
        for node in g.node:  # a tied float head: MatMul(x, Transpose(embedding)), folded by onnxruntime
            if node.op_type == "Transpose" and node.input[0] in shapes:
                shapes[node.output[0]] = shapes[node.input[0]]
        for node in g.node:
            graphs += [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
            if node.op_type == "MatMulNBits" and node.input[1] not in seen:
                seen.add(node.input[1])
                at = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                blocks = at["N"] * -(-at["K"] // at["block_size"])
                packed += blocks * (at["bits"] * at["block_size"] // 8 + 4 + 4)
                count += 1
            elif node.op_type == "MatMul" and node.input[1] in shapes and node.input[1] not in seen:
                seen.add(node.input[1])
                fp32 += 4 * int(np.prod(shapes[node.input[1]]))
    return {"bytes": packed + fp32, "matmulnbits": count, "matmulnbits_bytes": packed, "fp32_matmul_bytes": fp32}


def gguf_bytes(path: str) -> dict:
    """Bytes a token of a GGUF file's tensors: all but a gathered token_embd (module docstring)."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if t.name != "token_embd.weight" or tied]
    types: dict[str, int] = {}
    for t in read:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return {"bytes": sum(types.values()), "tied_head": tied, "by_type": types}


def bandwidth(threads: int, rounds: int) -> dict:
    """GB/s of a [1, 768] x [768, 131072] fp32 MatMul (bench/generate.py's run_bandwidth), best and median."""
    w = np.random.default_rng(0).standard_normal((768, 131072), dtype=np.float32)
    session, x = matmul_session(w, 1, threads), np.ones((1, 768), np.float32)
    session.run(None, {"x": x})
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return {"gb_s_best": w.nbytes / min(times) / 1e9, "gb_s_median": w.nbytes / statistics.median(times) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--onnx", action="append", default=[], metavar="NAME=FILE", help="a compiled Tessera file")
    p.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE", help="a GGUF file llama.cpp runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    rows = {}
    for spec, count in [(s, onnx_bytes) for s in a.onnx] + [(s, gguf_bytes) for s in a.gguf]:
        name, _, file = spec.partition("=")
        if not Path(file).is_file():
            sys.exit(f"{spec}: no such file (give NAME=FILE)")
        rows[name] = count(file)
    bw = bandwidth(a.threads, a.rounds)
    print(f"bandwidth, fp32 GEMV over 400 MB at {a.threads} threads: best {bw['gb_s_best']:.1f} GB/s, "
          f"median {bw['gb_s_median']:.1f} GB/s")
    print("| weights | MB a token | floor, ms a token (best / median bandwidth) | tokens/s at most |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        best, med = r["bytes"] / bw["gb_s_best"] / 1e6, r["bytes"] / bw["gb_s_median"] / 1e6
        print(f"| {name} | {r['bytes'] / 1e6:.1f} | {best:.2f} / {med:.2f} | {1000 / best:.0f} |")
    print(json.dumps({"bandwidth": bw, "threads": a.threads, "weights": rows}))


if __name__ == "__main__":
    main()
