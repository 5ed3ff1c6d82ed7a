"""Typed options: one dataclass per command, shared by the command line, the Python API and the server.

Why: the command line, ``tessera.load(...).compile(...)`` and the server must take the same options
with the same rules. Each command's options are one dataclass with typed, defaulted fields, and
one ``check()`` holds every rule about them: a value's type and range (the API and the server pass
raw Python values, so ``seed="x"`` or ``batch=1.5`` must be refused here, naming the argument) and
the rules between options (``--decode`` needs ``--kv-cache``, ``--full`` needs ``--format json``).
argparse only fills these objects (``from_args``); runtime/driver.py does the work. The fields
several commands share (the model, ``ModelRef``; the compile options, ``BuildOptions``; the serving
engine's, ``EngineOptions``) are declared with their flags (``flag(...)``) and every command generates
them from here (``add_arguments``), since runtime/serving/ does not import the command line. A compile
option is one field of BuildOptions (with its flag, its rule and its pipeline keyword) and one keyword
of each API method that compiles; an option of one command is one field here, one flag in
runtime/cli/ and one keyword in runtime/api.py; tests/project/test_options_parity.py fails until all exist.

Rules that need the model itself (its inputs, its graph) are checked by the driver once it is built.

Imports: every command's parser is built from this module for ``tessera --help``, which must not load
numpy, sympy, networkx, onnx or the compiler (tests/project/test_cli_help.py; about a second of
start-up on this machine). So the compiler's and numpy's names (``Target``, ``PipelineOptions``,
``Plan``, ``Sampling``) are imported in the methods that turn options into a compile, never at the top.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from tessera.runtime.errors import UsageError
from tessera.runtime import machine

# runtime/pipeline.py's quant_config takes these (compiler/passes/quantize.py SCHEMES, and none;
# tests/project/test_cli_help.py keeps the three equal); here so the command line's parsers are built without
# importing the compiler (tessera --help stays quick)
QUANTIZE_CHOICES = ("none", "int8", "int4", "w8a8", "int4-asym")

TARGETS = ("cpu", "cuda")
DTYPES = ("fp32", "fp16", "bf16")
RECURRENCES = ("auto", "scan")
CACHES = ("auto", "buffer", "concat")
# compiler/passes/kv_cache_dtype.py KV_CACHE_DTYPES (tests/generation/test_kv_cache_dtype.py keeps the two equal); here
# so the parsers are built without importing the compiler
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8", "int4")
DECODES = ("auto", "gqa", "gqa-unpacked", "plain")
PROVIDERS = ("auto", "cpu", "cuda")
QUANT_HEADS = ("auto", "float", "8", "4", "on")  # --quantize-head: compiler/passes/quantize.py HEADS
QUANT_EMBEDDINGS = ("auto", "float", "8")  # --quantize-embedding: compiler/passes/quantize.py EMBEDDINGS
GGUF_WEIGHTS = ("codes", "codes-fp32", "dequantize")  # runtime/io/gguf_codes.py MODES
REPORT_FORMATS = ("table", "json", "md", "csv")


def attention_choices() -> tuple[str, ...]:
    from tessera.compiler.passes.pipeline import ATTENTION_CHOICES

    return tuple(ATTENTION_CHOICES)


# ------------------------------------------------------------------ value checks (raw Python values)
def _is_int(v) -> bool:
    import numpy as np

    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_int(name: str, v, minimum: int | None = None, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not _is_int(v):
        raise UsageError(f"{name} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise UsageError(f"{name} must be at least {minimum}, got {v}")


def check_number(name: str, v) -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        raise UsageError(f"{name} must be a finite number, got {v!r}")


def check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise UsageError(f"{name} must be True or False, got {v!r}")


def check_choice(name: str, v, choices, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not isinstance(v, str) or v not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)}, got {v!r}")


def check_path(name: str, v, optional: bool = True) -> None:
    if v is None and optional:
        return
    if not isinstance(v, (str, Path)):  # an empty or unusable path is refused where it is used, with its reason
        raise UsageError(f"{name} must be a path (a str or pathlib.Path), got {v!r}")
    if "\0" in str(v):  # the OS cannot take it; open() would raise ValueError deep inside
        raise UsageError(f"{name} must be a path without NUL characters, got {str(v)!r}")
    check_text(name, str(v))


def check_text(name: str, v: str) -> None:
    """A str that is valid Unicode: a lone surrogate (``"\\ud800"``, or undecodable bytes of a command
    line) cannot be encoded to UTF-8, and tokenizers and file systems raise deep inside on it."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{name} holds a character that is not valid Unicode ({v[e.start]!r} at "
                         f"position {e.start}, a lone surrogate); give valid UTF-8 text") from None


def check_strings(name: str, v) -> None:
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise UsageError(f"{name} must be a list of strings, got {v!r}")
    for s in v:
        check_text(name, s)


def check_ints(name: str, v) -> None:
    if not isinstance(v, (list, tuple)) or not all(_is_int(t) for t in v):
        raise UsageError(f"{name} must be a list of integers, got {v!r}")


def split_prompt(prompt) -> tuple[list[str], object, bool]:
    """The API's ``prompt`` as (texts, token ids or None, single): a str, a list of str, a list of ids
    or a list of such lists (rows of ids are checked against the vocabulary once the model is loaded).
    Anything else (None, a number, a dict, floats) is refused here, naming what is accepted."""
    import numpy as np

    accepted = ("prompt must be a str, a list of str, a list of integer token ids or a list of such lists, "
                f"got {prompt!r}"[:300])
    if isinstance(prompt, str):
        check_text("prompt", prompt)
        return [prompt], None, True
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise UsageError(accepted)
    if prompt and all(isinstance(p, str) for p in prompt):
        check_strings("prompt", prompt)
        return list(prompt), None, False
    if prompt and all(_is_int(t) for t in prompt):
        return [], list(prompt), True
    rows = [p.tolist() if isinstance(p, np.ndarray) else p for p in prompt]
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or not all(_is_int(t) for t in row):
            raise UsageError(f"prompt {i}: {accepted}" if isinstance(row, (list, tuple)) else accepted)
    return [], rows, False


# ------------------------------------------------------------------ flags declared with their fields
def flag(default=MISSING, *, help: str, names: tuple[str, ...] = (), factory=None, positional: bool = False,
         **argparse_kwargs):
    """A field with its command-line flag: ``names`` (default ``--field-name``), argparse's keywords
    (choices, type, metavar, action...) and its help. Every command that takes the field generates the
    flag from here (``add_arguments``), so it is declared once: a field added with ``flag(...)`` to a
    class that compile, generate, serve and batch share reaches all of their command lines."""
    meta = {"flag": {"names": tuple(names), "help": help, "positional": positional, **argparse_kwargs}}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def add_arguments(p, cls, helps: dict[str, str] | None = None, only=None, skip=(), **overrides) -> None:
    """The flags of ``cls``'s fields declared with ``flag(...)`` (its own and its bases'), in field order,
    on ``p`` (a parser or an argument group). ``helps``: a command's own help for a field; ``only`` /
    ``skip``: which fields; ``overrides``: argparse keywords per field (``spec={"metavar": "SPEC"}``)."""
    for f in fields(cls):
        spec = f.metadata.get("flag")
        if spec is None or (only is not None and f.name not in only) or f.name in skip:
            continue
        kw = {k: v for k, v in spec.items() if k not in ("names", "help", "positional")}
        kw.update(overrides.get(f.name, {}))
        kw["help"] = (helps or {}).get(f.name, spec["help"])
        if spec["positional"]:
            p.add_argument(f.name, **kw)
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if default is not None and kw.get("action") != "store_true":
            kw["default"] = default
        p.add_argument(*(spec["names"] or ("--" + f.name.replace("_", "-"),)), dest=f.name, **kw)


def flag_fields(cls) -> list[str]:
    """The fields of ``cls`` whose flags ``add_arguments`` generates."""
    return [f.name for f in fields(cls) if "flag" in f.metadata]


class Options:
    """What every options class shares: filled from argparse, then checked."""

    # command-line dest -> field, where the flag is the negation or another name of the field
    CLI_NAMES: dict[str, str] = {}
    NEGATED = ("no_sparse_moe", "no_check")
    # set by for_api(): a message then names the API's keyword (tokenizer=...) instead of the flag
    api = False

    def for_api(self):
        self.api = True
        return self

    # field -> the API's keyword, where the API names it otherwise
    API_NAMES: dict[str, str] = {}

    def label(self, name: str) -> str:
        """A field as the caller names it: the API's keyword, else the field."""
        return self.API_NAMES.get(name, name) if self.api else name

    def flag(self, name: str) -> str:
        """A field as the caller spells it: --max-new-tokens on the command line, max_new_tokens in the API."""
        return self.label(name) if self.api else "--" + name.replace("_", "-")

    def say(self, cli: str, api: str) -> str:
        """The message of a rule, in the words of the caller's entry point."""
        return api if self.api else cli

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """The options an argparse namespace holds (the fields its flags fill; nothing else)."""
        names = {f.name for f in fields(cls)}
        values = {}
        for dest, value in vars(args).items():
            name = cls.CLI_NAMES.get(dest, dest)
            if name not in names:
                continue
            values[name] = (not value) if dest in cls.NEGATED else value
        return cls(**values)


# ------------------------------------------------------------------ the model a command is about
@dataclass(kw_only=True)
class ModelRef(Options):
    """The model: a spec (path or bundled name) or a compiled .onnx file, its variant, --set
    overrides (NAME=VALUE texts), its weights (else seeded with ``seed``) and --allow-large."""

    spec: str | Path = flag(positional=True, metavar="MODEL",
                            help="a .tsr spec (or a bundled spec's name), a checkpoint folder, or an .onnx file "
                                 "compiled with --kv-cache")
    variant: str | None = flag(None, names=("--variant", "-V"),
                               help="a variant defined in the spec file (e.g. small, medium)")
    sets: list[str] = flag(factory=list, names=("--set",), action="append", metavar="NAME=VALUE",
                           help="override a hyperparameter (repeatable), checked like the spec's own values")
    seed: int = flag(0, type=int, help="seed of the weight initialiser (default 0)")
    weights: str | Path | None = flag(None, metavar="FILE",
                                      help="a .safetensors file or folder of shards; Hugging Face names are mapped "
                                           "by the <spec>.hf.toml file beside the spec, and a folder's config.json "
                                           "gives the hyperparameters its [config] table names (a value "
                                           "contradicting --set or the variant is an error)")
    allow_large: bool = flag(False, action="store_true",
                             help="go ahead even when the weights look too large for the memory available "
                                  "(compile streams them to the file one tensor at a time, so there only its "
                                  "largest tensor and the free disk count) (by default such a model is refused "
                                  "before anything is allocated or written)")

    def check(self) -> None:
        check_path(self.label("spec"), self.spec, optional=False)
        if self.variant is not None and not isinstance(self.variant, str):
            raise UsageError(f"variant must be a string, got {self.variant!r}")
        check_strings(self.label("sets"), self.sets)
        check_path(self.label("weights"), self.weights)
        check_int(self.label("seed"), self.seed, minimum=0)
        check_bool(self.label("allow_large"), self.allow_large)

    @property
    def compiled(self) -> bool:
        """An .onnx file (or a folder of one) rather than a spec."""
        p = Path(self.spec)
        return p.suffix == ".onnx"


# ------------------------------------------------------------------ shared groups
@dataclass(kw_only=True)
class QuantOptions(Options):
    """--quantize and its details (compile, run, report and generate share them)."""

    quantize: str = flag("none", choices=list(QUANTIZE_CHOICES),
                         help="quantise the weights of the linear layers. int8, int4: block-wise scales, run by "
                              "onnxruntime's MatMulNBits (activations stored in float; see --quantize-activations); "
                              "smallest and fastest for one sequence at a time. w8a8: int8 weights with a scale per "
                              "output row, each activation row (token) quantised at run time, the product in "
                              "onnxruntime's integer GEMM (VNNI/AMX): fastest for prompts and batches (fp32 only). "
                              "int4-asym: int4 blocks with zero points over each block's [min, max] and a searched "
                              "scale; keeps a real model's quality best at 4 bits (docs/real-models.md). "
                              "The output head is stored at 8 bits under int4, int4-asym and int8, the token "
                              "embedding under int4 and int4-asym (under int8 where the 8-bit head is tied to it); "
                              "both stay float under w8a8 (--quantize-head, --quantize-embedding; "
                              "SmolLM2-135M int4: 212 MB compiled, 99 MB with the 8-bit embedding, perplexity "
                              "14.508 either way, docs/real-models.md) (default none)")
    quantize_block: int | None = flag(None, type=int, metavar="N",
                                      help="input features per quantisation scale: a power of two, at least 16; "
                                           "larger is faster and less accurate (int4 at 128: about 1.3x faster "
                                           "decoding, a larger error; docs/benchmarks/table.md Q8) (default 32; int8 and "
                                           "int4)")
    quantize_activations: str | None = flag(
        None, metavar="{int8,float,float:KIND[,KIND]}",
        help="which products round their activations to int8 inside MatMulNBits (accuracy_level 4) and which keep "
             "them in fp32 (accuracy_level 0): int8 (every product, the default), float (every product), or "
             "float:KIND[,KIND...] with KIND one of qkv, o, gate-up, down, head, other (the rest int8). Measured on "
             "an AVX2 CPU without VNNI (bench/matmul_nbits_choice.py): at one token fp32 activations make a 4-bit "
             "product 3-4x slower and an 8-bit one 10-100x (SmolLM2-135M's down projections in fp32 alone: +30 x "
             "0.15 ms a token); int8 activations cost SmolLM2-135M's GGUF codes +0.3 %% perplexity against "
             "llama.cpp's (docs/benchmarks/log.md). With --quantize, it applies to a GGUF file's own codes too")
    quantize_head: str | bool = flag(
        "auto", nargs="?", const="on", choices=list(QUANT_HEADS), metavar="{float,8,4}",
        help="the output head's bits (its errors go straight into the logits): float, 8 or 4. By default (auto) 8 "
             "under int4, int4-asym and int8 (llama.cpp's layout: symmetric under int4 and int8, with zero points "
             "under int4-asym; SmolLM2-135M int8: 1.24-1.29x faster decoding than a float head for +0.25 %% "
             "perplexity) and float under w8a8. --quantize-head alone, as before: the head at the scheme's bits (int4: "
             "4; int4-asym, int8, w8a8: 8). A tied head at 8 bits shares its codes with an 8-bit embedding")
    quantize_embedding: str = flag(
        "auto", choices=list(QUANT_EMBEDDINGS), metavar="{float,8}",
        help="the token embedding table's storage: float, or 8-bit codes with a scale per block (and a zero "
             "point under int4-asym) gathered by onnxruntime's GatherBlockQuantized. By default (auto) 8 under "
             "int4 and int4-asym, under int8 only where the 8-bit head is tied to it (one set of codes), float "
             "otherwise and under w8a8 (which takes no 8: its per-row int8 codes are not a "
             "layout the gather reads). A tied head at 8 bits reads the same codes, a GGUF file's Q8_0 table "
             "its own. SmolLM2-135M int4: the compiled file 212 MB -> 99 MB, perplexity 14.508 -> 14.508 "
             "(docs/real-models.md)")

    def check(self) -> None:
        check_choice(self.label("quantize"), self.quantize, QUANTIZE_CHOICES)
        check_int(self.label("quantize_block"), self.quantize_block, optional=True)
        if not isinstance(self.quantize_head, bool):  # the API takes True / False too (quant_config says how)
            check_choice(self.label("quantize_head"), str(self.quantize_head), QUANT_HEADS)
        if self.quantize_activations is not None and not isinstance(self.quantize_activations, str):
            raise UsageError(f"{self.label('quantize_activations')} must be a string (int8, float or "
                             f"float:KIND[,KIND...]), got {self.quantize_activations!r}")  # the values: quant_config
        check_choice(self.label("quantize_embedding"), str(self.quantize_embedding), QUANT_EMBEDDINGS)
        self.quant_config()  # the rules between them (--quantize-block needs --quantize, a power of two...)

    def quant_config(self):
        """The QuantConfig these options ask for (None for none)."""
        from tessera.runtime.pipeline import quant_config

        return quant_config(self.quantize, self.quantize_block, self.quantize_head, self.quantize_activations,
                            self.quantize_embedding)


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that fill QuantOptions (report takes them alone; the commands that compile take them
    with the rest of BuildOptions: ``add_build_arguments``)."""
    add_arguments(p, QuantOptions)


@dataclass(kw_only=True)
class CompileCacheOptions(Options):
    """Where compiled models are kept between runs (runtime/compile_cache.py): the commands that load a
    model (run, generate, serve, batch, perplexity and the API's methods) read a model compiled before
    from it and store what they compile; ``compile`` writes its output afresh."""

    compile_cache: str | Path | None = flag(
        None, metavar="DIR",
        help="keep compiled models in DIR and load them from there when the spec, the weights files (path, size, "
             "modification time), the compile options and the versions are the same (default: "
             "$TESSERA_COMPILE_CACHE, else the compiled/ folder of Tessera's cache folder, ~/.cache/tessera; "
             "`tessera cache list|clear`); run, generate, serve, batch and perplexity read and fill it, compile "
             "always writes its output afresh")
    no_compile_cache: bool = flag(False, action="store_true",
                                  help="compile the model now, neither reading nor filling the compile cache")

    def check(self) -> None:
        super().check()
        check_path(self.label("compile_cache"), self.compile_cache)
        check_bool(self.label("no_compile_cache"), self.no_compile_cache)
        if self.compile_cache is not None and not str(self.compile_cache):
            raise UsageError(f"{self.flag('compile_cache')} needs a folder, got an empty path")
        if self.compile_cache is not None and self.no_compile_cache:
            raise UsageError(self.say("--compile-cache DIR and --no-compile-cache contradict each other; give one",
                                      "compile_cache and no_compile_cache=True contradict each other; give one"))


def gguf_weights_flag():
    """--gguf-weights (BuildOptions and PerplexityOptions: every command that compiles a model from weights)."""
    return flag("codes", choices=list(GGUF_WEIGHTS),
                help="a GGUF file's Q4_0, Q8_0, Q5_0, Q4_1, Q5_1, Q4_K and Q5_K matrices: codes (default): kept as "
                     "the file stores them (onnxruntime's MatMulNBits reads the file's own codes and scales, which "
                     "it dequantises to exactly llama.cpp's weights; no requantisation), the activations quantised "
                     "to int8 per block of 32 inside the product as llama.cpp does; codes-fp32: the 4-bit ones "
                     "kept, the product in fp32, the 8-bit ones read as fp32 (the logits equal the dequantised "
                     "model's to rounding); dequantize: every tensor read as fp32. Other types (Q6_K, Q3_K, "
                     "Q2_K, IQ4_NL) are dequantised (--explain says which and why; docs/cli.md, A GGUF file as the model)")


CACHE_FIELDS = ("compile_cache", "no_compile_cache")  # where compiles are kept, not how: no pipeline keyword


@dataclass(kw_only=True)
class BuildOptions(CompileCacheOptions, QuantOptions):
    """How a model is compiled, for every entry point that compiles one: ``compile``, ``run``,
    ``generate``, ``serve``, ``batch``, the Ray deployment and the API's methods take these fields.
    A compile option that all of them should honour is a field here, declared with ``flag(...)`` (the
    commands generate its flag from it), checked in ``check()`` and handed to the pipeline by
    ``build_fields()``, which every ``pipeline_options`` below spreads into its PipelineOptions; the
    API's methods that compile take it as a keyword (tests/project/test_options_parity.py fails until they
    do, and until every command line, the server, ``batch`` and Ray reach it)."""

    # the quantisation's fields are QuantOptions'; a new compile option is declared here, with flag(...)
    gguf_weights: str = gguf_weights_flag()
    kv_cache_dtype: str = flag("auto", choices=list(KV_CACHE_DTYPES),
                               help="the precision the KV cache is stored at: fp16 halves its bytes (twice the "
                                    "sequences in the same memory) while the model computes in fp32; it needs "
                                    "every attention site decoding by GroupQueryAttention over the buffer cache "
                                    "(not a sliding window, chunked attention or recurrent state). int8 and int4 "
                                    "are refused with the reason (docs/serve.md). auto: the model's precision "
                                    "(fp32, or fp16 with --dtype fp16) (default auto)")

    def check(self) -> None:
        super().check()  # the quantisation's rules; a new compile option's follow
        check_choice(self.label("gguf_weights"), self.gguf_weights, GGUF_WEIGHTS)
        self._check_kv_cache_dtype()

    def _check_kv_cache_dtype(self) -> None:
        """--kv-cache-dtype: a choice; int8/int4 refused with the reason; against --dtype (an fp16 model's cache
        is fp16) and the device (on CUDA the fp16 cache comes with --dtype fp16)."""
        check_choice(self.label("kv_cache_dtype"), self.kv_cache_dtype, KV_CACHE_DTYPES)
        kv, dtype = self.kv_cache_dtype, getattr(self, "dtype", "fp32")
        name = self.flag("kv_cache_dtype")
        if kv in ("int8", "int4"):
            from tessera.compiler.passes.kv_cache_dtype import QUANTISED_REASON

            raise UsageError(f"{name} {kv}: {QUANTISED_REASON}")
        if kv in ("auto", dtype):
            return
        if dtype != "fp32":
            raise UsageError(f"{name} {kv} with {self.flag('dtype')} {dtype}: a model compiled at {dtype} keeps its "
                             f"cache at {dtype}; drop {name} or give {dtype}")
        device = getattr(self, "device", None) if not isinstance(self, OptimizeOptions) else self.target
        if device == "cuda":
            raise UsageError(f"{name} {kv} on CUDA: the fp16 cache there comes with {self.flag('dtype')} fp16 (the "
                             f"model in fp16; onnxruntime's CUDA GroupQueryAttention has no fp32 kernel to read a "
                             f"cache beside an fp32 model)")

    def build_fields(self) -> dict:
        """These options as PipelineOptions keywords (compiler/passes/pipeline.py)."""
        cache = {"kv_cache_dtype": self.kv_cache_dtype}
        return {"quantize": self.quant_config(), "gguf_weights": self.gguf_weights} | cache

    def build_given(self) -> list[str]:
        """The fields given otherwise than their defaults (an .onnx file is compiled already: it takes none;
        the compile cache's fields do not change a compile, so an .onnx file takes them, unused)."""
        return [f.name for f in fields(BuildOptions) if getattr(self, f.name) != f.default
                and f.name not in CACHE_FIELDS]

    def build_key(self) -> tuple:
        """The values of these fields: what a caller keeping compiled models (the API's) keys them by."""
        return tuple((f.name, repr(getattr(self, f.name))) for f in fields(BuildOptions))


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that fill BuildOptions (compile, run, generate, serve and batch share them)."""
    add_arguments(p, BuildOptions)


@dataclass(kw_only=True)
class OptimizeOptions(BuildOptions):
    """How a spec is optimised for a target (compile and run share them)."""

    target: str = "cpu"
    attention: str = "auto"
    dtype: str = "fp32"
    no_fuse: bool = False
    sparse_moe: bool = True
    recurrence: str = "auto"
    explain: bool = False

    def check(self) -> None:
        super().check()
        check_choice(self.label("target"), self.target, TARGETS)
        check_choice(self.label("attention"), self.attention, attention_choices())
        check_choice(self.label("dtype"), self.dtype, DTYPES)
        check_bool(self.label("no_fuse"), self.no_fuse)
        check_bool(self.label("sparse_moe"), self.sparse_moe)
        check_choice(self.label("recurrence"), self.recurrence, RECURRENCES)
        check_bool(self.label("explain"), self.explain)
        if self.no_fuse and self.attention not in ("auto", "unfused"):
            raise UsageError(f"--no-fuse contradicts --attention {self.attention}")
        if self.quantize == "w8a8" and self.target == "cuda":
            raise UsageError(self.say("--quantize w8a8 runs onnxruntime's CPU integer GEMM (MatMulIntegerToFloat has "
                                      "no CUDA kernel): use --target cpu, or --quantize int8 / int4 on CUDA",
                                      "quantize='w8a8' runs onnxruntime's CPU integer GEMM (MatMulIntegerToFloat has "
                                      "no CUDA kernel): use target='cpu', or quantize='int8' / 'int4' on CUDA"))

    @property
    def attention_lowering(self) -> str:
        return "unfused" if self.no_fuse else self.attention

    def pipeline_options(self, attention_probs=(), all_probs: bool = False):
        """The ``full`` pipeline's PipelineOptions for an export at the target's dtype (compile, run);
        ``attention_probs`` (site indices) or ``all_probs``: those sites' probabilities as outputs."""
        from tessera.compiler.passes.attention_kernels import Target
        from tessera.compiler.passes.pipeline import PipelineOptions

        return PipelineOptions(Target(self.target, self.dtype), self.attention_lowering, sparse_moe=self.sparse_moe,
                               recurrence=self.recurrence, lower_precision=True,
                               attention_probs=tuple(attention_probs), all_probs=all_probs, **self.build_fields())


# ------------------------------------------------------------------ one class per command
@dataclass(kw_only=True)
class CompileOptions(OptimizeOptions):
    """``tessera compile`` / ``Model.compile``."""

    CLI_NAMES = {"no_sparse_moe": "sparse_moe", "no_check": "check_model"}
    API_NAMES = {"output": "out", "check_model": "check"}

    output: str | Path
    check_model: bool = True
    kv_cache: bool = False
    cache: str = "auto"
    decode: str = "auto"
    combined_call: bool = False
    genai: bool = False
    tokenizer: str | Path | None = None
    context_length: int | None = None
    attention_probs: list[int | str] = field(default_factory=list)
    quiet: bool = False

    def check(self) -> None:
        super().check()
        check_path(self.label("output"), self.output, optional=False)
        for name in ("check_model", "kv_cache", "genai"):
            check_bool(self.label(name), getattr(self, name))
        check_bool(self.label("combined_call"), self.combined_call)
        check_bool(self.label("quiet"), self.quiet)
        check_choice(self.label("cache"), self.cache, CACHES)
        check_choice(self.label("decode"), self.decode, DECODES)
        check_path(self.label("tokenizer"), self.tokenizer)
        check_int(self.label("context_length"), self.context_length, optional=True)
        if not isinstance(self.attention_probs, (list, tuple)) or not all(
                s == "all" or (_is_int(s) and s >= 0) for s in self.attention_probs):
            raise UsageError(f"attention_probs must be a list of attention site numbers (0, 1, ...) or 'all', "
                             f"got {self.attention_probs!r}")
        if self.genai:
            self._check_genai()
        elif self.tokenizer or self.context_length is not None:
            raise UsageError(self.say(f"{'--tokenizer' if self.tokenizer else '--context-length'} applies to --genai "
                                      f"(the folder for onnxruntime-genai)",
                                      "tokenizer and context_length apply to genai=True"))
        if self.kv_cache or self.genai:
            if self.attention_probs:
                raise UsageError("--attention-probs applies to the full model, not to --kv-cache's cached decoder")
            if self.no_fuse or self.attention != "auto":
                raise UsageError("--kv-cache chooses the attention kernels per phase itself: it takes neither "
                                 "--no-fuse nor --attention")
        if self.combined_call:
            if not self.kv_cache or self.genai:
                raise UsageError(self.say("--combined-call applies with --kv-cache (a decoder for `tessera serve`), "
                                          "not without it or with --genai",
                                          "combined_call applies with kv_cache=True, not with genai=True"))
            if self.decode == "plain" or self.cache == "concat":
                raise UsageError(f"{self.flag('combined_call')} needs GroupQueryAttention decoding over the buffer "
                                 f"cache (the combined call runs the decoding rows' GroupQueryAttention in place); "
                                 f"drop {'--decode plain' if self.decode == 'plain' else '--cache concat'}")
        if self.kv_cache_dtype not in ("auto", self.dtype) and (self.genai or not self.kv_cache):
            raise UsageError(self.say("--kv-cache-dtype applies with --kv-cache (without --genai, which writes "
                                      "onnxruntime-genai's concat cache at the model's precision)",
                                      "kv_cache_dtype applies with kv_cache=True (not genai=True)"))
        if not (self.kv_cache or self.genai):
            if self.cache != "auto":
                raise UsageError(self.say("--cache applies with --kv-cache", "cache applies with kv_cache=True"))
            if self.decode != "auto":
                raise UsageError(self.say("--decode applies with --kv-cache", "decode applies with kv_cache=True"))

    def _check_genai(self) -> None:
        """The compile options --genai cannot be combined with, before anything is built."""
        if self.cache == "buffer":
            raise UsageError("--genai writes the concat cache (onnxruntime-genai feeds present = past + new back as "
                             "the next past; it has no slot for the buffer cache's new columns): drop --cache buffer")
        if self.target != "cpu":
            raise UsageError("--genai writes a CPU configuration (onnxruntime-genai's provider options); "
                             "--target cuda is not supported with it")
        if self.context_length is not None and self.context_length < 1:
            raise UsageError(f"{self.flag('context_length')} must be at least 1, got {self.context_length}")
        if str(self.output).endswith(".onnx"):
            raise UsageError(f"with --genai, -o names the folder to write (e.g. {str(self.output)[:-5]}), not an "
                             f".onnx file")
        if not self.tokenizer:
            why = "onnxruntime-genai reads the tokenizer and the end-of-sequence token from the folder"
            raise UsageError(self.say(f"--genai needs --tokenizer tokenizer.json: {why}",
                                      f"genai=True needs tokenizer='tokenizer.json' ({why})"))

    @property
    def cache_mode(self) -> str:
        """--genai writes the concat cache (onnxruntime-genai feeds present back as past)."""
        return "concat" if self.genai else self.cache

    def cached_pipeline_options(self):
        """The ``cached_decoder`` pipeline's PipelineOptions (--kv-cache, --genai): quantised as its first
        pass, kernels chosen per phase, the cache kept at the target's dtype."""
        from tessera.compiler.passes.attention_kernels import Target
        from tessera.compiler.passes.pipeline import PipelineOptions

        return PipelineOptions(Target(self.target, self.dtype), sparse_moe=self.sparse_moe, recurrence=self.recurrence,
                               cache=self.cache_mode, decode=self.decode, mixed=self.combined_call,
                               **self.build_fields())


@dataclass(kw_only=True)
class RunOptions(OptimizeOptions):
    """``tessera run`` / ``Model.run`` and ``Model.alignment``."""

    CLI_NAMES = {"no_sparse_moe": "sparse_moe"}
    API_NAMES = {"attention_output": "output", "plot_attention": "plot"}

    inputs: list[str] = field(default_factory=list)
    tokenizer: str | Path | None = None
    texts: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    pool: str | None = None
    provider: str = "auto"
    format: str = "table"
    full: bool = False
    save: str | Path | None = None
    plot_attention: str | Path | None = None
    attention_output: str | None = None
    layer: int | None = None
    head: int | str | None = None
    batch_index: int | None = None
    alignment: bool = False  # compute the attention alignment even without --plot-attention (the API's alignment())

    @property
    def wants_alignment(self) -> bool:
        return self.alignment or self.plot_attention is not None

    def check(self) -> None:
        super().check()
        if self.kv_cache_dtype not in ("auto", self.dtype):
            raise UsageError(f"{self.flag('kv_cache_dtype')} applies to a cached decoder (generate, serve, batch, "
                             f"compile --kv-cache); run computes the full model, which keeps no KV cache")
        check_strings(self.label("inputs"), self.inputs)
        check_path(self.label("tokenizer"), self.tokenizer)
        check_strings(self.label("texts"), self.texts)
        check_strings(self.label("images"), self.images)
        check_choice(self.label("pool"), self.pool, ("mean",), optional=True)
        check_choice(self.label("provider"), self.provider, PROVIDERS)
        check_choice(self.label("format"), self.format, ("table", "json"))
        check_bool(self.label("full"), self.full)
        check_path(self.label("save"), self.save)
        check_path(self.label("plot_attention"), self.plot_attention)
        if self.attention_output is not None and not isinstance(self.attention_output, str):
            raise UsageError(f"attention_output must be an output name, got {self.attention_output!r}")
        check_int(self.label("layer"), self.layer, minimum=0, optional=True)
        if self.head is not None and self.head != "mean":
            check_int(self.label("head"), self.head, minimum=0)
        check_int(self.label("batch_index"), self.batch_index, minimum=0, optional=True)
        check_bool(self.label("alignment"), self.alignment)
        if self.texts and not self.tokenizer:
            raise UsageError("--text needs --tokenizer tokenizer.json to turn the text into token ids")
        if self.tokenizer and not self.texts and not self.wants_alignment:
            raise UsageError("--tokenizer is given but no --text to tokenize")
        if not self.wants_alignment:
            given = [flag for flag, value in (("--attention-output", self.attention_output), ("--layer", self.layer),
                                              ("--head", self.head), ("--batch-index", self.batch_index))
                     if value is not None]
            if given:
                raise UsageError(f"{given[0]} applies with --plot-attention FILE.png")
        elif self.layer is not None and self.attention_output is not None:
            raise UsageError(self.say("--layer and --attention-output both choose the weights to plot; give one",
                                      "layer and output both choose the weights to plot; give one"))
        if self.full and self.format != "json":
            raise UsageError("--full applies to --format json (the table always summarises)")


@contextmanager
def plan_errors():
    """A deployment plan's PlanError (compiler/analysis/plan.py, which cannot know the runtime's
    errors) as the UsageError every entry point reports: the one place the two meet, used by
    ReportOptions.check (the rules between the options) and runtime/report/build.py (those of the model)."""
    from tessera.compiler.analysis.plan import PlanError

    try:
        yield
    except PlanError as e:
        raise UsageError(str(e)) from None


@dataclass(kw_only=True)
class ReportOptions(QuantOptions):
    """``tessera report`` / ``Model.report``. ``batch`` and ``seq`` are one value, or a list of
    them for a sweep (one row per (B, N); the other sections use the first values). ``tp`` ...
    ``context`` are the deployment plan (compiler/analysis/plan.Plan; docs/report.md, "Parallel
    splits, training, serving"): with none of them the report has no deployment sections."""

    CLI_NAMES = {"no_sparse_moe": "sparse_moe"}

    batch: int | list[int] = 1
    seq: int | list[int] = 1024
    dtype: str = "fp32"
    device: str = "h200"
    sparse_moe: bool = True
    format: str = "table"
    plot: str | Path | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    train: bool = False
    zero: int = 0
    recompute: str = "none"
    serve: bool = False
    context: int | None = None
    kv_cache_dtype: str = "auto"  # the KV cache's bytes per element in the memory figures and --serve's capacity
    gguf_weights: str = gguf_weights_flag()  # a GGUF file's codes: the report's gguf_codes section counts them
    # --measure / --calibrated (runtime/report/measure.py, calibration.py; docs/report.md)
    measure: bool = False
    repeats: int = 5
    calibrated: bool = False
    calibration: str | Path | None = None

    @property
    def batches(self) -> list[int]:
        return list(self.batch) if isinstance(self.batch, (list, tuple)) else [self.batch]

    @property
    def seqs(self) -> list[int]:
        return list(self.seq) if isinstance(self.seq, (list, tuple)) else [self.seq]

    @property
    def sweep(self) -> bool:
        """Several values of B or N: the report adds one row per (B, N)."""
        return len(self.batches) * len(self.seqs) > 1

    @property
    def plan(self):
        """The deployment plan these options ask for (compiler/analysis/plan.Plan), None if none."""
        from tessera.compiler.analysis.plan import Plan

        plan = Plan(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, train=self.train, zero=self.zero,
                    recompute=self.recompute, serve=self.serve, context=self.context)
        return None if plan == Plan() else plan

    def _check_sizes(self, name: str) -> None:
        """--batch and --seq: an integer, or a non-empty list of them (a sweep), each at least 1."""
        v = getattr(self, name)
        values = list(v) if isinstance(v, (list, tuple)) else [v]
        if not values or not all(_is_int(x) for x in values):
            raise UsageError(f"{self.label(name)} must be an integer or a non-empty list of integers, got {v!r}")
        if min(values) < 1:
            raise UsageError(f"{self.flag(name)} must be at least 1, got {min(values)}")

    def check(self) -> None:
        from tessera.compiler.analysis.plan import RECOMPUTE, check_options

        super().check()
        self._check_sizes("batch")
        self._check_sizes("seq")
        check_choice(self.label("dtype"), self.dtype, DTYPES)
        if not isinstance(self.device, str):
            raise UsageError(f"device must be a device name, got {self.device!r}")
        check_bool(self.label("sparse_moe"), self.sparse_moe)
        check_choice(self.label("format"), self.format, REPORT_FORMATS)
        check_path(self.label("plot"), self.plot)
        for name in ("tp", "pp", "dp", "ep", "zero"):
            check_int(self.label(name), getattr(self, name))
        check_int(self.label("context"), self.context, optional=True)
        check_bool(self.label("train"), self.train)
        check_bool(self.label("serve"), self.serve)
        check_choice(self.label("recompute"), self.recompute, RECOMPUTE)
        check_choice(self.label("kv_cache_dtype"), self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice(self.label("gguf_weights"), self.gguf_weights, GGUF_WEIGHTS)
        if self.kv_cache_dtype in ("int8", "int4"):
            from tessera.compiler.passes.kv_cache_dtype import QUANTISED_REASON

            raise UsageError(f"{self.flag('kv_cache_dtype')} {self.kv_cache_dtype}: {QUANTISED_REASON}")
        if self.kv_cache_dtype not in ("auto", self.dtype) and self.dtype != "fp32":
            raise UsageError(f"{self.flag('kv_cache_dtype')} {self.kv_cache_dtype} with {self.flag('dtype')} "
                             f"{self.dtype}: a model compiled at {self.dtype} keeps its cache at {self.dtype}")
        if self.plan is not None:  # the rules between them (--zero needs --dp 2 or more, --serve --context...)
            with plan_errors():
                check_options(self.plan, self.flag)
        self._check_measure()

    def _check_measure(self) -> None:
        """--measure, --repeats, --calibrated and --calibration: their types and the rules between them."""
        check_bool(self.label("measure"), self.measure)
        check_int(self.label("repeats"), self.repeats)
        if self.repeats < 1:
            raise UsageError(f"{self.flag('repeats')} must be at least 1, got {self.repeats}")
        check_bool(self.label("calibrated"), self.calibrated)
        check_path(self.label("calibration"), self.calibration)
        cpu = self.say("--device cpu", "device='cpu'")
        if self.measure and self.device != "cpu":
            raise UsageError(f"{self.flag('measure')} times the model on this machine's CPU and compares it with "
                             f"the probed cpu roofline: add {cpu}")
        if self.calibrated and self.device != "cpu":
            raise UsageError(f"{self.flag('calibrated')} applies the calibration of this machine's CPU: add {cpu}")
        if self.measure and self.sweep:
            raise UsageError(f"{self.flag('measure')} times one batch size and one sequence length; give one "
                             f"{self.flag('batch')} and one {self.flag('seq')}")
        if self.measure and self.dtype != "fp32":
            raise UsageError(f"{self.flag('measure')} runs the CPU export, which computes in float32: "
                             f"{self.flag('dtype')} fp32 only")
        if self.measure and not self.sparse_moe:
            raise UsageError(f"{self.flag('measure')} times the decoder that generate compiles, whose experts are "
                             f"always sparse: it does not take {self.say('--no-sparse-moe', 'sparse_moe=False')}")
        if self.repeats != 5 and not self.measure:
            raise UsageError(f"{self.flag('repeats')} applies with {self.flag('measure')}")
        if self.calibration is not None and not (self.measure or self.calibrated):
            raise UsageError(f"{self.flag('calibration')} names the file that {self.flag('measure')} writes and "
                             f"{self.flag('calibrated')} reads: add one of them")

    def pipeline_options(self):
        """The ``report`` pipeline's PipelineOptions: experts sparse as compile makes them."""
        from tessera.compiler.passes.pipeline import PipelineOptions

        return PipelineOptions(quantize=self.quant_config(), sparse_moe=self.sparse_moe, gguf_weights=self.gguf_weights)


@dataclass(kw_only=True)
class GenerateOptions(BuildOptions):
    """``tessera generate`` / ``Model.generate``. ``sampling_seed`` None: the model's seed (the
    command line's --seed is both)."""

    API_NAMES = {"prompts": "prompt", "stops": "stop", "sampling_seed": "seed"}

    # None: the checkpoint's generation_config.json gives it, else DEFAULTS (``with_defaults``)
    max_new_tokens: int | None = None
    tokenizer: str | Path | None = None
    prompts: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    start_token: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    logprobs: int | None = None
    chat: bool = False
    ignore_eos: bool = False
    explain: bool = False
    sampling_seed: int | None = None
    stops: list[str] = field(default_factory=list)
    stop_tokens: list[int] = field(default_factory=list)
    format: str = "text"
    threads: int | None = None
    cache: str = "auto"
    quiet: bool = False
    # issue 37: the execution provider (auto: CUDA where onnxruntime has it and the machine shows a GPU) and
    # the precision a spec is compiled at; on CUDA it is compiled for CUDA (``device``), its cache on the device
    provider: str = "auto"
    dtype: str = "fp32"
    # speculative decoding (generation/speculative.py): "ngram", a draft model (a spec, checkpoint folder
    # or compiled .onnx; the API also takes a loaded tessera.Model), and the tokens drafted per round
    speculative: str | Path | object | None = None
    draft_tokens: int | None = None
    # structured output (generation/constraints.py): a JSON schema file (the API also takes the schema as a
    # dict), a regular expression, a Lark grammar file; at most one
    json_schema: str | Path | dict | None = None
    regex: str | None = None
    grammar: str | Path | None = None

    # --draft-tokens' defaults. Prompt lookup: 10, as transformers' prompt-lookup examples use: a lookup
    # that finds nothing drafts nothing, and one that hits copies a run, which a short draft cuts into
    # several verifying calls (docs/benchmarks/log.md, "Speculative decoding and llama.cpp, quietly
    # after the merge": 1.73x plain at 4, 2.04x at 10).
    # A draft model: 4, since each drafted token is a call of the draft model, paid when rejected.
    NGRAM_DRAFT_TOKENS = 10
    MODEL_DRAFT_TOKENS = 4

    def check(self) -> None:
        super().check()
        check_choice(self.label("provider"), self.provider, PROVIDERS)
        check_choice(self.label("dtype"), self.dtype, DTYPES)
        if self.dtype == "bf16" and self.device != "cuda":  # runtime/bfloat16.py: the host never computes in it
            raise UsageError(self.say(f"--dtype bf16 runs on CUDA only, and this runs on the CPU ({BF16_CPU}); use "
                                      f"--provider cuda on a machine with a GPU, or --dtype fp32",
                                      f"dtype='bf16' runs on CUDA only, and this runs on the CPU ({BF16_CPU}); use "
                                      f"provider='cuda' on a machine with a GPU, or dtype='fp32'"))
        check_int(self.label("max_new_tokens"), self.max_new_tokens, optional=True)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"{self.flag('max_new_tokens')} must be at least 1, got {self.max_new_tokens}")
        check_path(self.label("tokenizer"), self.tokenizer)
        check_strings(self.label("prompts"), self.prompts)
        check_strings(self.label("inputs"), self.inputs)
        check_int(self.label("start_token"), self.start_token, optional=True)
        for name in ("temperature", "top_p", "repetition_penalty", "min_p"):
            if getattr(self, name) is not None:
                check_number(self.label(name), getattr(self, name))
        for name in ("top_k", "no_repeat_ngram_size", "min_new_tokens", "logprobs"):
            check_int(self.label(name), getattr(self, name), optional=True)
        check_bool(self.label("chat"), self.chat)
        check_bool(self.label("ignore_eos"), self.ignore_eos)
        check_bool(self.label("explain"), self.explain)
        check_int(self.label("sampling_seed"), self.sampling_seed, minimum=0, optional=True)
        check_strings(self.label("stops"), self.stops)
        check_ints(self.label("stop_tokens"), self.stop_tokens)
        check_choice(self.label("format"), self.format, ("text", "json", "jsonl"))
        check_int(self.label("threads"), self.threads, minimum=0, optional=True)
        check_choice(self.label("cache"), self.cache, CACHES)
        check_bool(self.label("quiet"), self.quiet)
        self.sampling(0).check()
        self._check_speculative()
        self._check_structured()
        if self.prompts and any(item.partition("=")[0] == "tokens" for item in self.inputs):
            raise UsageError("give the prompts either as --prompt text or as --input tokens, not both")
        if self.prompts and not self.tokenizer:
            raise UsageError(self.say("--prompt needs --tokenizer tokenizer.json to turn the text into token ids",
                                      "a text prompt needs tokenizer='tokenizer.json'"))
        if self.stops and not self.tokenizer:
            raise UsageError(self.say("--stop TEXT needs --tokenizer; use --stop-token ID for token ids",
                                      "stop strings need a tokenizer; use stop_tokens=[ids] for token ids"))
        if self.chat and not self.prompts:
            raise UsageError(self.say("--chat applies the chat template to --prompt TEXT (with --tokenizer)",
                                      "chat=True applies the chat template to a text prompt (with a tokenizer)"))
        if self.logprobs is not None and self.format == "text" and not self.api:
            raise UsageError("--logprobs N is printed with --format json or jsonl (the text output has no place "
                             "for it)")

    def _check_structured(self) -> None:
        """--json-schema, --regex, --grammar: one at most, of the right types, with a tokenizer."""
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if not given:
            return
        if len(given) > 1:
            raise UsageError(f"give one of {self.flag('json_schema')}, {self.flag('regex')} and "
                             f"{self.flag('grammar')}, not {' and '.join(self.flag(n) for n in given)}")
        if not (isinstance(self.json_schema, (str, Path)) or self.json_schema is None or
                (self.api and isinstance(self.json_schema, dict))):
            raise UsageError(f"{self.label('json_schema')} must be a JSON schema file"
                             + (" or a dict" if self.api else "") + f", got {type(self.json_schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise UsageError(f"{self.label('regex')} must be a non-empty regular expression")
        if self.grammar is not None:
            check_path(self.label("grammar"), self.grammar)
        if isinstance(self.json_schema, (str, Path)):
            check_path(self.label("json_schema"), self.json_schema)
        if not self.tokenizer:
            raise UsageError(f"{self.flag(given[0])} needs --tokenizer: the grammar is over the tokenizer's texts")
        if self.speculative is not None:
            raise UsageError(f"{self.flag(given[0])} and {self.flag('speculative')} together are `tessera serve`'s "
                             f"(--speculative ngram); `tessera generate` does one or the other")

    def _check_speculative(self) -> None:
        """--speculative and --draft-tokens: their values and what they exclude (the rules that need
        the models, a vocabulary or a cache mode, are checked once the models are loaded)."""
        spec, k = self.speculative, self.draft_tokens
        check_int(self.label("draft_tokens"), k, optional=True)
        if k is not None and k < 1:
            raise UsageError(f"{self.flag('draft_tokens')} must be at least 1 (the tokens drafted per round), got {k}")
        if spec is None:
            if k is not None:
                raise UsageError(self.say("--draft-tokens applies with --speculative ngram|DRAFT_MODEL",
                                          "draft_tokens applies with speculative='ngram' or a draft model"))
            return
        if not (isinstance(spec, (str, Path)) or hasattr(spec, "ref")):
            raise UsageError(f"{self.label('speculative')} must be 'ngram', a draft model's spec, checkpoint folder "
                             f"or .onnx file, or a loaded tessera.Model, got {spec!r}")
        if isinstance(spec, (str, Path)):
            check_path(self.label("speculative"), spec)
            if not str(spec):
                raise UsageError(f"{self.flag('speculative')} needs 'ngram' or a draft model, got an empty string")
        if self.temperature is not None and self.temperature > 0:
            raise UsageError(f"{self.flag('speculative')} is greedy only: temperature {self.temperature} samples, "
                             f"and the rejection-sampling acceptance that would keep sampling exact is not "
                             f"implemented; use temperature 0 or drop {self.flag('speculative')}")
        if self.cache == "concat":
            raise UsageError(f"{self.flag('speculative')} needs the buffer cache (its columns are rolled back per "
                             f"row); {self.flag('cache')} concat cannot be")

    @property
    def k(self) -> int:
        """The tokens drafted per round (--draft-tokens, else the drafter's default)."""
        if self.draft_tokens is not None:
            return self.draft_tokens
        return self.NGRAM_DRAFT_TOKENS if self.speculative == "ngram" else self.MODEL_DRAFT_TOKENS

    def pipeline_options(self):
        """The PipelineOptions generation compiles with (cached_decoder, or encoder_decoder with the
        target input filled in by the loader): the quantisation and the cache mode."""
        from tessera.compiler.passes.pipeline import PipelineOptions

        from tessera.compiler.passes.attention_kernels import Target

        # on CUDA the decoding step without its mask (prefix_keys: GroupQueryAttention may choose flash decoding;
        # the loop lays prompts of different lengths row by row, generation/cached.py CachedDecoder.by_row), as the
        # serving engine does; not for speculation's target or draft model (``drafting``, set by
        # generation/loop.py load_drafter), whose rollback caches keep the left-padded layout and its mask
        prefix_keys = self.device == "cuda" and self.speculative is None and not getattr(self, "drafting", False)
        return PipelineOptions(Target(self.device, self.dtype), cache=self.cache,
                               last_only=self.speculative is None,  # the verifier reads every position's logits
                               prefix_keys=prefix_keys, **self.build_fields())

    @property
    def device(self) -> str:
        """Where the model runs (``device_for``)."""
        return device_for(self.provider)

    def value(self, name: str):
        """A decoding setting as given, else its default (DEFAULTS)."""
        given = getattr(self, name)
        return self.DEFAULTS[name] if given is None else given

    def sampling(self, model_seed: int):
        from tessera.runtime.generation.sampling import Sampling

        seed = model_seed if self.sampling_seed is None else self.sampling_seed
        return Sampling(*(self.value(n) for n in ("temperature", "top_k", "top_p", "repetition_penalty")), seed,
                        *(self.value(n) for n in ("min_p", "no_repeat_ngram_size", "min_new_tokens")),
                        logprobs=self.logprobs)

    def with_defaults(self, found) -> tuple["GenerateOptions", list[str]]:
        """These options with what the user left out filled from the checkpoint (``found``:
        io/generation_config.GenerationDefaults) and its end-of-sequence ids as ``eos_tokens``
        (none with ignore_eos); with one line per setting saying where its value came from."""

        filled, lines = {}, []
        for name in self.DEFAULTS:
            if getattr(self, name) is not None:
                value, source = getattr(self, name), f"given ({self.flag(name)})"
            elif name in found.values:
                value, source = found.values[name], found.sources[name]
            else:
                value, source = self.DEFAULTS[name], "Tessera's default"
            filled[name] = value
            lines.append(f"{name} = {value}: {source}")
        if not found.eos:
            lines.append("end of sequence: none (no eos_token_id in generation_config.json or config.json beside "
                         "the model, weights or tokenizer)")
        elif self.ignore_eos:
            lines.append(f"end of sequence: {found.eos} from {found.eos_source}, ignored ({self.flag('ignore_eos')})")
        else:
            lines.append(f"end of sequence: {found.eos} from {found.eos_source} (a stop token; "
                         f"{self.flag('ignore_eos')} turns it off)")
        if found.start is not None and self.start_token is None:
            lines.append(f"decoder start token (an encoder-decoder's, without a target prompt): {found.start} "
                         f"from {found.start_source}")
        lines += found.notes
        out = dataclasses.replace(self, **filled)
        out.api = self.api
        out.eos_tokens = [] if self.ignore_eos else list(found.eos)
        out.start_default = found.start
        out.check()  # a file's value out of range is refused as the user's would be
        return out, lines

    # the checkpoint's end-of-sequence ids (with_defaults): stop tokens where the model's vocabulary has them
    eos_tokens = ()  # not a dataclass field (no annotation): no flag or keyword sets it
    start_default = None  # the checkpoint's decoder_start_token_id (with_defaults), likewise no field
    DEFAULTS = {"max_new_tokens": 32, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
                "min_p": 0.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}


# why --dtype bf16 is refused where the model would run on the CPU provider (generate, serve, batch)
BF16_CPU = ("onnxruntime's CPU provider has no bfloat16 kernel for GroupQueryAttention, MatMul, Add or Softmax "
            "(onnxruntime 1.31.1's CPU registry), so the model would not open there")


def device_for(provider: str) -> str:
    """Where a model runs: cuda for --provider cuda, and for auto on a machine showing a GPU with
    onnxruntime's CUDA provider installed (runtime/session.py opens it, or falls back to the CPU)."""
    if provider == "cuda":
        return "cuda"
    if provider == "auto":
        if machine.gpu_present():
            spec = importlib.util.find_spec("onnxruntime")
            capi = spec and spec.submodule_search_locations and \
                Path(list(spec.submodule_search_locations)[0]) / "capi" / "libonnxruntime_providers_cuda.so"
            return "cuda" if capi and capi.exists() else "cpu"
    return "cpu"


# ------------------------------------------------------------------ the serving engine's model
IDLE_PREFILL_CHUNK = 512  # serving/engine.py's, written out here: the parsers import no numpy (tests check they agree)


def prefill_chunk_help(default: int) -> str:
    """--prefill-chunk's help, as `tessera serve` and `tessera batch` give it (engine.py ``chunk_for``)."""
    return (f"the iteration's token budget: each decoding row takes one, a prompt's chunk the rest (at least 16), so "
            f"at most N prompt tokens run between two decoding steps; a prompt with no stream decoding goes in "
            f"by up to max(N, {IDLE_PREFILL_CHUNK}) tokens a call (default {default})")


def _whole(name: str, value, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < low:
        raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value}")


@dataclass(kw_only=True)
class EngineOptions(BuildOptions, ModelRef):
    """The model on the serving engine, for ``serve``, ``batch`` and the Ray deployment: the model as
    ``generate`` takes it (ModelRef's fields), its compile (BuildOptions: the same fields, flags and
    pipeline as every other command), the tokenizer and the engine's bounds. runtime/driver.py's
    ``serve_model`` loads it. Picklable: Ray's replicas and actors build their engines from it."""

    tokenizer: str | Path | None = flag(None, metavar="tokenizer.json",
                                        help="a Hugging Face tokenizer.json (or its folder): text prompts, stop "
                                             "strings; its folder's tokenizer_config.json gives the chat template "
                                             "and the end-of-sequence token")
    max_batch: int = flag(8, type=int, metavar="N", help="sequences decoded together, the cache's slots (default 8)")
    max_queue: int = flag(64, type=int, metavar="N",
                          help="requests waiting for a slot; past it requests get 429 (default 64)")
    threads: int | None = flag(None, type=int, help="onnxruntime intra-op threads (default: all cores)")
    max_context: int | None = flag(None, type=int, metavar="N",
                                   help="positions per slot, prompt and new tokens together (default: the model's "
                                        "context); the cache is max-batch x N positions, allocated at start")
    prefill_chunk: int = flag(256, type=int, metavar="N", help=prefill_chunk_help(256))
    prefix_cache_mb: float = flag(0.0, type=float, metavar="MB",
                                  help="keep the keys and values of prompt prefixes (blocks of 16 positions) for later "
                                       "requests starting with the same tokens, in at most MB MiB, least recently "
                                       "used evicted first (default 0: off). See docs/serve.md")
    # issue 37: the execution provider and the precision, as generate's (device_for); on CUDA the engine's
    # model is compiled for CUDA, its KV cache kept on the device (serving/device_cache.py; docs/serve.md "On CUDA")
    provider: str = flag("auto", choices=list(PROVIDERS),
                         help="onnxruntime's execution provider: auto takes CUDA where the machine shows a GPU and "
                              "onnxruntime has its CUDA provider; on CUDA the model is compiled for CUDA and the "
                              "engine's KV cache is kept on the device, so a decoding step copies the token ids, "
                              "positions and lengths in and the logits out (docs/serve.md, On CUDA; --explain states the bytes) "
                              "(default auto)")
    dtype: str = flag("fp32", choices=list(DTYPES),
                      help="the precision a spec is compiled at: fp32, fp16, or bf16 on CUDA only (the KV cache "
                           "on the device in bf16, the logits cast to fp32 in the graph) (default fp32)")

    def check(self) -> None:
        ModelRef.check(self)
        BuildOptions.check(self)
        check_path("tokenizer", self.tokenizer)
        _whole("max_batch", self.max_batch, 1)
        _whole("max_queue", self.max_queue, 0)
        _whole("prefill_chunk", self.prefill_chunk, 1)
        _whole("threads", self.threads, 1, optional=True)
        _whole("max_context", self.max_context, 2, optional=True)
        check_choice("provider", self.provider, PROVIDERS)
        check_choice("dtype", self.dtype, DTYPES)
        if self.dtype == "bf16" and self.device != "cuda":
            raise UsageError(f"--dtype bf16 runs on CUDA only, and this engine runs on the CPU ({BF16_CPU}); use "
                             f"--provider cuda on a machine with a GPU, or --dtype fp32")
        if self.quantize == "w8a8" and self.provider == "cuda":
            raise UsageError("--quantize w8a8 runs onnxruntime's CPU integer GEMM (MatMulIntegerToFloat has no CUDA "
                             "kernel): use --provider cpu, or --quantize int8 / int4 on CUDA")
        mb = self.prefix_cache_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 <= mb < float("inf"):
            raise UsageError(f"--prefix-cache-mb must be a number of MiB >= 0, got {mb}")

    @property
    def model(self) -> ModelRef:
        """The model these options name, as the driver takes it."""
        return ModelRef(**{f.name: getattr(self, f.name) for f in fields(ModelRef)})

    def engine_pipeline_options(self, decode: str = "auto", last_only: bool = True, mixed: bool = True,
                                state: bool = False, prefix_keys: bool | None = None, check_tokens: int = 0):
        """The cached decoder the engine runs (driver.serve_model): the buffer cache (one row per slot),
        ``decode``'s kernels, the last position's logits (``last_only=False``: every position's, which
        serve --speculative checks drafts with) and with them the combined call (``mixed``: the engine's
        variant, compiler/backends/onnx/mixed_attention.py); ``state``: a decoder carrying recurrent
        state (the row engine's), or an encoder-decoder, compiled as ``generate`` compiles it (with
        ``check_tokens``: every position's logits in every call, as generate compiles --speculative's target).
        ``prefix_keys``: the gqa decoding step without its mask (passes/kv_cache.py CacheOptions.prefix_keys:
        seqlens_k alone, which assumes each row's keys are its columns 0..cache_length, none hidden -- true of
        the engine, whose rows fill their columns from 0, and of no left-padded batch); None: on CUDA, where it
        lets onnxruntime choose flash decoding (with the mask as attention_bias it chose MATH), and not on the
        CPU, whose kernel has no flash path (the variant is checked there against the masked step, tests/serving).
        ``check_tokens`` > 0 (serve --speculative: the drafts and the token before them): calls of at most that
        many tokens give every position's logits; with the combined call (the CPU) that is its ``short_logits``
        and everything else keeps last-position logits; without it (CUDA, or ``mixed=False``) every call gives
        every position's."""
        from tessera.compiler.passes.attention_kernels import Target
        from tessera.compiler.passes.pipeline import PipelineOptions

        target = Target(self.device, self.dtype)
        if state:  # the row engine's: every position's logits when it checks drafts (serving/row_speculation.py)
            return PipelineOptions(target, last_only=not check_tokens, **self.build_fields())
        # the combined call's CUDA lowering is not built (mixed_attention.py): on CUDA a chunk and a step are two calls
        if prefix_keys is None:
            prefix_keys = target.device == "cuda"
        combined = mixed and last_only and target.device != "cuda"
        if check_tokens and not combined:
            last_only = False
        return PipelineOptions(target, cache="buffer", decode=decode, last_only=last_only, mixed=combined,
                               short_logits=check_tokens if combined else 0, prefix_keys=prefix_keys,
                               **self.build_fields())

    @property
    def device(self) -> str:
        """Where the engine's model runs (``device_for``): cuda or cpu."""
        return device_for(self.provider)


# --allow-large as the commands that load a model without writing one word it (generate, serve, batch)
LOAD_ALLOW_LARGE = ("go ahead even when the weights look too large for the memory available (by default such a "
                    "model is refused before anything is allocated)")


def add_engine_arguments(p: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
    """The flags that fill EngineOptions (serve and batch): the model, its compile, the tokenizer and
    the engine's bounds, generated from the fields."""
    add_arguments(p, EngineOptions, {"allow_large": LOAD_ALLOW_LARGE, **(helps or {})})


PERPLEXITY_FORMATS = ("text", "json")


@dataclass(kw_only=True)
class PerplexityOptions(CompileCacheOptions, QuantOptions):
    """``tessera perplexity`` / ``Model.perplexity``: a causal language model's perplexity on a text file
    (runtime/driver.perplexity says which windows are scored)."""

    text: str | Path
    gguf_weights: str = gguf_weights_flag()
    tokenizer: str | Path | None = None
    context: int = 512
    stride: int | None = None
    provider: str = "auto"
    format: str = "text"
    quiet: bool = False

    def check(self) -> None:
        super().check()
        check_path(self.label("text"), self.text, optional=False)
        check_choice(self.label("gguf_weights"), self.gguf_weights, GGUF_WEIGHTS)
        check_path(self.label("tokenizer"), self.tokenizer)
        check_int(self.label("context"), self.context, minimum=4)
        check_int(self.label("stride"), self.stride, minimum=1, optional=True)
        if self.stride is not None and self.stride > self.context:
            raise UsageError(f"{self.flag('stride')} {self.stride} is longer than {self.flag('context')} "
                             f"{self.context}: the windows would skip tokens (a stride is at most the context)")
        check_choice(self.label("provider"), self.provider, PROVIDERS)
        check_choice(self.label("format"), self.format, PERPLEXITY_FORMATS)
        check_bool(self.label("quiet"), self.quiet)


CACHE_ACTIONS = ("list", "clear")


@dataclass(kw_only=True)
class CacheOptions(Options):
    """``tessera cache list|clear``: the compile cache's entries listed or removed (runtime/compile_cache.py)."""

    action: str = "list"
    compile_cache: str | Path | None = None
    format: str = "text"

    def check(self) -> None:
        check_choice("action", self.action, CACHE_ACTIONS)
        check_path(self.label("compile_cache"), self.compile_cache)
        check_choice(self.label("format"), self.format, ("text", "json"))


COMMANDS = {"compile": CompileOptions, "run": RunOptions, "report": ReportOptions, "generate": GenerateOptions,
            "perplexity": PerplexityOptions}
