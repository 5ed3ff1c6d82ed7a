"""Autoregressive generation with a KV cache: prefill once, then one token per step.

Why a loop of its own: running the whole sequence again for every new token
costs O(N²) work per token. The cached graph (compiler/passes/kv_cache.py) takes
the keys and values of the positions seen so far and returns those of the new
ones, so a decoding step costs one column of queries, keys and values plus
attention over the stored positions. One onnxruntime session serves prefill
(T = the padded prompt length) and decoding (T = 1).

The cache (buffer mode, the default) is preallocated per generation call at its
final length, prompt + max_new_tokens, as one numpy array per layer and
key/value, [B, kv_heads, capacity, hd]. onnxruntime reads contiguous numpy
inputs in place, so the buffers go in without a copy; each step's new columns
come back as small outputs and are written into their slots, and the attention
mask hides the slots not filled yet. Nothing is concatenated or copied per step
except the new columns (the ``concat`` mode, kept for comparison and used for
sliding windows, feeds back the growing present tensors instead, trimmed to the
window). The prompt itself runs against an empty past, so its attention is the
tiled prefill kernel over the prompt alone (compiler/backends/onnx/cached_attention.py).
When the graph's decoding steps are GroupQueryAttention (CacheInfo.length_input, the CPU
default), the buffers are bound once per call with IOBinding as both the past inputs and the
graph's buffer outputs (``BoundStep``): the kernel writes each step's new columns into them itself.

A batch of prompts of different lengths is left-padded: the mask marks the
padding, and each row's positions count only its real tokens (Hugging Face's
``position_ids = cumsum(mask) - 1``), so every row is decoded as if alone. A hybrid's recurrent state
(attention beside Mamba layers: Jamba) reads the same mask and leaves the padding out
(compiler/passes/state_padding.py, CacheInfo.padded_state); a state-only model (Mamba) has no mask,
so its uneven prompts run one row at a time (``_prefill_rows``).

Token choice (transformers' logits processors, in their order, and the log-probabilities) is
generation/sampling.py's, shared with the recurrent loop and the serving engine. Sampling draws from
a numpy Generator seeded once per call, so the same seed gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tessera.compiler import build as compiler_build
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.kv_cache import CacheInfo
from tessera.compiler.passes.pipeline import PipelineOptions

from tessera.runtime import metadata, pipeline
from tessera.runtime.bfloat16 import element_type, is_bf16, np_float, run_bound
from tessera.runtime.pipeline import UsageError, compiler_errors


from tessera.runtime.generation.decoding import decode_steps  # noqa: E402
from tessera.runtime.generation.sampling import Sampling, choose, process_logits  # noqa: E402,F401  (this module's API)


# ------------------------------------------------------------------ the compiled model
@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)
    cache_bytes: int = 0  # the KV cache the loop allocated (buffer mode: once, at its final length)
    # speculative decoding (generation/speculative.py): None when decoding plainly
    drafted: int | None = None       # tokens the drafter proposed
    accepted: int | None = None      # of those, tokens the target agreed with
    rounds: int | None = None        # verifying calls of the target
    round_tokens: int | None = None  # tokens those calls emitted (accepted drafts and the target's own)
    replays: int | None = None       # recurrent state: the calls that ran kept tokens again (rollback.replay)
    replayed_rows: int | None = None  # and the rows they ran

    @property
    def decode_tokens_per_s(self) -> float:
        total = sum(self.decode_s)
        return len(self.decode_s) / total if total else 0.0


@dataclass
class Result:
    tokens: list[list[int]]  # new tokens per prompt (a stop token, when hit, is the last)
    stats: Stats
    texts: list[str] | None = None


def is_ortvalue(value) -> bool:
    """Whether a feed is an onnxruntime OrtValue (an encoder's output kept on the device: Seq2Seq) rather than
    a host array; checked by type name so that nothing imports onnxruntime for it."""
    return type(value).__name__ == "OrtValue"


def bind_feed(io, name: str, value) -> None:
    """Bind one input on an IOBinding: an OrtValue as it is (on the device: no copy), a host array from host
    memory (copied to the device at the run when the session is on CUDA)."""
    if is_ortvalue(value):
        io.bind_ortvalue_input(name, value)
    else:
        io.bind_cpu_input(name, np.ascontiguousarray(value))


class CachedModel:
    """An onnxruntime session over a cached graph, with what the loop needs to feed it."""

    compile_cache = None  # how the compile cache served it (runtime/compile_cache.Lookup), where it went through one
    # generate's cache for a decoder stepping with the plain branch (CachedDecoder): None, on the device on CUDA
    # (runtime/device_cache.py), else numpy; True forces the device cache's path (on the CPU: the tests' check)
    device_cache: bool | None = None

    def __init__(self, source: str | bytes, info: CacheInfo, provider: str = "cpu", threads: int | None = None):
        from tessera.runtime.session import _ort, open_session  # session.py imports onnx (~0.6 s)

        self.info = info
        if threads and provider != "cuda":  # the thread count is the CPU provider's
            ort = _ort()
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.log_severity_level = 4
            self.session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        else:
            self.session = open_session(source, provider)
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}
        vocab = self.session.get_outputs()[0].shape[-1]
        self.vocab = int(vocab) if isinstance(vocab, int) else None
        self.np_dtype = np_float(info.dtype)  # bf16: ml_dtypes' bfloat16, crossing as tagged words (runtime/bfloat16.py)
        # on CUDA, a graph whose every layer writes its buffer in place keeps the cache on the device
        # (BoundStep): a decoding step then moves the new token ids in and the logits out, nothing else
        self.on_device = (self.session.get_providers()[0] == "CUDAExecutionProvider" and bool(info.length_input)
                          and all(layer.buffer_key for layer in info.layers) and not info.states)

    @classmethod
    def from_onnx(cls, path: str | Path, provider: str = "cpu", threads: int | None = None) -> "CachedModel":
        path = Path(path)
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise UsageError(f"{path} holds {len(found)} .onnx files; name the one to generate with")
            path = found[0]
        if not path.exists():
            raise UsageError(f"model file not found: {path}")
        from tessera.runtime.session import load_model_proto  # session.py imports onnx (~0.6 s)

        model = load_model_proto(path)  # a random, text or truncated file: a ModelFileError, as for run
        meta = {e.key: e.value for e in model.metadata_props}
        if CacheInfo.METADATA_KEY not in meta:
            raise UsageError(f"{path} was compiled without a KV cache; generate from the .tsr spec, or compile "
                             f"one with tessera.load(...).compile(out, kv_cache=True)")
        inits = {i.name for i in model.graph.initializer}
        info = metadata.cache_info(meta[CacheInfo.METADATA_KEY], path,
                                   {i.name for i in model.graph.input if i.name not in inits},
                                   {o.name for o in model.graph.output})
        return cls(str(path), info, provider, threads)

    def bind_step_inputs(self, io) -> bool:
        """Bind on ``io`` (a decoding step bound in place) ``cache_columns`` = False when the graph has the
        bound step's branch (compiler/backends/onnx/bound_step.py): the step then skips the cache column
        outputs it does not read. Returns whether it did (the graph then gives empty columns for the
        layers written in place). Looked up on the session each time (a bench may swap it)."""
        from tessera.compiler.backends.onnx.bound_step import INPUT  # imports onnx (~0.6 s)

        if INPUT not in {i.name for i in self.session.get_overridable_initializers()}:
            return False
        from tessera.runtime.session import _ort  # session.py imports onnx (~0.6 s)

        value = _ort().OrtValue.ortvalue_from_numpy(np.array(False))
        io.bind_ortvalue_input(INPUT, value)  # an initializer input: IOBinding takes it as an OrtValue only
        io._tessera_keep = value  # the OrtValue lives as long as the binding
        return True

    def run(self, feeds: dict[str, np.ndarray], bound: "BoundStep | None" = None) -> dict[str, np.ndarray]:
        """One step: through ``bound`` (the cache buffers bound in place, a decoding step of a graph whose
        attention writes them: info.length_input) or with numpy feeds and outputs."""
        from tessera.runtime.session import run_session  # session.py imports onnx (~0.6 s)

        if bound is not None:
            return bound.run(feeds)
        if any(is_ortvalue(v) for v in feeds.values()):  # an encoder's outputs on the device: bound as they are
            return self._run_binding(feeds)
        if is_bf16(self.np_dtype):  # onnxruntime's run takes and gives no numpy bfloat16: through IOBinding
            from tessera.runtime.session import RunError, ort_message

            try:
                return run_bound(self.session, feeds, self.output_names)
            except Exception as e:  # onnxruntime's own exception types
                raise RunError(f"onnxruntime could not run the model: {ort_message(e)}") from None
        return run_session(self.session, feeds)

    def _run_binding(self, feeds: dict) -> dict[str, np.ndarray]:
        """One call with some feeds OrtValues (Seq2Seq's fixed inputs): every input bound (``bind_feed``), every
        output to host memory (bf16 read back by ``host_array``)."""
        from tessera.runtime.bfloat16 import host_array, ortvalue
        from tessera.runtime.session import RunError, ort_message

        io, keep = self.session.io_binding(), []
        for name, value in feeds.items():
            if not is_ortvalue(value) and is_bf16(np.asarray(value).dtype):  # tagged words (runtime/bfloat16.py)
                keep.append(ortvalue(value))
                value = keep[-1]
            bind_feed(io, name, value)
        for name in self.output_names:
            io.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(io)
        except Exception as e:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime could not run the model: {ort_message(e)}") from None
        return {name: host_array(v) for name, v in zip(self.output_names, io.get_outputs())}


def cached_options(mode: str = "auto", dtype: str = "fp32", target=None, sparse_moe: bool = True,
                   fuse_linears: bool = True, decode: str = "auto", last_only: bool = True, quantize=None,
                   mixed: bool = False, skip_norm: bool = True, bound_step: bool = True, kv_cache_dtype: str = "auto",
                   grouped_decode: bool | None = None):
    """The cached_decoder pipeline's PipelineOptions from the keyword choices tests and benches name
    (``mode``: the cache, buffer or concat; ``target`` a passes.attention_kernels.Target, else the CPU
    at ``dtype``; ``quantize`` a QuantConfig; ``mixed`` the serving engine's combined call; ``skip_norm`` and ``bound_step`` the two passes after
    export, off only to measure them; ``kv_cache_dtype`` the cache's precision, passes/kv_cache_dtype.py;
    ``grouped_decode`` the bound step's grouped form over an fp16 cache, backends/onnx/grouped_decode.py: None,
    PipelineOptions' default)."""
    grouped = {} if grouped_decode is None else {"grouped_decode": grouped_decode}
    return PipelineOptions(target or Target("cpu", dtype), quantize=quantize, sparse_moe=sparse_moe, cache=mode,
                           decode=decode, last_only=last_only, fuse_linears=fuse_linears, mixed=mixed,
                           skip_norm=skip_norm, bound_step=bound_step, kv_cache_dtype=kv_cache_dtype, **grouped)


def compile_cached(built, weights, options=None, **choices):
    """The cached decoder of ``built`` (compiler/build.py's compile_cached, the ``cached_decoder``
    pipeline: quantise, fuse attention, make experts sparse, add the KV cache, fuse the linears sharing
    an input, lower the precision) as (onnx.ModelProto, CacheInfo). ``options``: a PipelineOptions
    (the driver's, from the typed options); else ``choices``, cached_options' keywords. Rewrites
    built.graph; records the attention sites (--explain) and the quantisation on ``built``."""
    options = options or cached_options(**choices)
    with compiler_errors():
        done = compiler_build.compile_cached(built.graph, weights, built.info, options)
    built.attention_sites, built.quantize = done.sites, options.quantize
    return done.model, done.info


class Seq2Seq:
    """An encoder-decoder for generation: the encoder part (run once per source batch: the encoder and
    every layer's cross-attention keys and values) and the cached decoder (compiler/passes/encdec.py).

    On CUDA the encoder runs with IOBinding and its outputs stay on the device as OrtValues, which every
    decoding step binds as they are (``bind_feed``): the decoder's fixed inputs (each layer's cross-attention
    keys and values, the source mask) cross from the host once per source batch, never per step."""

    # the encoder's outputs as OrtValues on the decoder's device: None, when the decoder runs on CUDA; True forces
    # them (on the CPU: CPU OrtValues, the tests' check that this path gives the numpy path's numbers), False never
    device_outputs: bool | None = None

    def __init__(self, encoder_source: str | bytes, decoder: CachedModel, boundary: list[str],
                 provider: str = "cpu"):
        from tessera.runtime.session import open_session  # session.py imports onnx (~0.6 s)

        self.encoder = open_session(encoder_source, provider)
        self.decoder = decoder
        self.boundary = boundary

    def keeps_on_device(self) -> bool:
        """Whether ``encode`` gives OrtValues: on CUDA (or forced), for a decoder whose steps all bind their feeds
        (not one carrying recurrent state, whose initial state is sliced per row on the host)."""
        from tessera.runtime.device_cache import session_device

        wanted = self.device_outputs
        if wanted is None:
            wanted = session_device(self.decoder.session)[0] == "cuda"
        return bool(wanted) and not self.decoder.info.states and not self.decoder.info.prefix_keys

    def encode(self, feeds: dict[str, np.ndarray]) -> dict:
        """The decoder's fixed inputs for a source batch: the encoder's outputs and the inputs both read
        (numpy arrays; OrtValues on the decoder's device where ``keeps_on_device``)."""
        from tessera.runtime.session import run_session  # session.py imports onnx (~0.6 s)

        enc_inputs = {i.name for i in self.encoder.get_inputs()}
        given = {k: v for k, v in feeds.items() if k in enc_inputs}
        if self.keeps_on_device():
            return self._encode_on_device(given, feeds)
        out = run_session(self.encoder, given)
        return {b: out[b] if b in out else feeds[b] for b in self.boundary}

    def _encode_on_device(self, given: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict:
        """The encoder through IOBinding, its outputs left where the decoder runs; the source inputs the decoder
        reads too (the source mask) copied there once."""
        from tessera.runtime.device_cache import session_device
        from tessera.runtime.session import RunError, _ort, ort_message

        device, device_id = session_device(self.decoder.session)
        io = self.encoder.io_binding()
        for name, value in given.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        names = [o.name for o in self.encoder.get_outputs()]
        for name in names:
            io.bind_output(name, device, device_id)
        try:
            self.encoder.run_with_iobinding(io)
        except Exception as e:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime could not run the encoder: {ort_message(e)}") from None
        out = dict(zip(names, io.get_outputs()))
        fixed = {}
        for b in self.boundary:
            if b in out:
                fixed[b] = out[b]
            else:  # a source input (token ids and their mask, float features): never bfloat16
                fixed[b] = _ort().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[b]), device, device_id)
        return fixed


def compile_seq2seq(built, weights, decoder_input: str, last_only: bool = True, max_positions: int = 4096,
                    options=None):
    """An encoder-decoder for generation (compiler/build.py's compile_seq2seq, the ``encoder_decoder``
    pipeline: fuse attention, split off the encoder part, add the KV cache to the decoder): returns
    (encoder ModelProto, decoder ModelProto, CacheInfo, boundary value names). ``options``: a
    PipelineOptions (the quantisation, the cache mode), its decoder input and the rest filled in here."""
    options = dataclasses.replace(options or PipelineOptions(), decoder_input=decoder_input, last_only=last_only,
                                  max_positions=max_positions)
    with compiler_errors():
        done = compiler_build.compile_seq2seq(built.graph, weights, options, built.info)
    built.quantize = options.quantize
    return done.encoder, done.decoder, done.info, done.boundary


# ------------------------------------------------------------------ the loop
def _check_prompts(prompts, vocab: int | None) -> list[list[int]]:
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise UsageError("no prompt given")
    if all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        p = list(p.tolist() if isinstance(p, np.ndarray) else p)
        if not p:
            raise UsageError(f"prompt {i} is empty: generation needs at least one token to start from")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise UsageError(f"prompt {i} must be a list of integer token ids")
        bad = [t for t in p if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise UsageError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab})")
        out.append([int(t) for t in p])
    return out


def check_request(model: CachedModel, prompts, max_new_tokens: int, sampling: Sampling,
                  stop_tokens=()) -> list[list[int]]:
    """Every user error before anything runs; returns the prompts as lists of ids."""
    prompts = _check_prompts(prompts, model.vocab)
    sampling.check()
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    ctx = model.info.context
    if ctx is None and longest + max_new_tokens > NO_CONTEXT_CAP:
        raise UsageError(f"max_new_tokens={max_new_tokens}: the model declares no context length (a sliding window "
                         f"or positions without a trained bound), so generation is capped at {NO_CONTEXT_CAP:,} "
                         f"positions (prompt and new tokens); the prompt has {longest}, so at most "
                         f"{max(NO_CONTEXT_CAP - longest, 0):,} new tokens")
    if ctx is not None:
        if longest > ctx:
            raise UsageError(f"the prompt has {longest} tokens, longer than the model's context of {ctx} positions")
        if longest + max_new_tokens > ctx:
            raise UsageError(f"max_new_tokens={max_new_tokens} goes past the context: the prompt has {longest} "
                             f"tokens and the model has {ctx} positions, so at most {ctx - longest} new tokens")
    if model.info.states and model.info.layers and not model.info.padded_state and len({len(p) for p in prompts}) > 1:
        raise UsageError("this model carries recurrent state beside its attention, and its compiled decoder does not "
                         "keep left padding out of that state (a file compiled before Tessera did): prompts of "
                         "different lengths would run their padding through the recurrence, so give prompts of one "
                         "length (or one prompt at a time), or compile it again with --kv-cache")
    for t in stop_tokens:
        if not isinstance(t, (int, np.integer)) or t < 0 or (model.vocab is not None and t >= model.vocab):
            raise UsageError(f"unknown stop token {t}: ids are in [0, {model.vocab})")
    check_cache_fits(model.info, len(prompts), longest + max_new_tokens, np.dtype(model.np_dtype).itemsize)
    return prompts


NO_CONTEXT_CAP = 1 << 16
"""Positions (prompt and new tokens) a model that declares no context may generate to: without it a
sliding-window model (its cache trimmed to the window) would decode max_new_tokens=10**9 steps."""


def cache_bytes(info: CacheInfo, rows: int, positions: int, itemsize: int) -> int:
    """The KV cache's bytes for ``rows`` sequences of ``positions`` (a concat cache trimmed to a sliding
    window holds at most the window)."""
    window = cache_window(info)
    kept = min(positions, window) if window and info.mode == "concat" else positions
    states = sum(rows * int(np.prod(s.shape)) for s in info.states)  # recurrent state: fixed, whatever the length
    return (sum(rows * layer.kv_heads * kept * (layer.head_size + layer.value_size) for layer in info.layers)
            + states) * itemsize


def check_cache_fits(info: CacheInfo, rows: int, positions: int, itemsize: int, what: str = "the KV cache") -> None:
    """Refuse, before anything is allocated, a cache larger than the memory available, with its size
    (numpy's MemoryError would come after the prompt was run, or never: the allocation may be lazy)."""
    need, avail = cache_bytes(info, rows, positions, itemsize), pipeline.available_memory()
    if avail is not None and need > avail:
        raise UsageError(f"{what} for {rows} sequence(s) of {positions:,} positions is {need:,} bytes "
                         f"({need / 2**30:,.1f} GiB, {len(info.layers)} layers), more than the {avail:,} bytes "
                         f"({avail / 2**30:,.1f} GiB) of memory available; ask for fewer new tokens or prompts")


def cache_window(info: CacheInfo) -> int:
    """How many past positions the cache must keep: every position (0), or the sliding window when
    every cached layer has the same one (a query then sees at most the window's last keys, so older
    columns can go; the mask's causal offset counts the kept columns, so it stays right). Models
    mixing windowed and full layers keep everything: their layers share one attention mask."""
    windows = {layer.window for layer in info.layers}
    return windows.pop() if len(windows) == 1 and info.mode == "concat" else 0


class BoundStep:
    """A decoding step whose GroupQueryAttention writes the new keys and values into the cache
    buffers itself: the buffers are bound once with IOBinding as both the past inputs and the
    graph's buffer outputs (``cache_key.{i}``: onnxruntime then sees one memory and shares it), the
    logits and the new columns go to arrays of their own, and each step binds only its inputs. No
    step copies or reallocates the cache. A layer the kernel chooser left without a buffer output (a
    model mixing head sizes: GroupQueryAttention takes multiples of 8 only) reads its bound buffer
    as its past, and its one new column is copied in after the step."""

    def __init__(self, model: CachedModel, cache: dict[str, np.ndarray]):
        from tessera.runtime.session import _ort  # session.py imports onnx (~0.6 s)

        self.model, self.io = model, model.session.io_binding()
        info = model.info
        self.cache, self.copied = cache, [layer for layer in info.layers if not layer.buffer_key]
        # on the device (CachedModel.on_device): each buffer is one device OrtValue, bound as the past input
        # and as the buffer output (one memory: the kernel writes the new column there); ``upload`` puts the
        # prompt's columns in once, after the prompt ran with host arrays
        self.device = {}
        for layer in info.layers:
            for past, out in ((layer.past_key, layer.buffer_key), (layer.past_value, layer.buffer_value)):
                buf = cache[past]
                elem = element_type(buf.dtype)  # bf16: the ONNX type, an int (runtime/bfloat16.py)
                if model.on_device:
                    dev = self.device[past] = _ort().OrtValue.ortvalue_from_shape_and_type(list(buf.shape), elem,
                                                                                           "cuda", 0)
                    self.io.bind_ortvalue_input(past, dev)
                    self.io.bind_output(out, "cuda", 0, elem, list(buf.shape), dev.data_ptr())
                    continue
                self.io.bind_input(past, "cpu", 0, elem, list(buf.shape), buf.ctypes.data)
                if out:  # bound with an empty name, onnxruntime fails ("Failed to find NodeArg with name: ")
                    self.io.bind_output(out, "cpu", 0, elem, list(buf.shape), buf.ctypes.data)
        self.buffers = set(cache)
        self.fixed = {}  # OrtValue feeds bound (an encoder's outputs), by name
        self.outputs: dict[str, np.ndarray] = {}
        b = next(iter(cache.values())).shape[0]
        shapes = {info.logits: (b, 1, model.vocab)}
        skips = model.bind_step_inputs(self.io)  # then the graph gives no columns for the layers written in place
        for layer in self.copied if skips else info.layers:
            shapes[layer.present_key] = (b, layer.kv_heads, 1, layer.head_size)
            shapes[layer.present_value] = (b, layer.kv_heads, 1, layer.value_size)
        for state in info.states:  # recurrent state (a hybrid model's): returned, fed back by the decoder
            shapes[state.present] = (b, *state.shape)
        for name, shape in shapes.items():
            if None in shape:
                raise UsageError(f"cannot bind output {name}: its size is not known ({shape})")
            arr = np.empty(shape, dtype=np.float32 if name == info.logits else model.np_dtype)
            if model.on_device and name != info.logits:  # the new columns, written in the buffers: left there
                self.device[name] = _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), element_type(arr.dtype),
                                                                                 "cuda", 0)
                self.io.bind_ortvalue_output(name, self.device[name])
                continue
            self.io.bind_output(name, "cpu", 0, element_type(arr.dtype), list(arr.shape), arr.ctypes.data)
            self.outputs[name] = arr
        self.logits = info.logits

    def upload(self) -> None:
        """The host cache (the prompt's columns written in) copied once into the device buffers."""
        for past, dev in self.device.items():
            if past in self.cache:  # bf16: its words (update_inplace takes no numpy bfloat16)
                host = self.cache[past]
                dev.update_inplace(host.view(np.uint16) if is_bf16(host.dtype) else host)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One decoding step; returns the logits (a copy: the bound array is reused by the next step)."""
        from tessera.runtime.session import RunError, ort_message  # session.py imports onnx (~0.6 s)

        for name, value in feeds.items():
            if name in self.buffers:  # the buffers stay bound; the step's tokens, mask, positions rebind
                continue
            if is_ortvalue(value):  # an encoder's output on the device (Seq2Seq): bound once, read by every step
                if self.fixed.get(name) is not value:
                    self.io.bind_ortvalue_input(name, value)
                    self.fixed[name] = value
                continue
            self.io.bind_cpu_input(name, np.ascontiguousarray(value))
        try:
            self.model.session.run_with_iobinding(self.io)
        except Exception as e:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime could not run a decoding step: {ort_message(e)}") from None
        if self.copied:
            at = int(feeds[self.model.info.length_input][0])  # the slot this step's column goes to
            for layer in self.copied:
                self.cache[layer.past_key][:, :, at:at + 1] = self.outputs[layer.present_key]
                self.cache[layer.past_value][:, :, at:at + 1] = self.outputs[layer.present_value]
        out = {self.logits: self.outputs[self.logits].copy()}
        out.update({s.present: self.outputs[s.present].copy() for s in self.model.info.states})
        return out


class CachedDecoder:
    """The KV-cached model as a decoding.Decoder: the first step runs the left-padded prompts (against
    an empty past), each later one the last tokens against the cache, which it keeps (buffer: written
    in place or by the bound kernel; concat: the present tensors fed back, trimmed to a sliding window)."""

    # a plain-branch decoder on CUDA keeps its cache on the device (runtime/device_cache.py); a subclass that
    # edits the host cache itself (rollback.py's RollbackCache) does not
    plain_device_cache = True
    # the bound step's buffers on the device (CachedModel.on_device); a subclass whose calls all run on its host
    # cache (rollback.py's RollbackCache) allocates none
    bound_on_device = True

    def __init__(self, model: CachedModel, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                 stats: Stats, extra_feeds: dict[str, np.ndarray] | None = None):
        info = model.info
        self.model, self.info, self.stats, self.extra_feeds = model, info, stats, extra_feeds or {}
        b, t0 = len(prompts), max(len(p) for p in prompts)
        # a decoder whose decoding step has no mask (prefix_keys: each row's keys are its columns 0..cache_length,
        # seqlens_k alone; compiler/backends/onnx/attention.py PREFIX_KEYS_ASSUMES) gets the serving engine's
        # layout: each row's prompt from column 0 (run row by row), its own length, no left padding
        self.by_row = bool(info.prefix_keys)
        self.rows = b
        ids = np.full((b, t0), pad_id, dtype=np.int64)
        mask = np.zeros((b, t0), dtype=np.int64)
        for r, p in enumerate(prompts):
            ids[r, t0 - len(p):] = p
            mask[r, t0 - len(p):] = 1
        self.tokens, self.mask = ids, mask
        # every token so far, left-padded, and its mask: a longrope model (info.length_switch) runs them
        # all again at the step that takes the batch past its switch (restart); kept only until then
        self.history = (ids, mask) if info.length_switch and t0 <= info.length_switch else None
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)  # real tokens per row so far
        self.buffer = info.mode == "buffer"
        self.window = cache_window(info)
        capacity = t0 + max_new_tokens
        self.cache: dict[str, np.ndarray] = {}
        for layer in info.layers:
            for name, size in ((layer.past_key, layer.head_size), (layer.past_value, layer.value_size)):
                self.cache[name] = np.zeros((b, layer.kv_heads, capacity if self.buffer else 0, size),
                                            dtype=model.np_dtype)
        self.slots = np.zeros((b, capacity if self.buffer else 0), dtype=np.int64)  # mask of the cache's slots
        stats.cache_bytes = sum(c.nbytes for c in self.cache.values()) + sum(
            int(np.prod(s.shape)) * b * np.dtype(model.np_dtype).itemsize for s in info.states)
        self.filled = 0
        self.positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        # The prompt goes in against an empty past (P = 0): its attention is the tiled prefill kernel over
        # the prompt alone, not over the whole (still empty) buffer; its keys and values then fill the
        # buffer's first slots, and every later step reads the buffer in place.
        self.empty = {name: np.zeros(c.shape[:2] + (0,) + c.shape[3:], dtype=c.dtype) for name, c in self.cache.items()}
        self.bound = BoundStep(model, self.cache) if self.buffer and info.length_input and (
            self.bound_on_device or not model.on_device) else None
        # fp32 on CUDA: the plain branch (no fp32 CUDA GroupQueryAttention) over a device cache (runtime/device_cache.py):
        # the past bound from it, each step's new columns left on the device and written in by its graphs
        self.device = None
        on_cuda = model.session.get_providers()[0] == "CUDAExecutionProvider"
        if self.plain_device_cache and self.buffer and not info.length_input and not info.states and info.layers \
                and (on_cuda if model.device_cache is None else model.device_cache):
            from tessera.runtime.device_cache import DeviceCache

            dims = {}
            for layer in info.layers:
                dims[layer.past_key] = (layer.kv_heads, layer.head_size)
                dims[layer.past_value] = (layer.kv_heads, layer.value_size)
            self.device = DeviceCache(model.session, dims, b, capacity, model.np_dtype)
        self.first = True
        # recurrent state (compiler/passes/recurrent_state.py): zeros before the prompt, then each call's
        # present fed back as the next call's past
        self.states = self._initial_states()
        self.prompts = prompts
        if self.by_row and (self.bound is None or self.bound.copied or self.states):
            raise UsageError("this decoder was compiled for the serving engine's layout (its decoding step has no "
                             "mask: prefix_keys), which generate runs only with every layer's cache written in place "
                             "by GroupQueryAttention and no recurrent state; compile it without the engine's variant")

    def _initial_states(self) -> dict[str, np.ndarray]:
        b, dtype = self.rows, self.model.np_dtype
        return {s.past: (np.ascontiguousarray(self.extra_feeds[s.initial], dtype=dtype)
                         if s.initial else np.zeros((b, *s.shape), dtype=dtype)) for s in self.info.states}

    def _restart(self) -> None:
        """Forget the cache and make this step run every token so far against an empty past, as the
        prompt ran: a longrope model's frequencies switch once the sequence passes info.length_switch,
        so the keys cached before, rotated with the short factors, would be wrong (transformers'
        Phi3ForCausalLM drops its cache at that step too)."""
        ids, mask = self.history
        self.tokens, self.mask = ids, mask
        self.positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        self.first, self.filled = True, 0
        self.slots = np.zeros_like(self.slots) if self.buffer else np.zeros((self.rows, 0), dtype=np.int64)
        if not self.buffer:
            for name, empty in self.empty.items():
                self.cache[name] = empty
        self.states = self._initial_states()

    def step(self, last: np.ndarray | None) -> np.ndarray:
        info, cache = self.info, self.cache
        if self.by_row:
            return self._step_by_row(last)
        if self.first and self.states and not info.padded_state and len(set(self.lengths.tolist())) > 1:
            return self._prefill_rows()
        if last is not None:
            self.tokens = last[:, None].astype(np.int64)
            self.mask = np.ones((self.rows, 1), dtype=np.int64)
            self.positions = self.lengths[:, None].copy()
            self.lengths += 1
            if self.history is not None:
                self.history = (np.concatenate([self.history[0], self.tokens], axis=1),
                                np.concatenate([self.history[1], self.mask], axis=1))
                # the batch's longest row passes the switch at this step (transformers: max(position_ids) + 1)
                if self.positions.max() + 1 > info.length_switch >= self.positions.max():
                    self._restart()
                    self.history = None
        tokens, mask = self.tokens, self.mask
        t = tokens.shape[1]
        prefill = self.first and self.buffer
        self.first = False
        feeds = {info.tokens: tokens, "position_ids": self.positions, **(self.empty if prefill else cache),
                 **self.states, **self.extra_feeds}
        if "attention_mask" in self.model.input_names:  # a model with recurrent state only has no mask
            feeds["attention_mask"] = mask if prefill else np.concatenate([self.slots, mask], axis=1)
        if info.length_input:
            feeds[info.length_input] = np.array([0 if prefill else self.filled], dtype=np.int64)
        if "decode_mask" in self.model.input_names:  # CUDA: the filled slots and the new column (their count is
            feeds["decode_mask"] = (np.ones((self.rows, 1), np.int64) if prefill  # the kernel's total length)
                                    else np.concatenate([self.slots[:, :self.filled], mask], axis=1))
        if "decode_span" in self.model.input_names:  # the same count without the mask (prefix_keys: one length)
            feeds["decode_span"] = np.zeros((0, 1 if prefill else self.filled + 1), np.int64)
        if self.bound is not None and not prefill:  # the kernel writes the new columns into the buffers itself
            out = self.model.run(feeds, bound=self.bound)
        elif self.device is not None:  # the plain branch over the device cache: its columns written in there
            out = self._run_on_device(feeds, prefill)
            for r in range(self.rows):
                self.device.put(r, self.device.capacity, self.filled, out["presents"], r, 0, t)
        else:
            out = self.model.run(feeds)
            filled = self.filled
            for layer in info.layers:
                if self.buffer:
                    cache[layer.past_key][:, :, filled:filled + t] = out[layer.present_key]
                    cache[layer.past_value][:, :, filled:filled + t] = out[layer.present_value]
                else:
                    cache[layer.past_key], cache[layer.past_value] = out[layer.present_key], out[layer.present_value]
            if self.bound is not None and self.model.on_device:  # the prompt's columns to the device, once
                self.bound.upload()
        if self.buffer:
            self.slots[:, self.filled:self.filled + t] = mask
        else:
            self.slots = np.concatenate([self.slots, mask], axis=1)
            if self.window and self.slots.shape[1] > self.window:  # a sliding window keeps only its window
                self.slots = self.slots[:, -self.window:]
                for layer in info.layers:
                    for name in (layer.past_key, layer.past_value):
                        cache[name] = np.ascontiguousarray(cache[name][:, :, -self.window:])
            self.stats.cache_bytes = max(self.stats.cache_bytes, sum(c.nbytes for c in cache.values()))
        self.filled += t
        for state in info.states:
            self.states[state.past] = out[state.present]
        return out[info.logits][:, -1, :]

    def _run_on_device(self, feeds: dict[str, np.ndarray], prefill: bool) -> dict:
        """One call with the past bound from the device cache (empty for the prompt: P = 0), the logits to the
        host and the new keys and values left on the device (``presents``, by past name, for ``put``)."""
        from tessera.runtime.session import RunError, ort_message

        dc, info = self.device, self.info
        io = self.model.session.io_binding()
        io.bind_output(info.logits, "cpu")
        for layer in info.layers:
            for name in (layer.present_key, layer.present_value):
                io.bind_output(name, dc.device, dc.device_id)
        for name in dc.names:
            if prefill:
                kv, hd = dc.dims[name]
                io.bind_input(name, dc.device, dc.device_id, dc.elem, [self.rows, kv, 0, hd], dc.flat[name].data_ptr())
            else:
                dc.bind(io, name, 0, self.rows, dc.capacity)
        for name, value in feeds.items():
            if name not in dc.dims:
                bind_feed(io, name, value)  # an encoder's outputs as the device OrtValues they are
        try:
            self.model.session.run_with_iobinding(io)
        except Exception as e:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime could not run {'the prompt' if prefill else 'a decoding step'}: "
                           f"{ort_message(e)}") from None
        outs = io.get_outputs()
        presents = {}
        for i, layer in enumerate(info.layers):
            presents[layer.past_key], presents[layer.past_value] = outs[1 + 2 * i], outs[2 + 2 * i]
        return {info.logits: outs[0].numpy(), "presents": presents}

    def _step_by_row(self, last: np.ndarray | None) -> np.ndarray:
        """A step of the engine's layout (``by_row``): the prompts one row at a time, each from column 0 against
        an empty past, its keys and values written into its row; then every row's token at its own column
        (cache_length per row), written in place by GroupQueryAttention (the bound step), no mask read."""
        info, cache = self.info, self.cache
        if self.first:
            self.first = False
            logits = []
            for r, p in enumerate(self.prompts):
                n = len(p)
                feeds = {info.tokens: np.array([p], dtype=np.int64), "position_ids": np.arange(n, dtype=np.int64)[None],
                         **{k: v[:1] for k, v in self.empty.items()},
                         **{k: v[r:r + 1] for k, v in self.extra_feeds.items()}}
                self._by_row_feeds(feeds, np.ones((1, n), dtype=np.int64), np.zeros(1, dtype=np.int64), 1)
                out = self.model.run(feeds)
                for layer in info.layers:
                    cache[layer.past_key][r, :, :n] = out[layer.present_key][0]
                    cache[layer.past_value][r, :, :n] = out[layer.present_value][0]
                self.slots[r, :n] = 1
                logits.append(out[info.logits][:, -1, :])
            if self.bound is not None and self.model.on_device:  # the prompts' columns to the device, once
                self.bound.upload()
            self.filled = int(self.lengths.max())
            return np.concatenate(logits, axis=0)
        rows = np.arange(self.rows)
        # as the engine's step: the past's slots and the new token's column, and each row's column where the kernel
        # writes it (a last column of 0 would mark the engine's combined call, backends/onnx/mixed_attention.py)
        mask = np.concatenate([self.slots, np.ones((self.rows, 1), dtype=np.int64)], axis=1)
        mask[rows, self.lengths] = 1
        feeds = {info.tokens: last[:, None].astype(np.int64), "position_ids": self.lengths[:, None].copy(),
                 **cache, **self.extra_feeds}
        self._by_row_feeds(feeds, mask, self.lengths.copy(), int(self.lengths.max()) + 1)
        out = self.model.run(feeds, bound=self.bound)
        self.slots[rows, self.lengths] = 1
        self.lengths += 1
        self.filled = int(self.lengths.max())
        return out[info.logits][:, -1, :]

    def _by_row_feeds(self, feeds: dict, mask: np.ndarray, lengths: np.ndarray, width: int) -> None:
        """The by-row layout's other inputs, where the graph has them: the attention mask (the CPU variant's
        prompt branch reads it), cache_length per row, decode_span's width (CUDA: the kernel's total length)."""
        names = self.model.input_names
        if "attention_mask" in names:
            feeds["attention_mask"] = mask
        feeds[self.info.length_input] = lengths
        if "decode_span" in names:
            feeds["decode_span"] = np.zeros((0, width), dtype=np.int64)

    def _prefill_rows(self) -> np.ndarray:
        """Prompts of uneven length for a model with recurrent state and no attention mask (a hybrid's
        decoder keeps the padding out of its state itself, info.padded_state: compiler/passes/state_padding.py):
        left padding would run the pad tokens through the recurrence, so each prompt runs alone, unpadded,
        and the rows' states are stacked."""
        info, rows, logits = self.info, [], []
        for r, p in enumerate(self.prompts):
            feeds = {info.tokens: np.array([p], dtype=np.int64),
                     "position_ids": np.arange(len(p), dtype=np.int64)[None],
                     **{k: v[r:r + 1] for k, v in self.states.items()},
                     **{k: v[r:r + 1] for k, v in self.extra_feeds.items()}}
            out = self.model.run(feeds)
            rows.append(out)
            logits.append(out[info.logits][:, -1, :])
        for state in info.states:
            self.states[state.past] = np.concatenate([o[state.present] for o in rows], axis=0)
        self.first = False
        self.filled = max(len(p) for p in self.prompts)
        return np.concatenate(logits, axis=0)


def stream(model: CachedModel, prompts, max_new_tokens: int, sampling: Sampling | None = None,
           stop_tokens=(), pad_id: int = 0, stats: Stats | None = None,
           should_stop: Callable[[int, list[int]], bool] | None = None,
           on_logits: Callable[[int, np.ndarray], None] | None = None,
           extra_feeds: dict[str, np.ndarray] | None = None,
           logprobs: list[list[dict]] | None = None, masks: list | None = None) -> Iterator[list[int | None]]:
    """Yield, step by step, the new token of every prompt (None for prompts already finished).

    ``should_stop(row, tokens so far)`` may end a row (e.g. on a stop text); ``on_logits(step, logits
    [B, V])`` sees the scores each token was chosen from (tests compare them with a full recomputation);
    ``extra_feeds`` go to every step unchanged (an encoder-decoder's encoder outputs, see Seq2Seq);
    ``logprobs`` (one list per prompt) gets each token's log-probabilities (``sampling.logprobs``).
    The loop itself is generation/decoding.py's, shared with the recurrent decoder."""
    sampling = sampling or Sampling()
    prompts = check_request(model, prompts, max_new_tokens, sampling, stop_tokens)
    stats = stats if stats is not None else Stats()
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = np.zeros((len(prompts), model.vocab), dtype=bool)
        for r, p in enumerate(prompts):
            seen[r, p] = True
    stats.prompt_tokens = sum(len(p) for p in prompts)
    decoder = CachedDecoder(model, prompts, max_new_tokens, pad_id, stats, extra_feeds)
    return decode_steps(decoder, max_new_tokens, sampling, stop_tokens, stats, should_stop, on_logits, seen, pad_id,
                        prompts=prompts, logprobs=logprobs, masks=masks)


def generate(model: CachedModel, prompts, max_new_tokens: int, sampling: Sampling | None = None,
             stop_tokens=(), **kw) -> Result:
    """Run the loop to the end; returns the new tokens of every prompt and the timings."""
    stats = Stats()
    out: list[list[int]] | None = None
    for emitted in stream(model, prompts, max_new_tokens, sampling, stop_tokens, stats=stats, **kw):
        if out is None:
            out = [[] for _ in emitted]
        for r, tok in enumerate(emitted):
            if tok is not None:
                out[r].append(tok)
    return Result(out or [], stats)


# ------------------------------------------------------------------ text in, text out
def encode_prompts(tokenizer, texts: list[str], chat=None) -> list[list[int]]:
    """The prompts' ids; with ``chat`` (io/chat_template.ChatTemplate) each text is the user's message,
    rendered by the template and encoded as transformers' apply_chat_template does."""
    if not texts:
        raise UsageError("no prompt given")
    for i, t in enumerate(texts):
        if not t:
            raise UsageError(f"prompt {i} is empty: generation needs at least one token to start from")
    tokenizer.no_padding()
    if chat is not None:
        ids = [chat.encode(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    else:
        ids = [e.ids for e in tokenizer.encode_batch(list(texts))]
    for i, p in enumerate(ids):
        if not p:
            raise UsageError(f"the tokenizer produced no tokens for prompt {i}")
    return ids


def stop_token_ids(tokenizer, texts: list[str]) -> list[int]:
    """Stop strings that are single tokens of the vocabulary (e.g. <|endoftext|>) as ids; the rest stay text."""
    out = []
    for t in texts:
        tid = tokenizer.token_to_id(t) if tokenizer is not None else None
        if tid is not None:
            out.append(int(tid))
    return out


def progress(stats: Stats, file=sys.stderr) -> None:
    total = sum(stats.decode_s)
    print(f"\r{stats.new_tokens} tokens, prefill {stats.prefill_s * 1e3:.0f} ms, decode "
          f"{(len(stats.decode_s) / total) if total else 0:.1f} tok/s", end="", file=file, flush=True)
