"""Cache-aware compilation: turn a fused decoder-only graph into its KV-cached form.

Why: to generate, a decoder computes the scores of the next token, picks one,
appends it and repeats. The keys and values of earlier positions do not change
when a token is appended, so they are kept (the KV cache) and each new token
costs one column of queries, keys and values plus attention over the stored
positions, instead of recomputing the whole sequence. The cached form is
derived from the spec's own graph, after attention fusion, so no spec has to
be written twice: every causal ``fused_attention`` node is a cache site.

The rewrite (``add_kv_cache``), with P the number of cached positions and T
the number of new ones (the prompt at prefill, 1 when decoding):

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
- masks: every attention keeps its causal flag and window (the queries are the
  last T of the P+T keys) and takes ``attention_mask`` as its key padding, which
  also hides a buffer's unfilled slots;
- ``last_only``: the output head is applied to the last position only (logits
  [B, 1, vocab]), which is all a decoding step needs.

The attention nodes are lowered per phase (backends/onnx/cached_attention.py,
chosen by passes/attention_kernels.py ``choose_cached``): a prompt (T > 1) by the
portable tiled kernel, a decoding step (T = 1) in buffer mode on CPU by one
GroupQueryAttention that writes the new column into the buffer itself (``decode``
"gqa": an input ``cache_length`` i64 [1], the filled slots, and per layer the ONNX
outputs ``cache_key.{i}`` / ``cache_value.{i}``, the buffer as written, which the
loop binds to the same memory as the past inputs), else by plain matrix products
over the cache; the numpy interpreter runs the rewritten graph unchanged (it does
not read ``cache_length``), which is what the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node, TensorType
from tessera.compiler.ir.graph import SymbolSource
from tessera.compiler import ops
from tessera.compiler.passes.attention_kernels import Target, choose_cached

MASK, POSITIONS = "attention_mask", "position_ids"
LENGTH = "cache_length"  # buffer mode with GroupQueryAttention decoding: the filled slots, i64 [1]


class CacheError(Exception):
    """The graph has no cached form (not a decoder-only model with causal attention)."""


@dataclass
class CacheLayer:
    """One attention layer's cache: input and output names and the cached shape [kv_heads, hd]."""

    node: str
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    kv_heads: int
    head_size: int
    value_size: int
    window: int = 0
    # decode = "gqa": the outputs that are the cache buffer itself, written in place by
    # GroupQueryAttention when the loop binds them to the past buffers (empty otherwise)
    buffer_key: str = ""
    buffer_value: str = ""


@dataclass
class CacheKernel:
    """The lowering chosen for one cached attention site (both phases), and why: for --explain."""

    site: str
    impl: str
    reason: str


@dataclass
class CacheInfo:
    """What the cached graph takes and gives, for the runtime."""

    tokens: str
    logits: str
    layers: list[CacheLayer] = field(default_factory=list)
    context: int | None = None  # rows of the learned position table, or rotary max_ctx, if any
    last_only: bool = False
    mode: str = "buffer"
    dtype: str = "f32"
    kernels: list[CacheKernel] = field(default_factory=list)
    length_input: str | None = None  # LENGTH when decoding steps write the buffer in place (decode = "gqa")

    def explain(self) -> str:
        """--explain's listing for a cached compile: every cached site's kernel per phase and why."""
        lines = [f"KV cache ({self.mode} mode): {len(self.layers)} cached attention sites"]
        groups: dict[tuple[str, str], list[str]] = {}
        for k in self.kernels:
            groups.setdefault((k.impl, k.reason), []).append(k.site)
        for (impl, reason), sites in groups.items():
            lines.append(f"  {len(sites)} site(s) ({sites[0]}{', ...' if len(sites) > 1 else ''}): {impl} -- {reason}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "logits": self.logits, "context": self.context, "last_only": self.last_only,
                "mode": self.mode, "dtype": self.dtype, "layers": [vars(layer) for layer in self.layers],
                "kernels": [vars(k) for k in self.kernels], "length_input": self.length_input}

    @classmethod
    def from_json(cls, data: dict) -> "CacheInfo":
        return cls(data["tokens"], data["logits"], [CacheLayer(**layer) for layer in data["layers"]],
                   data.get("context"), data.get("last_only", False), data.get("mode", "buffer"),
                   data.get("dtype", "f32"), [CacheKernel(**k) for k in data.get("kernels", [])],
                   data.get("length_input"))

    METADATA_KEY = "tessera.kv_cache"


def _insert_before(g: Graph, new: Node, before: str) -> None:
    """Move the just-added node ``new`` to just before ``before`` (graph.nodes is kept topological)."""
    items = [(k, v) for k, v in g.nodes.items() if k != new.name]
    out = {}
    for k, v in items:
        if k == before:
            out[new.name] = new
        out[k] = v
    g.nodes = out
    g.reindex()


def _retype(g: Graph, value: str, t: TensorType) -> None:
    g.values[value].type = t


def _propagate(g: Graph) -> None:
    """Re-infer every node's output types in order (after inputs changed shape)."""
    for node in g.nodes.values():
        types = ops.infer(node.op, [g.type_of(v) for v in node.inputs], node.attrs)
        for o, t in zip(node.outputs, types):
            _retype(g, o, t)


CACHE_MODES = ("auto", "buffer", "concat")


DECODE_KERNELS = ("auto", "gqa", "plain")


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
    if q_t.dtype != "f32" or target.dtype != "fp32":
        return f"{target.dtype if q_t.dtype == 'f32' else q_t.dtype} (checked in float32 only)"
    if hd != hv or hd % 8:
        return f"head sizes {hd} (keys) and {hv} (values): GroupQueryAttention wants one, a multiple of 8"
    return None


def add_kv_cache(g: Graph, last_only: bool = False, mode: str = "auto", impl: str | None = None,
                 tokens: str | None = None, max_positions: int = 4096, target: Target = Target(),
                 decode: str = "auto") -> CacheInfo:
    """Rewrite a fused decoder-only graph in place into its cached form; returns what the runtime needs.

    ``mode`` says what the graph gives back per layer. ``concat``: the present keys and values
    [B, kv_heads, P+T, hd] (past and new concatenated), to be fed back as the next past -- simple,
    but every step copies the whole cache. ``buffer``: only the new keys and values [B, kv_heads,
    T, hd]; the past inputs are then a preallocated buffer of the maximum length (P = its
    capacity), the runtime writes each step's new columns into it in place and the mask hides
    the slots not filled yet. The attention kernel reads the past and the new columns separately,
    so the cache is never copied. ``impl`` forces the cached sites' lowering (``phased`` or
    ``cached``); by default passes/attention_kernels.py ``choose_cached`` picks it for ``target``. ``auto`` (the default) is buffer, except for models with a
    sliding window: the mask's causal offset is the past's length, which in buffer mode is the
    buffer's capacity rather than the filled slots, so a window would be measured from the wrong
    place; they take concat, where the past is exactly the filled positions. ``decode`` picks the
    decoding step's kernel in buffer mode: ``gqa`` (GroupQueryAttention writing the buffer in place,
    where ``_gqa_unfit`` finds nothing against it), ``plain``, or ``auto`` (gqa on CPU, plain elsewhere: unmeasured)."""
    if mode not in CACHE_MODES:
        raise CacheError(f"unknown cache mode '{mode}' (choose from {', '.join(CACHE_MODES)})")
    if decode not in DECODE_KERNELS:
        raise CacheError(f"unknown decode kernel '{decode}' (choose from {', '.join(DECODE_KERNELS)})")
    forced_gqa = decode == "gqa"
    if decode == "auto":  # measured on CPU only (docs/BENCHMARKS.md); CUDA keeps the plain branch, unmeasured
        decode = "gqa" if target.device == "cpu" else "plain"
    if tokens is None:  # a decoder-only model: its one input is the token ids
        int_inputs = [i for i in g.inputs if g.type_of(i).dtype in ("i64", "i32") and g.type_of(i).rank == 2]
        if len(g.inputs) != 1 or len(int_inputs) != 1:
            raise CacheError(f"generation needs a decoder-only model whose only input is token ids [B, T]; "
                             f"{g.name} takes " + ", ".join(f"{i}: {g.type_of(i)}" for i in g.inputs))
        tokens = int_inputs[0]
    b_dim, t_dim = g.type_of(tokens).shape
    t_sym = {str(s) for s in dims.dim(t_dim).free_symbols}
    fused = [n for n in g.nodes.values() if n.op == "fused_attention"]
    # cache sites: causal self-attention. Attention over keys that do not grow with the tokens (an
    # encoder-decoder's cross-attention, whose K and V are inputs here) is left as it is.
    fixed = [n for n in fused if not ({str(x) for x in dims.dim(g.type_of(n.inputs[1]).shape[-2]).free_symbols}
                                      & t_sym) and n.inputs[1] in g.inputs and n.inputs[2] in g.inputs]
    sites = [n for n in fused if n not in fixed]
    if not sites:
        raise CacheError(f"model {g.name} has no fused attention to cache (is attention fused? --no-fuse "
                         f"leaves nothing to cache)")
    bad = [n for n in sites if not n.attrs["causal"] or n.attrs["padding"] or n.attrs["bias"]]
    if bad:
        n = bad[0]
        why = "not causal (an encoder or cross-attention)" if not n.attrs["causal"] else \
            "already masked or biased by the spec"
        raise CacheError(f"the attention at {n.scope} is {why}; generation with a KV cache supports decoder-only "
                         f"models whose attention is causal")
    if len(g.outputs) != 1 or g.type_of(g.outputs[0]).rank != 3:
        raise CacheError(f"generation needs one output of logits [B, T, vocab]; {g.name} gives "
                         + ", ".join(f"{o}: {g.type_of(o)}" for o in g.outputs))
    logits = g.outputs[0]
    if mode == "auto":
        mode = "concat" if any(n.attrs["window"] for n in sites) else "buffer"
    elif mode == "buffer" and any(n.attrs["window"] for n in sites):
        raise CacheError("a sliding-window model cannot use the buffer cache (the window would be measured from "
                         "the buffer's end); use the concat cache")
    p_dim = dims.symbol("P")
    if "P" in g.symbols:
        raise CacheError("the model already uses a dimension named P, which the cache needs for past positions")

    g.add_input(MASK, TensorType("i64", (b_dim, p_dim + t_dim)))
    g.add_input(POSITIONS, TensorType("i64", (b_dim, t_dim)))
    info = CacheInfo(tokens, logits, last_only=last_only, mode=mode)

    # ---- positions: learned tables and rotary embeddings read position_ids
    for node in list(g.nodes.values()):
        if node.op == "arange":
            if not dims.equal(dims.dim(node.attrs["n"]), t_dim):
                continue
            users = g.consumers(node.outputs[0])
            if not users or any(u.op != "embedding" or u.inputs[0] != node.outputs[0] for u in users):
                raise CacheError(f"arange({dims.fmt(t_dim)}) at {node.scope or '<model>'} is used for something other "
                                 f"than a position table; its cached form is not known")
            for u in users:
                g.set_inputs(u, [POSITIONS] + u.inputs[1:])
                info.context = dims.static_int(g.type_of(u.inputs[1]).shape[0])
            g.remove_nodes([node.name])
        elif node.op == "sinusoidal":
            if not dims.equal(dims.dim(node.attrs["n"]), t_dim):
                continue
            from tessera.compiler.reference.numerics import sinusoidal_table

            # sinusoidal(T, d) -> rows position_ids of the fixed table, up to max_positions
            out_t = g.type_of(node.outputs[0])
            table = g.add_const("cache/sinusoidal", sinusoidal_table(max_positions, node.attrs["d"]).astype(
                np.float16 if out_t.dtype == "f16" else np.float32), out_t.dtype)
            emb = g.add_node("embedding", [POSITIONS, table.name], [TensorType(out_t.dtype, (b_dim, t_dim) +
                                                                              out_t.shape[1:])],
                             {}, node.scope, node.pos, name=f"{node.name}/positions", origin=node.origin)
            _insert_before(g, emb, node.name)
            for u in g.consumers(node.outputs[0]):
                g.set_inputs(u, [emb.outputs[0] if i == node.outputs[0] else i for i in u.inputs])
            g.remove_nodes([node.name])
            info.context = max_positions
        elif node.op == "rope":
            g.set_inputs(node, [node.inputs[0], POSITIONS])
            if node.attrs.get("max_ctx"):  # the trained context bounds prompt + new tokens
                info.context = min(info.context or node.attrs["max_ctx"], node.attrs["max_ctx"])

    dtype = g.type_of(sites[0].inputs[0]).dtype
    info.dtype = dtype

    # ---- per layer: past + new -> present, attention over present
    for i, node in enumerate(sites):
        q, k, v = node.inputs[:3]
        k_t, v_t = g.type_of(k), g.type_of(v)
        kv_heads, hd, hv = node.attrs["kv_heads"], int(k_t.shape[-1]), int(v_t.shape[-1])
        out_k, out_v = (f"present_key.{i}", f"present_value.{i}") if mode == "concat" else (f"key.{i}", f"value.{i}")
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
        # causal over P+T keys (the queries are the last T), the spec's window, the mask as key padding
        g.set_inputs(node, [q, full[0], full[1], MASK])
        node.attrs.update(padding=True, bias=False)
        unfit = "not the buffer cache" if mode != "buffer" else (
            f"the {impl} kernel" if impl not in (None, "phased") else _gqa_unfit(node, g, target))
        if forced_gqa and unfit:
            raise CacheError(f"the gqa decode kernel (--decode gqa) cannot decode the attention at "
                             f"{node.scope or node.name}: {unfit}")
        gqa = decode == "gqa" and not unfit
        node.attrs["impl"], reason = (impl, "forced") if impl else choose_cached(node, g, target, gqa_decode=gqa)
        if gqa:
            node.attrs["decode"] = "gqa"
            layer.buffer_key, layer.buffer_value = f"cache_key.{i}", f"cache_value.{i}"
            node.attrs["buffer_outputs"] = [layer.buffer_key, layer.buffer_value]
            node.attrs["length_input"] = LENGTH
        info.layers.append(layer)
        info.kernels.append(CacheKernel(node.scope or node.name, node.attrs["impl"], reason))
    g.symbols["P"] = SymbolSource(info.layers[0].past_key, 2)
    if any(layer.buffer_key for layer in info.layers):
        g.add_input(LENGTH, TensorType("i64", (dims.dim(1),)))
        info.length_input = LENGTH

    # ---- last position only: slice the head's input
    if last_only:
        head = g.producer(logits)
        # through identities and pointwise ops with constant operands (Gemma 2's tanh(l / c) * c)
        while head is not None and (head.op == "identity" or (ops.has_trait(head.op, "elementwise") and
                                                              all(v in g.consts for v in head.inputs[1:]))):
            head = g.producer(head.inputs[0])
        if head is None or head.op not in ("linear", "linear_nbits"):  # float or quantised (--quantize-head)
            raise CacheError("last_only needs the logits to come from a linear output head")
        x = head.inputs[0]
        xt = g.type_of(x)
        sl = g.add_node("slice", [x], [TensorType(xt.dtype, (xt.shape[0], dims.dim(1)) + xt.shape[2:])],
                        {"axis": 1, "start": t_dim - 1, "end": t_dim}, head.scope, head.pos, name="cache/last")
        _insert_before(g, sl, head.name)
        g.set_inputs(head, [sl.outputs[0]] + head.inputs[1:])

    g.outputs = [logits] + [n for layer in info.layers for n in (layer.present_key, layer.present_value)]
    g.reindex()
    _propagate(g)
    g.prune_constants()
    ops.check_graph(g)
    return info
