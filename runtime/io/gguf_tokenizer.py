"""A GGUF file's tokenizer, rebuilt from its metadata as a ``tokenizers`` tokenizer.json.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``),
each token's type and score, the merges where it has them, and the special ids. Two kinds are read:

- **byte-level BPE** (``tokenizer.ggml.model = gpt2``: GPT-2, SmolLM2, Llama 3, Qwen): the vocabulary
  and merges as they are, with the pre-tokenizer (the split regex) ``tokenizer.ggml.pre`` names
  (``PRE_TOKENIZERS``);
- **SentencePiece BPE** (``tokenizer.ggml.model = llama``: Llama 2, TinyLlama, Mistral, Gemma 1-3): a
  BPE over ``▁``-spelled text with byte fallback (the ``<0x0A>`` tokens). Such files list no merges;
  they are recovered from the vocabulary as transformers' GGUF loader does (every split of a token into
  two tokens of the vocabulary is a merge, ranked by the token's score); Gemma's scores do not follow
  its merge order, the tokens' order in the file does. (Gemma's runs of 2-31 spaces are stored as real
  spaces, marked user-defined: added tokens, matched whole before the ``▁`` spelling, so transformers'
  respelling of them changes no tokenization and is not repeated here.) Llama's form
  prepends ``▁`` to the text (when ``tokenizer.ggml.add_space_prefix`` is true or absent, as llama.cpp
  does); Gemma's replaces every space by ``▁`` and prepends nothing.

The reference for both is transformers' own GGUF tokenizer on the same file
(tests/io/test_gguf_tokenizer.py); llama.cpp's tokenizer is not available here to compare with.
Control tokens (type 3) are added as special tokens and user-defined ones (type 4) as plain added
tokens, so either is matched whole in the text rather than cut into pieces.
"""
from __future__ import annotations

import json
from pathlib import Path

CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"  # SentencePiece's spelling of a space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2's (and Qwen3's: llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, the Qwen tokenizer.json's Split): Llama 3's
# with digits one by one
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

PRE_TOKENIZERS = ("gpt2", "default", "smollm", "starcoder", "refact", "llama-bpe", "qwen2")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _pre_tokenizer(pre: str):
    """tokenizer.ggml.pre -> the Hugging Face pre-tokenizer llama.cpp's regexes stand for, or None."""
    from tokenizers import Regex, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):  # digits one by one, then GPT-2's split
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pt.Sequence([pt.Split(Regex(split), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    return None


def merges_from_vocabulary(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every way of cutting a token into two
    tokens of the vocabulary, best-ranked token first (ties: the longer left piece, then the longer
    right one; then the order found), as transformers' ``generate_merges`` with scores ranks them. ``rank``: each token's score (higher merges earlier)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in rank.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        cuts.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, score) for left, right in cuts)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _byte_level(meta: dict, tokens: list[str]):
    """(tokenizer, None) for a byte-level BPE file, or (None, why not)."""
    from tokenizers import Tokenizer, decoders, models

    pre = meta.get("tokenizer.ggml.pre", "default")
    pre_tok = _pre_tokenizer(pre)
    if pre_tok is None:
        return None, f"its pre-tokenizer {pre!r} is not one Tessera knows ({', '.join(PRE_TOKENIZERS)})"
    merges = [tuple(x.split(" ", 1)) for x in meta.get("tokenizer.ggml.merges") or []]
    if any(len(pair) != 2 for pair in merges):
        return None, "its merges or tokens are not BPE's (a merge is two tokens separated by a space)"
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                               byte_fallback=False, ignore_merges=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    return tok, None


def _sentencepiece(meta: dict, tokens: list[str], arch: str):
    """(tokenizer, None) for a SentencePiece BPE file (Llama's form, or Gemma's), or (None, why not)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers as pt

    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    gemma = arch in GEMMA_ARCHITECTURES
    if gemma:  # the merge order is the file's order, not the scores
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            return None, "it is a SentencePiece vocabulary without a score per token (tokenizer.ggml.scores)"
        rank = dict(zip(tokens, (float(s) for s in scores)))
    if f"<0x{ord(chr(10)):02X}>" not in tokens:
        return None, "it is a SentencePiece vocabulary without byte tokens (<0x0A> ...), which Tessera needs"
    merges = merges_from_vocabulary(tokens, rank)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk_token,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pt.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    else:
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is not False
        tok.pre_tokenizer = pt.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix else "never",
                                         split=False)
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok, None


def _add_special(tok, meta: dict, tokens: list[str], byte_level: bool) -> None:
    """Control tokens as special tokens, user-defined ones as plain added tokens (both matched whole;
    a user-defined token is added only as the vocabulary spells it, so no id past the vocabulary appears).
    In a byte-level vocabulary a 'control' token spelled outside the byte alphabet is llama.cpp's
    mislabel and is left out, as transformers leaves it out (adding it would grow the vocabulary)."""
    from tokenizers import AddedToken, pre_tokenizers

    types = meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None  # GPT-2's 256 byte spellings
    control = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
               if t == CONTROL and i < len(tokens) and (alphabet is None or set(tokens[i]) <= alphabet)]
    vocab = tok.get_vocab()  # a user-defined token the vocabulary spells otherwise (Gemma's spaces) is not added
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == USER_DEFINED and i < len(tokens) and tokens[i] in vocab]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def write(meta: dict, arch: str, folder: Path, context_length: int = 4096) -> str | None:
    """tokenizer.json and tokenizer_config.json in ``folder`` from the metadata; None, or a note why not."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return "it has no tokenizer metadata"
    if not all(isinstance(t, str) for t in tokens):
        return "its tokens are not all text"
    try:
        from tokenizers import processors
    except ImportError:
        return "the tokenizers package is not installed (pip install 'tessera[gguf]')"
    if kind == "gpt2":
        tok, why = _byte_level(meta, tokens)
    elif kind == "llama":
        tok, why = _sentencepiece(meta, tokens, arch)
    else:
        return (f"its tokenizer model is {kind!r} (Tessera reads byte-level BPE, 'gpt2', and SentencePiece "
                f"BPE, 'llama')")
    if tok is None:
        return why
    _add_special(tok, meta, tokens, byte_level=kind == "gpt2")
    if tok.get_vocab_size(with_added_tokens=True) > len(tokens):  # an id the model's embedding lacks
        return (f"its tokenizer would have {tok.get_vocab_size(with_added_tokens=True)} tokens, more than the "
                f"{len(tokens)} of its vocabulary (a special token spelled apart from the vocabulary)")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (as transformers does)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and isinstance(bos, int) and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                           pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                                                           special_tokens=[(tokens[bos], bos)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
              "add_bos_token": add_bos}
    for key, value in (("bos_token", bos), ("eos_token", eos),
                       ("unk_token", meta.get("tokenizer.ggml.unknown_token_id")),
                       ("pad_token", meta.get("tokenizer.ggml.padding_token_id"))):
        if isinstance(value, int) and 0 <= value < len(tokens):
            config[key] = tokens[value]
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return None
