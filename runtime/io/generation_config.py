"""What a checkpoint folder says about generating from it: its end-of-sequence tokens and its
decoding defaults (generation_config.json, else config.json).

Why one reader: ``tessera generate``, the Python API, the serving engine and ``compile --genai``
must stop at the same token as transformers' ``generate`` does on the same folder, and use the
same defaults when the user gives none. Before, each read (or did not read) these files its own
way, so the two runtimes of one model disagreed on where a reply ends. The folders looked in are
the model's (a checkpoint folder given as the model), the weights' and the tokenizer's, in that
order; the first file that gives a value wins, and each value keeps the file it came from so
``--explain`` can say so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tessera.runtime.errors import UsageError

FILES = ("generation_config.json", "config.json", "genai_config.json")
SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "min_p", "no_repeat_ngram_size",
            "min_new_tokens")
INTEGERS = ("max_new_tokens", "top_k", "no_repeat_ngram_size", "min_new_tokens")
# transformers applies these warpers only when sampling (do_sample true); the other settings always
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p")
# transformers' GenerationConfig defaults when do_sample is true and the file leaves them out
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50}


@dataclass
class GenerationDefaults:
    eos: list[int] = field(default_factory=list)
    eos_source: str | None = None
    start: int | None = None                      # an encoder-decoder's decoder_start_token_id
    start_source: str | None = None
    values: dict = field(default_factory=dict)    # setting -> value
    sources: dict = field(default_factory=dict)   # setting -> where it came from
    notes: list[str] = field(default_factory=list)


def folders_for(*paths) -> list[Path]:
    """The folders to look in: a folder as it is, a file's parent; None and duplicates dropped."""
    out: list[Path] = []
    for p in paths:
        if p is None or str(p) == "":
            continue
        p = Path(p)
        folder = p if p.is_dir() else p.parent
        if folder.is_dir() and folder not in out:
            out.append(folder)
    return out


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes()[:16 * 1024 * 1024].decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: not valid JSON ({e}); fix or remove it") from None
    except RecursionError:  # json's decoder recurses per nested array or object
        raise UsageError(f"{path}: not valid JSON (arrays or objects nested too deep); fix or remove it") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(value, where: str) -> list[int] | None:
    """eos_token_id: an int or a list of ints (None: not given)."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise UsageError(f"{where}: eos_token_id must be a token id or a list of token ids, got {json.dumps(value)}")
    return list(dict.fromkeys(items))


def _number(value, name: str, where: str, integer: bool):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise UsageError(f"{where}: {name} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}")
    return value


def read(folders) -> GenerationDefaults:
    """The EOS ids and decoding defaults the folders' files give."""
    d = GenerationDefaults()
    for folder in folders:
        for name in FILES:
            path = Path(folder) / name
            data = _read(path)
            if data is None:
                continue
            where = str(path)
            if name == "genai_config.json":  # an onnxruntime-genai folder (compile --genai) keeps it under model
                data = data.get("model") if isinstance(data.get("model"), dict) else {}
            if d.eos_source is None:
                ids = _ids(data.get("eos_token_id"), where)
                if ids:
                    d.eos, d.eos_source = ids, where
            if d.start_source is None and data.get("decoder_start_token_id") is not None:
                d.start = _number(data["decoder_start_token_id"], "decoder_start_token_id", where, integer=True)
                d.start_source = where
            if name == "generation_config.json" and not d.values:
                _settings(data, where, d)
    return d


def _settings(data: dict, where: str, d: GenerationDefaults) -> None:
    """generation_config.json's decoding values, as transformers' generate reads them: temperature,
    top_k, top_p and min_p only when do_sample is true (else greedy)."""
    sample = data.get("do_sample") is True
    for key in SETTINGS:
        value = data.get(key)
        if value is None:
            if sample and key in SAMPLING_DEFAULTS:
                d.values[key] = SAMPLING_DEFAULTS[key]
                d.sources[key] = f"transformers' default with do_sample true in {where}"
            continue
        value = _number(value, key, where, integer=key in INTEGERS)
        if key in SAMPLING_ONLY and not sample:
            d.notes.append(f"{where} has {key} {value} but not do_sample true: greedy, as transformers decodes")
            continue
        d.values[key], d.sources[key] = value, where
