"""Generation speed: Tessera's KV-cached decoder against transformers' generate, same weights.

    python bench/generate.py                       # GPT-2 small, B=1, 128-token prompt, 128 new tokens
    python bench/generate.py --rounds 3 --repeat 3 --threads 2 --json out/generate.json

Every case runs in its own process, the cases alternate (round 1: each case once, round 2: ...),
and each process times ``--repeat`` generations after one warm-up. Reported per case: prefill
(the prompt's forward pass up to the first new token) and decode (the mean time per later token),
minimum and median over all runs, and CPU time / wall time of the whole generation (how many
cores were busy). Greedy, fp32, the same thread count for onnxruntime and torch. The weights are
a seeded GPT-2 small (transformers' initialisation) saved once as safetensors and read by both.

Cases: ``tessera`` (buffer cache, the default), ``tessera-concat`` (present = past + new, fed back),
``hf-eager`` and ``hf-sdpa`` (GPT2LMHeadModel.generate with that attention implementation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CASES = ("tessera", "tessera-concat", "hf-eager", "hf-sdpa")


def _prompt(n: int, vocab: int) -> list[int]:
    return np.random.default_rng(0).integers(0, vocab, n).tolist()


def run_tessera(folder: Path, mode: str, n: int, new: int, repeat: int, threads: int) -> dict:
    from tessera.runtime import generate as gen
    from tessera.runtime import pipeline

    built = pipeline.build(ROOT / "models" / "gpt2.tsr", "small", [])
    weights = pipeline.weights_for(built, str(folder / "model.safetensors"), 0)
    model, info = gen.compile_cached(built, weights, mode=mode)
    cm = gen.CachedModel(model.SerializeToString(), info, threads=threads)
    del model, weights
    prompt = _prompt(n, 50257)
    runs = []
    for i in range(repeat + 1):
        stats = gen.Stats()
        w0, c0 = time.perf_counter(), time.process_time()
        out = []
        for emitted in gen.stream(cm, [prompt], new, gen.Sampling(), stats=stats):
            out.append(emitted[0])
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if i:  # the first run warms up
            runs.append({"prefill_s": stats.prefill_s, "decode_s": statistics.mean(stats.decode_s),
                         "wall_s": wall, "cpu_s": cpu})
    return {"runs": runs, "tokens": out}


def run_hf(folder: Path, attn: str, n: int, new: int, repeat: int, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation=attn).eval()
    ids = torch.tensor([_prompt(n, 50257)])

    class Clock:
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    runs = []
    for i in range(repeat + 1):
        clock = Clock()
        w0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, streamer=clock)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        t = clock.times  # put(prompt) before prefill, then one put per new token
        if i:
            runs.append({"prefill_s": t[1] - t[0], "decode_s": (t[-1] - t[1]) / (len(t) - 2),
                         "wall_s": wall, "cpu_s": cpu})
    return {"runs": runs, "tokens": out[0, n:].tolist()}


def child(case: str, folder: str, n: int, new: int, repeat: int, threads: int) -> dict:
    folder = Path(folder)
    if case.startswith("tessera"):
        res = run_tessera(folder, "concat" if case == "tessera-concat" else "buffer", n, new, repeat, threads)
    else:
        res = run_hf(folder, case.split("-", 1)[1], n, new, repeat, threads)
    res["case"] = case
    return res


def make_weights(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval().save_pretrained(folder, safe_serialization=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    p.add_argument("--repeat", type=int, default=2, help="timed generations per process (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="processes per case, alternating (default 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for onnxruntime and torch")
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        case, folder = args._child
        print(json.dumps(child(case, folder, args.prompt, args.new, args.repeat, args.threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_weights(folder)
        results: dict[str, list] = {c: [] for c in args.cases}
        tokens = {}
        for r in range(args.rounds):
            for case in args.cases:
                cmd = [sys.executable, __file__, "--_child", case, str(folder), "--prompt", str(args.prompt),
                       "--new", str(args.new), "--repeat", str(args.repeat), "--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
                if out.returncode:
                    sys.exit(f"{case} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results[case] += res["runs"]
                tokens[case] = res["tokens"]
                print(f"round {r + 1}: {case}: decode {statistics.median(x['decode_s'] for x in res['runs']) * 1e3:.1f} "
                      f"ms/token", file=sys.stderr)
    rows = []
    for case, runs in results.items():
        dec = [x["decode_s"] for x in runs]
        pre = [x["prefill_s"] for x in runs]
        rows.append({"case": case, "runs": len(runs),
                     "prefill_ms_min": min(pre) * 1e3, "prefill_ms_median": statistics.median(pre) * 1e3,
                     "decode_ms_min": min(dec) * 1e3, "decode_ms_median": statistics.median(dec) * 1e3,
                     "decode_tok_s_median": 1 / statistics.median(dec),
                     "cpu_per_wall": statistics.median(x["cpu_s"] / x["wall_s"] for x in runs),
                     "same_tokens_as_first_case": tokens[case] == tokens[args.cases[0]]})
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}"
    print(f"GPT-2 small, B=1, prompt {args.prompt}, {args.new} new tokens, greedy, fp32, {args.threads} threads; "
          f"{machine}")
    print("| case | runs | prefill ms (min / median) | decode ms/token (min / median) | decode tok/s (median) "
          "| CPU/wall | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['runs']} | {r['prefill_ms_min']:.1f} / {r['prefill_ms_median']:.1f} | "
              f"{r['decode_ms_min']:.2f} / {r['decode_ms_median']:.2f} | {r['decode_tok_s_median']:.1f} | "
              f"{r['cpu_per_wall']:.2f} | {'yes' if r['same_tokens_as_first_case'] else 'no'} |")
    base = {r["case"]: r for r in rows}
    if "tessera" in base:
        for other in ("hf-eager", "hf-sdpa"):
            if other in base:
                print(f"decode speed-up tessera vs {other}: "
                      f"{base[other]['decode_ms_median'] / base['tessera']['decode_ms_median']:.2f}x (median), "
                      f"prefill {base[other]['prefill_ms_median'] / base['tessera']['prefill_ms_median']:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": rows, "settings": vars(args) | {"machine": machine}}, indent=2))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
