"""The GPU benchmark for a lent machine (issue 37; replaces bench/cuda_check.py). Prepared, not run yet:
no GPU was lent to the task that wrote it. One run, at most about 8 minutes on one H100:

    python bench/gpu.py                    # every section; one JSON line per section, also $OUT/gpu.json
    python bench/gpu.py --only accuracy    # one section (accuracy, kernels, prefill, attention, decode)
    python bench/gpu.py --smoke            # tiny sizes, no timing goals: checks the script itself
                                           # (here: under tests/cuda_stub's stub libraries, where every
                                           # value is meaningless but each step runs)

Sections, each against the goals of issue 37 (which it prints, met or not, and never asserts):

- ``accuracy``: GPT-2 small and a Llama-shaped model, seeded weights, N = 512: the CUDA fp16 logits
  against onnxruntime's CPU fp32 (max |delta|, argmax agreement per position; goal max |delta| <= 1e-2).
  And bf16 the same way (exported for CUDA; its outputs are fp32 at the interface).
- ``kernels``: which kernel each attention node ran (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1, the lines
  onnxruntime prints on the first run), for each model, plain and the cached decoder's prompt and step.
- ``prefill``: GPT-2 small (N = 1024, its context) and the Llama-shaped ~0.3 B model (hidden 1024, 24
  layers, 8 heads of 128, 2 key/value heads; N = 2048), fp16, Tessera (compiled from the same weights,
  saved by transformers as a checkpoint folder) against transformers with attn_implementation="sdpa" on
  the same GPU; inputs and outputs stay on the device (IOBinding); min and median of 10 after 3 warm-ups
  (goal >= 1.0x transformers at N = 2048).
- ``attention``: the attention alone, causal, B = 1, 32 heads of 128 (8 key/value heads), N = 2048 and
  4096, fp16: the GroupQueryAttention node Tessera emits (with its presents) against
  torch.nn.functional.scaled_dot_product_attention (enable_gqa), inputs on the device (goal within 1.2x).
- ``decode``: the Llama-shaped model, one sequence, 4096 cached positions, 64 new tokens: Tessera's
  cached decoder on CUDA (the cache on the device, runtime/generation/cached.py BoundStep) per step
  against transformers' generate with its static cache off (goal >= 1.0x per token).

How to run it on a lent machine with the `run` tool (its limits: a call carries at most 64 MiB, the lent
image has onnxruntime CPU 1.30 and no lark, and nothing outside the machine can be reached):

1. Here, once: download the wheels and cut onnxruntime-gpu's (about 256 MB) into parts the calls can carry,
   in a folder git ignores (``.gpu/`` is in .gitignore):

       mkdir -p .gpu && pip download --no-deps -d .gpu onnxruntime-gpu==1.31.1 lark
       split -b 60M .gpu/onnxruntime_gpu-1.31.1-*.whl .gpu/ort-part-

2. One call per part, each carrying that part only (files a call leaves in ignored folders stay on the
   machine for the next call):  run(command="ls -la .gpu", carry=[".gpu/ort-part-aa"]), then -ab, -ac, ...
3. The last call carries the lark wheel and runs everything (about 8 minutes; timeout_s 600):

       cat .gpu/ort-part-* > /tmp/onnxruntime_gpu-1.31.1-cp311-cp311-manylinux_2_27_x86_64.whl &&
       pip install --no-deps /tmp/onnxruntime_gpu-*.whl .gpu/lark-*.whl && pip install --no-deps -e . &&
       python bench/gpu.py | tee $OUT/gpu.log

   (name the wheel file as pip downloaded it: pip checks the name). transformers and torch are the
   image's; a section whose peer is missing reports it and times Tessera alone.
4. Record the JSON lines in docs/benchmarks/log.md (a section "CUDA, bench/gpu.py") with the device line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO", "1")  # read before onnxruntime loads the provider
ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)
GPT2 = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
SMOKE_LLAMA = dict(LLAMA, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
SMOKE_GPT2 = dict(GPT2, n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256)
# the same shapes as bundled specs with seeded weights (accuracy, kernels: no transformers needed)
SPECS = {"gpt2": ("gpt2", ["layers=12", "d=768", "heads=12"]),
         "llama": ("llama", ["layers=24", "d=1024", "heads=8", "kv_heads=2", "d_ff=2816", "vocab=32000"])}
SMOKE_SPECS = {"gpt2": ("gpt2", ["layers=2", "d=64", "heads=4", "vocab=128", "ctx=256"]),
               "llama": ("llama", ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=96", "vocab=128"])}
WARM, REPS = 3, 10


def emit(section: str, result: dict, out: list) -> None:
    result = {"section": section, **result}
    out.append(result)
    print(json.dumps(result), flush=True)


def timed(fn, warm: int = WARM, reps: int = REPS) -> dict:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}


class Captured:
    """fd 1 captured while a block runs (onnxruntime prints the attention kernel lines there)."""

    def __enter__(self):
        sys.stdout.flush()
        self.file = tempfile.TemporaryFile(mode="w+")
        self.saved = os.dup(1)
        os.dup2(self.file.fileno(), 1)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self.saved, 1)
        self.file.seek(0)
        self.text = self.file.read()

    def kernels(self) -> list[str]:
        import re

        return [f"{op}:{kind}" for op, kind in re.findall(r"Operator=(\w+).*?SdpaKernel=(\w+)", self.text)]


def checkpoint(kind: str, config: dict, folder: Path):
    """The transformers model (fp16, on the GPU, SDPA attention) whose random weights (seed 0) are saved
    once in ``folder``, a checkpoint folder Tessera compiles (config.json's model_type picks the bundled
    spec): both run the same weights."""
    import torch
    import transformers

    cls, cfg = ((transformers.GPT2LMHeadModel, transformers.GPT2Config) if kind == "gpt2" else
                (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    if not folder.exists():
        torch.manual_seed(0)
        cls(cfg(**config)).save_pretrained(folder, safe_serialization=True)
    return cls.from_pretrained(folder, torch_dtype=torch.float16, attn_implementation="sdpa").to("cuda").eval()


def compile_tessera(model, out: Path, target: str, dtype: str, kv_cache: bool = False) -> Path:
    """``model``: a checkpoint folder, or (spec, sets) of a bundled spec with seeded weights."""
    from tessera.runtime import driver
    from tessera.runtime.options import CompileOptions, ModelRef

    ref = ModelRef(spec=str(model)) if isinstance(model, Path) else ModelRef(spec=model[0], sets=list(model[1]))
    driver.compile(ref, CompileOptions(output=out, target=target, dtype=dtype, quiet=True, kv_cache=kv_cache))
    return out


def session(path: Path, provider: str):
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), providers=providers)


def device_run(sess, feeds: dict):
    """A callable running ``sess`` with its inputs copied to the device once and its outputs left there."""
    import onnxruntime as ort

    io = sess.io_binding()
    keep = []
    for name, value in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        keep.append(v)
        io.bind_ortvalue_input(name, v)
    for o in sess.get_outputs():
        io.bind_output(o.name, "cuda", 0)
    return lambda: sess.run_with_iobinding(io)


def have_peers() -> str | None:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return f"transformers/torch missing ({e})"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


def accuracy(args, work: Path, out: list) -> None:
    for kind in ("gpt2", "llama"):
        spec, n = args.specs[kind], args.n_short
        cpu = session(compile_tessera(spec, work / f"{kind}-cpu.onnx", "cpu", "fp32"), "cpu")
        vocab = (args.gpt2 if kind == "gpt2" else args.llama)["vocab_size"]
        tokens = np.random.default_rng(0).integers(0, vocab, (1, n)).astype(np.int64)
        want = cpu.run(None, {"tokens": tokens})[0]
        for dtype in ("fp16", "bf16"):
            gpu = session(compile_tessera(spec, work / f"{kind}-cuda-{dtype}.onnx", "cuda", dtype), "cuda")
            with Captured() as cap:
                got = gpu.run(None, {"tokens": tokens})[0].astype(np.float32)
            emit("accuracy", {"model": kind, "n": n, "dtype": dtype, "providers": gpu.get_providers()[:1],
                              "max_abs_diff": float(np.abs(got - want).max()),
                              "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).mean()),
                              "goal_max_abs_diff": 1e-2 if dtype == "fp16" else None, "kernels": cap.kernels()}, out)


def kernels(args, work: Path, out: list) -> None:
    from tessera.runtime.generation import cached as gen

    for kind in ("gpt2", "llama"):
        for dtype in ("fp32", "fp16"):
            sess = session(compile_tessera(args.specs[kind], work / f"{kind}-k-{dtype}.onnx", "cuda", dtype), "cuda")
            with Captured() as cap:
                sess.run(None, {"tokens": np.ones((1, 64), np.int64)})
            emit("kernels", {"model": kind, "dtype": dtype, "kernels": cap.kernels()}, out)
            model = gen.CachedModel.from_onnx(compile_tessera(args.specs[kind], work / f"{kind}-kv-{dtype}.onnx", "cuda",
                                                              dtype, kv_cache=True), provider="cuda")
            with Captured() as cap:
                list(gen.stream(model, [[1] * 64], 2))
            emit("kernels", {"model": kind, "dtype": dtype, "kv_cache": "prompt of 64, then one step",
                             "on_device": model.on_device, "kernels": cap.kernels()}, out)


def prefill(args, work: Path, out: list) -> None:
    missing = have_peers()
    if missing:  # the same weights need transformers to write them
        emit("prefill", {"skipped": missing}, out)
        return
    import torch

    for kind, config, n in (("gpt2", args.gpt2, args.n_gpt2), ("llama", args.llama, args.n_long)):
        folder = work / f"{kind}-ckpt"
        hf = checkpoint(kind, config, folder)
        sess = session(compile_tessera(folder, work / f"{kind}-ckpt-cuda16.onnx", "cuda", "fp16"), "cuda")
        tokens = np.random.default_rng(1).integers(0, config["vocab_size"], (1, n)).astype(np.int64)
        result = {"model": kind, "n": n, "tessera": timed(device_run(sess, {"tokens": tokens}))}
        ids = torch.from_numpy(tokens).cuda()

        def peer():
            with torch.no_grad():
                hf(ids, use_cache=False)
            torch.cuda.synchronize()
        result["transformers_sdpa"] = timed(peer)
        result["speedup"] = result["transformers_sdpa"]["min_ms"] / result["tessera"]["min_ms"]
        result["goal"] = ">= 1.0 at N = 2048"
        emit("prefill", result, out)
        del hf


def attention(args, work: Path, out: list) -> None:
    import onnx
    from onnx import TensorProto, helper

    heads, kv, hd = args.heads
    missing = have_peers()
    for n in args.attn_lengths:
        q = helper.make_tensor_value_info("q", TensorProto.FLOAT16, [1, n, heads * hd])
        k = helper.make_tensor_value_info("k", TensorProto.FLOAT16, [1, n, kv * hd])
        v = helper.make_tensor_value_info("v", TensorProto.FLOAT16, [1, n, kv * hd])
        sl = helper.make_tensor("seqlens", TensorProto.INT32, [1], [n - 1])
        tl = helper.make_tensor("total", TensorProto.INT32, [], [n])
        node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens", "total"],
                                ["o", "present_key", "present_value"], domain="com.microsoft",
                                num_heads=heads, kv_num_heads=kv, scale=hd ** -0.5)
        graph = helper.make_graph([node], "gqa", [q, k, v], [helper.make_tensor_value_info("o", TensorProto.FLOAT16,
                                                                                        None)], [sl, tl])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        path = work / f"gqa-{n}.onnx"
        onnx.save(model, path)
        sess = session(path, "cuda")
        rng = np.random.default_rng(2)
        feeds = {"q": rng.standard_normal((1, n, heads * hd)).astype(np.float16),
                 "k": rng.standard_normal((1, n, kv * hd)).astype(np.float16),
                 "v": rng.standard_normal((1, n, kv * hd)).astype(np.float16)}
        with Captured() as cap:
            run = device_run(sess, feeds)
            run()
        result = {"n": n, "heads": heads, "kv_heads": kv, "head_size": hd, "kernels": cap.kernels(),
                  "tessera_gqa": timed(run)}
        if missing:
            result["torch_sdpa"] = missing
        else:
            import torch
            import torch.nn.functional as F

            tq, tk, tv = (torch.from_numpy(feeds[x]).cuda().view(1, n, -1, hd).transpose(1, 2) for x in "qkv")

            def peer():
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
            result["torch_sdpa"] = timed(peer)
            result["ratio"] = result["tessera_gqa"]["min_ms"] / result["torch_sdpa"]["min_ms"]
            result["goal"] = "<= 1.2"
        emit("attention", result, out)


def decode(args, work: Path, out: list) -> None:
    from tessera.runtime.generation import cached as gen

    folder = work / "llama-ckpt"
    missing = have_peers()
    hf = None if missing else checkpoint("llama", args.llama, folder)
    path = compile_tessera(args.specs["llama"] if missing else folder, work / "llama-kv16.onnx", "cuda", "fp16",
                           kv_cache=True)
    model = gen.CachedModel.from_onnx(path, provider="cuda")
    prompt = np.random.default_rng(3).integers(0, args.llama["vocab_size"], args.cached).tolist()
    stamps = []
    with Captured() as cap:
        for _ in gen.stream(model, [prompt], args.new_tokens,
                            on_logits=lambda step, logits: stamps.append(time.perf_counter())):
            pass
    steps = np.diff(stamps[1:])  # decoding steps only (the first stamp follows the prompt)
    result = {"cached": args.cached, "new_tokens": args.new_tokens, "on_device": model.on_device,
              "providers": model.session.get_providers()[:1], "kernels": sorted(set(cap.kernels())),
              "tessera_step_ms": {"min": float(steps.min() * 1e3), "median": float(np.median(steps) * 1e3)}}
    if missing:
        result["transformers"] = missing
    else:
        import torch

        ids = torch.tensor([prompt]).cuda()

        def generate(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        generate(2)
        per = (generate(args.new_tokens + 1) - generate(1)) / args.new_tokens
        result["transformers_step_ms"] = per * 1e3
        result["speedup"] = per * 1e3 / result["tessera_step_ms"]["median"]
        result["goal"] = ">= 1.0 per token at 4096 cached positions"
    emit("decode", result, out)


SECTIONS = {"accuracy": accuracy, "kernels": kernels, "prefill": prefill, "attention": attention, "decode": decode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(SECTIONS), action="append")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script, measures nothing")
    args = p.parse_args()
    smoke = args.smoke
    args.gpt2, args.llama = (SMOKE_GPT2, SMOKE_LLAMA) if smoke else (GPT2, LLAMA)
    args.specs = SMOKE_SPECS if smoke else SPECS
    args.n_short, args.n_gpt2, args.n_long = (16, 32, 64) if smoke else (512, 1024, 2048)
    args.heads = (4, 2, 16) if smoke else (32, 8, 128)
    args.attn_lengths = (64,) if smoke else (2048, 4096)
    args.cached, args.new_tokens = (32, 4) if smoke else (4096, 64)
    if smoke:
        global WARM, REPS
        WARM, REPS = 1, 2
    import onnxruntime as ort

    out: list = []
    emit("device", {"onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
                    "smoke": smoke}, out)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or SECTIONS:
            t0 = time.perf_counter()
            try:
                SECTIONS[name](args, Path(tmp), out)
            except Exception as e:  # one section's failure is reported; the others still run
                emit(name, {"error": f"{type(e).__name__}: {e}"[:2000]}, out)
            emit(name, {"seconds": round(time.perf_counter() - t0, 1)}, out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
