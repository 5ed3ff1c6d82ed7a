"""An onnxruntime-genai model folder from a spec: ``tessera compile SPEC --genai -o FOLDER``.

Why: onnxruntime-genai (``og.Model(FOLDER)``) runs a decoder's generation loop from a folder
holding the model, a ``genai_config.json`` that says how to feed it, and the tokenizer. Tessera's
KV-cached decoder (compiler/passes/kv_cache.py) in its ``concat`` form already has the interface
genai's decoder-only state drives, under other names, and genai's config names every input and
output (``inputs`` / ``outputs``, with ``%d`` for the layer), so the graph is mapped, not renamed:

| genai feeds / reads | Tessera's cached graph |
| --- | --- |
| ``input_ids`` [B, T] | ``tokens`` (i64) |
| ``attention_mask`` [B, P+T] (1 real, 0 padding) | ``attention_mask`` (i64) |
| ``position_ids`` [B, T] | ``position_ids`` (i64) |
| ``past_key_values.%d.key`` / ``.value`` [B, kv_heads, P, hd] | ``past_key.%d`` / ``past_value.%d`` |
| ``logits`` [B, 1, vocab] (a static 1: genai takes it as the last position's) | ``logits`` |
| ``present.%d.key`` / ``.value`` [B, kv_heads, P+T, hd] | ``present_key.%d`` / ``present_value.%d`` |

genai's ``past_present_share_buffer: false`` is the concat cache: it allocates each present at
P+T and feeds it back as the next past, with an empty past (P = 0) for the prompt -- what
Tessera's concat mode computes. (Its shared buffer, a present that *is* a max-length past
written in place, is GroupQueryAttention's convention; Tessera's ``buffer`` mode returns only the
new columns, which genai has no slot for, so --genai refuses it.)

Positions: for a batch of prompts of different lengths genai numbers each row from its first
column, padding included (its DefaultPositionInputs), where Tessera and transformers count real
tokens only (``cumsum(mask) - 1``); single prompts and batches of equal-length prompts get the
same positions from both (docs/generate.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx

from tessera.compiler.backends.atomic import write_folder_atomically
from tessera.compiler.passes.kv_cache import CacheInfo

from tessera.runtime.pipeline import UsageError

CONFIG_FILE = "genai_config.json"
MODEL_FILE = "model.onnx"
# tokenizer files copied from beside the tokenizer.json when they are there (onnxruntime-extensions
# reads tokenizer_config.json, and a chat template from it or from the template files)
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
# tokenizer.json models onnxruntime-extensions (genai's tokenizer) reads; a WordLevel one fails there
TOKENIZER_MODELS = ("BPE", "Unigram", "WordPiece")
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>", "[CLS]")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")


# ------------------------------------------------------------------ the tokenizer
class Tokenizer:
    """What the config needs from a Hugging Face tokenizer.json: token ids by name, the largest id."""

    def __init__(self, path: Path):
        path = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)  # a checkpoint folder's
        if not path.is_file():
            raise UsageError(f"tokenizer file not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UsageError(f"{path} is not a Hugging Face tokenizer.json ({e})") from None
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            model = data["model"]
            kind = model.get("type") or ("BPE" if "merges" in model else None)
            if kind not in TOKENIZER_MODELS:
                raise UsageError(f"{path} is a {kind} tokenizer; onnxruntime-genai's tokenizer "
                                 f"(onnxruntime-extensions) reads {', '.join(TOKENIZER_MODELS)} tokenizers")
            vocab = model.get("vocab", {})
            if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
                vocab = {piece[0]: i for i, piece in enumerate(vocab)}
            self.ids = {str(k): int(v) for k, v in dict(vocab).items()}
            self.special: dict[str, int] = {}
            for t in data.get("added_tokens") or []:
                self.ids[t["content"]] = int(t["id"])
                if t.get("special"):
                    self.special[t["content"]] = int(t["id"])
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise UsageError(f"{path} is not a Hugging Face tokenizer.json ({type(e).__name__}: {e})") from None
        self.path, self.kind = path, kind
        self.max_id = max(self.ids.values(), default=-1)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def special_ids(tok: Tokenizer, weights: str | None) -> dict:
    """bos, eos (a list) and pad ids: from generation_config.json / config.json beside the tokenizer
    or in the --weights folder, else tokenizer_config.json's token names, else the tokenizer's special
    tokens of the usual names; pad defaults to eos (as transformers' generate does), bos to eos."""
    from tessera.runtime.io import generation_config

    found: dict = {}
    folders = [tok.path.parent] + ([Path(weights)] if weights and Path(weights).is_dir() else [])
    eos = generation_config.read(generation_config.folders_for(weights, tok.path)).eos  # what `generate` stops at
    if eos:
        found["eos"] = eos
    for folder in folders:
        for name in ("generation_config.json", "config.json"):
            cfg = _read_json(folder / name)
            for key in ("bos", "eos", "pad"):
                v = cfg.get(f"{key}_token_id")
                ok = isinstance(v, int) or (isinstance(v, list) and v and all(isinstance(x, int) for x in v))
                if key not in found and ok and not isinstance(v, bool):
                    found[key] = v
    tcfg = _read_json(tok.path.parent / "tokenizer_config.json")
    for key in ("bos", "eos", "pad"):
        v = tcfg.get(f"{key}_token")
        v = v.get("content") if isinstance(v, dict) else v
        if key not in found and isinstance(v, str) and v in tok.ids:
            found[key] = tok.ids[v]
    for key, names in (("eos", EOS_NAMES), ("bos", BOS_NAMES), ("pad", PAD_NAMES)):
        if key not in found:
            hit = next((tok.special[n] for n in names if n in tok.special), None)
            if hit is not None:
                found[key] = hit
    if "eos" not in found:
        raise UsageError(f"cannot tell the end-of-sequence token of {tok.path}: it has no special token named "
                         f"{', '.join(EOS_NAMES[:4])}, ...; put a tokenizer_config.json with eos_token beside it")
    eos = found["eos"] if isinstance(found["eos"], list) else [found["eos"]]
    pad = found.get("pad", eos[0])
    return {"bos": int(found.get("bos", eos[0])), "eos": [int(e) for e in eos],
            "pad": int(pad[0] if isinstance(pad, list) else pad)}


# ------------------------------------------------------------------ the config
def _template(names: list[str], what: str) -> str:
    """``prefix%d`` when the i-th name is prefix + str(i) for every layer i (genai's name templates)."""
    prefix = names[0][:-1]
    if any(n != f"{prefix}{i}" for i, n in enumerate(names)):
        raise UsageError(f"the cached graph's {what} names ({', '.join(names[:3])}, ...) are not numbered by layer "
                         f"from 0, which onnxruntime-genai's name templates need")
    return prefix + "%d"


def genai_config(graph, info: CacheInfo, model: onnx.ModelProto, tokens: dict, context: int | None = None) -> dict:
    """genai_config.json for the cached graph ``graph`` (concat mode) exported as ``model``; ``context``
    the context length (default: the model's own, which it may not exceed)."""
    if info.states:  # its config names past and present keys and values, nothing else
        raise UsageError(f"onnxruntime-genai's decoder carries a KV cache only; this model carries recurrent state "
                         f"({len(info.states)} scan or conv1d state(s)): generate it with `tessera generate`")
    if info.mode != "concat":
        raise UsageError("onnxruntime-genai drives the concat cache; compile with --cache concat")
    if any(layer.value_size != layer.head_size for layer in info.layers):
        raise UsageError("onnxruntime-genai's cache has one head size for keys and values; this model's differ")
    if context is None and info.context is None:
        raise UsageError("the model has no position table nor rotary context (rope_max_ctx), so its context length "
                         "is unknown; onnxruntime-genai's config needs one: give --context-length N")
    if context is not None and info.context is not None and context > info.context:
        raise UsageError(f"--context-length {context} is past the model's context of {info.context} positions")
    context = int(context or info.context)
    if info.length_switch is not None and context > info.length_switch:
        # onnxruntime-genai would keep the keys rotated with the short factors past the switch
        raise UsageError(f"this model's longrope rotary switches to its long factors past {info.length_switch} "
                         f"positions, where its cache must be computed again, which onnxruntime-genai does not do: "
                         f"give --context-length {info.length_switch} or less (tessera generate runs longer ones)")
    logits = next(o for o in model.graph.output if o.name == info.logits)
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    if not vocab:
        raise UsageError("the logits' vocabulary axis is not a fixed size, which onnxruntime-genai's config needs")
    first = graph.nodes[info.layers[0].node]
    hidden = next((int(graph.type_of(n.outputs[0]).shape[-1]) for n in graph.consumers(info.tokens)
                   if n.op in ("embedding", "embedding_nbits")), first.attrs["heads"] * info.layers[0].head_size)
    inputs = {"input_ids": info.tokens, "attention_mask": "attention_mask", "position_ids": "position_ids",
              "past_key_names": _template([x.past_key for x in info.layers], "past key"),
              "past_value_names": _template([x.past_value for x in info.layers], "past value")}
    outputs = {"logits": info.logits,
               "present_key_names": _template([x.present_key for x in info.layers], "present key"),
               "present_value_names": _template([x.present_value for x in info.layers], "present value")}
    return {
        "model": {
            "bos_token_id": tokens["bos"],
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": info.layers[0].head_size,
                "hidden_size": hidden,
                "inputs": inputs,
                "outputs": outputs,
                "num_attention_heads": first.attrs["heads"],
                "num_hidden_layers": len(info.layers),
                "num_key_value_heads": info.layers[0].kv_heads,
            },
            "eos_token_id": tokens["eos"][0] if len(tokens["eos"]) == 1 else tokens["eos"],
            "pad_token_id": tokens["pad"],
            "type": "decoder",
            "vocab_size": int(vocab),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 50, "top_p": 1.0,
        },
    }


def write_folder(out: str | Path, graph, info: CacheInfo, model: onnx.ModelProto, tokenizer: str,
                 weights: str | None = None, verify=None, context: int | None = None) -> list[Path]:
    """Write FOLDER/model.onnx (+ model.onnx.data when large), genai_config.json and the tokenizer
    files, atomically (compiler/backends/atomic.py); returns the files written."""
    from tessera.compiler.backends.onnx import export as onnx_export

    tok = Tokenizer(Path(tokenizer))
    tokens = special_ids(tok, weights)
    config = genai_config(graph, info, model, tokens, context)
    vocab = config["model"]["vocab_size"]
    if tok.max_id >= vocab:
        raise UsageError(f"{tok.path} has token ids up to {tok.max_id}, past the model's vocabulary of {vocab}")
    bad = [t for t in tokens["eos"] + [tokens["bos"], tokens["pad"]] if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"special token id {bad[0]} is outside the model's vocabulary [0, {vocab})")

    def write(folder: Path) -> None:
        onnx_export.save(model, folder / MODEL_FILE, verify=verify)
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
        shutil.copyfile(tok.path, folder / "tokenizer.json")
        for name in TOKENIZER_FILES:
            if (tok.path.parent / name).is_file():
                shutil.copyfile(tok.path.parent / name, folder / name)
        if not (folder / "tokenizer_config.json").exists():
            names = {v: k for k, v in tok.ids.items()}
            tcfg = {"tokenizer_class": "TokenizersBackend", "model_max_length": config["model"]["context_length"]}
            for key in ("bos", "eos", "pad"):
                tid = tokens[key][0] if key == "eos" else tokens[key]
                if tid in names:
                    tcfg[f"{key}_token"] = names[tid]
            (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n", encoding="utf-8")

    return write_folder_atomically(out, write, CONFIG_FILE)


__all__ = ["CONFIG_FILE", "MODEL_FILE", "genai_config", "special_ids", "write_folder"]
