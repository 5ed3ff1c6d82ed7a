"""`tessera run` with text and image inputs, and their errors.

Text: a tokenizer.json fills the inputs tokens, mask and token_types by name,
right-padded to the longest text. Images: resized and normalised as Hugging
Face's ViTImageProcessor does, into the input pixels. (The real tokenizer of
all-MiniLM-L6-v2 is exercised in test_minilm.py.)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from conftest import MODELS, cli
from conftest import cli_error as shared_cli_error
from tessera.compiler.ir.signature import InputError, InputSpec
from tessera.runtime.io import image
from tessera.runtime.io import text

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPT2 = MODELS / "gpt2.tsr"
BERT = MODELS / "bert.tsr"
VIT = MODELS / "vit.tsr"
TINY_GPT2 = [a for s in ("layers=1", "d=16", "heads=2", "vocab=16", "ctx=8") for a in ("--set", s)]
TINY_BERT = [a for s in ("vocab=16", "ctx=16", "d=16", "heads=2", "layers=1", "d_ff=16") for a in ("--set", s)]
TINY_VIT = [a for s in ("image=32", "patch=16", "d=16", "heads=2", "layers=1", "d_ff=16") for a in ("--set", s)]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "man", "is", "eating", "food", "the", "sky", "blue", "."]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A small BERT-style tokenizer.json: word-level, lowercased, [CLS] ... [SEP]."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers, processors

    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_padding(pad_id=0, pad_token="[PAD]", length=16)  # replaced by padding to the longest text
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def cli_error(capsys, *args) -> str:
    return shared_cli_error(capsys, *args, spec_error_ok=False)


# ------------------------------------------------------------------ text
def test_encode_pads_on_the_right_to_the_longest_text(tokenizer_file):
    enc = text.encode(text.load_tokenizer(tokenizer_file), ["A man is eating food.", "The sky is blue"])
    assert enc.lengths == [8, 6]
    assert enc.ids.tolist() == [[2, 4, 5, 6, 7, 8, 12, 3], [2, 9, 10, 6, 11, 3, 0, 0]]
    assert enc.mask.tolist() == [[1] * 8, [1] * 6 + [0, 0]]
    assert enc.type_ids.tolist() == [[0] * 8] * 2


def test_text_feeds_fill_the_inputs_the_model_declares(tokenizer_file):
    enc = text.encode(text.load_tokenizer(tokenizer_file), ["a man", "the sky is blue"])
    bert = [InputSpec("tokens", "i64", ("B", "T")), InputSpec("token_types", "i64", ("B", "T")),
            InputSpec("mask", "i64", ("B", "T"))]
    assert set(text.text_feeds(enc, bert)) == {"tokens", "token_types", "mask"}
    assert set(text.text_feeds(enc, [InputSpec("tokens", "i32", ("B", "T"))])) == {"tokens"}
    assert text.text_feeds(enc, [InputSpec("tokens", "i32", ("B", "T"))])["tokens"].dtype == np.int32
    with pytest.raises(InputError, match="--text fills the input 'tokens'"):
        text.text_feeds(enc, [InputSpec("src", "i64", ("B", "S"))])


def test_mean_pool_ignores_padding():
    hidden = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    mask = np.array([[1, 1, 1], [1, 0, 0]])
    pooled = text.mean_pool(hidden, mask, normalize=False)
    assert pooled.tolist() == [[2.0, 3.0], [6.0, 7.0]]
    unit = text.mean_pool(hidden, mask)
    assert np.allclose(np.linalg.norm(unit, axis=-1), 1.0)


def test_run_bert_on_text_batch(capsys, tokenizer_file):
    rc, out, err = cli(capsys, "run", BERT, *TINY_BERT, "--tokenizer", tokenizer_file, "--text", "A man is eating.",
                       "--text", "The sky", "--provider", "cpu", "--format", "json")
    assert rc == 0, err
    outputs = json.loads(out)["outputs"]
    assert outputs["hidden"]["shape"] == [2, 7, 16] and outputs["pooled"]["shape"] == [2, 16]


def test_run_with_pool_mean_prints_embeddings_and_similarities(capsys, tokenizer_file):
    rc, out, err = cli(capsys, "run", BERT, *TINY_BERT, "--tokenizer", tokenizer_file, "--text", "A man is eating.",
                       "--text", "The sky", "--text", "a man is eating.", "--pool", "mean", "--provider", "cpu",
                       "--format", "json")
    assert rc == 0, err
    outputs = json.loads(out)["outputs"]
    emb, sim = np.array(outputs["embedding"]["values"]), np.array(outputs["similarity"]["values"])
    assert emb.shape == (3, 16) and sim.shape == (3, 3)
    assert np.allclose(np.diag(sim), 1.0, atol=1e-5)
    assert sim[0, 2] == pytest.approx(1.0, abs=1e-5)  # lowercased: the same tokens


def test_run_gpt2_on_texts_of_different_lengths_notes_the_padding(capsys, tokenizer_file):
    rc, out, err = cli(capsys, "run", GPT2, *TINY_GPT2, "--tokenizer", tokenizer_file, "--text", "a man",
                       "--text", "the sky is blue", "--provider", "cpu", "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["outputs"]["logits"]["shape"] == [2, 6, 16]
    assert "note: the texts have 4, 6 tokens and are right-padded to 6; the model has no mask input" in err


def test_text_without_tokenizer(capsys):
    err = cli_error(capsys, "run", BERT, *TINY_BERT, "--text", "a man")
    assert err == "error: --text needs --tokenizer tokenizer.json to turn the text into token ids"


def test_tokenizer_without_text(capsys, tokenizer_file):
    err = cli_error(capsys, "run", BERT, *TINY_BERT, "--tokenizer", tokenizer_file)
    assert err == "error: --tokenizer is given but no --text to tokenize"


def test_tokenizer_file_not_found(capsys, tmp_path):
    err = cli_error(capsys, "run", BERT, *TINY_BERT, "--tokenizer", tmp_path / "nope.json", "--text", "a")
    assert err == f"error: tokenizer file not found: {tmp_path / 'nope.json'}"


def test_tokenizer_file_that_is_not_a_tokenizer(capsys, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    err = cli_error(capsys, "run", BERT, *TINY_BERT, "--tokenizer", bad, "--text", "a")
    assert err.startswith(f"error: cannot read {bad} as a Hugging Face tokenizer.json file: ")


def test_text_for_a_model_without_tokens(capsys, tokenizer_file):
    err = cli_error(capsys, "run", VIT, *TINY_VIT, "--tokenizer", tokenizer_file, "--text", "a man")
    assert err.startswith("error: --text fills the input 'tokens' (and 'mask', 'token_types' where the model has "
                          "them), but the model's inputs are: pixels: f32[B, 3, 32, 32]")


def test_text_and_input_for_the_same_input(capsys, tokenizer_file):
    err = cli_error(capsys, "run", BERT, *TINY_BERT, "--tokenizer", tokenizer_file, "--text", "a man",
                    "--input", "mask=[[1, 1, 1, 1]]")
    assert err == "error: input 'mask' is given both by --input and by --text"


def test_pool_needs_hidden_states(capsys):
    err = cli_error(capsys, "run", GPT2, *TINY_GPT2, "--input", "tokens=[[1, 2]]", "--pool", "mean",
                    "--provider", "cpu")
    assert err == ("error: --pool mean pools an output named 'hidden' of shape [B, T, d]; the model's outputs are: "
                   "logits [1, 2, 16]")


# ------------------------------------------------------------------ images
@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """Two random images of other sizes than the model's: RGB 61x37 and RGBA 20x50."""
    pil = pytest.importorskip("PIL.Image")
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    a = folder / "a.png"
    pil.fromarray(rng.integers(0, 256, size=(37, 61, 3), dtype=np.uint8), "RGB").save(a)
    b = folder / "b.png"
    pil.fromarray(rng.integers(0, 256, size=(50, 20, 4), dtype=np.uint8), "RGBA").save(b)
    return [a, b]


def _hf_processor(size):
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "ViTImageProcessorPil", None) or transformers.ViTImageProcessor
    return cls(size={"height": size, "width": size})


def test_images_are_preprocessed_as_hugging_face_does(pngs):
    from PIL import Image

    ours = image.image_feeds([str(p) for p in pngs], [InputSpec("pixels", "f32", ("B", 3, 48, 48))])["pixels"]
    images = [Image.open(p).convert("RGB") for p in pngs]
    ref = _hf_processor(48)(images=images, return_tensors="np")["pixel_values"]
    assert ours.shape == ref.shape == (2, 3, 48, 48)
    assert np.abs(ours - ref).max() < 1e-5


def test_run_vit_on_images_matches_hugging_face(capsys, pngs):
    """The tiny ViT of test_families.py, run from image files, against ViTModel on the processor's pixels."""
    torch = pytest.importorskip("torch")
    from PIL import Image
    from test_families import vit_case

    case = vit_case(pngs[0].parent)
    rc, out, err = cli(capsys, "run", VIT, "--variant", "b16", *case.set_args(), "--weights", case.ckpt,
                       "--image", pngs[0], "--image", pngs[1], "--provider", "cpu", "--format", "json")
    assert rc == 0, err
    outputs = json.loads(out)["outputs"]
    pixels = _hf_processor(48)(images=[Image.open(p).convert("RGB") for p in pngs], return_tensors="pt")
    with torch.no_grad():
        ref = case.model(pixel_values=pixels["pixel_values"])
    assert np.abs(np.array(outputs["hidden"]["values"]) - ref.last_hidden_state.numpy()).max() < 1e-4
    assert np.abs(np.array(outputs["pooled"]["values"]) - ref.pooler_output.numpy()).max() < 1e-4


def test_image_for_a_model_without_pixels(capsys, pngs):
    err = cli_error(capsys, "run", GPT2, *TINY_GPT2, "--image", pngs[0])
    assert err.startswith("error: --image fills an input 'pixels' of shape [B, C, H, W], but the model's inputs "
                          "are: tokens: i64[B, T]")


def test_image_file_not_found(capsys, tmp_path):
    err = cli_error(capsys, "run", VIT, *TINY_VIT, "--image", tmp_path / "nope.png")
    assert err == f"error: image file not found: {tmp_path / 'nope.png'}"


def test_file_that_is_not_an_image(capsys, tmp_path):
    pytest.importorskip("PIL")
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    err = cli_error(capsys, "run", VIT, *TINY_VIT, "--image", bad)
    assert err.startswith(f"error: cannot read {bad} as an image: ")


def test_image_and_input_for_the_same_input(capsys, pngs):
    err = cli_error(capsys, "run", VIT, *TINY_VIT, "--image", pngs[0], "--input", "pixels=[[[[0]]]]")
    assert err == "error: input 'pixels' is given both by --input and by --image"


def test_image_without_pillow(capsys, pngs, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    err = cli_error(capsys, "run", VIT, *TINY_VIT, "--image", pngs[0])
    assert err == "error: --image needs Pillow: pip install 'tessera[image]'"
