"""Text inputs for ``tessera run``, and sentence embeddings.

A Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` package, the
``text`` extra) turns strings into token ids. A batch of texts is padded on the
right to its longest member, and the inputs the model declares are filled by
name:

- ``tokens``: the token ids (required),
- ``mask``: 1 for real tokens, 0 for padding (if the model has this input),
- ``token_types``: the tokenizer's type ids, all 0 for single sentences (if
  the model has this input).

The tokenizer file's own truncation setting is kept (all-MiniLM-L6-v2's cuts
at 128 tokens); its padding setting is replaced by padding to the longest text
of the batch, on the right.

``mean_pool`` is the sentence embedding of sentence-transformers models such
as all-MiniLM-L6-v2: the mean of the hidden states over the real tokens,
L2-normalised. ``embed`` runs a whole text batch through an ONNX session and
returns those embeddings::

    from tessera.runtime import pipeline
    from tessera.runtime.io import text
    from tessera.runtime.session import open_session
    from tessera.compiler.backends.onnx import export as onnx_export

    built = pipeline.build("models/bert.tsr", "minilm_l6")
    weights = pipeline.weights_for(built, "model.safetensors", seed=0)
    sess = open_session(onnx_export.to_bytes(built.graph, weights), "cpu")
    tok = text.load_tokenizer("tokenizer.json")
    emb = text.embed(sess, tok, ["A man is eating food.", "A man is eating a meal."])
    print(emb @ emb.T)   # cosine similarities
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import DTYPES
from tessera.compiler.ir.signature import InputError, InputSpec

TEXT_INPUTS = ("tokens", "mask", "token_types")


@dataclass
class Encoded:
    """A padded text batch: ids, mask and type ids, each int64 [N, T]."""

    ids: np.ndarray
    mask: np.ndarray
    type_ids: np.ndarray
    lengths: list[int]


def tokenizer_file(path: str | Path) -> Path:
    """--tokenizer's file: the path itself, or a folder's tokenizer.json (a checkpoint folder, as
    transformers' AutoTokenizer takes it)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise InputError(f"tokenizer folder {path} has no tokenizer.json")
        return path / "tokenizer.json"
    return path


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file (or a folder holding one); errors are InputErrors."""
    try:
        from tokenizers import Tokenizer  # optional (tessera[text]): only text prompts need it
    except ImportError:
        raise InputError("--tokenizer needs the 'tokenizers' package: pip install 'tessera[text]'") from None
    path = tokenizer_file(path)
    if not path.is_file():
        raise InputError(f"tokenizer file not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exceptions for bad JSON or unknown models
        raise InputError(f"cannot read {path} as a Hugging Face tokenizer.json file: {e}") from None


def _pad_ids(tokenizer) -> tuple[int, int]:
    pad = tokenizer.padding
    if pad:
        return int(pad["pad_id"]), int(pad["pad_type_id"])
    for token in ("[PAD]", "<pad>", "<|pad|>"):
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return int(tid), 0
    return 0, 0  # no pad token: the id is hidden by the mask (or lies past the text in a causal model)


def encode(tokenizer, texts: list[str]) -> Encoded:
    """Tokenize a batch (special tokens added as the tokenizer.json says) and right-pad it to its longest text."""
    if not texts:
        raise InputError("no text given")
    pad_id, pad_type = _pad_ids(tokenizer)
    tokenizer.no_padding()
    encodings = tokenizer.encode_batch(list(texts))
    lengths = [len(e.ids) for e in encodings]
    if max(lengths) == 0:
        raise InputError("the tokenizer produced no tokens for the text given")
    n, t = len(encodings), max(lengths)
    ids = np.full((n, t), pad_id, dtype=np.int64)
    types = np.full((n, t), pad_type, dtype=np.int64)
    mask = np.zeros((n, t), dtype=np.int64)
    for row, e in enumerate(encodings):
        k = len(e.ids)
        ids[row, :k] = e.ids
        types[row, :k] = e.type_ids
        mask[row, :k] = 1
    return Encoded(ids, mask, types, lengths)


def text_feeds(enc: Encoded, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    """The model's text inputs (tokens, and mask / token_types if it declares them) from an encoded batch."""
    by_name = {s.name: s for s in specs}
    if "tokens" not in by_name:
        raise InputError("--text fills the input 'tokens' (and 'mask', 'token_types' where the model has them), "
                         "but the model's inputs are: " + ", ".join(f"{s.name}: {s}" for s in specs)
                         + "; give them with --input NAME=VALUE")
    values = {"tokens": enc.ids, "mask": enc.mask, "token_types": enc.type_ids}
    feeds = {}
    for name in TEXT_INPUTS:
        spec = by_name.get(name)
        if spec is None:
            continue
        want = np.dtype(DTYPES[spec.dtype])
        if want.kind not in "iu":
            raise InputError(f"--text cannot fill input '{name}': it is {spec}, not integer ids")
        feeds[name] = values[name].astype(want)
    return feeds


def mean_pool(hidden: np.ndarray, mask: np.ndarray | None = None, normalize: bool = True) -> np.ndarray:
    """Mean of hidden [N, T, d] over the positions where mask [N, T] is nonzero; L2-normalised by default."""
    hidden = np.asarray(hidden, dtype=np.float32)
    if hidden.ndim != 3:
        raise InputError(f"mean pooling needs hidden states [N, T, d], got shape {list(hidden.shape)}")
    if mask is None:
        mask = np.ones(hidden.shape[:2], dtype=np.float32)
    m = (np.asarray(mask) != 0).astype(np.float32)[..., None]
    if m.shape[:2] != hidden.shape[:2]:
        raise InputError(f"mask of shape {list(np.shape(mask))} does not fit hidden states {list(hidden.shape)}")
    pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    if normalize:
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled.astype(np.float32)


def hidden_output(outputs: dict[str, np.ndarray]) -> str:
    """The output to pool: the model's output named 'hidden', of shape [B, T, d]."""
    v = outputs.get("hidden")
    if v is None or v.ndim != 3:
        raise InputError("--pool mean pools an output named 'hidden' of shape [B, T, d]; the model's outputs are: "
                         + ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items()))
    return "hidden"


def embed(session, tokenizer, texts: list[str]) -> np.ndarray:
    """Sentence embeddings [N, d] of texts: run the model, mean-pool its hidden states, L2-normalise."""
    from tessera.runtime.session import run_session  # session.py imports onnx (~0.6 s)

    enc = encode(tokenizer, texts)
    dtypes = {"tensor(int64)": "i64", "tensor(int32)": "i32"}
    specs = [InputSpec(i.name, dtypes.get(i.type, "f32"), tuple(i.shape)) for i in session.get_inputs()]
    outputs = run_session(session, text_feeds(enc, specs))
    return mean_pool(outputs[hidden_output(outputs)], enc.mask)
