"""A small GPT-2 with Hugging Face's weights gives Hugging Face's logits.

The checkpoint is a randomly initialised GPT2LMHeadModel saved as safetensors
with Hugging Face's own names; models/gpt2.hf.toml maps them to Tessera's.
"""

import numpy as np
import pytest

from conftest import MODELS, build, ort_run
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import load_weights, name_map_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(layers=2, d=64, heads=4, vocab=1000, ctx=128)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    folder = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder / "model.safetensors"


def test_logits_equal_hugging_face(hf_model):
    model, ckpt = hf_model
    graph = build("gpt2", **SMALL)
    weights = load_weights(graph, ckpt, name_map_for(MODELS / "gpt2.tsr"))
    tokens = np.random.default_rng(0).integers(0, 1000, size=(2, 9)).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    ours_numpy = interpret.run(graph, weights, {"tokens": tokens})["logits"]
    ours_ort = ort_run(graph, weights, {"tokens": tokens})["logits"]
    assert np.abs(ours_numpy - ref).max() < 1e-4
    assert np.abs(ours_ort - ref).max() < 1e-4


def test_compile_with_hf_weights_through_the_cli(hf_model, tmp_path):
    import onnxruntime as ort

    from tessera.runtime.cli import main

    model, ckpt = hf_model
    out = tmp_path / "gpt2.onnx"
    sets = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    assert main(["compile", str(MODELS / "gpt2.tsr"), *sets, "--weights", str(ckpt), "-o", str(out)]) == 0
    tokens = np.arange(12, dtype=np.int64).reshape(1, 12)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(sess.run(None, {"tokens": tokens})[0] - ref).max() < 1e-4
