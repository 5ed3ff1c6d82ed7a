"""What the serving engines need from the rest of the runtime, in one place: the model for the engine
(``load``: runtime/driver.py's ``serve_model``, which compiles it as every other command compiles;
row_engine.py ``engine_for`` picks the engine that serves it), token choice, the tokenizer and the errors.

Why one module: the engines and the routes (engine.py, row_engine.py, speculation.py, app.py) import
the runtime only through here, so the runtime can be reorganised by changing these imports alone; what
builds them (server.py, batch.py) takes its options from runtime/options.py and its model from the
driver. The parsers of `tessera serve` and `tessera batch`
do not import it (they must not import onnxruntime, onnx or the compiler: tests/project/test_cli_help.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from tessera.compiler.backends.onnx.mixed_attention import COMBINED_KEY, SHORT_LOGITS_KEY
from tessera.compiler.reference.quant import ROWS
from tessera.runtime import driver, metadata
from tessera.runtime.driver import DECODE, check_fit, served_sources  # noqa: F401  (re-exported)
from tessera.runtime.errors import UsageError  # noqa: F401  (re-exported)
from tessera.runtime.generation.cached import (NO_CONTEXT_CAP, CachedDecoder, CachedModel, Stats,  # noqa: F401
                                               check_cache_fits, encode_prompts, stop_token_ids)
from tessera.runtime.generation.stops import StopStrings, TextStopper  # noqa: F401
from tessera.runtime.generation.drafting import NgramDrafter  # noqa: F401
from tessera.runtime.generation.sampling import Sampling, Step, choose, token_logprobs  # noqa: F401
from tessera.runtime.io.chat_template import ChatTemplate, ChatTemplateError  # noqa: F401
from tessera.runtime.io import checkpoint, generation_config
from tessera.runtime.io.text import load_tokenizer  # noqa: F401
from tessera.runtime.io.text import tokenizer_file
from tessera.runtime.options import EngineOptions
from tessera.runtime.session import RunError, ort_message  # noqa: F401

DECODE_REASONS = {
    "gqa": ("decode (T = 1): onnxruntime's GroupQueryAttention over the shared cache buffer with per-row "
            "seqlens_k (cache_length [B]): each row attends over its own filled slots and the kernel writes "
            "its new column at its own slot, in place (the buffer bound as past and present), so rows of any "
            "lengths share a step. Chosen over the plain MatMul/Softmax branch with a per-row mask: faster in "
            "11 of 12 rounds of bench/serve_decode.py (one step at 16 rows of uneven lengths; "
            "docs/benchmarks/table.md S3)."),
    "gqa-prefix": ("decode (T = 1): onnxruntime's GroupQueryAttention over the shared cache buffer with per-row "
                   "seqlens_k (cache_length [B]) and no attention_bias: each row's keys are its columns "
                   "0..cache_length, none hidden among them (the engine fills every row from column 0, so the "
                   "slot mask would say nothing the lengths do not), the kernel writes each row's new column at "
                   "its own slot, in place. Without the mask onnxruntime's CUDA kernel may choose its flash "
                   "decoding (FLASH_ATTENTION under tests/cuda's stub, fp16; with the mask as attention_bias it "
                   "chose MATH) and the mask's values are not copied to the device (only decode_mask's width is "
                   "read, for the kernel's total length). A left-padded batch (`tessera generate`) keeps the mask."),
    "plain": ("decode (T = 1): plain MatMul/Softmax over the cache buffer with a per-row slot mask and per-row "
              "positions, so every row of one step has its own length; the engine writes each row's new "
              "column at that row's own slot. (GroupQueryAttention with per-row lengths, faster where it "
              "fits, is used when every cached attention takes it: head sizes that are multiples of 8, and "
              "no feature it lacks.)"),
}


# The combined call (compiler/backends/onnx/mixed_attention.py): measured by bench/prefill_mix_cost.py
# (docs/benchmarks/table.md S7, under load): an iteration of 16 decoding rows and a 16-token chunk as one call
# costs about 1.2 of the engine's decoding step, against 1.6-1.7 as two calls.
COMBINED_REASONS = {
    True: ("iteration: the decoding rows and a prompt chunk in ONE onnxruntime call (the combined call: the tokens "
           "packed [1, rows + chunk], every weight read once; each attention site runs the decoding rows' "
           "GroupQueryAttention in place and the chunk's attention as one block over its row's filled columns); "
           "a prompt with no decoding row beside it, or a decoding step with no prompt waiting, runs alone"),
    False: ("iteration: a prompt chunk and the decoding step in two onnxruntime calls (this model has no combined "
            "call: it needs GroupQueryAttention decoding at every site and last-position logits)"),
}


def has_combined_call(model) -> bool:
    """Whether the loaded decoder has the engine's combined call (its metadata says so,
    compiler/backends/onnx/mixed_attention.py: ``load`` builds it for every GroupQueryAttention decoder)."""
    session = getattr(model, "session", None)
    return session is not None and session.get_modelmeta().custom_metadata_map.get(COMBINED_KEY) == "1"


def short_call_logits(model) -> int:
    """The most tokens a call that is not combined may have and still give every position's logits (the engine's
    variant compiled for serve --speculative: mixed_attention.py settle_mixed's ``short_logits``); 0 where the
    loaded model has no such calls. An untrusted value reads as 0."""
    session = getattr(model, "session", None)
    value = session.get_modelmeta().custom_metadata_map.get(SHORT_LOGITS_KEY, "") if session is not None else ""
    return int(value) if value.isdigit() else 0


def _activations_words(value: str) -> str:
    """--quantize-activations' value as the file records it, in words: ``float:down`` (fp32 in the MLP's down
    projection: compiler/passes/activations.py) as "activations fp32 in down, int8 in the rest"."""
    if value.startswith("float:"):
        return f"activations fp32 in {value[len('float:'):].replace(',', ', ')}, int8 in the rest"
    return f"activations {value} in the product"


def weights_line(model) -> str:
    """The --explain line on the served weights: float, or the quantisation the file records
    (compiler/build.py's ``tessera.quantize`` metadata, read as untrusted input by runtime/metadata.py)."""
    session = getattr(model, "session", None)
    meta = session.get_modelmeta().custom_metadata_map if session is not None else {}
    if metadata.QUANTIZE_KEY not in meta:
        return "weights: float (no --quantize)"
    q = metadata.quantization(meta[metadata.QUANTIZE_KEY], "the served model")
    how = "one scale per output row, each activation row quantised at run time" if q["block_size"] == ROWS \
        else f"one scale per {q['block_size']} input features, {_activations_words(q['activations'])}"
    head = (f"at {q['head_bits']} bits" if q.get("head_bits") else "quantised") if q["head"] else "in float"
    embedding = f"at {q['embedding_bits']} bits" if q.get("embedding_bits") else "float"
    return f"weights: {q['scheme']} ({how}; the output head {head}; the embedding {embedding})"


def decode_kernel(info) -> str:
    """The decoding kernel a loaded model runs: "gqa" when its steps write the buffer in place ("gqa-prefix"
    without their mask: the engine's variant, CacheInfo.prefix_keys)."""
    if not info.length_input:
        return "plain"
    return "gqa-prefix" if getattr(info, "prefix_keys", False) else "gqa"


def load(spec: str, decode: str | None = None, last_only: bool = True, prefix_keys: bool | None = None,
         check_tokens: int = 0, **options) -> CachedModel:
    """The engine's model for ``spec`` with EngineOptions' fields as keywords (``sets=[...]``,
    ``threads=1``, ``quantize="int4"``...): runtime/driver.py's ``serve_model``, as `tessera serve` and
    `tessera batch` load it (a shorthand for tests and benchmarks; ``decode``, ``last_only``,
    ``prefix_keys`` and ``check_tokens`` are the engine's choices, serve_model's)."""
    o = EngineOptions(spec=spec, **options)
    return driver.serve_model(o.model, o, decode or DECODE, last_only, prefix_keys, check_tokens)


def tokenizer_path(tokenizer, spec) -> str | None:
    """--tokenizer as given, else a checkpoint folder's tokenizer.json (the model given as a folder)."""
    found = checkpoint.tokenizer_in(spec) if not tokenizer else None
    if found is not None:
        return str(found)
    return str(tokenizer_file(tokenizer)) if tokenizer else tokenizer  # a folder: its tokenizer.json


def tokenizer_folder_file(tokenizer_path: str | Path, name: str) -> Path | None:
    """A file next to tokenizer.json (tokenizer_config.json, generation_config.json), if present."""
    p = Path(tokenizer_path).parent / name
    return p if p.is_file() else None



def eos_ids(tokenizer, tokenizer_path: str | Path | None, spec=None, weights=None) -> list[int]:
    """The end-of-sequence tokens: ``eos_token_id`` of generation_config.json / config.json in the
    model's, the weights' or the tokenizer's folder (runtime/io/generation_config.py, the reader
    ``tessera generate`` uses), and ``eos_token`` of tokenizer_config.json beside the tokenizer (a
    request stops there unless it says ignore_eos). None found: no end-of-sequence token."""
    spec_folder = spec if spec is not None and Path(spec).is_dir() else None
    out = list(generation_config.read(generation_config.folders_for(spec_folder, weights, tokenizer_path)).eos)
    f = tokenizer_folder_file(tokenizer_path, "tokenizer_config.json") if tokenizer is not None and \
        tokenizer_path is not None else None
    if f is not None:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # unreadable: no eos_token from it (the chat template
            data = None  # reader, io/chat_template.py, says why when a template is wanted)
        tok = data.get("eos_token") if isinstance(data, dict) else None
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tokenizer.token_to_id(tok) is not None:
            out.append(int(tokenizer.token_to_id(tok)))
    return sorted(set(out))


def decoder_start(tokenizer_path, spec=None, weights=None) -> int | None:
    """An encoder-decoder's decoder start token from the checkpoint (``decoder_start_token_id`` of
    generation_config.json / config.json: runtime/io/generation_config.py, as ``tessera generate``)."""
    spec_folder = spec if spec is not None and Path(spec).is_dir() else None
    return generation_config.read(generation_config.folders_for(spec_folder, weights, tokenizer_path)).start
