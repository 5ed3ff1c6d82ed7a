"""A GGUF file's matrices kept as its own codes (``--gguf-weights codes``, the default; ``codes-fp32``)
against the same file dequantised to fp32 (``--gguf-weights dequantize``): the compiled file's size and
the compile's peak memory, the logits, ``tessera perplexity``, and decoding speed; and the
MatMulNBits micro-measurement that decides which GGUF types are kept (float zero points against
uint8 ones and fp32 MatMul at one token).

    python bench/gguf_codes.py FILE.gguf --text TEXT [--chars 16000] [--threads 2] [--tokenizer T] [--json OUT]
    python bench/gguf_codes.py --kernels                # the MatMulNBits paths alone

Each measurement runs the command line in a process of its own (``/usr/bin/time -v`` gives its peak
RSS), the modes one after the other, once: on a shared machine say so beside the figures. The
compile cache is off (each mode compiled afresh); the GGUF conversion itself is cached (run once
before, so it is not timed here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = ("dequantize", "codes-fp32", "codes")
IDS = [1, 504, 3458, 314, 260, 1385, 282, 4649, 30, 2]


def _tessera(*args, threads: int) -> tuple[str, str, int]:
    """Run the command line; (stdout, stderr, peak RSS in kB)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "tessera.runtime.cli", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return done.stdout, done.stderr, rss


def model(path: str, text: str | None, chars: int, threads: int, tokenizer: str | None = None) -> dict:
    out: dict = {}
    work = Path(tempfile.mkdtemp(prefix="gguf-codes-"))
    if text:
        body = Path(text).read_text()[:chars]
        (work / "text.txt").write_text(body)
    logits = {}
    for mode in MODES:
        row: dict = {}
        onnx_path = work / f"{mode}.onnx"
        t0 = time.perf_counter()
        _, _, rss = _tessera("compile", path, "-o", onnx_path, "--gguf-weights", mode, threads=threads)
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        row["compile_peak_rss_mb"] = round(rss / 1024, 1)
        row["file_mb"] = round(sum(p.stat().st_size for p in work.glob(f"{mode}.onnx*")) / 1e6, 1)
        _, _, rss = _tessera("run", path, "--input", f"tokens=[{IDS}]", "--save", work / mode, "--gguf-weights", mode,
                             "--no-compile-cache", threads=threads)
        row["run_peak_rss_mb"] = round(rss / 1024, 1)
        logits[mode] = np.load(work / mode / "logits.npy")
        if text:
            stdout, _, rss = _tessera("perplexity", path, "--text", work / "text.txt", "--context", 512, "--format",
                                      "json", "-q", "--gguf-weights", mode, "--no-compile-cache",
                                      *(["--tokenizer", tokenizer] if tokenizer else []), threads=threads)
            got = json.loads(stdout)
            row["perplexity"] = round(got["perplexity"], 4)
            row["perplexity_tokens_scored"] = got.get("scored") or got.get("tokens_scored")
            row["perplexity_peak_rss_mb"] = round(rss / 1024, 1)
        prompt = [IDS * 13][0][:128]
        stdout, _, rss = _tessera("generate", path, "--input", f"tokens=[{prompt}]", "--max-new-tokens", 128,
                                  "--ignore-eos", "--threads", threads, "--format", "json", "-q", "--gguf-weights",
                                  mode, "--no-compile-cache", threads=threads)
        got = json.loads(stdout)
        row["decode_tokens_per_s"] = round(got.get("decode_tokens_per_s") or got["stats"]["decode_tokens_per_s"], 2)
        row["generate_peak_rss_mb"] = round(rss / 1024, 1)
        out[mode] = row
        print(mode, row, flush=True)
    ref = logits["dequantize"]
    for mode in MODES[1:]:
        d = np.abs(logits[mode] - ref)
        out[mode]["logits_max_abs_diff"] = float(d.max())
        out[mode]["logits_max_abs"] = float(np.abs(ref).max())
        out[mode]["same_argmax"] = float((logits[mode].argmax(-1) == ref.argmax(-1)).mean())
    return out


def kernels(threads: int) -> dict:
    """One 1536 x 576 MatMulNBits at one token, block 32, each path: median and min microseconds."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    n, k = 1536, 576
    nb = k // 32

    def session(nodes, inits):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
        o = ort.SessionOptions()
        o.intra_op_num_threads = threads
        return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])

    def nbits(bits=4, zp=None, acc=0):
        arr = numpy_helper.from_array
        inits = [arr(rng.integers(0, 256, (n, nb, 32 * bits // 8)).astype(np.uint8), "B"),
                 arr(rng.uniform(0.01, 0.1, (n, nb)).astype(np.float32), "S")] + ([arr(zp, "Z")] if zp is not None else [])
        node = helper.make_node("MatMulNBits", ["A", "B", "S"] + (["Z"] if zp is not None else []), ["Y"],
                                domain="com.microsoft", K=k, N=n, bits=bits, block_size=32, accuracy_level=acc)
        return session([node], inits)

    cases = {
        "fp32 MatMul": session([helper.make_node("MatMul", ["A", "W"], ["Y"])],
                               [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")]),
        "4 bits, default zero point, fp32 (Q4_0 codes-fp32)": nbits(),
        "4 bits, uint8 zero points, fp32 (Q4_1 codes-fp32)": nbits(zp=np.zeros((n, nb // 2), np.uint8)),
        "4 bits, float zero points, fp32": nbits(zp=rng.standard_normal((n, nb)).astype(np.float32)),
        "4 bits, default zero point, int8 activations (Q4_0 codes)": nbits(acc=4),
        "4 bits, uint8 zero points, int8 activations (Q4_1 codes)": nbits(zp=np.zeros((n, nb // 2), np.uint8), acc=4),
        "4 bits, float zero points, int8 activations": nbits(zp=rng.standard_normal((n, nb)).astype(np.float32), acc=4),
        "8 bits, default zero point, fp32 (Q8_0 codes-fp32)": nbits(bits=8),
        "8 bits, default zero point, int8 activations (Q8_0 codes)": nbits(bits=8, acc=4),
    }
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = {}
    for name, sess in cases.items():
        for _ in range(20):
            sess.run(None, {"A": x})
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            sess.run(None, {"A": x})
            times.append(time.perf_counter() - t0)
        out[name] = {"median_us": round(float(np.median(times)) * 1e6, 1), "min_us": round(min(times) * 1e6, 1)}
        print(f"{name:60s} median {out[name]['median_us']:8.1f} us  min {out[name]['min_us']:8.1f} us", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", nargs="?", help="a GGUF file")
    p.add_argument("--text", help="a UTF-8 text for tessera perplexity")
    p.add_argument("--chars", type=int, default=16000, help="the text's first N characters (default 16000)")
    p.add_argument("--tokenizer", help="a tokenizer.json for perplexity where the file's tokenizer is not read")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", action="store_true", help="the MatMulNBits micro-measurement")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    result = {"threads": args.threads}
    if args.kernels:
        result["kernels"] = kernels(args.threads)
    if args.gguf:
        result["model"] = model(args.gguf, args.text, args.chars, args.threads, args.tokenizer)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
