"""Which decoding kernel the serving engine should use: one engine step at B rows of uneven lengths,
the plain branch (MatMul/Softmax over the shared buffer, a per-row mask) against onnxruntime's
GroupQueryAttention with per-row ``seqlens_k`` over the same buffer (bound in place).

    python bench/serve_decode.py                       # the issue's Llama shape, B = 16, 2 threads
    python bench/serve_decode.py --model small --rows 16 --rounds 5

Both engines get the same requests (prompts uniform in [--prompt-min, --prompt-max], greedy), are
stepped until every prompt is in the cache, then timed in alternating rounds of --steps decoding
steps each (``Engine.step``: scheduling, the onnxruntime call, token choice), so the two see the
same lengths and, on a shared machine, the same load. Reported: ms per step per kernel and round,
and the ratio plain / gqa per round (> 1: GroupQueryAttention is faster); the median ratio is what
to read on a busy machine. The tokens of the two engines are compared too (greedy: equal).

Not a timed test: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import MODELS, _vocab, prompts  # noqa: E402


def engine_for(model_args: dict, decode: str, rows: int, threads: int | None, capacity: int | None):
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine

    model = serving_model.load(model_args["spec"], variant=model_args.get("variant"), sets=model_args["sets"],
                               threads=threads, decode=decode)
    return Engine(model, max_batch=rows, max_queue=0, capacity=capacity, prefill_chunk=256)


def main() -> None:
    from tessera.runtime.serving.engine import Request

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="llama")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="decoding steps per round and kernel")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    model_args = MODELS[args.model]
    ps = prompts(args.rows, args.prompt_min, args.prompt_max, _vocab(model_args["sets"]))
    new = args.steps * args.rounds + 8
    engines = {k: engine_for(model_args, k, args.rows, args.threads, None) for k in ("plain", "gqa")}
    handles = {}
    for k, e in engines.items():
        handles[k] = [e.submit(Request(list(pr), new)) for pr in ps]
        while any(s.prefilling for s in e.rows) or e.queued:
            e.step()
        e.step()  # warm-up: one decoding step at this width
    times = {k: [] for k in engines}
    for _ in range(args.rounds):
        for k, e in engines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                e.step()
            times[k].append((time.perf_counter() - start) / args.steps * 1e3)
    lengths = sorted(s.filled for s in engines["plain"].rows)
    print(f"model {args.model}, {args.rows} rows of {lengths[0]}..{lengths[-1]} cached positions, "
          f"threads {args.threads}, {args.steps} steps per round")
    for k in engines:
        print(f"  {k:<6} ms/step per round: " + " ".join(f"{t:6.1f}" for t in times[k]))
    ratios = [a / b for a, b in zip(times["plain"], times["gqa"])]
    print("  plain/gqa per round:    " + " ".join(f"{r:6.2f}" for r in ratios))
    print(f"  median plain/gqa {statistics.median(ratios):.2f} (> 1: GroupQueryAttention faster); "
          f"best ms/step plain {min(times['plain']):.1f}, gqa {min(times['gqa']):.1f}")
    same = all(a.tokens == b.tokens for a, b in zip(handles["plain"], handles["gqa"]))
    print(f"  greedy tokens equal between the kernels: {same}")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
