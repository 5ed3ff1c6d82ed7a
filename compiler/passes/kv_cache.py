"""Cache-aware compilation: turn a fused decoder-only graph into its KV-cached form.

Why: to generate, a decoder computes the scores of the next token, picks one,
appends it and repeats. The keys and values of earlier positions do not change
when a token is appended, so they are kept (the KV cache) and each new token
costs one column of queries, keys and values plus attention over the stored
positions, instead of recomputing the whole sequence. The cached form is
derived from the spec's own graph, after attention fusion, so no spec has to
be written twice: every causal ``fused_attention`` node is a cache site.

The rewrite is seven passes (``cache_passes``, run in order by the cached
pipelines of passes/pipeline.py, or alone by ``add_kv_cache``): kv-cache-inputs,
kv-cache-position-bias, kv-cache-position-factor, kv-cache-positions, kv-cache-layers,
kv-cache-kernels, last-position-logits. Each
reads its options and the graph, never another pass's state; ``cache_info``
assembles the runtime's CacheInfo from their notes. With P the number of cached
positions and T the number of new ones (the prompt at prefill, 1 when decoding):

- new inputs ``attention_mask`` i64 [B, P+T] (1 = a real token, 0 = padding:
  prompts of uneven length are left-padded), ``position_ids`` i64 [B, T], and per
  attention layer ``past_key.{i}`` / ``past_value.{i}`` [B, kv_heads, P, hd]
  (grouped-query attention caches its kv_heads, not the query heads);
- new outputs per layer: in ``buffer`` mode (the default) ``key.{i}`` / ``value.{i}``
  [B, kv_heads, T, hd], the new columns only, which the runtime writes into a
  preallocated cache (the past inputs are then the whole buffer, unfilled slots
  masked); in ``concat`` mode ``present_key.{i}`` / ``present_value.{i}``
  [B, kv_heads, P+T, hd] = concat(past, new), fed back as the next past;
- positions: ``embedding(arange(T), ...)`` (GPT-2's learned table) reads
  ``position_ids`` instead, and every ``rope`` node takes them as a second input
  (with and without Llama 3.1's frequency scaling) -- so positions stay right
  with P > 0 and with left padding;
- score biases computed from the positions (T5's relative position bias, from
  ``arange(T)`` as query and key positions): computed at ``position_ids`` and at
  the keys' positions, the attention mask's running count (passes/position_bias.py),
  [B, heads, T, P+T]; any other score bias is refused;
- factors computed from the query positions (Llama 4's attention temperature, from
  ``arange(T)``, applied pointwise along the activations' token axis): computed at
  ``position_ids`` (passes/position_factor.py); any other use of ``arange(T)`` than
  these three is refused with the reason;
- masks: every attention keeps its causal flag and window (the queries are the
  last T of the P+T keys) and takes ``attention_mask`` as its key padding, which
  also hides a buffer's unfilled slots; a spec's own key padding mask input (``in mask: i64[B, T]``
  handed to its attention as ``mask=``) is replaced by it and dropped (passes/spec_mask.py, which
  refuses any other use of an extra input, naming the node);
- ``last_only``: the output head is applied to the last position only (logits
  [B, 1, vocab]), which is all a decoding step needs.

The attention nodes are lowered per phase (backends/onnx/cached_attention.py,
chosen by passes/attention_kernels.py ``choose_cached``): a prompt (T > 1) by the
portable tiled kernel, a decoding step (T = 1) in buffer mode on CPU by one
GroupQueryAttention that writes the new column into the buffer itself (``decode``
"gqa": an input ``cache_length`` i64 [1] or [B], the filled slots, one for every row
or one per row, and per layer the ONNX outputs ``cache_key.{i}`` / ``cache_value.{i}``, the buffer as written, which the
loop binds to the same memory as the past inputs), else by plain matrix products
over the cache; the numpy interpreter runs the rewritten graph unchanged (it does
not read ``cache_length``), which is what the tests compare against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node, TensorType
from tessera.compiler.ir.graph import numpy_dtype
from tessera.compiler.ir.graph import SymbolSource
from tessera.compiler import ops
from tessera.compiler.passes.attention_kernels import Target, cached_prefill, choose_cached, unsupported
from tessera.compiler.patterns.positions import NotAffine, affine_reads, positions_reached
from tessera.compiler.reference.numerics import longrope_parts, sinusoidal_table
from tessera.compiler.passes.base import Pass, PassError, PassManager, PassResult, PipelineResult
from tessera.compiler.passes import cache_schema, spec_mask
from tessera.compiler.passes.cache_parts import CACHE_DTYPES, CacheError, CacheState, insert_before as _insert_before
from tessera.compiler.passes.cache_schema import Kind, json
from tessera.compiler.passes.position_bias import CachedPositionBiasPass, grid_or_refuse
from tessera.compiler.passes.position_factor import CachedPositionFactorPass
from tessera.compiler.patterns.position_grid import bias_input
from tessera.compiler.passes.recurrent_state import carries_state, carry_state, check_state

MASK, POSITIONS = "attention_mask", "position_ids"
LENGTH = "cache_length"  # buffer mode with GroupQueryAttention decoding: the filled slots, i64 [1] or [B]
LENGTH_ROWS = "length_rows"  # its size: 1 (one length for every row, generate) or B (one per row, serving)
# CUDA (fp16): the decoding step's mask of the filled slots and the new column, i64 [B, DECODE_WIDTH]; its width
# is GroupQueryAttention's total length, kept on the host (backends/onnx/cached_attention.py _gqa_inputs_on_device)
DECODE_MASK, DECODE_WIDTH = "decode_mask", "decode_width"
# CUDA, the serving engine's variant without the mask (prefix_keys): i64 [0, DECODE_WIDTH], no values, only its width
# read (the kernel's total length, on the host); as decode_mask's values no longer matter, none are copied to the device
DECODE_SPAN = "decode_span"
PREFIX_KEYS_REASON = ("decode without its mask (the serving engine's variant, prefix_keys): seqlens_k alone says each "
                      "row's keys, its columns 0..cache_length, none hidden (the engine fills rows from column 0), so "
                      "no attention_bias and onnxruntime's CUDA kernel may choose flash decoding")


@dataclass
class CacheLayer:
    """One attention layer's cache: input and output names and the cached shape [kv_heads, hd]."""

    node: str = json(Kind("name"))
    past_key: str = json(Kind("input"))
    past_value: str = json(Kind("input"))
    present_key: str = json(Kind("output"))
    present_value: str = json(Kind("output"))
    kv_heads: int = json(Kind("int", 1))
    head_size: int = json(Kind("int", 1))
    value_size: int = json(Kind("int", 1))
    window: int = json(Kind("int", 0), default=0)
    # decode = "gqa": the outputs that are the cache buffer itself, written in place by
    # GroupQueryAttention when the loop binds them to the past buffers (empty otherwise)
    buffer_key: str = json(Kind("output", empty=True), default="")
    buffer_value: str = json(Kind("output", empty=True), default="")


@dataclass
class CacheKernel:
    """The lowering chosen for one cached attention site (both phases), and why: for --explain."""

    site: str = json(Kind("text"))
    impl: str = json(Kind("text"))
    reason: str = json(Kind("text"))


@dataclass
class CacheInfo:
    """What the cached graph takes and gives, for the runtime."""

    tokens: str = json(Kind("input"))
    logits: str = json(Kind("output"))
    layers: list[CacheLayer] = json(Kind("records", of=CacheLayer), default_factory=list)
    # rows of the learned position table, or rotary max_ctx, if any
    context: int | None = json(Kind("int", 1, optional=True), default=None)
    last_only: bool = json(Kind("bool"), default=False)
    mode: str = json(Kind("choice", choices=("buffer", "concat")), default="buffer")
    dtype: str = json(Kind("choice", choices=CACHE_DTYPES), default="f32")
    kernels: list[CacheKernel] = json(Kind("records", of=CacheKernel), default_factory=list)
    # LENGTH when decoding steps write the buffer in place (decode = "gqa")
    length_input: str | None = json(Kind("input", optional=True), default=None)
    # recurrent state carried call to call
    states: list[CacheState] = json(Kind("records", of=CacheState), default_factory=list)
    # the gqa decoding step without its mask (CacheOptions.prefix_keys): each row's keys must be its columns
    # 0..cache_length, none hidden (the serving engine's layout; a left-padded batch breaks it)
    prefix_keys: bool = json(Kind("bool"), default=False)
    # longrope (Phi-3): the rotary frequencies switch once the sequence (the batch's longest) passes this
    # length, and the keys cached before were rotated with the others: the runtime runs the whole
    # sequence again at the call that crosses it, as transformers does (Phi3ForCausalLM drops its cache)
    length_switch: int | None = json(Kind("int", 1, optional=True), default=None)
    # the recurrent state keeps left padding out (a hybrid's: passes/state_padding.py reads the attention mask),
    # so prompts of different lengths batch left-padded; False: a row's padding would enter its state
    padded_state: bool = json(Kind("bool"), default=False)
    # --explain's lines from the passes over the exported graph (compiler/build.py); not in the file's metadata
    notes: list[str] = json(None, default_factory=list, compare=False)

    def explain(self) -> str:
        """--explain's listing for a cached compile: every cached site's kernel per phase and why."""
        stored = ", stored at fp16" if self.dtype == "f16" else ""  # --kv-cache-dtype fp16, or --dtype fp16
        lines = [f"KV cache ({self.mode} mode{stored}): {len(self.layers)} cached attention sites"]
        if self.states:
            lines.append(f"recurrent state: {sum(s.kind == 'scan' for s in self.states)} scan state(s), "
                         f"{sum(s.kind == 'conv' for s in self.states)} causal conv1d window(s) carried"
                         + ("; left padding kept out of them (the attention mask)" if self.padded_state else ""))
        if self.length_switch is not None:
            lines.append(f"longrope: the rotary switches to its long factors past {self.length_switch} positions; "
                         f"generation runs the whole sequence again at the step that crosses it")
        groups: dict[tuple[str, str], list[str]] = {}
        for k in self.kernels:
            groups.setdefault((k.impl, k.reason), []).append(k.site)
        for (impl, reason), sites in groups.items():
            lines.append(f"  {len(sites)} site(s) ({sites[0]}{', ...' if len(sites) > 1 else ''}): {impl} -- {reason}")
        lines.extend(f"  {note}" for note in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The file's ``tessera.kv_cache`` (the schema is the fields' own: passes/cache_schema.py)."""
        return cache_schema.to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> "CacheInfo":
        return cache_schema.from_json(cls, data)

    def record_problem(self) -> str | None:
        """A rule between fields that the schema of each cannot state (runtime/metadata.py checks it)."""
        return None if self.layers or self.states else "layers must be a non-empty list"

    METADATA_KEY = "tessera.kv_cache"


def _retype(g: Graph, value: str, t: TensorType) -> None:
    g.values[value].type = t


def _propagate(g: Graph) -> None:
    """Re-infer every node's output types in order (after inputs changed shape)."""
    for node in g.nodes.values():
        types = ops.infer(node.op, [g.type_of(v) for v in node.inputs], node.attrs)
        for o, t in zip(node.outputs, types):
            _retype(g, o, t)


CACHE_MODES = ("auto", "buffer", "concat")


DECODE_KERNELS = ("auto", "gqa", "gqa-unpacked", "plain")  # gqa-unpacked: gqa without the packed q+k+v input


# onnxruntime 1.31.1's CUDA GroupQueryAttention refuses head_sink beside attention_bias (seen under tests/cuda_stub:
# "attention_bias with smooth softmax or head_sink is not implemented in GroupQueryAttention cuda kernel"); the
# decoding step keeps its mask as that bias unless the engine's variant drops it (prefix_keys), so a site with
# attention sinks decodes on CUDA through GroupQueryAttention only there, else through the plain branch.
SINKS_WITH_BIAS_ON_CUDA = ("attention sinks with the decoding step's mask as attention_bias, which onnxruntime 1.31's "
                           "CUDA GroupQueryAttention refuses beside head_sink (only the serving engine's step without "
                           "the mask, prefix_keys, takes it)")


def _gqa_unfit(node: Node, g: Graph, target: Target) -> str | None:
    """Why onnxruntime's GroupQueryAttention cannot be this site's decoding step, or None if it can:
    it needs no sliding window (buffer mode has none), keys and values of one head size, a multiple
    of 8 (its CPU kernel's rule), float32 (its float16 is not checked here: the graph is still in
    float32 when the cache is added, so the target's precision decides); the spec's scale and
    soft-cap become its attributes."""
    a = node.attrs
    q_t, k_t, v_t = (g.type_of(x) for x in node.inputs[:3])
    hd, hv = int(k_t.shape[-1]), int(v_t.shape[-1])
    if a["window"]:
        return "a sliding window"
    if a["bias"]:
        return "an additive score bias (GroupQueryAttention's attention_bias carries the cache's mask)"
    cuda_half = target.device == "cuda" and target.dtype in ("fp16", "bf16")  # its CUDA kernels: fp16/bf16
    if q_t.dtype != "f32" or (target.dtype != "fp32" and not cuda_half):
        return f"{target.dtype if q_t.dtype == 'f32' else q_t.dtype} (checked in float32 only, and fp16/bf16 on CUDA)"
    if target.device == "cuda" and target.dtype == "fp32":
        return "fp32 on CUDA (onnxruntime has no fp32 CUDA kernel for GroupQueryAttention)"
    if hd != hv or hd % 8:
        return f"head sizes {hd} (keys) and {hv} (values): GroupQueryAttention wants one, a multiple of 8"
    return None


def _longrope(g: Graph) -> str | None:
    """Why a model with a longrope rotary keeps its decoding step's mask (None: it has none): `generate` recomputes
    a longrope cache when the batch's longest row passes the switch, all rows together in the left-padded layout
    (generation/cached.py ``_restart``, as transformers' batch does); the engine's layout runs rows one by one."""
    if any(n.op == "rope" and n.attrs.get("rope_type") == "longrope" for n in g.nodes.values()):
        return "a longrope rotary, whose cache generate recomputes for the whole left-padded batch at its switch"
    return None


@dataclass(frozen=True)
class CacheOptions:
    """How the cache is added (the options every kv-cache pass reads; see ``add_kv_cache``)."""

    last_only: bool = False
    mode: str = "auto"
    impl: str | None = None
    tokens: str | None = None
    max_positions: int = 4096
    target: Target = Target()
    decode: str = "auto"
    mixed: bool = False  # the serving engine's combined call (backends/onnx/mixed_attention.py), gqa sites only
    # The serving engine's variant of the gqa decoding step: GroupQueryAttention with seqlens_k alone, no
    # attention_bias, so onnxruntime's CUDA kernel may choose flash decoding (with the bias it took MATH).
    # Assumes each row's keys are its columns 0..cache_length, none hidden among them (score_epilogue.py
    # ASSUMPTIONS "keys_by_length"): guaranteed by the engine, whose rows fill their columns from 0; NOT by
    # ``tessera generate``, which left-pads prompts of different lengths (it never sets this). A site whose
    # features break it (backends/onnx/attention.py PREFIX_KEYS_ASSUMES) keeps the step with its mask, the
    # reason in its kernel note.
    prefix_keys: bool = False

    def check(self) -> None:
        if self.mode not in CACHE_MODES:
            raise CacheError(f"unknown cache mode '{self.mode}' (choose from {', '.join(CACHE_MODES)})")
        if self.decode not in DECODE_KERNELS:
            raise CacheError(f"unknown decode kernel '{self.decode}' (choose from {', '.join(DECODE_KERNELS)})")

    @property
    def decode_kernel(self) -> str:
        """``decode`` with auto resolved: measured on CPU only (docs/benchmarks/log.md); on CUDA gqa in
        fp16 and bf16 (onnxruntime's CUDA GroupQueryAttention kernels, the cache on the device), the plain
        branch in fp32 (onnxruntime has no fp32 CUDA kernel for GroupQueryAttention)."""
        if self.decode == "auto":
            if self.target.device == "cuda":
                return "gqa" if self.target.dtype in ("fp16", "bf16") else "plain"
            return "gqa"
        return self.decode


# ---- what every pass reads from the graph itself (passes never hand each other state)
def _token_input(g: Graph, tokens: str | None) -> str:
    if tokens is not None:
        return tokens
    # a decoder-only model: its one input is the token ids, or the token ids and key padding masks
    # (passes/spec_mask.py: the cache's attention_mask takes their place)
    int_inputs = [i for i in g.inputs if g.type_of(i).dtype in ("i64", "i32") and g.type_of(i).rank == 2]
    if len(g.inputs) == 1 and len(int_inputs) == 1:
        return int_inputs[0]
    return spec_mask.token_and_masks(g)[0]


def _over_time(g: Graph, value: str, t_dim) -> bool:
    """Whether ``value`` is per position: [B, T, ...]."""
    shape = g.type_of(value).shape
    return len(shape) >= 2 and dims.equal(dims.dim(shape[1]), t_dim)


def _batch_and_time(g: Graph) -> tuple:
    """(B, T) as the cache inputs pass declared them: position_ids is [B, T]."""
    return g.type_of(POSITIONS).shape


def _self_attention(g: Graph, t_dim) -> list[Node]:
    """The cache sites: fused attention whose keys grow with the tokens. Attention over keys that do
    not (an encoder-decoder's cross-attention, whose K and V are inputs here) is left as it is."""
    t_sym = {str(s) for s in dims.dim(t_dim).free_symbols}
    fused = [n for n in g.nodes.values() if n.op == "fused_attention"]
    fixed = [n for n in fused if not ({str(x) for x in dims.dim(g.type_of(n.inputs[1]).shape[-2]).free_symbols}
                                      & t_sym) and n.inputs[1] in g.inputs and n.inputs[2] in g.inputs]
    return [n for n in fused if n not in fixed]


def cached_sites(g: Graph) -> list[Node]:
    """The attention nodes the cache layers pass rewrote: they read the cache's mask as key padding."""
    return [n for n in g.nodes.values() if n.op == "fused_attention" and n.inputs[3:4] == [MASK]]


def _mode(requested: str, sites: list[Node]) -> str:
    """``auto`` is buffer, except with a sliding window or chunked attention (see ``add_kv_cache``)."""
    if requested == "auto":
        return "concat" if any(n.attrs["window"] or n.attrs.get("chunk") for n in sites) else "buffer"
    return requested


def cache_tensors(g: Graph) -> set[str]:
    """The cache's past inputs and present outputs: held by the runtime at the graph's own precision
    (passes/precision.py ``native``)."""
    return {i for i in g.inputs if i.startswith(("past_key.", "past_value.", "past_state.", "past_conv."))} \
        | set(g.outputs[1:])


def _settle(g: Graph) -> None:
    """After a rewrite: the graph store rebuilt, every type re-inferred, unread constants dropped."""
    g.reindex()
    _propagate(g)
    g.prune_constants()


def _needs(g: Graph, name: str, what: str) -> None:
    if name not in g.inputs:
        raise PassError(f"{what} needs the input {name}: run kv-cache-inputs first")


def _check_biases(g: Graph, sites: list[Node], t_dim) -> None:
    """A cache site may add a score bias only if it is computed from the positions alone (T5's relative
    position bias: passes/position_bias.py reads it at the cache's positions); any other has no cached form."""
    biased = [n for n in sites if n.attrs["bias"]]
    if not biased:
        return
    grid = grid_or_refuse(g, t_dim)
    read = {s for sites_of in (grid.biases.values() if grid else ()) for s in sites_of}
    for n in biased:
        if n.name not in read:
            raise CacheError(f"the attention at {n.scope} adds a score bias ({bias_input(n)}) that is not computed "
                             f"from the positions arange({dims.fmt(t_dim)}) alone; its cached form is not known")


# ---- the passes, in the order CACHE_PASSES runs them
@dataclass(frozen=True)
class CacheInterface:
    """The cache inputs pass's note: the graph's token input and logits, the resolved cache mode."""

    tokens: str
    logits: str
    mode: str
    last_only: bool


class AddCacheInputs(Pass):
    """Check the graph has a cached form; add ``attention_mask`` [B, P+T] and ``position_ids`` [B, T]."""

    name = "kv-cache-inputs"

    def __init__(self, options: CacheOptions):
        options.check()
        self.options = options

    def requires(self, g: Graph) -> None:
        tokens = _token_input(g, self.options.tokens)
        _, t_dim = g.type_of(tokens).shape
        sites = _self_attention(g, t_dim)
        if not sites and not carries_state(g, t_dim):
            raise CacheError(f"model {g.name} has no fused attention and no recurrence over time to cache (is "
                             f"attention fused? --no-fuse leaves nothing to cache)")
        masks = [] if self.options.tokens is not None or len(g.inputs) == 1 else spec_mask.token_and_masks(g)[1]
        bad = [n for n in sites if not n.attrs["causal"] or (n.attrs["padding"] and n.inputs[3] not in masks)]
        if bad:
            n = bad[0]
            why = "not causal (an encoder or cross-attention)" if not n.attrs["causal"] else \
                "already masked by the spec"
            raise CacheError(f"the attention at {n.scope} is {why}; generation with a KV cache supports "
                             f"decoder-only models whose attention is causal")
        _check_biases(g, sites, t_dim)
        # a recurrent decoder may give per-step outputs beside its logits (RNNsearch's alignment): they
        # are kept; the attention cache's outputs replace everything but the logits
        extra_ok = not sites and all(_over_time(g, o, t_dim) for o in g.outputs[1:])
        if (len(g.outputs) != 1 and not extra_ok) or g.type_of(g.outputs[0]).rank != 3:
            raise CacheError(f"generation needs one output of logits [B, T, vocab]; {g.name} gives "
                             + ", ".join(f"{o}: {g.type_of(o)}" for o in g.outputs))
        if self.options.mode == "buffer" and any(n.attrs["window"] for n in sites):
            raise CacheError("a sliding-window model cannot use the buffer cache (the window would be measured "
                             "from the buffer's end); use the concat cache")
        if self.options.mode == "buffer" and any(n.attrs.get("chunk") for n in sites):
            raise CacheError("a model with chunked attention cannot use the buffer cache (the chunks would be "
                             "measured from the buffer's end); use the concat cache")
        if "P" in g.symbols:
            raise CacheError("the model already uses a dimension named P, which the cache needs for past "
                             "positions")

    def run(self, g: Graph) -> PassResult:
        tokens = _token_input(g, self.options.tokens)
        b_dim, t_dim = g.type_of(tokens).shape
        sites = _self_attention(g, t_dim)
        mode = _mode(self.options.mode, sites)
        if sites:  # a model with recurrent state only has no keys to mask
            g.add_input(MASK, TensorType("i64", (b_dim, dims.symbol("P") + t_dim)))
        g.add_input(POSITIONS, TensorType("i64", (b_dim, t_dim)))
        return PassResult(g, True, [CacheInterface(tokens, g.outputs[0], mode, self.options.last_only)])


@dataclass(frozen=True)
class CacheContext:
    """The positions pass's note: the positions a prompt and its new tokens may span (None: unbounded),
    and the length past which a longrope rotary switches its frequencies (None: none does)."""

    positions: int | None
    switch: int | None = None


def _read_positions(g: Graph, arange: Node, b_dim, t_dim) -> list[int | None]:
    """Make every position table that ``arange`` (= arange(T)) indexes, at any ``a * arange(T) + c``
    (patterns/positions.py), read ``a * position_ids + c`` instead; drop the arange and its index
    chain. Returns the positions each table serves (None: not a fixed number of rows)."""
    where = arange.scope or "<model>"
    try:
        reads = affine_reads(g, arange)
    except NotAffine as e:
        raise CacheError(f"arange({dims.fmt(t_dim)}) at {where} is used for something other than a position "
                         f"table read at a * arange + c: {e}; its cached form is not known") from None
    served = []
    for r in reads:
        if r.a < 1 or r.c < 0:
            why = "does not grow with the position" if r.a < 1 else "is negative at the first positions"
            raise CacheError(f"the position table at {r.embedding.scope or '<model>'} is read at {r.a} * "
                             f"arange({dims.fmt(t_dim)}) + {r.c}, which {why}; its cached form is not known "
                             f"(a >= 1 and c >= 0 are)")
        index = POSITIONS
        for op, k in (("mul", r.a), ("add", r.c)):
            if k != (1 if op == "mul" else 0):
                const = g.add_const(f"cache/position_{op}", np.array(k, dtype=np.int64), "i64")
                step = g.add_node(op, [index, const.name], [TensorType("i64", (b_dim, t_dim))], {},
                                  r.embedding.scope, r.embedding.pos, name=f"{r.embedding.name}/position_{op}",
                                  origin=r.embedding.origin)
                _insert_before(g, step, r.embedding.name)
                index = step.outputs[0]
        g.set_inputs(r.embedding, [index] + r.embedding.inputs[1:])
        rows = dims.static_int(g.type_of(r.embedding.inputs[1]).shape[0])
        served.append(None if rows is None else positions_reached(rows, r.a, r.c))
    g.remove_nodes([arange.name, *(n for r in reads for n in r.chain)])
    return served


class ReadPositionIds(Pass):
    """Learned position tables (read at any ``a * arange(T) + c``: GPT-2's arange(T), BART's
    arange(T) + 2), sinusoidal tables and rotary embeddings read ``position_ids``, so positions
    stay right with P > 0 and with left padding."""

    name = "kv-cache-positions"

    def __init__(self, options: CacheOptions):
        self.options = options

    def requires(self, g: Graph) -> None:
        _needs(g, POSITIONS, self.name)

    def run(self, g: Graph) -> PassResult:
        b_dim, t_dim = _batch_and_time(g)
        context = switch = None
        for node in list(g.nodes.values()):
            if node.op == "arange":
                if not dims.equal(dims.dim(node.attrs["n"]), t_dim):
                    continue
                for rows in _read_positions(g, node, b_dim, t_dim):
                    if rows is not None:
                        context = rows if context is None else min(context, rows)
            elif node.op == "sinusoidal":
                if not dims.equal(dims.dim(node.attrs["n"]), t_dim):
                    continue
                # sinusoidal(T, d) -> rows position_ids of the fixed table, up to max_positions
                out_t = g.type_of(node.outputs[0])
                table = g.add_const("cache/sinusoidal", sinusoidal_table(self.options.max_positions,
                                                                         node.attrs["d"]).astype(
                    _np_float(out_t.dtype)), out_t.dtype)
                emb = g.add_node("embedding", [POSITIONS, table.name],
                                 [TensorType(out_t.dtype, (b_dim, t_dim) + out_t.shape[1:])],
                                 {}, node.scope, node.pos, name=f"{node.name}/positions", origin=node.origin)
                _insert_before(g, emb, node.name)
                for u in g.consumers(node.outputs[0]):
                    g.set_inputs(u, [emb.outputs[0] if i == node.outputs[0] else i for i in u.inputs])
                g.remove_nodes([node.name])
                context = self.options.max_positions
            elif node.op == "rope":
                if node.attrs.get("rope_type") == "dynamic":
                    raise CacheError(f"the rope at {node.scope} is dynamic NTK: its frequencies follow the whole "
                                     f"sequence's length, so keys cached at a shorter length would be rotated "
                                     f"differently; it has no cached form (run the model whole instead)")
                if node.attrs.get("rope_type") == "longrope":
                    at = longrope_parts(node.attrs["scaling"])[0]
                    if switch not in (None, at):
                        raise CacheError(f"the rope at {node.scope} switches its frequencies past {at} positions "
                                         f"and another past {switch}: one decoder cannot recompute its cache at "
                                         f"both lengths (its cached form is not known)")
                    switch = at
                g.set_inputs(node, [node.inputs[0], POSITIONS])
                if node.attrs.get("max_ctx"):  # the trained context bounds prompt + new tokens
                    context = min(context or node.attrs["max_ctx"], node.attrs["max_ctx"])
        _settle(g)
        return PassResult(g, True, [CacheContext(context, switch)])


class AddCacheLayers(Pass):
    """Per attention layer: past keys and values in, the attention over past + new, the mask as its key
    padding (causal over P+T keys, the queries being the last T; the spec's window kept), and the cache
    outputs (concat: the present keys and values; buffer: the new columns). Notes: a CacheLayer each.
    Then the recurrent state over time (passes/recurrent_state.py: every time scan's state, every causal
    conv1d's window) as past inputs and present outputs after the layers'. Notes: a CacheState each."""

    name = "kv-cache-layers"

    def __init__(self, options: CacheOptions):
        self.options = options

    def requires(self, g: Graph) -> None:
        _needs(g, POSITIONS, self.name)
        t_dim = _batch_and_time(g)[1]
        if _self_attention(g, t_dim):
            _needs(g, MASK, self.name)
        b_dim, keys = _batch_and_time(g)[0], g.type_of(MASK).shape[1] if MASK in g.inputs else None
        for n in _self_attention(g, t_dim):
            shape = g.type_of(bias_input(n)).shape if n.attrs["bias"] else None
            if shape is not None and not (len(shape) == 4 and dims.equal(shape[0], b_dim) and (
                    dims.equal(shape[-1], keys) or dims.equal(shape[-1], 1))):
                raise PassError(f"{self.name}: the score bias of the attention at {n.scope} is "
                                f"{dims.fmt_shape(shape)}, not [B, heads, T, P+T] over the cache's keys: run "
                                f"{CachedPositionBiasPass.name} first")
        check_state(g, t_dim)

    def run(self, g: Graph) -> PassResult:
        b_dim, t_dim = _batch_and_time(g)
        sites = _self_attention(g, t_dim)
        masks = spec_mask.spec_masks(g, sites)  # the spec's own key padding: attention_mask replaces it
        layers = self._attention_layers(g, sites, b_dim, t_dim) if sites else []
        if masks:
            spec_mask.drop_spec_masks(g, masks, next(i for i in g.inputs if i not in masks))
        states = carry_state(g, t_dim, MASK if sites else None)  # a hybrid: the mask keeps padding out
        _settle(g)
        return PassResult(g, True, layers + states)

    def _attention_layers(self, g: Graph, sites: list[Node], b_dim, t_dim) -> list[CacheLayer]:
        p_dim = dims.symbol("P")
        mode = _mode(self.options.mode, sites)
        dtype = g.type_of(sites[0].inputs[0]).dtype
        layers = []
        for i, node in enumerate(sites):
            q, k, v = node.inputs[:3]
            k_t, v_t = g.type_of(k), g.type_of(v)
            kv_heads, hd, hv = node.attrs["kv_heads"], int(k_t.shape[-1]), int(v_t.shape[-1])
            out_k, out_v = (f"present_key.{i}", f"present_value.{i}") if mode == "concat" else \
                (f"key.{i}", f"value.{i}")
            layer = CacheLayer(node.name, f"past_key.{i}", f"past_value.{i}", out_k, out_v, kv_heads, hd, hv,
                               node.attrs["window"])
            full = []
            for past, new, out, size in ((layer.past_key, k, out_k, hd), (layer.past_value, v, out_v, hv)):
                g.add_input(past, TensorType(dtype, (b_dim, dims.dim(kv_heads), p_dim, dims.dim(size))))
                cat = g.add_node("concat", [past, new],
                                 [TensorType(dtype, (b_dim, dims.dim(kv_heads), p_dim + t_dim, dims.dim(size)))],
                                 {"axis": 2}, node.scope, node.pos, name=out if mode == "concat" else f"{out}/all",
                                 origin=node.origin)
                _insert_before(g, cat, node.name)
                full.append(cat.outputs[0])
                if mode == "buffer":  # the new columns only; the runtime writes them into its buffer
                    ident = g.add_node("identity", [new], [g.type_of(new)], {}, node.scope, node.pos, name=out,
                                       origin=node.origin)
                    _insert_before(g, ident, node.name)
            sinks = [node.inputs[-1]] if node.attrs.get("sinks") else []  # attention sinks: the last input
            bias = [bias_input(node)] if node.attrs["bias"] else []  # read at the cache's positions already
            g.set_inputs(node, [q, full[0], full[1], MASK] + bias + sinks)
            node.attrs.update(padding=True)
            layers.append(layer)
        g.symbols["P"] = SymbolSource(layers[0].past_key, 2)
        g.outputs = [g.outputs[0]] + [n for layer in layers for n in (layer.present_key, layer.present_value)]
        return layers


@dataclass(frozen=True)
class CachedKernel:
    """The cache kernels pass's note for one site: its lowering and, with the gqa decode kernel, the
    outputs that are the cache buffer itself (written in place when bound to the past buffers)."""

    node: str
    kernel: CacheKernel
    buffer_key: str = ""
    buffer_value: str = ""


class ChooseCacheKernels(Pass):
    """Each cached site's lowering per phase (passes/attention_kernels.py ``choose_cached``), and in
    buffer mode the decoding step's kernel (``decode``); gqa adds the ``cache_length`` input."""

    name = "kv-cache-kernels"

    def __init__(self, options: CacheOptions):
        self.options = options

    def requires(self, g: Graph) -> None:
        if not cached_sites(g) and (POSITIONS not in g.inputs or _self_attention(g, _batch_and_time(g)[1])):
            raise PassError(f"{self.name} needs cached attention sites: run kv-cache-layers first")

    def run(self, g: Graph) -> PassResult:
        impl, target = self.options.impl, self.options.target
        sites = cached_sites(g)
        mode = _mode(self.options.mode, sites)
        decode = self.options.decode_kernel
        notes = []
        # the serving engine's combined call runs every site in one call, so it is built for all sites or
        # none: mixed_attention.py computes no attention sinks, so a model with sinks gets two calls (a
        # prompt chunk, then the decoding step), the engine's other path, and each site's note says why
        sinks = next((n for n in sites if n.attrs.get("sinks")), None)
        mixed = self.options.mixed and sinks is None
        longrope = _longrope(g) if self.options.prefix_keys else None  # once for the graph, not per site
        for i, node in enumerate(sites):
            unfit = "not the buffer cache" if mode != "buffer" else (
                f"the {impl} kernel" if impl not in (None, "phased") else _gqa_unfit(node, g, target))
            if not unfit and target.device == "cuda" and node.attrs.get("sinks") and not (
                    self.options.prefix_keys and not unsupported("phased", {**node.attrs, "decode": "gqa",
                                                                            "prefix_keys": True})):
                unfit = SINKS_WITH_BIAS_ON_CUDA
            if self.options.decode in ("gqa", "gqa-unpacked") and unfit:
                raise CacheError(f"the gqa decode kernel (--decode gqa) cannot decode the attention at "
                                 f"{node.scope or node.name}: {unfit}")
            gqa = decode in ("gqa", "gqa-unpacked") and not unfit
            node.attrs["impl"], reason = (impl, "forced") if impl else choose_cached(node, g, target, gqa_decode=gqa)
            if target.device == "cuda" and decode in ("gqa", "gqa-unpacked") and unfit and not impl and \
                    node.attrs["impl"] == "phased":  # on CUDA the plain branch is the exception: say why
                reason = f"{reason}; not GroupQueryAttention for decoding: {unfit}"
            note = CachedKernel(node.name, CacheKernel(node.scope or node.name, node.attrs["impl"], reason))
            prefill = cached_prefill(node, g, target, gqa) if node.attrs["impl"] == "phased" else None
            if prefill:
                node.attrs["prefill"] = prefill
            if gqa:
                node.attrs["decode"] = "gqa"
                node.attrs["pack_qkv"] = decode == "gqa"  # cached_attention.packed_qkv reads it
                note = dataclasses.replace(note, buffer_key=f"cache_key.{i}", buffer_value=f"cache_value.{i}")
                node.attrs["buffer_outputs"] = [note.buffer_key, note.buffer_value]
                node.attrs["length_input"] = LENGTH
                if target.device == "cuda":
                    node.attrs["decode_mask"] = DECODE_MASK
                if mixed:  # the engine's combined call too (backends/onnx/mixed_attention.py)
                    node.attrs["mixed"] = True
                elif self.options.mixed:
                    note = dataclasses.replace(note, kernel=dataclasses.replace(
                        note.kernel, reason=f"{note.kernel.reason}; no combined call: mixed_attention.py computes "
                                            f"no attention sinks (at {sinks.scope or sinks.name})"))
                if self.options.prefix_keys:  # the engine's step without its mask, where the site allows it
                    refused = unsupported("phased", {**node.attrs, "prefix_keys": True}) or longrope
                    if refused:
                        note = dataclasses.replace(note, kernel=dataclasses.replace(
                            note.kernel, reason=f"{note.kernel.reason}; decode keeps its mask as attention_bias "
                                                f"(not seqlens_k alone: {refused})"))
                    else:
                        node.attrs["prefix_keys"] = True
                        if target.device == "cuda":  # the width alone, from an input holding no values
                            node.attrs["decode_mask"] = DECODE_SPAN
                        note = dataclasses.replace(note, kernel=dataclasses.replace(
                            note.kernel, reason=f"{note.kernel.reason}; {PREFIX_KEYS_REASON}"))
            notes.append(note)
        if any(n.buffer_key for n in notes):
            g.add_input(LENGTH, TensorType("i64", (dims.symbol(LENGTH_ROWS),)))
        if any(n.attrs.get("decode_mask") == DECODE_MASK for n in sites):
            g.add_input(DECODE_MASK, TensorType("i64", (_batch_and_time(g)[0], dims.symbol(DECODE_WIDTH))))
        if any(n.attrs.get("decode_mask") == DECODE_SPAN for n in sites):
            g.add_input(DECODE_SPAN, TensorType("i64", (dims.dim(0), dims.symbol(DECODE_WIDTH))))
        _settle(g)
        return PassResult(g, True, notes)


@dataclass(frozen=True)
class LastPosition:
    """The last-position pass's note: the slice it put before the output head."""

    node: str


def _fixed(g: Graph, value: str) -> bool:
    """A constant or a parameter (buffers too): the same for every position."""
    return value in g.consts or value in g.params


class LastPositionLogits(Pass):
    """The output head applied to the last position only (logits [B, 1, vocab]): all a decoding step
    needs. The head is found through identities and pointwise ops with constant operands (Gemma 2's
    tanh(l / c) * c) or parameter operands (BART's final_logits_bias buffer, [1, vocab]: a parameter
    has no sequence axis); it is a linear, float or quantised (--quantize-head)."""

    name = "last-position-logits"

    def requires(self, g: Graph) -> None:
        _needs(g, POSITIONS, self.name)

    def run(self, g: Graph) -> PassResult:
        _, t_dim = _batch_and_time(g)
        head = g.producer(g.outputs[0])
        while head is not None and (head.op == "identity" or (ops.has_trait(head.op, "elementwise") and
                                                              all(_fixed(g, v) for v in head.inputs[1:]))):
            head = g.producer(head.inputs[0])
        if head is None or not (head.op == "linear" or ops.has_trait(head.op, "quantized")):
            raise CacheError("last_only needs the logits to come from a linear output head")
        x = head.inputs[0]
        xt = g.type_of(x)
        sl = g.add_node("slice", [x], [TensorType(xt.dtype, (xt.shape[0], dims.dim(1)) + xt.shape[2:])],
                        {"axis": 1, "start": t_dim - 1, "end": t_dim}, head.scope, head.pos, name="cache/last")
        _insert_before(g, sl, head.name)
        g.set_inputs(head, [sl.outputs[0]] + head.inputs[1:])
        _settle(g)
        return PassResult(g, True, [LastPosition(sl.name)])


def cache_passes(options: CacheOptions) -> list[Pass]:
    """The KV cache as passes, in order (the cached pipelines in passes/pipeline.py splice them in)."""
    passes = [AddCacheInputs(options), CachedPositionBiasPass(), CachedPositionFactorPass(), ReadPositionIds(options),
              AddCacheLayers(options), ChooseCacheKernels(options)]
    if options.last_only:
        passes.append(LastPositionLogits())
    return passes


def cache_info(result: PipelineResult) -> CacheInfo:
    """What the runtime needs, read from the cache passes' notes and the final graph (whose cache
    dtype is the one a later precision lowering left)."""
    (face,) = result.notes(AddCacheInputs.name)
    (context,) = result.notes(ReadPositionIds.name)
    kernels = {k.node: k for k in result.notes(ChooseCacheKernels.name)}
    layers = [dataclasses.replace(layer, buffer_key=kernels[layer.node].buffer_key,
                                  buffer_value=kernels[layer.node].buffer_value)
              for layer in result.notes(AddCacheLayers.name) if isinstance(layer, CacheLayer)]
    g = result.graph
    states = [dataclasses.replace(s, dtype=g.type_of(s.past).dtype)
              for s in result.notes(AddCacheLayers.name) if isinstance(s, CacheState)]
    dtype = g.type_of(layers[0].past_key).dtype if layers else states[0].dtype
    prefix = any(n.attrs.get("prefix_keys") for n in cached_sites(g))
    return CacheInfo(face.tokens, face.logits, layers, context.positions, face.last_only, face.mode, dtype,
                     [kernels[layer.node].kernel for layer in layers],
                     LENGTH if any(layer.buffer_key for layer in layers) else None, states, prefix,
                     length_switch=context.switch, padded_state=bool(layers and states))  # carry_state's mask


def add_kv_cache(g: Graph, last_only: bool = False, mode: str = "auto", impl: str | None = None,
                 tokens: str | None = None, max_positions: int = 4096, target: Target = Target(),
                 decode: str = "auto") -> CacheInfo:
    """Rewrite a fused decoder-only graph in place into its cached form (the ``cache_passes``, run by a
    PassManager); returns what the runtime needs.

    ``mode`` says what the graph gives back per layer. ``concat``: the present keys and values
    [B, kv_heads, P+T, hd] (past and new concatenated), to be fed back as the next past -- simple,
    but every step copies the whole cache. ``buffer``: only the new keys and values [B, kv_heads,
    T, hd]; the past inputs are then a preallocated buffer of the maximum length (P = its
    capacity), the runtime writes each step's new columns into it in place and the mask hides
    the slots not filled yet. The attention kernel reads the past and the new columns separately,
    so the cache is never copied. ``impl`` forces the cached sites' lowering (``phased`` or
    ``cached``); by default passes/attention_kernels.py ``choose_cached`` picks it for ``target``.
    ``auto`` (the default) is buffer, except for models with a sliding window: the mask's causal
    offset is the past's length, which in buffer mode is the buffer's capacity rather than the
    filled slots, so a window would be measured from the wrong place; they take concat, where the
    past is exactly the filled positions. ``decode`` picks the decoding step's kernel in buffer
    mode: ``gqa`` (GroupQueryAttention writing the buffer in place, where ``_gqa_unfit`` finds
    nothing against it), ``plain``, or ``auto`` (gqa on CPU, plain elsewhere: unmeasured)."""
    options = CacheOptions(last_only, mode, impl, tokens, max_positions, target, decode)
    return cache_info(PassManager(cache_passes(options))(g))


def _np_float(dtype: str):
    return numpy_dtype(dtype) if dtype in ("f16", "bf16") else np.float32
