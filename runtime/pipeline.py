"""The steps every command shares: load a spec, elaborate it, get weights, export."""

from __future__ import annotations

import os
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.compiler.frontend.elaborate import ModelInfo, elaborate
from tessera.compiler.ir.graph import DTYPES, Graph
from tessera.compiler.passes import PassError
from tessera.compiler.passes.quantize import DEFAULT_BLOCK, ROW_SCHEMES, QuantConfig
from tessera.compiler.reference.quant import ROWS
from tessera.models import bundled_names, bundled_spec
from tessera.spec import Program, SpecError, did_you_mean, load_program

from tessera.runtime.errors import UsageError  # noqa: F401  (re-exported: callers import it from here)
from tessera.runtime.io.checkpoint import unshadowed
from tessera.runtime.io import gguf_codes
from tessera.runtime.io.checkpoint_config import config_overrides
from tessera.runtime.io.weights import (SeededWeights, StoredWeights, WeightsError, absent_params, drop_unfed_outputs,
                                        init_weights, load_weights, name_map_for, stored_pieces)


@dataclass
class Built:
    program: Program
    graph: Graph
    info: ModelInfo
    spec_path: Path
    quantize: object = None  # the QuantConfig optimize applied (compiler/passes/quantize.py), if any


def parse_set(items: list[str], program: Program) -> dict:
    """--set k=v values: ints, floats, true/false, lists of those ([1, 2], ["full", "sliding"]), block
    names, else strings."""
    out = {}
    for item in items:
        m = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", item)
        if not m:
            raise UsageError(f"--set '{item}' must be NAME=VALUE, e.g. --set layers=2")
        key, text = m.groups()
        if key in out:
            raise UsageError(f"--set {key} is given twice")
        out[key] = _parse_value(text, program)
    return out


def _parse_value(text: str, program: Program):
    if text.startswith("[") and text.endswith("]"):  # a list, as the spec writes one: [1, 2] or ["a", "b"]
        inner = text[1:-1].strip()
        return [_parse_value(part.strip(), program) for part in _split_list(inner)] if inner else []
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?", text):
        return float(text)
    if text in ("true", "false"):
        return text == "true"
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]  # `--set 'rope_type="yarn"'`: a string written as the spec writes one
    return text  # a string; the elaborator turns it into a block where the hyperparameter is a block


def _split_list(text: str) -> list[str]:
    """A list's items at its top-level commas (a quoted string may hold commas; lists do not nest)."""
    parts, current, quote = [], "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == ",":
            parts.append(current)
            current = ""
            continue
        elif ch in "[]":
            raise UsageError(f"--set: a list holds numbers, true/false or strings, not lists: [{text}]")
        current += ch
    return parts + [current] if current.strip() or parts else parts


def resolve_spec(spec: str | Path) -> Path:
    """The spec file a command names: a path when that file exists, else a bundled spec by name
    (``gpt2`` or ``gpt2.tsr``, shipped in ``tessera.models``). Raises SpecError for neither."""
    path = Path(unshadowed(spec))  # a folder named like a bundled spec that is no model: the bundled spec
    if path.exists():
        return path  # a path wins (load_program reports a folder or an unreadable file)
    text = str(spec)
    if "/" in text or "\\" in text:  # meant as a path: keep the plain message
        raise SpecError(f"spec file not found: {text}")
    bundled = bundled_spec(text)
    if bundled is not None:
        return bundled
    names = bundled_names()
    stem = text[:-4] if text.endswith(".tsr") else text
    raise SpecError(f"no spec file or bundled spec named '{text}'{did_you_mean(stem, names)} "
                    f"(bundled specs: {', '.join(names)})")


def build(spec: str | Path, variant: str | None = None, sets: list[str] | None = None,
          weights: str | Path | None = None) -> Built:
    """Elaborate a spec. When ``weights`` is a checkpoint folder with a config.json and the
    spec's mapping file has a [config] table, its hyperparameters are taken from there too
    (checkpoint_config.py: a value contradicting ``sets`` or the variant is an error)."""
    path = resolve_spec(spec)
    program = load_program(path)
    overrides = parse_set(sets or [], program)
    if weights:
        overrides.update(config_overrides(program, name_map_for(path), weights, variant, overrides))
    graph, info = elaborate(program, variant, overrides)
    if weights:
        _drop_unfed_outputs(graph, Path(weights), name_map_for(path), info.hyperparams)
        _mark_stored(graph, Path(weights), name_map_for(path), info.hyperparams)
    return Built(program, graph, info, path)


def _mark_stored(graph: Graph, weights: Path, name_map, hyper: dict) -> None:
    """Set ``Param.stored`` on the parameters whose checkpoint tensor a GGUF file's codes hold
    (runtime/io/gguf_codes.py), each one whole: a parameter cut from a tensor or transposed reads the
    fp32 tensor. Inert until the stored-codes pass reads it (--gguf-weights)."""
    codes = gguf_codes.Codes.open(weights) if weights.is_dir() else None
    if codes is None:
        return
    try:
        pieces = stored_pieces(graph, weights, name_map, hyper)
    except WeightsError:
        return  # an unreadable checkpoint: load_weights says why
    for path, piece in pieces.items():
        entry = codes.index.get(piece.source)
        param = graph.params[path]
        if entry and not piece.sizes and not piece.transpose and list(param.shape) == entry["shape"]:
            param.stored = (entry["bits"], entry["block"], entry["type"], bool(entry.get("mins")))


def _drop_unfed_outputs(graph: Graph, weights: Path, name_map, hyper: dict) -> None:
    """A checkpoint without the weights of some outputs (a BERT saved without its pooler) runs with
    those outputs dropped and a note, as transformers does; any other gap is the load's error."""
    try:
        absent = absent_params(graph, weights, name_map, hyper)
    except WeightsError:
        return  # an unreadable checkpoint: load_weights says why
    outputs, params = drop_unfed_outputs(graph, absent)
    if outputs:
        print(f"note: {weights} has no {', '.join(params)}: output{'s' if len(outputs) > 1 else ''} "
              f"{', '.join(outputs)} dropped (computed from them), the other outputs run", file=sys.stderr)


# Running a spec holds the weights about three times over (the serialised model, onnxruntime's
# parsed copy and its own tensors). Compiling streams them to the file one tensor at a time
# (compiler/backends/onnx/stream.py): at most the tensor being written, the next one and a
# converted copy, so a compile needs memory for three of its largest tensor and disk for all.
PEAK_WEIGHT_COPIES = 3
PEAK_TENSOR_COPIES = 3


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_disk(path: Path) -> int | None:
    """Bytes free on the file system that would hold ``path`` (its nearest existing folder)."""
    def is_dir(p: Path) -> bool:  # Path.is_dir raises for a name too long (ENAMETOOLONG); the writer says why
        try:
            return p.is_dir()
        except (OSError, ValueError):
            return False

    folder = next((p for p in [Path(path).parent, *Path(path).parent.parents] if is_dir(p)), None)
    try:
        return shutil.disk_usage(folder).free if folder is not None else None
    except OSError:
        return None


def _param_bytes(built: Built) -> list[int]:
    return [p.numel * np.dtype(DTYPES[p.dtype] or np.float32).itemsize for p in built.graph.params.values()]


def check_memory(built: Built, allow_large: bool = False, streaming: bool = False) -> None:
    """Refuse, before allocating anything, weights that would not fit in memory: all of them held
    PEAK_WEIGHT_COPIES times over, or (``streaming``, a compile) the largest tensor PEAK_TENSOR_COPIES times."""
    sizes = _param_bytes(built)
    need = sum(sizes)
    peak = max(sizes, default=0) * PEAK_TENSOR_COPIES if streaming else need * PEAK_WEIGHT_COPIES
    avail = available_memory()
    if allow_large or avail is None or peak <= avail:
        return
    how = (f"compiling holds its largest tensor ({max(sizes) / 2**30:,.1f} GiB) about {PEAK_TENSOR_COPIES} times "
           f"over" if streaming else f"holding them about {PEAK_WEIGHT_COPIES} times over")
    raise UsageError(f"{built.graph.name}'s weights are {need / 2**30:,.1f} GiB; {how} needs more than the "
                     f"{avail / 2**30:,.1f} GiB of memory available. 'tessera report' gives its cost without "
                     f"weights; --allow-large tries anyway")


def check_disk(built: Built, out: str | Path, allow_large: bool = False) -> None:
    """Refuse, before writing anything, a model whose weights would not fit on the output's disk."""
    need = sum(_param_bytes(built))
    free = available_disk(Path(out))
    if allow_large or free is None or need <= free:
        return
    raise UsageError(f"{built.graph.name}'s weights are {need / 2**30:,.1f} GiB; the disk that would hold {out} "
                     f"has {free / 2**30:,.1f} GiB free. 'tessera report' gives its cost without weights; "
                     f"--allow-large tries anyway")


def weights_for(built: Built, weights: str | None, seed: int, allow_large: bool = False,
                streaming: bool = False):
    """The weights, as a mapping by parameter path: a checkpoint's, else the seeded initialiser's
    (SeededWeights: drawn as each tensor is read). ``streaming``: the caller writes them one
    tensor at a time (a compile), which needs far less memory than holding them all."""
    check_memory(built, allow_large, streaming)
    if weights:
        notes: list[str] = []
        loaded = load_weights(built.graph, Path(weights), name_map_for(built.spec_path), notes,
                              built.info.hyperparams)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        codes = gguf_codes.Codes.open(weights) if Path(weights).is_dir() else None
        return loaded if codes is None else StoredWeights(loaded, codes)
    return SeededWeights(built.graph, seed)


# runtime/options.py has the same list for the parsers (options imports this module, not the reverse;
# tests/project/test_cli_help.py keeps the two and compiler/passes/quantize.py's SCHEMES equal)
QUANTIZE_CHOICES = ("none", "int8", "int4", "w8a8", "int4-asym")


@contextmanager
def compiler_errors():
    """The one place a compiler PassError (CacheError among them) becomes the runtime's UsageError:
    an option the compiler refuses is the user's to change, reported without a traceback."""
    try:
        yield
    except PassError as e:
        raise UsageError(str(e)) from None


def head_choice(head) -> str:
    """--quantize-head's value as QuantConfig takes it (compiler/passes/quantize.py HEADS): the API's
    True is the old flag (the scheme's head bits: "on"), False float, 8 and 4 the bits; None the default."""
    if head is None:
        return "auto"
    if isinstance(head, bool):
        return "on" if head else "float"
    return str(head)


def quant_config(scheme: str = "none", block: int | None = None, head: str | bool | None = "auto",
                 activations: str | None = None, embedding: str | int | None = "auto"):
    """The QuantConfig that --quantize, --quantize-block, --quantize-head, --quantize-activations and
    --quantize-embedding ask for (None for none)."""
    scheme = scheme or "none"
    head = head_choice(head)
    embedding = "auto" if embedding is None else str(embedding)
    if scheme not in QUANTIZE_CHOICES:
        raise UsageError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {scheme!r}")
    if scheme == "none":
        if block is not None or head not in ("auto", "float") or activations is not None or \
                embedding not in ("auto", "float"):
            raise UsageError("--quantize-block, --quantize-head, --quantize-activations and --quantize-embedding "
                             "need --quantize (int8, int4 or w8a8)")
        return None
    if scheme in ROW_SCHEMES:
        if block is not None or activations is not None:
            raise UsageError(f"--quantize {scheme} has one scale per output row and quantises the activations per "
                             f"row at run time: --quantize-block and --quantize-activations apply to int8 and int4")
        block = ROWS
    config = QuantConfig(scheme, DEFAULT_BLOCK if block is None else block, head, activations or "int8", embedding)
    with compiler_errors():
        config.check()
    return config


def optimize(built: Built, options, explain: bool = False) -> list:
    """Run the ``full`` pipeline (compiler/build.py ``compile_full``) on built.graph with ``options`` (a
    PipelineOptions, from runtime/options.OptimizeOptions.pipeline_options); print --explain's
    listing when asked. Returns the ExposedProbs notes of the sites whose probabilities became outputs."""
    from tessera.compiler.build import compile_full  # every pass (~0.2 s): `tessera ir` builds without them

    built.quantize = options.quantize
    with compiler_errors():
        done = compile_full(built.graph, options)
    if explain:
        print(done.explain(), file=sys.stderr)
    return done.exposed


def metadata(built: Built) -> dict:
    """The model file's metadata (compiler/build.py's model_metadata, the one place it is built)."""
    from tessera.compiler.build import model_metadata  # every pass (~0.2 s): not for `tessera ir`

    return model_metadata(built.info, built.quantize, graph=built.graph)


def export(built: Built, weights, out: str | Path, check: bool = True, progress=None) -> list[Path]:
    """The ONNX file(s), the weights streamed; ``progress(bytes done, bytes in all)`` after each (runtime/progress.py)."""
    from tessera.compiler.backends.onnx import export as onnx_export  # here: `tessera ir` builds without onnx

    return onnx_export.write(built.graph, weights, out, metadata(built), verify=onnx_export.check if check else None,
                             progress=progress)


__all__ = ["Built", "resolve_spec", "build", "weights_for", "optimize", "export", "parse_set", "UsageError",
           "compiler_errors"]
