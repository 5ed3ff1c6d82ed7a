"""Shared helpers: paths to the bundled specs and small builders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One thread for numpy's BLAS and PyTorch's OpenMP pool (the references, the numpy interpreter), set before
# either is imported: the suite's matrices are small, and on CI's two shared cores a pool waiting at its
# barrier for a descheduled thread is far slower than one thread (timed under load: a 60 x 256 x 1000 numpy
# matmul 20-33 ms on two threads, 3.1-3.2 ms on one; a 2 x 30 x 64 by 64 x 200 torch linear 1.1-3.5 ms against
# 0.12-0.3 ms).
# onnxruntime ignores the variable (each session says its threads); a value already set is kept. Subprocesses
# the tests start (servers, the recipes' pytest) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.frontend.elaborate import elaborate
from tessera.spec import load_program

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# tests/ is in folders by area (spec, compiler, report, models, io, generation, serving, cuda, project);
# a test module may import another's helpers (serving's tests use generation/test_structured.py's
# tokenizer): every area on the path, whichever folder pytest was pointed at.
for _area in sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_area) not in sys.path:
        sys.path.append(str(_area))

# The compile cache (runtime/compile_cache.py) is off for the suite: it compiles thousands of models that
# would fill the user's cache folder, and a hit would skip the compile a test means to exercise (or to
# patch). tests/generation/test_compile_cache.py turns it on, in a folder of its own, where it is the subject.
os.environ["TESSERA_COMPILE_CACHE"] = "off"


def load_bench(name: str):
    """bench/NAME.py as a module (its own imports from bench/ resolved while it loads), for the tests
    of a bench's parsing and graph surgery: bench/ is not a package."""
    import importlib.util
    import sys

    folder = str(ROOT / "bench")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module
MODELS = ROOT / "models"


def build(spec: str, variant: str | None = None, **overrides):
    """Elaborate models/<spec>.tsr (or a path) with a variant and hyperparameter overrides."""
    path = Path(spec) if Path(spec).suffix == ".tsr" else MODELS / f"{spec}.tsr"
    graph, info = elaborate(load_program(path), variant, overrides)
    return graph


def ort_run(graph, weights, feeds, tmp_path=None):
    """Export to ONNX in memory and run it on onnxruntime's CPU provider."""
    import onnxruntime as ort

    model = onnx_export.to_onnx(graph, weights)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# Small versions of every family, for tests that run whole models (names are each spec's hyperparameters).
SMALL_MODELS = [
    ("gpt2", dict(layers=2, d=32, heads=4, vocab=50, ctx=64)),
    ("bert", dict(layers=2, d=32, heads=4, vocab=50, ctx=64, d_ff=64)),
    ("vit", dict(layers=2, d=32, heads=4, d_ff=64, image=32, patch=8)),
    ("llama", dict(layers=2, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48)),
    ("mixtral", dict(layers=2, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48, experts=4, top=2)),
    ("transformer", dict(layers=2, d=32, heads=4, vocab=50, d_ff=64)),
]


def feeds_for(graph, rng, b=2, t=37):
    """Random inputs by name: ids below 50, token types 0/1, masks with the second sequence padded
    by five positions, floats from N(0, 1); S (the encoder's length) is three longer than T."""
    feeds = {}
    for name in graph.inputs:
        typ = graph.type_of(name)
        shape = [int(d) if not d.free_symbols else (b if str(d) == "B" else t + 3 * (str(d) == "S"))
                 for d in typ.shape]
        if typ.dtype == "i64":
            if "mask" in name:
                arr = np.ones(shape, np.int64)
                arr[1, -5:] = 0
            else:
                arr = rng.integers(0, 2 if "type" in name else 50, shape)
            feeds[name] = arr.astype(np.int64)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run the tessera command in-process; return (status, stdout, stderr)."""
    from tessera.runtime.cli import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_error(capsys, *args, spec_error_ok: bool = True) -> str:
    """Run a command that must fail as a user error (status 2, no traceback); return its stderr, stripped."""
    rc, _, err = cli(capsys, *args)
    assert rc == 2, err
    assert "Traceback" not in err
    if spec_error_ok:
        assert err.startswith("error: ") or ": error: " in err.splitlines()[0], err
    else:
        assert err.startswith("error: "), err
    return err.strip()


class Recomputation:
    """An ``on_logits`` hook for the decoding loop: at every step it compares the logits each row's
    token was chosen from with the uncached session ``full`` run over the row's whole sequence so far
    (following the loop's greedy tokens). ``worst`` is the largest difference seen: absolute, or with
    ``relative`` divided by the reference's largest magnitude."""

    def __init__(self, full, prompts, relative: bool = False):
        self.full, self.relative = full, relative
        self.so_far = [list(p) for p in prompts]
        self.worst = 0.0

    def __call__(self, step, logits) -> None:
        import numpy as np

        for r, seq in enumerate(self.so_far):
            ref = self.full.run(None, {"tokens": np.array([seq], dtype=np.int64)})[0][0, -1]
            diff = float(np.abs(logits[r] - ref).max())
            if self.relative:
                diff /= float(np.abs(ref).max()) + 1e-6
            self.worst = max(self.worst, diff)
            seq.append(int(np.argmax(logits[r])))


def compile_written_cached(path, text: str, cache: str = "auto"):
    """``text`` written to ``path`` as a spec, built with seeded weights (seed 0) and compiled as a cached
    decoder in ``cache`` mode: (path, weights, compiler/build.py's compile_cached result), what
    ``cached_equals_recomputation`` takes."""
    from tessera.compiler import build as compiler_build
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime import pipeline as rt

    path.write_text(text)
    built = rt.build(str(path), None, [])
    weights = rt.weights_for(built, None, 0)
    return path, weights, compiler_build.compile_cached(built.graph, weights, built.info, PipelineOptions(cache=cache))


def cached_equals_recomputation(spec_path, weights, done, steps: int, vocab: int = 50) -> None:
    """Greedy generation with a compiled cached decoder (``done``: compiler/build.py compile_cached's
    result) from prompts of 7 and 2 tokens (left-padded to one batch), ``steps`` tokens each: at every
    step its logits equal the unfused graph of ``spec_path`` over each row's whole sequence (1e-4)."""
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes.pipeline import PipelineOptions, pipeline
    from tessera.runtime import pipeline as rt
    from tessera.runtime.generation import cached as gen

    ref = rt.build(str(spec_path), None, [])
    pipeline("full", PipelineOptions(attention="unfused"))(ref.graph)
    full = ort.InferenceSession(onnx_export.to_onnx(ref.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, n).tolist() for n in (7, 2)]
    check = Recomputation(full, prompts)
    result = gen.generate(gen.CachedModel(done.model.SerializeToString(), done.info), prompts, steps,
                          on_logits=check)
    assert [len(r) for r in result.tokens] == [steps, steps]
    assert check.worst <= 1e-4, f"max |cached - uncached| logits: {check.worst:.2e}"


def hf_greedy(hf, prompts: list[list[int]], new: int, **kw) -> list[list[int]]:
    """transformers' greedy generate, the reference of the generation tests: prompts of any lengths
    left-padded with their attention mask, exactly ``new`` tokens each (no EOS stop), ``kw`` more
    generate options (processors)."""
    import torch

    t0 = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), t0), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, t0 - len(p):] = torch.tensor(p)
        mask[r, t0 - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None, **kw)
    return out[:, t0:].tolist()


def engine_cache_columns(engine) -> list[dict]:
    """Every active row's filled columns of every cache buffer of a serving engine, as host arrays (its numpy
    cache's views or its device cache's host view)."""
    if not engine.rows:
        return []
    if engine.device_cache is not None:
        views = engine.device_cache.host_view(len(engine.rows), engine.width)
    else:
        views = engine._views()
    return [{name: v[s.slot, :, :s.filled].copy() for name, v in views.items()} for s in engine.rows]


def assert_engines_agree(want, other) -> None:
    """Two serving engines stepped together hold the same rows, slots and cache columns."""
    import numpy as np

    assert [(s.handle.request.prompt, s.filled) for s in other.rows] == \
        [(s.handle.request.prompt, s.filled) for s in want.rows]
    np.testing.assert_array_equal(other.slots, want.slots)
    for a, b in zip(engine_cache_columns(want), engine_cache_columns(other)):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def perturbed(model, scale: float, seed: int = 0):
    """A transformers model's weights moved away from its initialisation (norms by 0.1, the rest by
    ``scale``), so that greedy tokens differ by row and by step (a tied head at its initialisation
    copies the input token)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else scale))
    return model.eval()


def tiny_hf(family: str, vocab: int = 300):
    """A 2-layer transformers model of width 64 (``family`` "gpt2", else a Llama with grouped-query
    attention: 4 query heads, 2 key/value heads), seeded, its weights moved further from the
    initialisation so that its greedy output is not one repeated token: the serving tests' reference."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
                                       max_position_embeddings=256, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.08)
    return model.eval()


def tiny_recurrent_hf(family: str, vocab: int):
    """A seeded, perturbed transformers model with recurrent state (``family`` "jamba": 4 layers, Mamba
    mixers with attention at every second, one expert; else "mamba": 2 layers), width 32, the slow
    (non-kernel) Mamba path: the reference of the recurrent-state generation and serving tests."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "jamba":
        cfg = transformers.JambaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                       attn_layer_offset=1, num_experts=1, mamba_d_state=8, mamba_d_conv=4,
                                       mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, bos_token_id=1,
                                       eos_token_id=None, pad_token_id=0)
        return perturbed(transformers.JambaForCausalLM(cfg), 0.3)
    cfg = transformers.MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                   conv_kernel=4, time_step_rank=4, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return perturbed(transformers.MambaForCausalLM(cfg), 0.5)


@pytest.fixture(scope="session")
def cuda_stub(tmp_path_factory):
    """onnxruntime-gpu's CUDA provider under stub CUDA libraries built for this session
    (tests/cuda_stub_support.py); skipped, with the reason, where gcc, the CUDA headers or the
    provider library are missing."""
    import cuda_stub_support

    why = cuda_stub_support.why_unavailable()
    if why:
        pytest.skip(f"CUDA stub unavailable: {why}")
    return cuda_stub_support.build(tmp_path_factory.mktemp("cuda-stub"))


def sentence_transformers_reference(model_dir, sentences):
    """What sentence-transformers computes for a BERT folder (mean pooling over the attention mask, then
    L2 normalisation), written with transformers' BertModel: (embeddings, hidden states, input ids,
    attention mask), as numpy. Shared by the MiniLM tests of the compiler and of the server."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.BertModel.from_pretrained(str(model_dir)).eval()
    feats = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**feats).last_hidden_state
    m = feats["attention_mask"].unsqueeze(-1).float()
    emb = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)
    return emb.numpy(), hidden.numpy(), feats["input_ids"].numpy(), feats["attention_mask"].numpy()
