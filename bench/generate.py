"""Generation speed: Tessera's KV-cached decoder against transformers' generate and onnxruntime-genai,
same weights, same thread count.

    python bench/generate.py                                  # GPT-2 small, B=1, 128-token prompt, 128 new
    python bench/generate.py --model llama --genai-python /path/to/venv/bin/python
    python bench/generate.py --cases tessera --positions 128 1000     # decode cost against the position
    python bench/generate.py --cases tessera --new 512 --rounds 1     # peak memory over 512 new tokens
    python bench/generate.py --model llama --cases tessera llama-cpp \
        --llama-cpp-python /path/to/venv/bin/python --llama-cpp-tools /path/to/llama.cpp
    python bench/generate.py --checkpoint DIR --cases tessera ort-genai --quantize int4-asym --genai-python PYTHON

Models (weights seeded with transformers' own initialisation, saved once as safetensors, read by
every case): ``gpt2``, GPT-2 small (124 M); ``llama``, a Llama-shaped model (hidden 768, 12 layers,
12 heads, intermediate 3072, vocab 32000: 162 M), the shape onnxruntime-genai's model builder
takes (it has no GPT-2). Or ``--checkpoint DIR``, a real model: a transformers checkpoint folder with
its own tokenizer (a Llama folder for ``ort-genai``; e.g. the folder Tessera converts a GGUF file into,
runtime/io/gguf_file.py ``folder_for``). Tessera compiles it as ``tessera generate DIR`` does (its
config.json names the bundled spec, runtime/io/checkpoint.py ``resolve``) except that a converted GGUF
file's kept codes are not read (``--gguf-weights dequantize``): every case reads the same fp32 tensors,
and ``--quantize`` quantises them. onnxruntime-genai's model builder reads the folder and its tokenizer
as they are; the prompt is drawn from the vocabulary without its added (special) tokens.

Cases: ``tessera`` (buffer cache, the default), ``tessera-concat`` (present = past + new, fed back),
``hf-eager`` and ``hf-sdpa`` (transformers' generate with that attention), ``ort-genai``
(onnxruntime-genai's Generator on its model builder's fp32 (or ``-p int4``) export of the same checkpoint; it needs
its own environment, ``--genai-python``, because it brings its own onnxruntime; its session is given
the same intra-op thread count through the config, which otherwise says 1), ``llama-cpp`` (llama.cpp
through llama-cpp-python's ``Llama.generate``, greedy; the checkpoint converted to GGUF by llama.cpp's
own ``convert_hf_to_gguf.py`` at f32, and for ``--quantize int4`` quantised to Q4_0 by llama.cpp's
``llama_model_quantize``; ``--llama-cpp-python`` is an environment with llama-cpp-python built from the
package index (``pip install llama-cpp-python``; on a CPU with AMX build it with GGML_NATIVE=OFF and the AMX
options off, docs/benchmarks/log.md: the native build crashes on Q4_0 there), ``--llama-cpp-tools`` the llama.cpp source folder the
converter lives in: the ``vendor/llama.cpp`` folder of llama-cpp-python's source distribution. The
Llama-shaped checkpoint has no tokenizer, so the converter is given llama.cpp's own Llama
SentencePiece vocabulary (``models/ggml-vocab-llama-spm.gguf``, through its ``_set_vocab_builtin``,
the path it takes for models without one): token ids are fed directly, so the vocabulary's text is
never used. n_threads and n_threads_batch = ``--threads``).

Every case runs in its own process and the cases alternate (round 1: each case once, round 2: ...);
each process times ``--repeat`` generations after one warm-up (``--json`` also keeps each case's
last greedy tokens, for a check against another reference). Per case: prefill (the prompt's forward
pass up to the first new token) and decode (the mean time per later token), minimum and median over all
runs; CPU time / wall time of the whole generation (how many cores were busy); memory: RSS before
loading (the interpreter and libraries), after loading (the model is compiled beforehand in another
process, as onnxruntime-genai's is built) and the peak RSS during the generations (the kernel's
high-water mark, reset after loading), split into what the process allocated (RssAnon) and pages of
mapped files (RssFile: onnxruntime maps an external-data weights file and reads it on demand), both
sampled after each token. For Tessera the peak is also given against the weights as written plus the
preallocated cache. Greedy, fp32 unless --quantize.

The memory-bound line: a decoding step must read every weight it multiplies by once (everything but
the embedding rows it gathers) and the cache its attention reads (Tessera's buffer: the whole
preallocated buffer), so at the machine's bandwidth that is a floor on the step time. The bandwidth is
measured here with onnxruntime itself: a [1, K] x [K, N] fp32 MatMul over 400 MB of weights, at the
same thread count (a GEMV streams its matrix once: the same access as a decoding step).
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

from jsonout import write_json  # the bench folder: this script's own

ROOT = Path(__file__).resolve().parents[1]
CASES = ("tessera", "tessera-concat", "hf-eager", "hf-sdpa", "ort-genai", "llama-cpp")
MODELS = {
    "gpt2": {"spec": "gpt2.tsr", "variant": "small", "sets": [], "vocab": 50257},
    "llama": {"spec": "llama.tsr", "variant": None, "vocab": 32000,
              "sets": ["vocab=32000", "d=768", "layers=12", "heads=12", "kv_heads=12", "d_ff=3072",
                       "theta=10000.0", "eps=1e-5"]},
}


def _prompt(n: int, vocab: int) -> list[int]:
    return np.random.default_rng(0).integers(3, vocab, n).tolist()


def prompt_ids(n: int, model: str, checkpoint: str | None = None) -> list[int]:
    """The benchmark's prompt: ``n`` seeded ids of the seeded model's vocabulary, or of the checkpoint's
    (config.json's vocab_size) without the tokenizer's added tokens (its special tokens: a chat model
    fed <|im_end|> mid-prompt would be measured on an input no user sends)."""
    if checkpoint is None:
        return _prompt(n, MODELS[model]["vocab"])
    folder = Path(checkpoint)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    added = set()
    if (folder / "tokenizer.json").is_file():
        added = {t["id"] for t in json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])}
    ordinary = np.array([i for i in range(vocab) if i not in added])
    return ordinary[np.random.default_rng(0).integers(0, len(ordinary), n)].tolist()


# the weights files transformers' from_pretrained looks for in a folder (onnxruntime-genai's builder loads through it)
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_checkpoint(folder: str) -> str:
    """--checkpoint's folder, refused with a reason unless it is a transformers checkpoint with a
    tokenizer (the prompt and onnxruntime-genai's builder need its vocabulary)."""
    p = Path(folder)
    if not p.is_dir():
        sys.exit(f"--checkpoint {folder}: not a folder")
    for need in ("config.json", "tokenizer.json"):
        if not (p / need).is_file():
            sys.exit(f"--checkpoint {folder}: no {need} (a transformers checkpoint folder with its tokenizer)")
    try:
        config = json.loads((p / "config.json").read_text())
        int(config["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"--checkpoint {folder}: config.json has no readable vocab_size ({type(e).__name__}: {e})")
    return str(p.resolve())


def head_choice(head: str | None, checkpoint: str | None) -> str:
    """--quantize-head's value for Tessera: as given; by default float for the seeded models (as the
    log's earlier runs measured them) and Tessera's own default (``auto``: 8 bits under the 4-bit
    schemes) for a checkpoint, as ``tessera generate DIR --quantize ...`` runs it."""
    return head if head is not None else ("auto" if checkpoint else "float")


def _memory_mib() -> dict[str, float]:
    """This process's memory from /proc/self/status in MiB (one read, about 30 us): VmRSS (all
    resident), VmHWM (its peak), RssAnon (what the process allocated) and RssFile (mapped file pages:
    the weights file onnxruntime maps, read on demand; the kernel may drop them)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) / 1024
    return out


def _rss_mib() -> float:
    return _memory_mib()["VmRSS"]


def _hwm_mib() -> float:
    return _memory_mib()["VmHWM"]


class _AnonPeak:
    """The peak of RssAnon and RssFile, sampled after each token (the kernel keeps a peak of VmRSS
    only, VmHWM): how much of the peak the process allocated and how much is mapped weights."""

    def __init__(self):
        self.anon = self.file = 0.0

    def sample(self) -> None:  # 0.2 % of a 15 ms step
        got = _memory_mib()
        self.anon, self.file = max(self.anon, got["RssAnon"]), max(self.file, got["RssFile"])

    def fields(self, before: dict) -> dict:
        return {"rss_before_mib": before["VmRSS"], "anon_before_mib": before["RssAnon"],
                "peak_anon_mib": self.anon, "peak_file_mib": self.file}


# ------------------------------------------------------------------ the cases (each in a child process)
def compile_tessera(folder: Path, model: str, mode: str, quantize: str = "none", checkpoint: str | None = None) -> dict:
    """Compile the cached decoder to folder/tessera-{mode}.onnx (as tessera.load(...).compile(out,
    kv_cache=True) does), so the timed process only loads a file, as onnxruntime-genai's does. A
    ``checkpoint`` folder is resolved to its bundled spec as ``tessera generate DIR`` resolves it."""
    import dataclasses

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.runtime.generation import cached as gen
    from tessera.runtime import pipeline

    if checkpoint is not None:
        from tessera.runtime.io import checkpoint as hf_folder
        from tessera.runtime.options import ModelRef

        ref = hf_folder.resolve(ModelRef(spec=checkpoint))
        built = pipeline.build(ref.spec, None, [], ref.weights)
        weights = pipeline.weights_for(built, ref.weights, 0)
        gathered = {p for p in built.graph.params if p == "embed.weight"}
        tied = "head.weight" not in built.graph.params  # a tied head (models/llama.tsr) reads the whole table
    else:
        m = MODELS[model]
        built = pipeline.build(ROOT / "models" / m["spec"], m["variant"], m["sets"])
        weights = pipeline.weights_for(built, str(folder / "model.safetensors"), 0)
        gathered = {p for p in built.graph.params if p in ("wte.weight", "wpe.weight", "embed.weight")}
        tied = model == "gpt2"  # GPT-2's head is the token table: it is read whole every step

    def streamed(k: str) -> bool:  # read whole each step: all but the gathered tables, a tied head's table too
        return k not in gathered or (tied and k in ("wte.weight", "embed.weight"))

    read = sum(a.nbytes for k, a in weights.items() if streamed(k))
    config = None
    if quantize != "none":  # weight-only, block --quantize-block (default 32, --quantize's), head --quantize-head
        from tessera.compiler.ir.graph import DTYPES
        from tessera.compiler.passes.quantize import QuantizeWeights

        config = pipeline.quant_config(quantize, block=int(os.environ.get("BENCH_QUANTIZE_BLOCK", "32")),
                                       head=os.environ.get("BENCH_QUANTIZE_HEAD", "float"))
        packed = built.graph.copy()  # counted on a copy: the cached pipeline quantises as its first pass
        QuantizeWeights(config)(packed)
        read = sum(int(np.prod(q.shape)) * np.dtype(DTYPES[q.dtype] or np.float32).itemsize  # packed bytes
                   for k, q in packed.params.items() if streamed(k))
    options = gen.cached_options(mode=mode, quantize=config, decode=os.environ.get("BENCH_DECODE", "auto"),
                                 # sn1's "before": BENCH_SKIP_NORM=0 BENCH_BOUND_STEP=0
                                 skip_norm=os.environ.get("BENCH_SKIP_NORM", "1") != "0",
                                 bound_step=os.environ.get("BENCH_BOUND_STEP", "1") != "0")
    # a converted GGUF file's kept codes are not read: every case quantises (or not) the same fp32 tensors
    onnx_model, _ = gen.compile_cached(built, weights, dataclasses.replace(options, gguf_weights="dequantize"))
    onnx_export.save(onnx_model, folder / f"tessera-{mode}.onnx", external=True)  # as compile --kv-cache writes it
    stored = sum(f.stat().st_size for f in folder.glob(f"tessera-{mode}.onnx*"))  # the weights, as written
    return {"weights_read_bytes": read, "weights_bytes": stored}


def _reset_peak() -> None:
    """Start the kernel's peak-RSS counter (VmHWM) afresh, so the peak is that of the generation alone."""
    Path("/proc/self/clear_refs").write_text("5")


def run_tessera(folder: Path, model: str, mode: str, n: int, new: int, repeat: int, threads: int,
                checkpoint: str | None = None) -> dict:
    from tessera.runtime.generation import cached as gen

    before, peaks = _memory_mib(), _AnonPeak()
    cm = gen.CachedModel.from_onnx(folder / f"tessera-{mode}.onnx", threads=threads)
    rss_loaded = _rss_mib()
    _reset_peak()
    prompt = prompt_ids(n, model, checkpoint)
    runs = []
    for i in range(repeat + 1):
        stats = gen.Stats()
        w0, c0 = time.perf_counter(), time.process_time()
        out = []
        for e in gen.stream(cm, [prompt], new, gen.Sampling(), stats=stats):  # the step's time excludes this body
            out.append(e[0])
            peaks.sample()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if i:  # the first run warms up
            runs.append({"prefill_s": stats.prefill_s, "decode_s": statistics.mean(stats.decode_s),
                         "decode_median_step_s": statistics.median(stats.decode_s), "wall_s": wall, "cpu_s": cpu})
    return {"runs": runs, "tokens": out, "cache_bytes": stats.cache_bytes,
            "rss_loaded_mib": rss_loaded, "peak_rss_mib": _hwm_mib(), **peaks.fields(before)}


def run_hf(folder: Path, model: str, attn: str, n: int, new: int, repeat: int, threads: int,
           checkpoint: str | None = None) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    before, peaks = _memory_mib(), _AnonPeak()
    if checkpoint is not None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=attn).eval()
    else:
        cls = transformers.GPT2LMHeadModel if model == "gpt2" else transformers.LlamaForCausalLM
        hf = cls.from_pretrained(folder, attn_implementation=attn).eval()
    rss_loaded = _rss_mib()
    _reset_peak()
    ids = torch.tensor([prompt_ids(n, model, checkpoint)])

    class Clock:
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())
            peaks.sample()

        def end(self):
            pass

    runs = []
    for i in range(repeat + 1):
        clock = Clock()
        w0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, streamer=clock)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        t = clock.times  # put(prompt) before prefill, then one put per new token
        if i:
            steps = np.diff(t[1:])
            runs.append({"prefill_s": t[1] - t[0], "decode_s": (t[-1] - t[1]) / (len(t) - 2),
                         "decode_median_step_s": float(np.median(steps)), "wall_s": wall, "cpu_s": cpu})
    return {"runs": runs, "tokens": out[0, n:].tolist(), "rss_loaded_mib": rss_loaded, "peak_rss_mib": _hwm_mib(),
            **peaks.fields(before)}


def run_genai(folder: Path, model: str, n: int, new: int, repeat: int, threads: int,
              checkpoint: str | None = None) -> dict:
    """onnxruntime-genai: append_tokens runs the prompt, each generate_next_token picks a token and runs
    the model on it (the same work per token as one Tessera step)."""
    import onnxruntime_genai as og

    before, peaks = _memory_mib(), _AnonPeak()
    cfg = og.Config(str(folder / "genai"))
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    og_model = og.Model(cfg)
    rss_loaded = _rss_mib()
    _reset_peak()
    prompt = prompt_ids(n, model, checkpoint)
    runs = []
    for i in range(repeat + 1):
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=n + new, min_length=n + new, do_sample=False)
        w0, c0 = time.perf_counter(), time.process_time()
        g = og.Generator(og_model, params)
        g.append_tokens(prompt)
        t = [time.perf_counter()]
        out = []
        while not g.is_done() and len(out) < new:
            g.generate_next_token()
            out.append(int(g.get_next_tokens()[0]))
            t.append(time.perf_counter())
            peaks.sample()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if i:
            steps = np.diff(t[1:])
            runs.append({"prefill_s": t[1] - w0, "decode_s": float(np.mean(steps)),
                         "decode_median_step_s": float(np.median(steps)), "wall_s": wall, "cpu_s": cpu})
        del g
    return {"runs": runs, "tokens": out, "rss_loaded_mib": rss_loaded, "peak_rss_mib": _hwm_mib(),
            **peaks.fields(before)}


def make_gguf(folder: Path, tools: str, python: str, quantize: str) -> None:
    """llama.cpp's converter (this environment: it needs torch) writes model-f32.gguf; Q4_0 from it
    with llama.cpp's quantiser (in the llama-cpp-python environment) for --quantize int4."""
    convert = (f"import sys; sys.path.insert(0, {tools!r}); import convert_hf_to_gguf as conv; "
               f"from conversion.llama import LlamaModel; "
               f"LlamaModel.set_vocab = lambda self: self._set_vocab_builtin('llama-spm', 32000); "
               f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outfile', "
               f"{str(folder / 'model-f32.gguf')!r}, '--outtype', 'f32']; conv.main()")
    out = subprocess.run([sys.executable, "-c", convert], capture_output=True, text=True, cwd=tools)
    if out.returncode:
        sys.exit(f"llama.cpp's convert_hf_to_gguf.py failed:\n{out.stderr[-3000:]}")
    if quantize != "none":
        q = (f"import llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); "
             f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0; "
             f"rc = llama_cpp.llama_model_quantize({str(folder / 'model-f32.gguf').encode()!r}, "
             f"{str(folder / 'model-q4_0.gguf').encode()!r}, p); raise SystemExit(rc)")
        out = subprocess.run([python, "-c", q], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"llama.cpp's quantiser failed:\n{out.stderr[-3000:]}")


def run_llama_cpp(folder: Path, model: str, n: int, new: int, repeat: int, threads: int) -> dict:
    """llama.cpp: generate() runs the prompt, then yields each greedy token and runs the model on it."""
    from llama_cpp import Llama

    name = "model-q4_0.gguf" if os.environ.get("BENCH_QUANTIZE", "none") != "none" else "model-f32.gguf"
    before, peaks = _memory_mib(), _AnonPeak()
    llm = Llama(model_path=str(folder / name), n_ctx=n + new + 8, n_batch=max(512, n), n_threads=threads,
                n_threads_batch=threads, verbose=False)
    rss_loaded = _rss_mib()
    _reset_peak()
    prompt = _prompt(n, MODELS[model]["vocab"])
    runs = []
    for i in range(repeat + 1):
        llm.reset()  # else generate() reuses the previous run's cache for the prompt and times no prefill
        w0, c0 = time.perf_counter(), time.process_time()
        t, out = [], []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            t.append(time.perf_counter())
            peaks.sample()
            if len(out) == new:
                break
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if i:
            steps = np.diff(t)
            runs.append({"prefill_s": t[0] - w0, "decode_s": float(np.mean(steps)),
                         "decode_median_step_s": float(np.median(steps)), "wall_s": wall, "cpu_s": cpu})
    return {"runs": runs, "tokens": out, "rss_loaded_mib": rss_loaded, "peak_rss_mib": _hwm_mib(),
            **peaks.fields(before)}


def run_bandwidth(threads: int, repeat: int = 20) -> dict:
    """GB/s of a [1, K] x [K, N] fp32 MatMul over 400 MB in onnxruntime (streams the matrix once)."""
    from matmul_probe import matmul_session

    k, n = 768, 131072
    w = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    s = matmul_session(w, 1, threads)
    x = np.ones((1, k), np.float32)
    s.run(None, {"x": x})
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        s.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    return {"gb_s_best": w.nbytes / min(times) / 1e9, "gb_s_median": w.nbytes / statistics.median(times) / 1e9}


def child(case: str, folder: str, model: str, n: int, new: int, repeat: int, threads: int,
          checkpoint: str | None = None) -> dict:
    folder = Path(folder)
    if case == "bandwidth":
        return run_bandwidth(threads)
    if case.startswith("compile-"):
        return compile_tessera(folder, model, case.split("-", 1)[1], os.environ.get("BENCH_QUANTIZE", "none"),
                               checkpoint)
    if case.startswith("tessera"):
        res = run_tessera(folder, model, "concat" if case == "tessera-concat" else "buffer", n, new, repeat, threads,
                          checkpoint)
    elif case == "ort-genai":
        res = run_genai(folder, model, n, new, repeat, threads, checkpoint)
    elif case == "llama-cpp":
        res = run_llama_cpp(folder, model, n, new, repeat, threads)
    else:
        res = run_hf(folder, model, case.split("-", 1)[1], n, new, repeat, threads, checkpoint)
    res["case"] = case
    return res


# ------------------------------------------------------------------ the parent
def make_weights(folder: Path, model: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if model == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    else:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                       num_key_value_heads=12, intermediate_size=3072, max_position_embeddings=2048,
                                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       bos_token_id=1, eos_token_id=2)
        hf = transformers.LlamaForCausalLM(cfg)
    hf.eval().save_pretrained(folder, safe_serialization=True)


def make_genai_model(folder: Path, python: str, precision: str = "fp32", block: int | None = None,
                     checkpoint: str | None = None) -> None:
    """The model builder's CPU export of the checkpoint at ``precision`` (fp32 or int4, at ``block``
    input features per scale: its extra option ``block_size``, default 32) into folder/genai; it wants a
    tokenizer: a ``checkpoint`` folder's own, the seeded model a word-level one written here."""
    source = Path(checkpoint) if checkpoint is not None else folder
    if checkpoint is None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 32000)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
             "unk_token": "<unk>"}))
    cmd = [python, "-m", "onnxruntime_genai.models.builder", "-m", str(source), "-i", str(source),
           "-o", str(folder / "genai"), "-p", precision, "-e", "cpu", "-c", str(folder / "genai-cache")]
    if block is not None and precision != "fp32":
        cmd += ["--extra_options", f"block_size={block}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"onnxruntime-genai's model builder failed:\n{out.stderr[-3000:]}")


def _spawn(args, case: str, folder: Path, prompt: int, new: int) -> dict:
    python = {"ort-genai": args.genai_python, "llama-cpp": args.llama_cpp_python}.get(case) or sys.executable
    cmd = [python, __file__, "--_child", case, str(folder), "--model", args.model, "--prompt", str(prompt),
           "--new", str(new), "--repeat", str(args.repeat), "--threads", str(args.threads)]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "BENCH_QUANTIZE": args.quantize,
                              "BENCH_QUANTIZE_HEAD": head_choice(args.quantize_head, args.checkpoint),
                              "BENCH_DECODE": args.decode,
                              "BENCH_QUANTIZE_BLOCK": str(args.quantize_block)})
    if out.returncode:
        sys.exit(f"{case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(case: str, runs: list[dict], extra: dict) -> dict:
    dec = [x["decode_s"] for x in runs]
    pre = [x["prefill_s"] for x in runs]
    return {"case": case, "runs": len(runs), "prefill_ms_min": min(pre) * 1e3,
            "prefill_ms_median": statistics.median(pre) * 1e3, "decode_ms_min": min(dec) * 1e3,
            "decode_ms_median": statistics.median(dec) * 1e3, "decode_tok_s_median": 1 / statistics.median(dec),
            "cpu_per_wall": statistics.median(x["cpu_s"] / x["wall_s"] for x in runs), **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="gpt2", help="gpt2 (small) or llama (Llama-shaped, 162 M)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="instead of --model: a transformers checkpoint folder with its tokenizer (a real model; "
                        "Llama for ort-genai), as `tessera generate DIR` compiles it, its GGUF codes not read")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    p.add_argument("--positions", type=int, nargs="*", metavar="P",
                   help="instead of the comparison: Tessera's decode step at these prompt lengths (16 new tokens each)")
    p.add_argument("--repeat", type=int, default=2, help="timed generations per process (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="processes per case, alternating (default 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for onnxruntime and torch")
    p.add_argument("--cases", nargs="*", choices=CASES, help="default: every case available")
    p.add_argument("--genai-python", metavar="PYTHON", help="a Python with onnxruntime-genai installed (ort-genai case)")
    p.add_argument("--llama-cpp-python", metavar="PYTHON", help="a Python with llama-cpp-python installed (llama-cpp case)")
    p.add_argument("--llama-cpp-tools", metavar="DIR",
                   help="llama.cpp's source folder holding convert_hf_to_gguf.py (llama-cpp case)")
    p.add_argument("--quantize", choices=["none", "int4", "int4-asym"], default="none",
                   help="weight-only int4 (MatMulNBits, block --quantize-block): Tessera's --quantize int4 (or "
                        "int4-asym: zero points, the full range) against onnxruntime-genai's builder -p int4 and "
                        "llama.cpp's Q4_0 either way (default none: fp32)")
    p.add_argument("--quantize-block", type=int, metavar="N",
                   help="with --quantize int4: input features per scale, Tessera's --quantize-block and "
                        "onnxruntime-genai's builder option block_size (llama.cpp's Q4_0 stays 32) (default 32)")
    p.add_argument("--quantize-head", nargs="?", const="on", choices=["auto", "float", "8", "4", "on"],
                   help="with --quantize: Tessera's output head, as its --quantize-head (alone: the scheme's bits, "
                        "as onnxruntime-genai's builder does). Default: float for --model, Tessera's default "
                        "(auto: 8 bits under int4) for --checkpoint")
    p.add_argument("--decode", choices=["auto", "gqa", "gqa-unpacked", "plain"], default="auto",
                   help="Tessera's decoding-step kernel (compile --decode): gqa-unpacked is the step before the "
                        "packed q+k+v input, for before/after comparisons")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        case, folder = args._child
        print(json.dumps(child(case, folder, args.model, args.prompt, args.new, args.repeat, args.threads,
                               args.checkpoint)))
        return
    if args.quantize_block is not None and args.quantize == "none":
        sys.exit("--quantize-block needs --quantize int4")
    if args.quantize_head is not None and args.quantize == "none":
        sys.exit("--quantize-head needs --quantize int4 or int4-asym")
    if args.checkpoint is not None:
        args.checkpoint = check_checkpoint(args.checkpoint)
    args.quantize_block = args.quantize_block or 32
    cases = args.cases or [c for c in CASES if (c != "ort-genai" or args.genai_python)
                           and (c != "llama-cpp" or args.llama_cpp_python)]
    if args.checkpoint is not None:
        readers = [c for c in cases if c.startswith("hf-") or c == "ort-genai"]
        if readers and not any((Path(args.checkpoint) / f).is_file() for f in HF_WEIGHTS):
            sys.exit(f"--checkpoint {args.checkpoint}: no {', '.join(HF_WEIGHTS)}: transformers (and through it "
                     f"onnxruntime-genai's builder, for {', '.join(readers)}) reads none of its weights (a folder "
                     f"Tessera converted a GGUF file into before its conversion version 5 named its shards "
                     f"model-00000.safetensors...: convert the file again, or link the single shard as "
                     f"model.safetensors, docs/benchmarks/log.md gs1)")
    if "ort-genai" in cases and (not args.genai_python or (args.model != "llama" and not args.checkpoint)):
        sys.exit("the ort-genai case needs --model llama (its builder has no GPT-2) or --checkpoint, and "
                 "--genai-python")
    if "llama-cpp" in cases and (not args.llama_cpp_python or not args.llama_cpp_tools or args.model != "llama"
                                 or args.checkpoint):
        sys.exit("the llama-cpp case needs --model llama, --llama-cpp-python and --llama-cpp-tools (for a GGUF "
                 "file's own model: bench/gguf_llama_cpp.py)")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if not args.checkpoint:
            make_weights(folder, args.model)
        if "ort-genai" in cases:
            make_genai_model(folder, args.genai_python, "fp32" if args.quantize == "none" else "int4",
                             args.quantize_block, args.checkpoint)
        if "llama-cpp" in cases:
            make_gguf(folder, args.llama_cpp_tools, args.llama_cpp_python, args.quantize)
        compiled = {}
        for mode in {"buffer"} | ({"concat"} if "tessera-concat" in cases else set()):
            compiled = _spawn(args, f"compile-{mode}", folder, 1, 1)
        if args.positions:
            return positions(args, folder, machine)
        results: dict[str, list] = {c: [] for c in cases}
        info: dict[str, dict] = {}
        bandwidth = []
        for r in range(args.rounds):
            bandwidth.append(_spawn(args, "bandwidth", folder, 1, 1))
            for case in cases:
                res = _spawn(args, case, folder, args.prompt, args.new)
                results[case] += res["runs"]
                info[case] = res
                print(f"round {r + 1}: {case}: decode {statistics.median(x['decode_s'] for x in res['runs']) * 1e3:.1f} "
                      f"ms/token", file=sys.stderr)
    first = cases[0]
    rows = [_row(c, runs, {"same_tokens_as_first_case": info[c]["tokens"] == info[first]["tokens"],
                           **{k: info[c][k] for k in ("rss_before_mib", "rss_loaded_mib", "peak_rss_mib",
                                                      "anon_before_mib", "peak_anon_mib", "peak_file_mib")}})
            for c, runs in results.items()]
    gb_s = max(b["gb_s_best"] for b in bandwidth)
    print(f"{args.checkpoint or args.model}, B=1, prompt {args.prompt}, {args.new} new tokens, greedy, "
          f"{'fp32' if args.quantize == 'none' else f'{args.quantize} weights, block {args.quantize_block}'}, "
          f"{args.threads} threads; "
          f"{machine}")
    print("| case | runs | prefill ms (min / median) | decode ms/token (min / median) | decode tok/s (median) "
          "| CPU/wall | RSS before / loaded / peak MiB | peak allocated / mapped MiB | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['runs']} | {r['prefill_ms_min']:.1f} / {r['prefill_ms_median']:.1f} | "
              f"{r['decode_ms_min']:.2f} / {r['decode_ms_median']:.2f} | {r['decode_tok_s_median']:.1f} | "
              f"{r['cpu_per_wall']:.2f} | {r['rss_before_mib']:.0f} / {r['rss_loaded_mib']:.0f} / "
              f"{r['peak_rss_mib']:.0f} | {r['peak_anon_mib']:.0f} / {r['peak_file_mib']:.0f} | "
              f"{'yes' if r['same_tokens_as_first_case'] else 'no'} |")
    base = {r["case"]: r for r in rows}
    summary = {}
    if "tessera" in base:
        t = base["tessera"]
        for other in ("hf-eager", "hf-sdpa", "ort-genai", "llama-cpp", "tessera-concat"):
            if other in base:
                o = base[other]
                print(f"Tessera vs {other}: decode {o['decode_ms_median'] / t['decode_ms_median']:.2f}x (median), "
                      f"{o['decode_ms_min'] / t['decode_ms_min']:.2f}x (min); prefill "
                      f"{o['prefill_ms_median'] / t['prefill_ms_median']:.2f}x (median)")
        ti = info["tessera"] | compiled
        layers_bytes = ti["cache_bytes"]  # the buffer the attention reads each step (its whole capacity)
        floor_ms = (ti["weights_read_bytes"] + layers_bytes) / (gb_s * 1e9) * 1e3
        summary = {"bandwidth_gb_s": gb_s, "weights_read_bytes": ti["weights_read_bytes"],
                   "cache_bytes": layers_bytes, "memory_bound_step_ms": floor_ms,
                   "decode_over_bound_min": t["decode_ms_min"] / floor_ms,
                   "decode_over_bound_median": t["decode_ms_median"] / floor_ms}
        print(f"memory-bound step: ({ti['weights_read_bytes'] / 1e6:.0f} MB of weights + {layers_bytes / 1e6:.1f} MB "
              f"of cache) / {gb_s:.1f} GB/s (onnxruntime GEMV, best) = {floor_ms:.2f} ms; Tessera's decode step is "
              f"{summary['decode_over_bound_min']:.2f}x that (min), {summary['decode_over_bound_median']:.2f}x (median)")
        growth = ti["peak_rss_mib"] - ti["rss_loaded_mib"]
        budget = (ti["weights_bytes"] + layers_bytes) / 2**20
        summary["peak_over_weights_and_cache"] = (ti["peak_rss_mib"] - ti["rss_before_mib"]) / budget
        summary["allocated_over_weights_and_cache"] = (ti["peak_anon_mib"] - ti["anon_before_mib"]) / budget
        print(f"memory against the weights as written ({ti['weights_bytes'] / 2**20:.0f} MiB) plus the cache "
              f"({layers_bytes / 2**20:.1f} MiB): the peak RSS over what the process held before loading is "
              f"{summary['peak_over_weights_and_cache']:.3f}x that; the memory it allocated (RssAnon, peak over "
              f"before) {summary['allocated_over_weights_and_cache']:.3f}x; the rest of the peak is pages of the "
              f"mapped weights file ({ti['peak_file_mib']:.0f} MiB at most)")
        print(f"memory: RSS after loading {ti['rss_loaded_mib']:.0f} MiB, peak {ti['peak_rss_mib']:.0f} MiB "
              f"(+{growth:.0f} MiB during generation; the preallocated cache is {layers_bytes / 2**20:.1f} MiB)")
    if args.json:
        write_json(args.json, {"rows": rows, "summary": summary, "bandwidth": bandwidth,
                               "tokens": {c: info[c]["tokens"] for c in cases},  # the last run's, per case
                               "settings": vars(args) | {"machine": machine}}, indent=2)


def positions(args, folder: Path, machine: str) -> None:
    """Tessera's decode step at several positions: prompt P, 16 new tokens, alternating over the rounds."""
    steps: dict[int, list[float]] = {n: [] for n in args.positions}
    for _ in range(args.rounds):
        for n in args.positions:
            res = _spawn(args, "tessera", folder, n, 16)
            steps[n] += [x["decode_median_step_s"] for x in res["runs"]]
    print(f"{args.checkpoint or args.model}: Tessera decode step by position (prompt P, 16 new tokens, buffer cache), fp32, "
          f"{args.threads} threads; {machine}")
    print("| prompt P | runs | ms/step (min / median) | ratio to the first (min / median) |")
    print("| ---: | ---: | ---: | ---: |")
    ref = args.positions[0]
    for n, xs in steps.items():
        print(f"| {n} | {len(xs)} | {min(xs) * 1e3:.2f} / {statistics.median(xs) * 1e3:.2f} | "
              f"{min(xs) / min(steps[ref]):.2f} / {statistics.median(xs) / statistics.median(steps[ref]):.2f} |")


if __name__ == "__main__":
    main()
