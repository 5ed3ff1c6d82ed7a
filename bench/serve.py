"""Serving throughput and latency: `tessera serve` under a bounded load on loopback, against
Tessera's one-request-at-a-time ``generate`` and a static batch, on the same weights and threads.

    python bench/serve.py                                   # a small Llama-shaped model, quick
    python bench/serve.py --model llama --requests 32       # the issue's Llama shape (hidden 768, 12 layers)
    python bench/serve.py --model gpt2 --concurrency 1 4 16 32
    python bench/serve.py --model tiny --concurrency 16 16 16 16 --requests 250 --new 16 --prompt-max 64
                                                            # a soak: 1,000 requests, RSS after each 250
    python bench/serve.py --model llama --genai-python /path/to/genai-venv/bin/python
                                                            # and onnxruntime-genai's static batches
    python bench/serve.py --model llama --concurrency 16 --no-serve --genai-python PY
                                                            # the static batches only (equal prompts: both)
    python bench/serve.py --model llama --concurrency 16 --requests 64 --prefill-chunk 32 64 128 --rounds 2
                                                            # steady state (prompts arriving while others
                                                            # decode), one server per chunk budget
    python bench/serve.py --model llama --concurrency 1 16 --requests 64 --quantize w8a8 --quantize-head \
        --genai-python PY                                   # every case quantised (the server, generate,
                                                            # the static batches); genai at int8

What runs (weights seeded; a word-level tokenizer over the model's vocabulary, one word per id, so
every new token is one streamed chunk of text):

- ``generate-1``: the engine's compiled decoder (GroupQueryAttention decoding, the engine's choice:
  bench/serve_decode.py) through ``generate``, one request at a time: aggregate tokens/s = all new
  tokens / all the time; and the same with the plain decoding branch;
- ``static-C``: ``generate`` over C prompts at once (left-padded, every row to the end), and its
  ratio to ``generate-1``: how many one-stream steps a step of C rows costs on this machine (the
  issue's 6x goal at C = 16 assumes a static batch of 16 is itself well past 6x one stream, and its
  p99 inter-token latency goal of 3x one stream's step assumes a step of 16 rows under 3x);
- ``static-C-equal``: the same over C prompts of one length, the tokens onnxruntime-genai's static batch
  gets (``equal_batch``: the mean of --prompt-min and --prompt-max), so the two static batches do the
  same work (apples to apples: left-padded prompts of different lengths pad every row to the longest);
- ``ort-genai-static-C`` (with ``--genai-python``, ``--model llama`` only): onnxruntime-genai's
  Generator with ``batch_size`` = C over C prompts of one length (the mean of --prompt-min and
  --prompt-max: its best case), on its model builder's fp32 export of a checkpoint of the same shape
  (bench/generate.py ``make_weights``, ``make_genai_model``), in a child process of that Python
  (onnxruntime-genai 0.18 brings its own onnxruntime; its builder needs torch, transformers, onnx_ir);
- with ``--quantize`` (and ``--quantize-head``), every Tessera case runs the model quantised so (the
  server gets the same flags) and onnxruntime-genai's builder exports at ``--genai-precision``
  (default: int8 for int8 and w8a8, int4 for int4, fp32 without --quantize);
- ``serve-C``: the server in its own process (``tessera serve``, --max-batch = the largest C), C
  client threads each sending streaming completions one after another until the level's requests
  are done (prompts of different lengths, uniform in [--prompt-min, --prompt-max], ``--new`` tokens
  each, greedy, ``ignore_eos``). Per level: aggregate output tokens/s (all completion tokens / the
  level's wall time), time to first token p50/p99 (from sending the request to its first text chunk),
  inter-token latency p50/p99 (between successive chunks of one stream), the server's CPU time
  over wall time, the load generator's own (``client_cpu_s``: its threads run on the same cores) and
  the server's resident memory after the level. A level C > 1 runs --requests requests
  (at least C): with more than C, each client sends its next request when its last one ends, so
  prompts arrive while the others decode (the steady state of a loaded server; with exactly C they
  all arrive at once, a burst, whose start and end run fewer rows than C). Level 1 runs
  --baseline-requests requests, the prompts ``generate-1`` runs. With several --prefill-chunk
  values (the engine's token budget per iteration: what trades inter-token latency for throughput),
  one server per value, the values in alternating order over --rounds rounds.

Every case also gives its CPU seconds (``cpu_s``: the process's user + system time over the case,
all its threads; for ``serve-C`` the server process's), so a case that waited on a busy machine shows
a CPU/wall under the threads it was given.

Not a timed test: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from jsonout import write_json  # the bench folder: this script's own

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": {"spec": "gpt2", "sets": ["layers=2", "d=64", "heads=4", "vocab=1000", "ctx=512"]},
    "small": {"spec": "llama", "sets": ["vocab=4000", "d=256", "layers=4", "heads=8", "kv_heads=4", "d_ff=704",
                                        "ctx=1024"]},
    "llama": {"spec": "llama", "sets": ["vocab=32000", "d=768", "layers=12", "heads=12", "kv_heads=12", "d_ff=3072",
                                        "ctx=512"]},
    "gpt2": {"spec": "gpt2", "variant": "small", "sets": []},
}


def _vocab(sets: list[str], default: int = 50257) -> int:
    for s in sets:
        if s.startswith("vocab="):
            return int(s.split("=")[1])
    return default


def make_tokenizer(folder: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def equal_batch(c: int, length: int, vocab: int) -> list[list[int]]:
    """C prompts of ``length`` tokens: the batch both static batches of equal prompts get (Tessera's
    and onnxruntime-genai's, in its child process)."""
    return np.random.default_rng(0).integers(3, vocab, (c, length)).tolist()


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def baselines(args, model_args: dict, ps: list[list[int]]) -> list[dict]:
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.serving import model as serving_model

    from tessera.runtime.pipeline import quant_config

    rows = []
    quant_config(args.quantize, head=args.quantize_head)  # a bad combination refused before anything loads
    load = lambda decode=None: serving_model.load(model_args["spec"], variant=model_args.get("variant"),  # noqa: E731
                                                  sets=model_args["sets"], threads=args.threads, decode=decode,
                                                  quantize=args.quantize, quantize_head=args.quantize_head)
    engine_model, plain = load(), load("plain")
    kernel = serving_model.decode_kernel(engine_model.info)
    one = None
    for name, m in ((f"generate-1 ({kernel} decode, the engine's)", engine_model),
                    ("generate-1 (plain decode)", plain)):
        gen.generate(m, [ps[0]], 4)  # warm-up
        start, cpu0, new = time.perf_counter(), time.process_time(), 0
        for p in ps[:args.baseline_requests]:
            new += len(gen.generate(m, [p], args.new).tokens[0])
        wall = time.perf_counter() - start
        rows.append({"case": name, "tokens_per_s": new / wall, "wall_s": wall, "cpu_s": time.process_time() - cpu0})
        one = one or rows[-1]["tokens_per_s"]
    del plain
    length = (args.prompt_min + args.prompt_max) // 2
    for c in args.concurrency:
        if c == 1:
            continue
        for name, batch in ((f"static-{c} (generate, left-padded)", ps[:c]),
                            (f"static-{c}-equal (generate, {length}-token prompts)",
                             equal_batch(c, length, engine_model.vocab))):
            gen.generate(engine_model, batch, 2)
            start, cpu0 = time.perf_counter(), time.process_time()
            res = gen.generate(engine_model, batch, args.new)
            wall = time.perf_counter() - start
            tps = res.stats.new_tokens / wall
            rows.append({"case": name, "tokens_per_s": tps, "wall_s": wall, "cpu_s": time.process_time() - cpu0,
                         "x_one_stream": tps / one, "step_in_one_stream_steps": c * one / tps})
    return rows


def genai_static(args, ps: list[list[int]]) -> list[dict]:
    """onnxruntime-genai's static batch of C (each level C > 1, and 1), in a child process of
    --genai-python, on its builder's export of a checkpoint of the Llama shape."""
    sys.path.insert(0, str(ROOT / "bench"))
    from generate import make_genai_model, make_weights

    length = (args.prompt_min + args.prompt_max) // 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_weights(folder, "llama")
        make_genai_model(folder, args.genai_python, args.genai_precision)
        for c in args.concurrency:
            cmd = [args.genai_python, __file__, "--_genai", str(folder / "genai"), str(c), str(length), str(args.new),
                   str(args.threads or os.cpu_count())]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"onnxruntime-genai failed:\n{out.stderr[-3000:]}")
            rows.append({"case": f"ort-genai-static-{c} (batch_size {c}, {length}-token prompts, {args.genai_precision})",
                         **json.loads(out.stdout.strip().splitlines()[-1])})
    return rows


def genai_child(folder: str, c: int, length: int, new: int, threads: int) -> dict:
    """In the onnxruntime-genai Python: a warm-up, then one Generator over C prompts of ``length``
    tokens decoding ``new`` tokens each (min_length: no early end), timed from append_tokens (prefill
    included, as Tessera's static batch)."""
    import onnxruntime_genai as og

    cfg = og.Config(folder)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    batch = np.array(equal_batch(c, length, 32000), dtype=np.int32)
    for n in (4, new):  # warm-up, then the timed run
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length + n, min_length=length + n, do_sample=False, batch_size=c)
        start, cpu0 = time.perf_counter(), time.process_time()
        g = og.Generator(model, params)
        g.append_tokens(batch)
        steps = 0
        while not g.is_done():
            g.generate_next_token()
            steps += 1
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        del g
    return {"tokens_per_s": c * steps / wall, "wall_s": wall, "cpu_s": cpu}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_levels(args, model_args: dict, tokenizer: Path, ps: list[list[int]], chunk: int) -> list[dict]:
    """Each concurrency level against one server started with --prefill-chunk ``chunk``."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from tessera.runtime.cli import main; sys.exit(main())", "serve",
           model_args["spec"], *sum((["--set", s] for s in model_args["sets"]), []), "--tokenizer", str(tokenizer),
           "--port", str(port), "--max-batch", str(max(args.concurrency)), "--max-queue", "256",
           "--prefill-chunk", str(chunk)]
    if model_args.get("variant"):
        cmd += ["--variant", model_args["variant"]]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.quantize != "none":
        cmd += ["--quantize", args.quantize] + (["--quantize-head"] if args.quantize_head else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {proc.stderr.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        texts = [" ".join(f"w{t}" for t in p) for p in ps]

        def one(client, text):
            sent = time.perf_counter()
            stamps, tokens = [], 0
            body = {"prompt": text, "max_tokens": args.new, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return None
                for line in r.iter_lines():
                    if not line.startswith("data:") or "[DONE]" in line:
                        continue
                    data = json.loads(line[5:])
                    if data.get("usage"):
                        tokens = data["usage"]["completion_tokens"]
                    elif data["choices"] and data["choices"][0]["text"]:
                        stamps.append(time.perf_counter())
            return sent, stamps, tokens

        one(httpx.Client(timeout=600), texts[0])  # warm-up
        for c in args.concurrency:
            n = args.baseline_requests if c == 1 else max(args.requests, c)
            todo = list(range(n))
            lock, results, errors = threading.Lock(), [], [0]

            def worker():
                with httpx.Client(timeout=600) as client:
                    while True:
                        with lock:
                            if not todo:
                                return
                            i = todo.pop(0)
                        r = one(client, texts[i % len(texts)])
                        with lock:
                            if r is None:
                                errors[0] += 1
                            else:
                                results.append(r)

            cpu0, start, client0 = _cpu_s(proc.pid), time.perf_counter(), time.process_time()
            threads = [threading.Thread(target=worker) for _ in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall, cpu = time.perf_counter() - start, _cpu_s(proc.pid) - cpu0
            client_cpu = time.process_time() - client0  # the load generator's threads, on the same cores
            ttft = [s[0] - sent for sent, s, _ in results if s]
            itl = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
            total = sum(t for _, _, t in results)
            rows.append({"case": f"serve-{c}", "prefill_chunk": chunk, "requests": len(results), "errors": errors[0],
                         "tokens_per_s": total / wall, "wall_s": wall, "ttft_p50_ms": pct(ttft, 50),
                         "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
                         "cpu_per_wall": cpu / wall, "cpu_s": cpu, "client_cpu_s": client_cpu,
                         "server_rss_mib": _rss_mib(proc.pid)})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def _label(r: dict) -> str:
    """A row's case, with the chunk budget and round of a serve level when the run had several."""
    if "prefill_chunk" not in r:
        return r["case"]
    return f"{r['case']} (chunk {r['prefill_chunk']}, round {r['round']})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="small")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least the level)")
    p.add_argument("--baseline-requests", type=int, default=4,
                   help="requests run one at a time by generate (and by the server at concurrency 1)")
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--new", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--prefill-chunk", type=int, nargs="+", default=[128],
                   help="the server's --prefill-chunk (its token budget per iteration); several: one server each")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the serve levels (the chunk values alternating)")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    p.add_argument("--genai-python", metavar="PYTHON",
                   help="a Python with onnxruntime-genai 0.18 (and its builder's torch, transformers, onnx_ir): "
                        "adds its static batch of each concurrency (--model llama only)")
    p.add_argument("--quantize", choices=["none", "int8", "int4", "w8a8"], default="none",
                   help="every Tessera case quantised so (tessera's --quantize)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: the output head too")
    p.add_argument("--genai-precision", choices=["fp32", "int8", "int4"],
                   help="onnxruntime-genai's builder precision (default: int8 for --quantize int8 and w8a8, int4 "
                        "for int4, else fp32)")
    p.add_argument("--no-serve", action="store_true",
                   help="the in-process baselines (and onnxruntime-genai's static batches) only, no server")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--_genai", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._genai:
        folder, c, length, new, threads = args._genai
        print(json.dumps(genai_child(folder, int(c), int(length), int(new), int(threads))))
        return
    args.genai_precision = args.genai_precision or {"none": "fp32", "int4": "int4"}.get(args.quantize, "int8")
    if args.genai_python and args.model != "llama":
        raise SystemExit("--genai-python needs --model llama (onnxruntime-genai's builder has no GPT-2 here)")
    model_args = MODELS[args.model]
    vocab = _vocab(model_args["sets"])
    ps = prompts(max(max(args.concurrency), args.requests), args.prompt_min, args.prompt_max, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(Path(tmp), vocab)
        rows = baselines(args, model_args, ps)
        if not args.no_serve:
            for r in range(args.rounds):
                for chunk in (args.prefill_chunk if r % 2 == 0 else args.prefill_chunk[::-1]):
                    rows += [{**row, "round": r} for row in serve_levels(args, model_args, tokenizer, ps, chunk)]
    if args.genai_python:
        rows += genai_static(args, ps)
    quantized = f", --quantize {args.quantize}{' --quantize-head' if args.quantize_head else ''}" \
        if args.quantize != "none" else ""
    print(f"model {args.model} ({' '.join(model_args['sets']) or model_args.get('variant')}{quantized}), prompts "
          f"{args.prompt_min}-{args.prompt_max} tokens, {args.new} new, threads {args.threads or os.cpu_count()}")
    for r in rows:
        extra = ""
        if "ttft_p50_ms" in r:
            extra = (f"  TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms  ITL p50 {r['itl_p50_ms']:.1f} "
                     f"p99 {r['itl_p99_ms']:.1f} ms  CPU/wall {r['cpu_per_wall']:.2f} (client "
                     f"{r['client_cpu_s'] / r['wall_s']:.2f})  RSS {r['server_rss_mib']:.0f} MiB  "
                     f"{r['requests']} requests, {r['errors']} errors")
        if "x_one_stream" in r:
            extra = (f"  {r['x_one_stream']:.2f}x one stream (a step of these rows = {r['step_in_one_stream_steps']:.2f} "
                     f"one-stream steps)")
        cpu = f"  CPU {r['cpu_s']:.2f} s / wall {r['wall_s']:.2f} s" if "cpu_s" in r else ""
        print(f"{_label(r):<48} {r['tokens_per_s']:8.1f} tokens/s{cpu}{extra}")
    one = rows[0]["tokens_per_s"]
    step = 1e3 / one  # one stream's step, ms
    for r in rows:
        if r["case"].startswith(("serve-", "ort-genai-static-")):
            itl = f", p99 ITL {r['itl_p99_ms'] / step:.2f}x one stream's step" if "itl_p99_ms" in r else ""
            name = _label(r) if "prefill_chunk" in r else r["case"].split(" ")[0]
            print(f"{name}: {r['tokens_per_s'] / one:.2f}x generate-1{itl}")
    by = {r["case"].split(" ")[0]: r["tokens_per_s"] for r in rows if "prefill_chunk" not in r}
    for c in args.concurrency:  # the two static batches on the same equal prompts (apples to apples)
        genai = by.get(f"ort-genai-static-{c}")
        if f"static-{c}-equal" in by and genai:
            ratio = by[f"static-{c}-equal"] / genai
            print(f"static-{c}-equal / ort-genai-static-{c}: {ratio:.3f}"
                  f" (the same {(args.prompt_min + args.prompt_max) // 2}-token prompts)")
        for r in rows:
            if genai and r["case"] == f"serve-{c}":
                print(f"{_label(r)} / ort-genai-static-{c}: {r['tokens_per_s'] / genai:.3f}")
    if args.json:
        write_json(args.json, rows, indent=1)


if __name__ == "__main__":
    main()
