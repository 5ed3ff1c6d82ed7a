"""What the serving engine needs from the rest of the runtime, in one place: the cached decoder
(compiled with the plain decoding branch, see ``load``), token choice, the tokenizer and the errors.

Why one module: the engine and the server import the runtime only through here, so the runtime can
be reorganised by changing these imports alone.
"""

from __future__ import annotations

from pathlib import Path

from tessera.runtime.generation import cached as _gen
from tessera.runtime import pipeline as _pipeline
from tessera.runtime.session import ort_message  # noqa: F401  (re-exported)
from tessera.runtime.io.text import load_tokenizer  # noqa: F401  (re-exported)

CachedModel = _gen.CachedModel
Sampling = _gen.Sampling
choose = _gen.choose
check_cache_fits = _gen.check_cache_fits
UsageError = _pipeline.UsageError

# Why the engine decodes with the plain branch: see ``DECODE_REASON``.
DECODE = "plain"
DECODE_REASON = (
    "decode (T = 1): plain MatMul/Softmax over the cache buffer with a per-row slot mask and per-row "
    "positions, so every row of one step has its own length and sequences join and leave at any step. "
    "The GroupQueryAttention branch (the CPU default of `tessera generate`) takes one scalar cache_length "
    "for all rows and writes every row's new column at that one slot, which cannot hold rows of different "
    "lengths; the plain branch reads the buffer in place with no binding and the engine writes each row's "
    "new column at that row's own slot. bench/serve.py measures one request at a time with both branches "
    "(docs/BENCHMARKS.md).")


def load(spec: str, variant: str | None = None, sets: list[str] | None = None, weights: str | None = None,
         seed: int = 0, threads: int | None = None) -> CachedModel:
    """The cached decoder for the engine: a .tsr spec (or a bundled spec's name) compiled now with the
    plain decoding branch in buffer mode, or an .onnx file compiled with ``--kv-cache --decode plain``."""
    path = Path(spec)
    if path.suffix == ".onnx" or path.is_dir():
        if variant or sets or weights:
            raise UsageError("--variant, --set and --weights apply to .tsr specs; an .onnx file is already compiled")
        model = CachedModel.from_onnx(path, threads=threads)
    else:
        built = _pipeline.build(spec, variant, sets or [], weights)
        from tessera.runtime.generation.loop import target_input

        if target_input(built.graph) is not None:
            raise UsageError(f"{spec} is an encoder-decoder; `tessera serve` serves decoder-only models")
        w = _pipeline.weights_for(built, weights, seed)
        try:
            proto, info = _gen.compile_cached(built, w, mode="buffer", decode=DECODE)
        except UsageError as e:  # e.g. a sliding window: no buffer-mode cache
            raise UsageError(f"{e}; `tessera serve` needs the buffer cache (one row per slot), so it cannot serve "
                             f"this model") from None
        model = CachedModel(proto.SerializeToString(), info, threads=threads)
    check_fit(model)
    return model


def check_fit(model: CachedModel) -> None:
    """The engine needs buffer mode (a preallocated cache, one row per slot) and the plain decoding
    branch (per-row lengths); say how to recompile otherwise."""
    info = model.info
    if info.mode != "buffer":
        raise UsageError("the engine needs a buffer-mode cache (sliding-window models compile to concat mode, "
                         "which the engine does not serve); recompile with --kv-cache --cache buffer")
    if info.length_input:
        raise UsageError("this file decodes with GroupQueryAttention, one cache length for every row, so rows of "
                         "different lengths cannot share a step; recompile it with "
                         "`tessera compile --kv-cache --decode plain`, or serve the .tsr spec")
    if model.vocab is None:
        raise UsageError("the model's vocabulary size is not static; the engine needs it")


def tokenizer_folder_file(tokenizer_path: str | Path, name: str) -> Path | None:
    """A file next to tokenizer.json (tokenizer_config.json, generation_config.json), if present."""
    p = Path(tokenizer_path).parent / name
    return p if p.is_file() else None


TextStopper = _gen.TextStopper
encode_prompts = _gen.encode_prompts
stop_token_ids = _gen.stop_token_ids


def eos_ids(tokenizer, tokenizer_path: str | Path | None) -> list[int]:
    """The end-of-sequence tokens: ``eos_token`` of tokenizer_config.json and ``eos_token_id`` of
    generation_config.json / config.json beside the tokenizer (a request stops there unless it
    says ignore_eos). None found: no end-of-sequence token."""
    import json

    if tokenizer is None or tokenizer_path is None:
        return []
    out: list[int] = []
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        f = tokenizer_folder_file(tokenizer_path, name)
        if f is None:
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        tok = data.get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tokenizer.token_to_id(tok) is not None:
            out.append(int(tokenizer.token_to_id(tok)))
        ids = data.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0:
                out.append(i)
    return sorted(set(out))
