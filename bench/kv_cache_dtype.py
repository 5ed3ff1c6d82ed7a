"""The KV cache at fp16 against fp32 (``--kv-cache-dtype fp16``, issue 40 item 2): decode speed at long
contexts, sequences that fit a fixed memory, and the quality on real text.

    python bench/kv_cache_dtype.py $GGUF                      # SmolLM2-135M (TESSERA_SMOLLM2_GGUF)
    python bench/kv_cache_dtype.py $GGUF --positions 1024,4096 --steps 32 --rounds 2 --threads 2 \\
        --memory-gib 1 --text 000_b9c095075ac9a444.txt --quality-tokens 768

- speed: per context P in --positions, a prompt of P tokens (the text's, repeated) prefilled once into
  a one-slot serving engine per cache dtype; then --steps decoding steps of each engine, alternating,
  --rounds times (each step timed: the cache bound in place, GroupQueryAttention writing its column),
  in one process, so drift on the busy machine falls on both. Reported: min and median ms/step over
  every step, and fp16 / fp32 of each.
- memory: the serving engine (runtime/serving/engine.py) with one slot at the context, its cache read
  from its buffers (``Engine.cache_bytes``: their nbytes); sequences at the largest --positions that fit
  --memory-gib GiB = floor(GiB / bytes per slot).
- quality (--text): the text's first --quality-tokens tokens, the first quarter as the prompt and each
  later token fed one at a time (teacher forcing) through the decoding step over the cache (the bound
  step, as the engine runs it: with an fp16 cache the grouped form, compiler/backends/onnx/grouped_decode.py,
  but at the buffer's last G - 1 columns), so every scored token is predicted by the step that reads the cache: the perplexity of those tokens, the largest
  |logits(fp16) - logits(fp32)| over the fp32 logits' range, and the steps whose argmax differs.
``tessera perplexity`` scores windows with the full model (no cache), so it cannot say this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def _tokens(model_path: str, text: str | None, n: int) -> list[int]:
    """n ids of the text (repeated to length), by the model's tokenizer; seeded ids without a text or a
    tokenizer (a spec: its vocabulary is taken to be at least 100)."""
    from tessera.runtime.io import gguf_file
    from tokenizers import Tokenizer

    folder = gguf_file.folder_for(model_path) if str(model_path).endswith(".gguf") else Path(model_path)
    if text is None or not (folder / "tokenizer.json").is_file():
        return np.random.default_rng(0).integers(1, 100, n).tolist()
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(Path(text).read_text()).ids
    return (ids * (n // len(ids) + 1))[:n]


def _load(model_path: str, kv: str, threads: int, sets=(), gguf_weights: str = "codes"):
    from tessera.runtime.generation import loop
    from tessera.runtime.io import checkpoint
    from tessera.runtime.options import GenerateOptions, ModelRef

    o = GenerateOptions(threads=threads, kv_cache_dtype=kv, provider="cpu", no_compile_cache=True,
                        gguf_weights=gguf_weights).for_api()
    o.check()
    ref = checkpoint.resolve(ModelRef(spec=model_path, sets=list(sets)))  # a GGUF file or folder: its spec
    return loop.load_model(ref, o)


def speed(models: dict, prompt_of, positions: list[int], steps: int, rounds: int) -> dict:
    """Per context P: each model's serving engine (one slot) holds one request whose prompt is P tokens,
    prefilled once; then, alternating, each engine runs ``steps`` decoding steps (each timed: one
    Engine.step, the cache bound in place, GroupQueryAttention writing its column), ``rounds`` times. The
    contexts grow by steps x rounds positions over the run (both alike)."""
    from tessera.runtime.serving.engine import Engine, Request

    out = {}
    for p in positions:
        prompt = prompt_of(p)
        engines = {}
        for kv, m in models.items():
            engine = Engine(m, max_batch=1, capacity=p + steps * rounds + 8, prefill_chunk=512)
            handle = engine.submit(Request(prompt, steps * rounds + 4))
            while len(handle.tokens) < 2:  # the prompt in chunks, its first token, one decoding step
                engine.step()
            engines[kv] = engine
        times = {kv: [] for kv in models}
        for _ in range(rounds):
            for kv, engine in engines.items():  # alternating
                for _ in range(steps):
                    t = time.perf_counter()
                    engine.step()
                    times[kv].append(time.perf_counter() - t)
        row = {kv: {"min_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t), "steps": len(t)}
               for kv, t in times.items()}
        row["fp16/fp32 min"] = row["fp16"]["min_ms"] / row["fp32"]["min_ms"]
        row["fp16/fp32 median"] = row["fp16"]["median_ms"] / row["fp32"]["median_ms"]
        out[p] = row
        print(f"P={p}: " + "  ".join(f"{kv} min {r['min_ms']:.2f} med {r['median_ms']:.2f} ms/step"
                                     for kv, r in row.items() if isinstance(r, dict))
              + f"  fp16/fp32 min {row['fp16/fp32 min']:.3f} median {row['fp16/fp32 median']:.3f}", flush=True)
    return out


def memory(models: dict, context: int, gib: float) -> dict:
    from tessera.runtime.serving.engine import Engine

    out = {}
    for kv, m in models.items():
        engine = Engine(m, max_batch=1, capacity=context)
        per_slot = engine.cache_bytes  # the buffers' nbytes, one slot at the context
        out[kv] = {"bytes_per_sequence": per_slot, "sequences": int(gib * 2**30 // per_slot)}
    out["ratio"] = out["fp16"]["sequences"] / out["fp32"]["sequences"]
    print(f"memory at {context} positions, {gib:g} GiB: " + "  ".join(
        f"{kv} {r['bytes_per_sequence'] / 2**20:.1f} MiB/seq -> {r['sequences']} sequences"
        for kv, r in out.items() if isinstance(r, dict)) + f"  ({out['ratio']:.2f}x)", flush=True)
    return out


def _teacher_forced(m, ids: list[int], prompt: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-probabilities of ids[prompt:], the logits [steps, vocab]) with ids[:prompt] as the prompt and
    each later token fed through a decoding step over the cache: the bound step where the graph has one (the
    buffers bound in place, the kernel writing each new column, as the engine decodes: with an fp16 cache the
    grouped form, compiler/backends/onnx/grouped_decode.py, but at the buffer's last columns), else numpy feeds
    with the new columns written back."""
    from tessera.runtime.generation.cached import BoundStep

    info = m.info
    capacity = len(ids)
    cache = {}
    feeds = {info.tokens: np.array([ids[:prompt]], np.int64), "attention_mask": np.ones((1, prompt), np.int64),
             "position_ids": np.arange(prompt, dtype=np.int64)[None], info.length_input: np.array([0], np.int64)}
    for layer in info.layers:
        for name, size in ((layer.past_key, layer.head_size), (layer.past_value, layer.value_size)):
            feeds[name] = np.zeros((1, layer.kv_heads, 0, size), m.np_dtype)
            cache[name] = np.zeros((1, layer.kv_heads, capacity, size), m.np_dtype)
    out = m.run(feeds)
    filled, logits = 0, []

    def write(out, t):
        for layer in info.layers:
            cache[layer.past_key][:, :, filled:filled + t] = out[layer.present_key]
            cache[layer.past_value][:, :, filled:filled + t] = out[layer.present_value]

    write(out, prompt)
    filled = prompt
    logits.append(out[info.logits][0, -1].astype(np.float64))
    bound = BoundStep(m, cache) if info.length_input and all(layer.buffer_key for layer in info.layers) else None
    for tok in ids[prompt:-1]:
        mask = np.zeros((1, capacity + 1), np.int64)
        mask[0, :filled] = 1
        mask[0, -1] = 1
        feeds = {info.tokens: np.array([[tok]], np.int64), "attention_mask": mask,
                 "position_ids": np.array([[filled]], np.int64), info.length_input: np.array([filled], np.int64)}
        if bound is not None:
            out = bound.run(feeds)
        else:
            out = m.run({**feeds, **cache})
            write(out, 1)
        filled += 1
        logits.append(out[info.logits][0, -1].astype(np.float64))
    lg = np.stack(logits)
    lp = lg - lg.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    target = np.array(ids[prompt:])
    return lp[np.arange(len(target)), target], lg


def quality(models: dict, ids: list[int]) -> dict:
    prompt = len(ids) // 4
    res = {kv: _teacher_forced(m, ids, prompt) for kv, m in models.items()}
    (lp32, lg32), (lp16, lg16) = res["fp32"], res["fp16"]
    rel = np.abs(lg16 - lg32).max(-1) / np.ptp(lg32, axis=-1)
    out = {"prompt_tokens": prompt, "scored_tokens": len(lp32),
           "perplexity": {"fp32": float(np.exp(-lp32.mean())), "fp16": float(np.exp(-lp16.mean()))},
           "max_abs_logit_diff": float(np.abs(lg16 - lg32).max()),
           "max_diff_over_range": float(rel.max()), "median_diff_over_range": float(np.median(rel)),
           "argmax_differs": int((lg16.argmax(-1) != lg32.argmax(-1)).sum())}
    print(f"quality over {out['scored_tokens']} decoded tokens (prompt {prompt}): perplexity fp32 "
          f"{out['perplexity']['fp32']:.4f} fp16 {out['perplexity']['fp16']:.4f}; max |dlogit| "
          f"{out['max_abs_logit_diff']:.4f} = {out['max_diff_over_range']:.2e} of the range (median "
          f"{out['median_diff_over_range']:.2e}); argmax differs at {out['argmax_differs']} steps", flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default=os.environ.get("TESSERA_SMOLLM2_GGUF"),
                   help="a GGUF file, checkpoint folder or spec (default $TESSERA_SMOLLM2_GGUF)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a spec's hyperparameter")
    p.add_argument("--positions", default="1024,4096")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory-gib", type=float, default=1.0)
    p.add_argument("--text", help="a text file: the prompts' tokens, and --quality's")
    p.add_argument("--quality-tokens", type=int, default=768)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: speed, memory, quality")
    p.add_argument("--gguf-weights", default="codes", choices=["codes", "codes-fp32", "dequantize"],
                   help="a GGUF file's weights as MatMulNBits over its codes (default), or dequantised to fp32")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if not a.model:
        p.error("give the model (or set TESSERA_SMOLLM2_GGUF)")
    skip = set(filter(None, a.skip.split(",")))
    positions = [int(x) for x in a.positions.split(",")]
    t0 = time.perf_counter()
    models = {kv: _load(a.model, kv, a.threads, a.set, a.gguf_weights) for kv in ("fp32", "fp16")}
    print(f"loaded both in {time.perf_counter() - t0:.0f} s; threads {a.threads}", flush=True)
    result = {"model": str(a.model), "threads": a.threads, "gguf_weights": a.gguf_weights}
    if "memory" not in skip:
        result["memory"] = memory(models, max(positions), a.memory_gib)
    if "quality" not in skip and a.text:
        result["quality"] = quality(models, _tokens(a.model, a.text, a.quality_tokens))
    if "speed" not in skip:
        longest = _tokens(a.model, a.text, max(positions))
        result["speed"] = speed(models, lambda n: longest[:n], positions, a.steps, a.rounds)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
