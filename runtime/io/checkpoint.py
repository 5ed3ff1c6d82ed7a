"""A Hugging Face checkpoint folder as the model: its config.json picks the bundled spec.

Why: a user coming from transformers has a folder (config.json, model.safetensors,
tokenizer.json) and expects ``tessera generate FOLDER`` to work, as ``from_pretrained`` does.
The folder's ``model_type`` names the family; the bundled spec of that family, with the folder
as its weights, is then the same model as ``tessera generate SPEC --weights FOLDER``: the spec's
mapping file (``models/NAME.hf.toml``) renames the tensors and its ``[config]`` table takes
every hyperparameter from config.json (checkpoint_config.py), so no ``--set`` is needed. A
folder holding .onnx files (``compile --kv-cache`` or ``--genai`` output) is a compiled model,
not a checkpoint, and is left alone. A GGUF file is converted into such a folder once
(runtime/io/gguf_file.py) and is then the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tessera.models import bundled_spec
from tessera.runtime.errors import UsageError
from tessera.runtime.io import gguf_file
from tessera.runtime.io.checkpoint_config import read_config

# Hugging Face model_type -> bundled spec (models/NAME.tsr with its NAME.hf.toml)
MODEL_TYPES = {
    "gpt2": "gpt2",
    "bert": "bert",
    "vit": "vit",
    "llama": "llama",
    "mistral": "llama",  # Llama's layers and names; only without a sliding window shorter than the context
    "mixtral": "mixtral",
    "bloom": "bloom",
    "t5": "t5",
    "gemma2": "gemma2",
    "gptj": "gptj",
    "bart": "bart",
    "whisper": "whisper",
    "mamba": "mamba",
    "jamba": "jamba",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt_oss",
    "phi3": "phi3",
    "deepseek_v3": "deepseek_v3",
    "llama4_text": "llama4",
}


def local(path):
    """A GGUF file as its checkpoint folder (runtime/io/gguf_file.py: converted once, then cached);
    any other path unchanged."""
    return str(gguf_file.folder_for(path)) if path is not None and gguf_file.is_gguf(path) else path


def is_checkpoint(path) -> bool:
    """A folder with a config.json and no compiled .onnx model."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not any(p.glob("*.onnx"))


def spec_for(folder: Path) -> str:
    """The bundled spec of the folder's model_type; a clear error for one Tessera has no spec for."""
    config = read_config(folder) or {}
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in MODEL_TYPES:  # a list or an object is not hashable
        shown = repr(kind) if isinstance(kind, str) else f"of type {type(kind).__name__} (a string is expected)"
        what = f"model_type {shown[:80]}" if kind is not None else "no model_type"
        raise UsageError(f"{folder / 'config.json'} has {what}; a checkpoint folder works as the model for "
                         f"{', '.join(sorted(MODEL_TYPES))}. For another architecture write a spec "
                         f"(docs/language.md) with a NAME.hf.toml mapping beside it (docs/weights.md) and run "
                         f"`tessera ... SPEC.tsr --weights {folder}`")
    window = config.get("sliding_window")
    ctx = config.get("max_position_embeddings")
    if kind == "mistral" and window is not None and not (isinstance(ctx, int) and isinstance(window, int)
                                                         and window >= ctx):
        raise UsageError(f"{folder / 'config.json'}: sliding_window {window} is shorter than the context "
                         f"({ctx}); the bundled llama spec has no sliding window, so this Mistral checkpoint "
                         f"needs a spec with one")
    # the bundled file itself, not its name: a name is looked up as a path first, and a folder named
    # like the spec in the working directory (often the checkpoint itself: `tessera run llama`) would win
    return str(bundled_spec(MODEL_TYPES[kind]))


def unshadowed(spec):
    """A bare name (``llama``) that is both a folder in the working directory and a bundled spec, the
    folder neither a checkpoint (no config.json) nor a compiled model (no .onnx), is the bundled spec:
    a virtualenv or a source tree named ``llama/`` is not a model. Anything else unchanged."""
    text = str(spec)
    p = Path(text)
    if "/" in text or "\\" in text or not p.is_dir() or is_checkpoint(p) or any(p.glob("*.onnx")):
        return spec
    bundled = bundled_spec(text)
    return str(bundled) if bundled is not None else spec


def resolve(ref):
    """``ref`` (options.ModelRef) with a checkpoint folder as the model replaced by its bundled spec,
    the folder as the weights (a folder merely named like a bundled spec: that spec; a GGUF file: its
    converted folder, as the model or as --weights); any other ref unchanged."""
    if local(ref.spec) != ref.spec or local(ref.weights) != ref.weights:
        api = ref.api
        ref = dataclasses.replace(ref, spec=local(ref.spec), weights=local(ref.weights))
        ref.api = api
    if not is_checkpoint(ref.spec):
        spec = unshadowed(ref.spec)
        if spec is ref.spec:
            return ref
        out = dataclasses.replace(ref, spec=spec)
        out.api = ref.api
        return out
    folder = Path(ref.spec)
    if ref.weights is not None and Path(ref.weights).resolve() != folder.resolve():
        raise UsageError(f"{folder} is a checkpoint folder, its own weights; --weights {ref.weights} would be a "
                         f"second set (give the folder alone, or a spec with --weights)")
    out = dataclasses.replace(ref, spec=spec_for(folder), weights=str(folder))
    out.api = ref.api
    return out


def tokenizer_in(spec) -> Path | None:
    """The checkpoint folder's tokenizer.json, when the model is such a folder (or a GGUF file) and has one."""
    spec = local(spec)
    p = Path(spec) / "tokenizer.json"
    return p if is_checkpoint(spec) and p.is_file() else None
