"""Issue 37: what `--target cuda` graphs do on onnxruntime-gpu 1.31.1's real CUDA provider, loaded on this
machine under stub CUDA libraries (tests/cuda_stub_support.py; skipped with the reason where they cannot
be built). Checked: the session's placement (no compute node on the CPU, only the int64 shape arithmetic
onnxruntime itself prefers there), no Memcpy inside a Loop or If body, the attention kernel each contrib
or opset-23 attention node chose (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1), and one run completing the
kernels' host-side checks. Not checked here, and not checkable without a GPU: any value computed on
the device (the kernels do nothing under the stub); the numbers of each lowering are held to the unfused
graph on CPU onnxruntime in tests/compiler/test_fusion.py (attn23) and tests/compiler/test_attention_contract.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuda_stub_support import placement_problems
from tessera.runtime import driver
from tessera.runtime.options import CompileOptions, ModelRef

# tiny configurations (head size 16: the CUDA kernels' multiple of 8); each compiles in about a second
FAMILIES = {
    "gpt2": ["layers=2", "d=64", "heads=4", "vocab=128", "ctx=64"],
    "llama": ["layers=2", "d=64", "heads=4", "kv_heads=2", "vocab=128", "d_ff=96"],
    "bert": ["layers=2", "d=64", "heads=4", "vocab=128", "ctx=64", "d_ff=96"],
    "t5": ["layers=2", "d=64", "heads=4", "d_kv=16", "vocab=128", "d_ff=96"],
}
CAUSAL_ONLY = {"gpt2", "llama"}  # every site causal self-attention with no other mask


def _compile(tmp_path, family, dtype, target="cuda", **extra) -> str:
    out = tmp_path / f"{family}-{target}-{dtype}{'-kv' if extra.get('kv_cache') else ''}-{extra.get('quantize', 'none')}.onnx"
    driver.compile(ModelRef(spec=family, sets=FAMILIES[family]),
                   CompileOptions(output=out, target=target, dtype=dtype, quiet=True, **extra))
    return str(out)


@pytest.fixture(scope="module")
def plain_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-models")
    models = {(f, dt): _compile(folder, f, dt) for f in FAMILIES for dt in ("fp32", "fp16", "bf16")}
    models.update({(f, f"{dt}-int4"): _compile(folder, f, dt, quantize="int4") for f in CAUSAL_ONLY
                   for dt in ("fp32", "fp16")})  # onnxruntime's MatMulNBits on CUDA
    return models


@pytest.fixture(scope="module")
def plain_reports(cuda_stub, plain_models):
    """One check.py process for all of them (the provider loads once), at T = 5: the key length not a
    multiple of the memory-efficient kernel's alignment, so the padded keys of the attn23 lowering count."""
    keys = sorted(plain_models)
    return dict(zip(keys, cuda_stub.check(*(plain_models[k] for k in keys), seq=5)))


CASES = [(f, dt) for f in sorted(FAMILIES) for dt in ("fp32", "fp16", "bf16")] + \
    [(f, f"{dt}-int4") for f in sorted(CAUSAL_ONLY) for dt in ("fp32", "fp16")]


@pytest.mark.parametrize("family, dtype", CASES)
def test_every_node_on_cuda_and_one_run_completes(plain_reports, family, dtype):
    report = plain_reports[(family, dtype)]
    assert not placement_problems(report), placement_problems(report)
    assert report["cuda_nodes"] > 0 and report["memcpy_subgraph"] == 0


@pytest.mark.parametrize("family, dtype", CASES)
def test_every_attention_site_gets_a_fused_kernel(plain_reports, family, dtype):
    kernels = plain_reports[(family, dtype)]["kernels"]
    sites = {"t5": 6}.get(family, 2)
    assert len(kernels) == sites, kernels
    chosen = {k[3] for k in kernels}
    if family in CAUSAL_ONLY and not dtype.startswith("fp32"):  # GroupQueryAttention with its presents
        assert chosen == {"FLASH_ATTENTION"} and {k[0] for k in kernels} == {"GroupQueryAttention"}, kernels
    else:  # onnx's Attention (opset 23) with its masks as one attn_mask
        assert chosen <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION"}, kernels
        assert {k[0] for k in kernels} == {"Attention"}, kernels


# The other bundled families, tiny: every one is placed on CUDA; a run completes except where the stub
# itself stops it (its cuDNN has no functions: Conv, onnx's GRU). Gemma 2's soft-capped sites in fp32 and
# gpt-oss's sinks in fp32 are onnx's Attention (its softcap attribute; the sink as one more key), no longer
# the portable Loop; sparse experts are onnxruntime's fused MoE in every dtype.
OTHERS = {
    "mixtral": ["layers=2", "d=64", "heads=4", "kv_heads=2", "vocab=128", "d_ff=48", "experts=4", "top=2"],
    "gemma2": ["layers=2", "d=64", "heads=4", "kv_heads=2", "head_dim=16", "d_ff=96", "vocab=128"],
    "bloom": ["layers=2", "d=64", "heads=4", "vocab=128"],
    "gptj": ["layers=2", "d=64", "heads=4", "vocab=128", "rotary_dim=8"],
    "bart": ["layers=2", "d=64", "heads=4", "d_ff=96", "dec_layers=2", "dec_heads=4", "dec_d_ff=96", "vocab=128"],
    "transformer": ["layers=2", "d=64", "heads=4", "vocab=128", "d_ff=96"],
    "vit": ["layers=2", "d=64", "heads=4", "d_ff=96", "image=32", "patch=8"],
    "whisper": ["layers=2", "d=64", "heads=4", "d_ff=96", "dec_layers=2", "dec_heads=4", "dec_d_ff=96", "vocab=128",
                "mels=16"],
    "mamba": ["layers=2", "d=64", "vocab=128"],
    "qwen2": ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=96", "vocab=128"],
    "qwen3": ["layers=2", "d=64", "heads=4", "kv_heads=2", "head_dim=16", "d_ff=96", "vocab=128"],
    "qwen3_moe": ["layers=2", "d=64", "heads=4", "kv_heads=2", "head_dim=16", "d_expert=48", "n_experts=4", "top=2",
                  "vocab=128"],
    "gemma3": ["layers=6", "d=64", "heads=4", "kv_heads=2", "head_dim=16", "d_ff=96", "vocab=128", "window=4"],
    # attention sinks (GroupQueryAttention's head_sink), a sliding layer, biased clamped experts (fused MoE)
    # longrope (the factors switched by the length: a TopK of the positions in the cached graph)
    "phi3": ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=96", "vocab=128", "ctx=64", "rope_type=longrope",
             "original_ctx=16", "short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5]",
             "long_factor=[1.3, 2.2, 3.5, 5.0, 8.0, 12.0, 19.0, 30.0]"],
    "gpt_oss": ["layers=2", "d=64", "heads=4", "kv_heads=2", "head_dim=16", "d_ff=48", "n_experts=4", "top=2",
                "vocab=128", "window=4"],
}
OTHER_CASES = [(f, dt) for f in sorted(OTHERS) for dt in ("fp32", "fp16", "bf16")]
STUB_STOPS = {"vit": "cuDNN is unavailable", "whisper": "cuDNN is unavailable", "mamba": "cuDNN is unavailable"}


@pytest.fixture(scope="module")
def other_reports(cuda_stub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-others")
    paths = []
    for family, dtype in OTHER_CASES:
        out = folder / f"{family}-{dtype}.onnx"
        driver.compile(ModelRef(spec=family, sets=OTHERS[family]),
                       CompileOptions(output=out, target="cuda", dtype=dtype, quiet=True))
        paths.append(out)
    return dict(zip(OTHER_CASES, cuda_stub.check(*paths, seq=5)))


@pytest.mark.parametrize("family, dtype", OTHER_CASES)
def test_the_other_bundled_families_on_cuda(other_reports, family, dtype):
    report = other_reports[(family, dtype)]
    assert report["providers"][:1] == ["CUDAExecutionProvider"] and report["cuda_nodes"] > 0
    assert not report["cpu_unforced"] and not report["not_found"], report
    assert report["memcpy_subgraph"] == 0
    if family in STUB_STOPS:
        assert not report["ran"] and STUB_STOPS[family] in report["error"], report["error"]
    else:
        assert report["ran"], report["error"]
        kinds = {k[3] for k in report["kernels"]}
        assert kinds and kinds <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION"}, report["kernels"]


INT4_STOPS = {"vit", "whisper", "mamba"}  # Conv: the stub's cuDNN has no functions


@pytest.fixture(scope="module")
def int4_reports(cuda_stub, tmp_path_factory):
    """Every bundled family quantised to int4 (MatMulNBits) for CUDA in fp32, fp16 and bf16, checked in one process."""
    folder = tmp_path_factory.mktemp("cuda-int4")
    cases, paths = [], []
    for family, sets in sorted({**FAMILIES, **OTHERS}.items()):
        for dtype in ("fp32", "fp16", "bf16"):
            out = folder / f"{family}-{dtype}.onnx"
            driver.compile(ModelRef(spec=family, sets=sets),
                           CompileOptions(output=out, target="cuda", dtype=dtype, quantize="int4", quiet=True))
            cases.append((family, dtype))
            paths.append(out)
    return dict(zip(cases, cuda_stub.check(*paths, seq=5, timeout=600)))


def test_every_bundled_family_at_int4_on_cuda(int4_reports):
    """The issue's third mode: int4 weights (onnxruntime's MatMulNBits, which has fp32, fp16 and bf16 CUDA kernels)
    for every bundled family in every dtype: no compute node on the CPU, no Memcpy in a subgraph, a run completing
    (ViT's, Whisper's and Mamba's Conv stop at the stub's cuDNN after placement), every attention site fused."""
    assert len(int4_reports) == 3 * len({**FAMILIES, **OTHERS})
    for (family, dtype), report in int4_reports.items():
        if family in INT4_STOPS:
            assert report["providers"][:1] == ["CUDAExecutionProvider"] and not report["cpu_unforced"], report
            assert not report["memcpy_subgraph"] and "cuDNN is unavailable" in report["error"], report["error"]
            continue
        assert not placement_problems(report), ((family, dtype), placement_problems(report))
        assert {k[3] for k in report["kernels"]} <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION"}, report["kernels"]


def test_gqa_fp16_names_its_presents(plain_models):
    """The failure of issue 37: onnxruntime's CUDA GroupQueryAttention refuses a node without
    present_key/present_value ('present_key and present_value are required ...')."""
    import onnx

    model = onnx.load(plain_models[("gpt2", "fp16")], load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(len(n.output) == 3 and all(n.output) for n in gqa)


def test_forced_gqa_in_fp32_on_cuda_is_refused(tmp_path):
    """onnxruntime has no fp32 CUDA GroupQueryAttention: it would run on the CPU with copies around it."""
    from tessera.runtime.errors import UsageError

    with pytest.raises(UsageError, match="no fp32 CUDA kernel for GroupQueryAttention"):
        _compile(tmp_path, "gpt2", "fp32", attention="gqa")


def test_explain_names_the_cuda_kernel_of_each_site(tmp_path, capsys):
    _compile(tmp_path, "t5", "fp32", explain=True)
    err = capsys.readouterr()
    text = err.out + err.err
    assert "fused -> attn23: onnx's Attention (opset 23), its padding and bias as one attn_mask: " \
           "EFFICIENT_ATTENTION in fp32" in text
    assert "portable" not in text


@pytest.fixture(scope="module")
def cached_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-cached")
    return {(f, dt): _compile(folder, f, dt, kv_cache=True) for f in ("gpt2", "llama") for dt in ("fp32", "fp16", "bf16")}


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_kv_cache_prefill_and_decoding_step_on_cuda(cuda_stub, cached_models, phase):
    """--kv-cache on CUDA: the prompt (T > 1) through onnx's Attention over past and new keys, its mask and key
    pads built before the If (no shape arithmetic in the branch, so no Memcpy there); a decoding step (T = 1)
    in fp16 and bf16 through GroupQueryAttention writing the buffer in place (its total length from the decode_mask
    input's width, on the host; with the padding mask as its attention_bias onnxruntime took its MATH path,
    one row of scores), in fp32 through the plain MatMul/Softmax over the cache (no fp32 CUDA kernel)."""
    keys = sorted(cached_models)
    seq, past = (5, 3) if phase == "prefill" else (1, 6)
    for key, report in zip(keys, cuda_stub.check(*(cached_models[k] for k in keys), seq=seq, past=past)):
        assert not placement_problems(report), (key, placement_problems(report))
        ops = [(k[0], k[3]) for k in report["kernels"]]
        if phase == "prefill":
            assert ops == [("Attention", "EFFICIENT_ATTENTION")] * 2, (key, ops)
        else:
            assert [op for op, _ in ops] == (["GroupQueryAttention"] * 2 if key[1] in ("fp16", "bf16") else []), \
                (key, ops)


def test_the_cuda_cached_prompt_equals_the_cpu_one_on_cpu(tmp_path):
    """The CUDA-target cached decoder (its prompt through onnx's Attention, keys padded to a multiple of 8)
    run by onnxruntime's CPU kernels gives the CPU-target one's logits and cache: left-padded rows, a
    past of 3 positions."""
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    outs = {}
    for target in ("cpu", "cuda"):
        path = tmp_path / f"{target}.onnx"
        driver.compile(ModelRef(spec="llama", sets=FAMILIES["llama"]),
                       CompileOptions(output=path, target=target, quiet=True, kv_cache=True, decode="plain"))
        if target == "cuda":  # the prompt's branch holds onnx's Attention
            import onnx

            from tessera.compiler.backends.onnx.walk import all_nodes

            ops = [n.op_type for n in all_nodes(onnx.load(str(path), load_external_data=False).graph.node)]
            assert ops.count("Attention") == 2 and "Loop" not in ops
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        b, t, p = 2, 5, 3
        feeds = {}
        for i in sess.get_inputs():
            if i.name == "tokens":
                feeds[i.name] = rng.integers(0, 128, (b, t)) if target == "cpu" else outs["tokens"]
            elif i.name == "attention_mask":
                m = np.ones((b, p + t), np.int64)
                m[1, :2] = 0  # the second row left-padded
                feeds[i.name] = m
            elif i.name == "position_ids":
                feeds[i.name] = np.stack([np.arange(p, p + t), np.arange(p - 2, p + t - 2).clip(0)])
            elif i.name.startswith("past_"):
                shape = [b if d == "B" else p if d == "P" else d for d in i.shape]
                feeds[i.name] = np.random.default_rng(hash(i.name) % 1000).standard_normal(shape).astype(np.float32)
        if target == "cpu":
            outs["tokens"] = feeds["tokens"]
        names = [o.name for o in sess.get_outputs()]
        outs[target] = dict(zip(names, sess.run(names, feeds)))
    for name, want in outs["cpu"].items():
        np.testing.assert_allclose(outs["cuda"][name], want, atol=2e-5, rtol=1e-4, err_msg=name)


GENERATE = """
import ctypes, json, sys
from tessera.runtime.generation import cached as gen
model = gen.CachedModel.from_onnx(sys.argv[1], provider=sys.argv[2])
lib = ctypes.CDLL("libcudart.so.13")
out = {"providers": model.session.get_providers(), "on_device": model.on_device}
for n in (4, 20):
    lib.stub_memcpy_reset()
    tokens = list(gen.stream(model, [[1, 2, 3, 4, 5], [6, 7, 8]], n))
    c = (ctypes.c_uint64 * 10)()
    lib.stub_memcpy_counts(c)
    out[n] = {"tokens": len(tokens), "h2d": c[3], "d2h": c[5]}
print(json.dumps(out))
"""


@pytest.mark.parametrize("family, dtype", [(f, dt) for dt in ("fp16", "bf16", "fp32") for f in ("gpt2", "llama")])
def test_generation_keeps_the_cache_on_the_device(cuda_stub, cached_models, family, dtype, tmp_path):
    """The issue's bound: a decoding step moves at most B x (V x 4 + 1 KiB) bytes between host and device
    (the new token ids and the mask in, the last position's logits out; the KV cache stays in device
    buffers bound in place with IOBinding, GroupQueryAttention writing each new column there), measured
    as the difference between a 20-token and a 4-token generation of two left-padded prompts, per step."""
    import json

    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    p = cuda_stub.run([str(script), cached_models[(family, dtype)], "cuda"])
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # fp32: the plain branch, its cache on the device all the same (runtime/device_cache.py), not BoundStep's
    assert r["providers"][0] == "CUDAExecutionProvider" and (r["on_device"] or dtype == "fp32"), r
    assert r["20"]["tokens"] == 20 and r["4"]["tokens"] == 4
    per_step = (r["20"]["h2d"] + r["20"]["d2h"] - r["4"]["h2d"] - r["4"]["d2h"]) / 16
    rows, vocab = 2, 128
    assert per_step <= rows * (vocab * 4 + 1024), r
    assert r["20"]["d2h"] - r["4"]["d2h"] == 16 * rows * vocab * 4  # the logits, nothing else, come back


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_tessera_generate_on_cuda_copies_the_logits_and_little_else(cuda_stub, dtype, tmp_path):
    """The issue's check through the command line: `tessera generate gpt2 ... --dtype fp16|bf16|fp32 --provider cuda`
    under the stub copies at most B x (V x 4 + 1 KiB) bytes per decoding step between host and device (the
    difference between a 20-token and a 4-token generation, per step; STUB_MEMCPY_REPORT counts every copy
    of the process, the weights' upload included, the same in both)."""
    import json

    counts = {}
    for n in (4, 20):
        report = tmp_path / f"copies-{n}.json"
        p = cuda_stub.run(["-m", "tessera.runtime.cli", "generate", "gpt2", *[a for s in FAMILIES["gpt2"] for a in ("--set", s)],
                           "--dtype", dtype, "--provider", "cuda", "--input", "tokens=[[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]",
                           "--max-new-tokens", str(n), "--ignore-eos", "--format", "json"],
                          STUB_MEMCPY_REPORT=report)
        assert p.returncode == 0, p.stderr[-3000:]
        c = json.loads(report.read_text())
        counts[n] = c["host_to_device"][1] + c["device_to_host"][1]
    rows, vocab = 2, 128
    assert (counts[20] - counts[4]) / 16 <= rows * (vocab * 4 + 1024), counts


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tessera_generate_on_cuda_decodes_with_flash_attention(cuda_stub, dtype):
    """`tessera generate --provider cuda` compiles the decoder whose decoding step has no mask (prefix_keys, as the
    serving engine's) and lays prompts of different lengths row by row (generation/cached.py CachedDecoder.by_row):
    each prompt through onnx's Attention (EFFICIENT_ATTENTION, one call per row), every decoding step through
    GroupQueryAttention's FLASH_ATTENTION, where with the left-padded batch's mask as attention_bias onnxruntime
    chose MATH. Its numbers on the CPU: tests/generation/test_generate_by_row.py."""
    import re

    p = cuda_stub.run(["-m", "tessera.runtime.cli", "generate", "llama", *[a for s in FAMILIES["llama"] for a in ("--set", s)],
                       "--dtype", dtype, "--provider", "cuda", "--input", "tokens=[[1, 2, 3, 4, 5], [6, 7]]",
                       "--max-new-tokens", "5", "--ignore-eos", "--format", "json"])
    assert p.returncode == 0, p.stderr[-3000:]
    kernels = re.findall(r"Operator=(\w+)(?: Node=\S+)? DataType=\w+ SdpaKernel=(\w+)", p.stdout)
    layers, rows, steps = 2, 2, 4  # the first token comes from the prompts' calls
    assert sorted(set(kernels)) == [("Attention", "EFFICIENT_ATTENTION"), ("GroupQueryAttention", "FLASH_ATTENTION")]
    assert kernels.count(("Attention", "EFFICIENT_ATTENTION")) == layers * rows
    assert kernels.count(("GroupQueryAttention", "FLASH_ATTENTION")) == layers * steps


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_speculative_generation_on_cuda_runs_every_call_on_the_host_cache(cuda_stub, dtype, tmp_path):
    """`tessera generate ... --speculative ngram --provider cuda`: the rollback cache (runtime/generation/rollback.py)
    feeds chunks and rolls rows back on its host cache, so it keeps no bound device buffers beside it (in fp16
    they took the single-token calls' columns while the chunks went to the host cache: the two parted); every
    call completes its host-side checks, the chunks' calls and the single-token ones. Values: not checkable
    here (tests/generation/test_speculative.py holds the host path to plain generation on the CPU)."""
    script = tmp_path / "spec.py"
    script.write_text("""
import sys
from tessera.runtime.generation import cached as gen, rollback
model = gen.CachedModel.from_onnx(sys.argv[1], provider="cuda")
cache = rollback.RollbackCache(model, [[1, 2, 3, 1, 2], [4, 5]], 6, 3)
assert model.on_device == (sys.argv[2] != "fp32") and cache.bound is None, (model.on_device, cache.bound)
cache.prefill()
cache.feed([[3, 1, 2, 3], [6]])  # a chunk per row (the longer one's drafts)
cache.rollback(0, 2)
cache.feed([[1], [7]])  # single tokens: the same host cache
print("ok", cache.filled)
""")
    from tessera.compiler.passes.attention_kernels import Target
    from tessera.runtime import pipeline as rt
    from tessera.runtime.generation import cached as gen

    built = rt.build("gpt2", None, FAMILIES["gpt2"])  # every position's logits: the verifier's
    model, _ = gen.compile_cached(built, rt.weights_for(built, None, 0), target=Target("cuda", dtype), mode="buffer",
                                  last_only=False)
    out = tmp_path / f"spec-{dtype}.onnx"
    out.write_bytes(model.SerializeToString())
    p = cuda_stub.run([str(script), str(out), dtype])
    assert p.returncode == 0 and p.stdout.strip().endswith("ok 10"), (p.stdout[-1000:], p.stderr[-3000:])


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_speculative_generation_with_the_cuda_decoder_equals_plain_generation_on_cpu(dtype):
    """The CUDA-target verifier (fp16: GroupQueryAttention decoding steps fed decode_mask, which the rollback
    cache did not feed, so `generate --speculative` on CUDA stopped at its first round) run by onnxruntime's CPU
    kernels: greedy tokens with prompt-lookup drafts equal plain generation's with the same model, drafts
    accepted (two prompts of different lengths, one repeating itself)."""
    from tessera.compiler.passes.attention_kernels import Target
    from tessera.runtime import pipeline as rt
    from tessera.runtime.generation import cached as gen, speculative
    from tessera.runtime.generation.drafting import NgramDrafter

    built = rt.build("llama", None, FAMILIES["llama"])
    model, info = gen.compile_cached(built, rt.weights_for(built, None, 0), target=Target("cuda", dtype),
                                     mode="buffer", last_only=False)
    verifier = gen.CachedModel(model.SerializeToString(), info, threads=1)
    assert ("decode_mask" in verifier.input_names) == (dtype == "fp16")
    prompts = [[5, 9, 2, 31, 7, 5, 9, 2, 31, 7, 5, 9], [3, 4, 5]]
    plain = gen.generate(verifier, prompts, 16).tokens
    stats, got = gen.Stats(), [[], []]
    for step in speculative.steps(verifier, prompts, 16, gen.Sampling(), NgramDrafter(), 3, stats=stats):
        for r, t in enumerate(step):
            if t is not None:
                got[r].append(t)
    assert got == plain and stats.accepted > 0, (got, plain, stats.accepted)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_cuda_decoder_equals_the_cpu_one_on_cpu(cached_models, family, tmp_path):
    """The CUDA-target fp16 cached decoder (the prompt through onnx's Attention, each step through
    GroupQueryAttention over the bound buffer, its total length from decode_mask) run by onnxruntime's CPU
    kernels gives the CPU-target fp16 decoder's logits within fp16 rounding and its tokens up to a near-tie
    (fp16 rounding may flip one): two left-padded prompts, 12 tokens (Llama: grouped heads, the rotary
    tables as fp16 caches)."""
    from tessera.runtime.generation import cached as gen

    cpu = _compile(tmp_path, family, "fp16", kv_cache=True, target="cpu")
    got = {}
    for name, path in (("cuda", cached_models[(family, "fp16")]), ("cpu", cpu)):
        model = gen.CachedModel.from_onnx(path, provider="cpu")
        logits = []
        tokens = list(gen.stream(model, [[1, 2, 3, 4, 5], [6, 7, 8]], 12,
                                 on_logits=lambda step, x: logits.append(x.copy())))
        got[name] = tokens, np.stack(logits)
    (tokens, logits), (want_tokens, want) = got["cuda"], got["cpu"]
    same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(want_tokens))
    np.testing.assert_allclose(logits[:same + 1], want[:same + 1], atol=2e-3)
    if same < len(want_tokens):  # fp16 rounding may flip a near-tie (seen: a top-2 gap of 6e-5): only there
        top2 = np.sort(want[same], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() < 2e-3, (same, tokens, want_tokens)


def test_the_gpu_bench_runs_its_smoke_sizes(cuda_stub, tmp_path):
    """bench/gpu.py (prepared for a lent GPU, not run on one) at --smoke sizes under the stub: every
    section runs to its end (values and times meaningless; the peers skip without a CUDA torch)."""
    import json

    from conftest import ROOT

    p = cuda_stub.run([str(ROOT / "bench" / "gpu.py"), "--smoke", "--only", "accuracy", "--only", "kernels",
                       "--only", "attention", "--only", "decode"], timeout=300, OUT=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert not [r for r in results if "error" in r], results
    assert {r["section"] for r in results} == {"device", "accuracy", "kernels", "attention", "decode"}
    decode = next(r for r in results if r["section"] == "decode" and "on_device" in r)
    assert decode["on_device"] and decode["providers"] == ["CUDAExecutionProvider"]


def test_the_vocabulary_hint_only_follows_an_index_out_of_range():
    """A kernel's own refusal (issue 37: GroupQueryAttention's missing presents on CUDA) got 'Check that
    token ids are below the vocabulary size', which misled; only a Gather's bounds check gets it now."""
    from onnx import TensorProto, helper

    from tessera.runtime.session import RunError, open_session, run_session

    def model(node, inputs):
        g = helper.make_graph([node], "m", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
        m.ir_version = 10
        return open_session(m.SerializeToString(), "cpu")

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])
    shape = helper.make_tensor_value_info("s", TensorProto.INT64, [1])
    sess = model(helper.make_node("Reshape", ["x", "s"], ["y"]), [x, shape])
    with pytest.raises(RunError) as e:
        run_session(sess, {"x": np.zeros(4, np.float32), "s": np.array([3])})
    assert "vocabulary" not in str(e.value) and "Reshape" in str(e.value)
    table = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])
    ids = helper.make_tensor_value_info("i", TensorProto.INT64, [None])
    sess = model(helper.make_node("Gather", ["x", "i"], ["y"]), [table, ids])
    with pytest.raises(RunError, match="Check that token ids are below the vocabulary size"):
        run_session(sess, {"x": np.zeros((3, 2), np.float32), "i": np.array([5])})


ENGINE = """
import ctypes, json, sys
from tessera.runtime import driver
from tessera.runtime.options import EngineOptions
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.serving.prefix_cache import PrefixCache
from tessera.runtime.serving.speculation import Speculation
lib = ctypes.CDLL("libcudart.so.13")
def run(eng, handles, most):
    out = []
    for _ in range(most):  # each iteration's copies, with the engine's state before and after it
        if all(h.finished for h in handles):
            break
        before = {"rows": len(eng.rows), "prefilling": sum(s.prefilling for s in eng.rows), "width": eng.width,
                  "relayouts": eng.relayouts, "moved": eng.device_cache.moved_rows}
        lib.stub_memcpy_reset()
        eng.step()
        c = (ctypes.c_uint64 * 10)()
        lib.stub_memcpy_counts(c)
        out.append({**before, "h2d": c[3], "d2h": c[5], "d2d": c[7], "after_rows": len(eng.rows),
                    "after_width": eng.width, "relayouts": eng.relayouts - before["relayouts"],
                    "moved": eng.device_cache.moved_rows - before["moved"], "row_bytes": eng.view_row_bytes()})
    return out
o = EngineOptions(spec=sys.argv[1], sets=sys.argv[2].split(","), provider="cuda", dtype=sys.argv[3], max_batch=2,
                  max_context=192)
model = driver.serve_model(o.model, o)
eng = Engine(model, max_batch=2, capacity=192)
r = {"providers": model.session.get_providers(), "device": eng.device_cache is not None, "describe": eng.describe()}
# a 60-token prompt that decodes past the first 64 columns (the view widens), a short one that leaves first
handles = [eng.submit(Request(list(range(1, 61)), 40)), eng.submit(Request([6, 7, 8], 8))]
r["plain"] = run(eng, handles, 80)
r["errors"] = [h.error for h in handles]
r["tokens"] = [len(h.tokens) for h in handles]
# speculation and the prefix cache: the model with every position's logits
model = driver.serve_model(o.model, o, last_only=False)
eng = Engine(model, max_batch=2, capacity=192)
PrefixCache.for_engine(eng, 1)
Speculation(adaptive=False).attach(eng)
phrase = [1, 2, 3, 4, 5, 6, 7, 8] * 5
handles = [eng.submit(Request(phrase, 12)), eng.submit(Request(phrase + [9], 12))]
r["speculative"] = run(eng, handles, 60)
r["speculative_errors"] = [h.error for h in handles]
r["checks"], r["hits"] = eng.speculation.calls, eng.prefix_cache.hits
print(json.dumps(r))
"""


@pytest.mark.parametrize("family, dtype", [(f, dt) for dt in ("fp16", "bf16", "fp32") for f in ("gpt2", "llama")])
def test_the_serving_engine_on_cuda(cuda_stub, family, dtype, tmp_path):
    """`serve`/`batch`'s engine with --provider cuda --dtype fp16, bf16 or fp32 (runtime/driver.py serve_model): the model
    compiled for CUDA, its KV cache in device OrtValues (runtime/serving/device_cache.py), every call's and
    every cache graph's host-side checks complete, and the copies are what docs/serve.md ("On CUDA") states:
    a decoding step of n rows at any view width copies its token ids, positions and cache lengths (n x 24 B)
    in and n x V x 4 B of logits out -- no attention mask (derived in the graph; before, n x (W + 1) x 8 B a
    step) and not the cache (n x 32 KiB at W = 64 for the 2-layer fp16 gpt2: what the host cache
    copied each way); in fp32 (the plain branch: no fp32 CUDA GroupQueryAttention) the same, less the lengths,
    the new columns coming back as device OrtValues written into their rows by the cache's graphs (a row's
    bytes per row on the device, none across); a prompt chunk its tokens in and its last logits out; an iteration where the view
    widens or narrows or a row leaves (moved into the freed slot) copies nothing more between host and device.
    With speculation and the prefix cache (every position's logits) the calls run and drafts are checked.
    Values computed on the device are not checkable here (tests/serving/test_serve_device_cache.py holds the same
    path to the numpy engine on the CPU provider)."""
    import json

    sets = [x for x in FAMILIES[family] if not x.startswith("ctx=")] + ["ctx=192"]
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    p = cuda_stub.run([str(script), family, ",".join(sets), dtype], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["providers"][0] == "CUDAExecutionProvider" and r["device"], r
    assert r["errors"] == [None, None] and r["tokens"] == [40, 8], r
    assert "placement: CUDAExecutionProvider; the KV cache in device memory" in r["describe"]
    vocab, steps = 128, r["plain"]
    decoding = [s for s in steps if s["rows"] and not s["prefilling"]]  # every row decodes: one call, n rows
    for s in decoding:
        n = s["rows"]
        assert s["d2h"] == n * vocab * 4, s  # the logits, nothing else, come back
        # ids, positions and lengths, n x 24 B (fp32, the plain branch: no lengths, n x 16 B), and a few shape
        # scalars: no attention mask (derived in the graph from cache_length, or in fp32 from the first position
        # ids, compiler/backends/onnx/prefix_mask.py; the gqa decoding step's own is gone too: prefix_keys, its
        # width in decode_span, which holds no values), whatever the view's width
        assert s["h2d"] <= n * (16 if dtype == "fp32" else 24) + 64, s
        assert s["h2d"] + s["d2h"] <= n * (vocab * 4 + 1024), s  # the bound
        if not s["relayouts"] and not s["moved"]:  # nor is the cache copied on the device
            if dtype == "fp32":  # the plain branch's new column per row written in: its row composed once, on the device
                assert s["d2d"] <= n * (s["row_bytes"] + 8192), s
            else:  # GroupQueryAttention wrote it in place
                assert s["d2d"] < n * s["row_bytes"], s
    assert any(s["relayouts"] and s["after_width"] > s["width"] for s in decoding)  # widened during a step
    assert any(s["after_rows"] < s["rows"] for s in decoding)  # a row left
    for s in steps:  # prefill (a chunk's last logits, beside the decoding rows') included: never the cache
        assert s["d2h"] % (vocab * 4) == 0 and s["d2h"] <= 3 * vocab * 4, s
        assert s["h2d"] <= 8 * 1024 < s["row_bytes"], s
    assert r["speculative_errors"] == [None, None] and r["checks"] > 0 and r["hits"] > 0, r


@pytest.mark.parametrize("target, dtype, fused", [("cuda", "fp16", True), ("cuda", "bf16", True), ("cuda", "fp32", True),
                                                  ("cpu", "fp16", False), ("cpu", "fp32", False)])
def test_mixtral_experts_are_fused_moe_on_cuda(tmp_path, target, dtype, fused):
    """Sparse experts on CUDA lower to com.microsoft.MoE in every dtype (compiler/passes/pipeline.py sparse_moe_impl;
    onnxruntime-gpu 1.31.1 registers it for fp32 too: test_every_bundled_decoder_s_cache_on_cuda runs it): no
    NonZero/ScatterND per expert, whose count the host would read back; on the CPU the measured gather form.
    MoE's numbers against the gather form: tests/compiler/test_sparse_moe.py (onnxruntime's CPU kernel, impl "moe");
    on CUDA only placement and the host-side checks are verified (test_the_other_bundled_families_on_cuda)."""
    import onnx

    out = tmp_path / "m.onnx"
    driver.compile(ModelRef(spec="mixtral", sets=OTHERS["mixtral"]),
                   CompileOptions(output=out, target=target, dtype=dtype, quiet=True))
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert (ops.count("MoE") == 2) == fused and ("NonZero" in ops) != fused, sorted(set(ops))


def test_gpt_oss_experts_are_fused_moe_with_biases_and_the_clamp_on_cuda(tmp_path):
    """gpt-oss's biased, clamped experts on CUDA fp16 are com.microsoft.MoE with its fc1/fc2 biases and the
    clamped SwiGLU's attributes (the values of that form: tests/compiler/test_experts_options.py, CPU kernel)."""
    import onnx
    from onnx import helper

    out = tmp_path / "g.onnx"
    driver.compile(ModelRef(spec="gpt_oss", sets=OTHERS["gpt_oss"]),
                   CompileOptions(output=out, target="cuda", dtype="fp16", quiet=True))
    moe = [n for n in onnx.load(str(out)).graph.node if n.op_type == "MoE"]
    assert len(moe) == 2
    for n in moe:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert n.input[3] and n.input[5], "fc1 and fc2 biases"
        assert attrs["swiglu_fusion"] == 1 and attrs["activation_beta"] == 1.0 and attrs["swiglu_limit"] == 7.0
        assert abs(attrs["activation_alpha"] - 1.702) < 1e-6


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_sliding_window_cached_decoder_keeps_no_copy_inside_a_branch(cuda_stub, tmp_path, dtype):
    """Gemma 3's --kv-cache decoder (five sliding layers of six) on CUDA: its windowed sites' branches built
    their key positions from the run-time dimensions (Squeeze, Range), which onnxruntime placed on the
    device with a Memcpy to the host for each Range bound (15 in the decoding branches before); moved into
    the main graph (backends/onnx/hoist.py), no Memcpy is left inside a branch, at a prompt (T = 5) and at
    decoding steps over 3 and 9 cached positions (past the window of 4), each run completing."""
    out = tmp_path / f"gemma3-kv-{dtype}.onnx"
    driver.compile(ModelRef(spec="gemma3", sets=OTHERS["gemma3"]),
                   CompileOptions(output=out, target="cuda", dtype=dtype, kv_cache=True, quiet=True))
    for past in (0, 3, 9):
        (report,) = cuda_stub.check(out, seq=1 if past else 5, past=past)
        assert report["providers"][:1] == ["CUDAExecutionProvider"] and not report["cpu_unforced"], report
        assert report["memcpy_subgraph"] == 0 and report["ran"], (past, report["memcpy_subgraph"], report["error"])


# Every other bundled decoder's --kv-cache graph (the generate/batch variant: the decoding step's mask fed) on CUDA in
# fp32, fp16 and bf16. Seen before: gpt-oss's prompt branch the portable Loop (18-22 Memcpy in its body) and its
# decoding step refused by onnxruntime (GroupQueryAttention's CUDA kernel takes head_sink only without attention_bias;
# bf16 had no CUDA ReduceMax, so no session at all); Gemma 2's soft-capped prompt the portable Loop; sparse experts in
# fp32 the gather form (NonZero's count read back on the host). Now: the prompt through onnx's Attention (softcap
# attribute, sinks as one more key), the decoding step of a site with sinks through the plain branch (passes/kv_cache.py
# SINKS_WITH_BIAS_ON_CUDA), fused MoE in every dtype. Mamba's Conv needs cuDNN, which the stub lacks.
CACHED_OTHERS = ["gemma2", "gemma3", "gptj", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "phi3", "mamba"]


@pytest.fixture(scope="module")
def other_cached_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-cached-others")
    out = {}
    for family in CACHED_OTHERS:
        for dtype in ("fp32", "fp16", "bf16"):
            path = folder / f"{family}-{dtype}.onnx"
            driver.compile(ModelRef(spec=family, sets=OTHERS[family]),
                           CompileOptions(output=path, target="cuda", dtype=dtype, kv_cache=True, quiet=True))
            out[(family, dtype)] = path
    return out


@pytest.mark.parametrize("seq, past", [(5, 3), (1, 6)], ids=["prompt", "decoding-step"])
def test_every_bundled_decoder_s_cache_on_cuda(cuda_stub, other_cached_models, seq, past):
    """Placement (no compute node on the CPU, no Memcpy in any Loop/If body), a prompt over a past of 3 and a
    decoding step over 6 cached positions each completing its host-side checks, every prompt site on a fused
    kernel (onnx's Attention: EFFICIENT_ATTENTION), every decoding step on GroupQueryAttention or the plain
    branch (no contrib kernel)."""
    keys = sorted(other_cached_models)
    reports = cuda_stub.check(*(other_cached_models[k] for k in keys), seq=seq, past=past, timeout=600)
    for key, report in zip(keys, reports):
        if key[0] == "mamba":  # placed, then stopped by the stub's cuDNN
            assert report["providers"][:1] == ["CUDAExecutionProvider"] and not report["cpu_unforced"], report
            assert report["memcpy_subgraph"] == 0 and "cuDNN is unavailable" in report["error"], report["error"]
            continue
        assert not placement_problems(report), (key, placement_problems(report))
        kinds = {(k[0], k[3]) for k in report["kernels"]}
        if seq > 1:
            assert kinds == {("Attention", "EFFICIENT_ATTENTION")}, (key, kinds)
        else:
            assert {op for op, _ in kinds} <= {"GroupQueryAttention"}, (key, kinds)
            if key[0] == "gpt_oss" or key[1] == "fp32":  # sinks with the fed mask, or no fp32 GQA: the plain branch
                assert not kinds, (key, kinds)


ENGINE_KERNELS = """
import ctypes, json, os, sys
from tessera.runtime import driver
from tessera.runtime.options import EngineOptions
from tessera.runtime.serving.engine import Engine, Request
lib = ctypes.CDLL("libcudart.so.13")
def mark(s):  # between the kernels' debug lines, which onnxruntime prints on stdout
    sys.stdout.flush()
    os.write(1, (s + "\\n").encode())
o = EngineOptions(spec=sys.argv[1], sets=sys.argv[2].split(","), provider="cuda", dtype=sys.argv[3], max_batch=2,
                  max_context=192)
out = {}
for variant, prefix_keys in (("default", None), ("masked", False)):
    model = driver.serve_model(o.model, o, prefix_keys=prefix_keys)
    eng = Engine(model, max_batch=2, capacity=192)
    handles = [eng.submit(Request(list(range(1, 21)), 6)), eng.submit(Request([6, 7, 8], 6))]
    steps = []
    while not all(h.finished for h in handles):
        decoding = bool(eng.rows) and not any(s.prefilling for s in eng.rows)
        rows, longest = len(eng.rows), max([s.filled for s in eng.rows] or [0]) + 1
        mark(f"@@step {variant} {len(steps)}")
        lib.stub_memcpy_reset()
        eng.step()
        c = (ctypes.c_uint64 * 10)()
        lib.stub_memcpy_counts(c)
        mark("@@end")
        steps.append({"decoding": decoding, "rows": rows, "longest": longest, "h2d": c[3], "d2h": c[5],
                      "width": eng.width})
    out[variant] = {"steps": steps, "errors": [h.error for h in handles], "tokens": [len(h.tokens) for h in handles],
                    "prefix_keys": model.info.prefix_keys, "inputs": sorted(model.input_names), "describe": eng.describe()}
mark("@@json " + json.dumps(out))
"""


def _kernels_by_step(stdout: str) -> dict:
    """(variant, step) -> the [op, kernel] each attention node chose in that step (check.py's pattern)."""
    import re

    found, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("@@step "):
            _, variant, i = line.split()
            current = found.setdefault((variant, int(i)), [])
        elif line.startswith("@@end"):
            current = None
        elif current is not None:
            m = re.search(r"Operator=(\w+)(?: Node=\S+)? DataType=\w+ SdpaKernel=(\w+)", line)
            if m:
                current.append([m.group(1), m.group(2)])
    return found


@pytest.mark.parametrize("family, dtype", [("gpt2", "fp16"), ("llama", "fp16"), ("llama", "bf16"), ("gpt_oss", "fp16")])
def test_the_engines_decoding_step_takes_flash_attention(cuda_stub, family, dtype, tmp_path):
    """The serving engine's decoder on CUDA in fp16 and bf16 (runtime/driver.py serve_model: prefix_keys by default on
    CUDA, passes/kv_cache.py) gives GroupQueryAttention no attention_bias -- each row's keys are its columns
    0..seqlens_k, as the engine lays rows -- and onnxruntime-gpu 1.31.1 chooses FLASH_ATTENTION for every
    decoding step (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO), where the same engine with the masked variant
    (prefix_keys=False: the mask as attention_bias) chose MATH; the mask's values are no longer an input
    (decode_span [0, longest + 1] carries the width) and neither is the attention mask (derived in the graph
    from cache_length, compiler/backends/onnx/prefix_mask.py), so each decoding step copies
    n x (longest + 1) x 8 B + n x (W + 1) x 8 B less host-to-device, the logits the same. Values are not
    checked (the stub computes nothing; the variant's numerics: tests/serving/test_serve_device_cache.py and
    test_serve_prefix_mask.py)."""
    import json

    if family == "gpt_oss":  # attention sinks (head_sink), every layer full: the engine serves no sliding window
        sets = [x for x in OTHERS[family] if not x.startswith("window=")] + ["window=0", "ctx=192"]
    else:
        sets = [x for x in FAMILIES[family] if not x.startswith("ctx=")] + ["ctx=192"]
    script = tmp_path / "engine_kernels.py"
    script.write_text(ENGINE_KERNELS)
    p = cuda_stub.run([str(script), family, ",".join(sets), dtype], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("@@json "))[len("@@json "):])
    kernels = _kernels_by_step(p.stdout)
    default, masked = r["default"], r["masked"]
    assert default["prefix_keys"] and not masked["prefix_keys"]
    assert "decode_span" in default["inputs"] and "decode_mask" not in default["inputs"]
    assert ("decode_mask" in masked["inputs"]) != (family == "gpt_oss") and "decode_span" not in masked["inputs"]
    assert default["errors"] == masked["errors"] == [None, None] and default["tokens"] == [6, 6]
    assert "FLASH_ATTENTION" in default["describe"] and "no mask of its own" in default["describe"]
    assert len(default["steps"]) == len(masked["steps"])
    decoding = [i for i, s in enumerate(default["steps"]) if s["decoding"]]
    assert len(decoding) >= 4
    for i in decoding:
        layers = 2
        assert kernels[("default", i)] == [["GroupQueryAttention", "FLASH_ATTENTION"]] * layers, kernels[("default", i)]
        # the masked variant: GroupQueryAttention with attention_bias (MATH); with sinks the plain branch, since
        # onnxruntime's CUDA kernel refuses head_sink beside attention_bias (passes/kv_cache.py SINKS_WITH_BIAS_ON_CUDA)
        masked_kernels = [] if family == "gpt_oss" else [["GroupQueryAttention", "MATH"]] * layers
        assert kernels[("masked", i)] == masked_kernels, kernels[("masked", i)]
        d, m = default["steps"][i], masked["steps"][i]
        assert (d["rows"], d["longest"]) == (m["rows"], m["longest"])
        assert d["h2d"] <= d["rows"] * 24 + 64, d  # ids, positions, lengths, a few shape scalars
        # decode_mask's bytes and attention_mask's (derived in the graph, prefix_mask.py), gone; the two graphs'
        # shape scalars differ by a few bytes
        if family == "gpt_oss":  # the plain branch's inputs: ids, positions and the attention mask, no lengths
            assert m["h2d"] <= m["rows"] * (16 + (m["width"] + 1) * 8) + 64, m
        else:
            assert abs(m["h2d"] - d["h2d"] - d["rows"] * (d["longest"] + d["width"] + 1) * 8) <= 16, (d, m)
        assert d["d2h"] == m["d2h"] == d["rows"] * 128 * 4  # the logits
    # every GroupQueryAttention of the mask-less decoder, prompt chunks' decoding branch included, is flash
    assert {k for (v, _), ks in kernels.items() if v == "default" for op, k in ks if op == "GroupQueryAttention"} == \
        {"FLASH_ATTENTION"}


# ---- encoder-decoders generating on CUDA (generation/loop.py EncoderDecoder, generation/cached.py Seq2Seq)
ENCDEC = ("bart", "transformer", "whisper")
ENCDEC_CASES = [(f, dt) for f in ENCDEC for dt in ("fp32", "fp16", "bf16")]


@pytest.fixture(scope="module")
def seq2seq_reports(cuda_stub, tmp_path_factory):
    """Each encoder-decoder's two generation graphs, compiled as `tessera generate --provider cuda --dtype DT`
    compiles them (loop.seq2seq_options), checked in three processes: the encoders on a source of 5, the
    decoders at the prompt (T = 4, no past) and at a decoding step (T = 1 after 3 positions)."""
    import onnx

    from tessera.runtime import pipeline
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.generation.loop import seq2seq_options, target_input
    from tessera.runtime.options import GenerateOptions

    folder = tmp_path_factory.mktemp("cuda-seq2seq")
    encoders, decoders = [], []
    for family, dtype in ENCDEC_CASES:
        o = GenerateOptions(provider="cuda", dtype=dtype)
        o.check()
        built = pipeline.build(family, None, OTHERS[family], None)
        weights = pipeline.weights_for(built, None, 0)
        enc, dec, _, _ = gen.compile_seq2seq(built, weights, target_input(built.graph), options=seq2seq_options(o))
        for proto, paths, part in ((enc, encoders, "encoder"), (dec, decoders, "decoder")):
            paths.append(folder / f"{family}-{dtype}-{part}.onnx")
            onnx.save(proto, paths[-1])
    return {"encoder": dict(zip(ENCDEC_CASES, cuda_stub.check(*encoders, seq=5, timeout=300))),
            "prompt": dict(zip(ENCDEC_CASES, cuda_stub.check(*decoders, seq=4, timeout=300))),
            "step": dict(zip(ENCDEC_CASES, cuda_stub.check(*decoders, seq=1, past=3, timeout=300)))}


@pytest.mark.parametrize("part", ["encoder", "prompt", "step"])
@pytest.mark.parametrize("family, dtype", ENCDEC_CASES)
def test_encoder_decoder_generation_graphs_on_cuda(seq2seq_reports, family, dtype, part):
    """Every compute node of both parts on CUDA, in every dtype (before issue 37's item, the decoder's cached
    self-attention stayed fp32 under an fp16 model: GroupQueryAttention without a CUDA kernel, left to the CPU);
    one run completes, except Whisper's encoder, whose Conv stops at the stub's cuDNN: placement only there."""
    report = seq2seq_reports[part][(family, dtype)]
    if family == "whisper" and part == "encoder":
        assert not report["ran"] and STUB_STOPS["whisper"] in report["error"], report["error"]
        report = {**report, "ran": True}
    assert not placement_problems(report), placement_problems(report)
    assert report["cuda_nodes"] > 0
    kinds = {k[3] for k in report["kernels"]}
    assert kinds <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION"}, report["kernels"]
    assert {k[2] for k in report["kernels"]} <= {dtype}, report["kernels"]  # every site at the model's dtype


ENCDEC_GENERATE = {
    "bart": ["--input", "src=[[5, 9, 14, 3, 22], [11, 4, 30, 1, 1]]", "--input", "src_mask=[[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]",
             "--start-token", "2"],
    "transformer": ["--input", "src=[[5, 9, 14, 3, 22], [11, 4, 30, 1, 1]]", "--input",
                    "src_mask=[[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]", "--start-token", "1"],
}


@pytest.mark.parametrize("family, dtype", [(f, dt) for f in ENCDEC_GENERATE for dt in ("fp16", "bf16", "fp32")])
def test_tessera_generate_encoder_decoder_on_cuda_copies_the_logits_and_little_else(cuda_stub, family, dtype, tmp_path):
    """`tessera generate bart|transformer ... --provider cuda --dtype fp16|bf16|fp32` under the stub: the encoder's
    outputs (each layer's cross-attention keys and values, the source mask) stay on the device and every step binds
    them, so a decoding step copies at most B x (V x 4 + 1 KiB) bytes between host and device (the difference
    between a 20-token and a 4-token generation, per step), the logits and nothing else coming back."""
    import json

    counts = {}
    for n in (4, 20):
        report = tmp_path / f"copies-{n}.json"
        p = cuda_stub.run(["-m", "tessera.runtime.cli", "generate", family,
                           *[a for s in OTHERS[family] for a in ("--set", s)], *ENCDEC_GENERATE[family],
                           "--dtype", dtype, "--provider", "cuda", "--max-new-tokens", str(n), "--ignore-eos",
                           "--format", "json"], STUB_MEMCPY_REPORT=report)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith('{"outputs"')))
        assert [len(row["tokens"]) for row in out["outputs"]] == [n, n]
        counts[n] = json.loads(report.read_text())
    rows, vocab = 2, 128
    moved = {n: c["host_to_device"][1] + c["device_to_host"][1] for n, c in counts.items()}
    assert (moved[20] - moved[4]) / 16 <= rows * (vocab * 4 + 1024), counts
    assert counts[20]["device_to_host"][1] - counts[4]["device_to_host"][1] == 16 * rows * vocab * 4, counts
