"""The KV cache stored at a lower precision than the model computes in (``--kv-cache-dtype fp16``).

Why: a decoder's KV cache grows with every position of every sequence; at fp16 it takes half the bytes
of fp32, so twice the sequences fit a fixed memory (issue 40 item 2). The model itself stays fp32 (its
weights, its products): only what crosses the interface as the cache is fp16, and the attention over it.

What this pass does (after the cache passes, passes/kv_cache.py, on an fp32 graph): every cache input
``past_key.{i}`` / ``past_value.{i}`` is typed f16 and read through a ``cast`` to f32 (named
``{past}/to_f32``); every cache output (``key.{i}``: the new columns the runtime writes into its rows) is a
``cast`` to f16 of the new keys and values. The numpy interpreter runs that graph as written, so it is
the reference of an fp16 cache: the past rounded to fp16, the attention over it in fp32.

How it is lowered (backends/onnx/cached_attention.py, mixed_attention.py, half_cache.py): the ``cast`` of a
past is never emitted in the main graph (that would convert the whole cache at every step). The
decoding step's GroupQueryAttention reads the fp16 buffer in place (past and present bound to one
buffer, the new column written by the kernel), its queries and new keys and values cast to fp16 and its
output cast back to fp32. fp32 queries over an fp16 cache (a mixed T/T_CACHE, which onnxruntime 1.31's
schema allows) give the same output but ran slower still in a probe (bench/kv_fp16_gqa_probe.py; on this
machine's CPU, without fp16 arithmetic, the fp16 kernel itself is slower than fp32's: docs/serve.md
gives the figures: the fp16 cache buys memory, not speed). Every other reader of the past (the
prompt's tiled kernel, the engine's combined call's chunk block, the verifying call of speculation,
which is the prompt branch) casts what it reads to fp32 inside its branch.

Assumptions, checked here (a CacheError says which failed, and why):
- every cached attention site decodes by GroupQueryAttention over the buffer cache (the only reader of
  the cache in place; the plain decoding step would cast the whole cache every step): a sliding window,
  chunked attention or a concat cache decodes otherwise and is refused;
- no recurrent state is carried (its state is not attention's cache: not built);
- the graph computes in fp32 (with ``--dtype fp16`` the cache is fp16 already, by the precision pass).
"""

from __future__ import annotations

from tessera.compiler.backends.onnx.half_cache import TO_F32
from tessera.compiler.ir.graph import Graph, TensorType
from tessera.compiler.passes.base import Pass, PassResult
from tessera.compiler.passes.cache_parts import CacheError

# the cache's precisions as the options name them; "auto" is the model's own (fp32, or fp16 with --dtype fp16)
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8", "int4")
BUILT = ("auto", "fp32", "fp16")
# why int8 and int4 are refused (docs/serve.md "A quantised KV cache")
QUANTISED_REASON = ("onnxruntime 1.31's CPU GroupQueryAttention reads an int8/int4 cache only with fixed scales "
                    "(one per tensor or per channel, given as inputs, calibrated beforehand), not per token, and "
                    "every other reader of the cache (the prompt's tiled kernel, the engine's combined call, the "
                    "verifying call of --speculative) computes in float: not built (docs/serve.md, A quantised KV "
                    "cache); fp16 halves the cache")


def resolve(kv_cache_dtype: str, model_dtype: str) -> str:
    """The cache's precision for a compile at ``model_dtype`` (fp32, fp16, bf16); raises a CacheError
    for what is refused."""
    if kv_cache_dtype in ("int8", "int4"):
        raise CacheError(f"--kv-cache-dtype {kv_cache_dtype}: {QUANTISED_REASON}")
    if kv_cache_dtype not in BUILT:
        raise CacheError(f"unknown --kv-cache-dtype '{kv_cache_dtype}' (choose from {', '.join(KV_CACHE_DTYPES)})")
    if kv_cache_dtype == "auto":
        return model_dtype
    if model_dtype != "fp32" and kv_cache_dtype != model_dtype:
        raise CacheError(f"--kv-cache-dtype {kv_cache_dtype} with --dtype {model_dtype}: a model compiled at "
                         f"{model_dtype} keeps its cache at {model_dtype} (the cache is lowered with the model); "
                         f"drop --kv-cache-dtype or give {model_dtype}")
    return kv_cache_dtype


class StoreCacheAt(Pass):
    """The cache's inputs and outputs at fp16 in an fp32 graph (see the module docstring)."""

    name = "kv-cache-dtype"

    def __init__(self, dtype: str = "f16"):
        self.dtype = dtype

    def requires(self, g: Graph) -> None:
        from tessera.compiler.passes.kv_cache import cached_sites

        if any(i.startswith(("past_state.", "past_conv.")) for i in g.inputs):
            raise CacheError("--kv-cache-dtype fp16: this model carries recurrent state (a scan or a causal conv1d), "
                             "which is not attention's key/value cache; a lower-precision state is not built")
        sites = cached_sites(g)
        if not sites:
            raise CacheError(f"{self.name} needs the cache passes first (no cached attention sites)")
        for node in sites:
            if node.attrs.get("decode") != "gqa":
                why = ("a sliding window" if node.attrs.get("window") else "chunked attention" if node.attrs.get("chunk")
                       else "its decoding step is not GroupQueryAttention")
                raise CacheError(f"--kv-cache-dtype fp16 needs every attention site to decode by onnxruntime's "
                                 f"GroupQueryAttention over the buffer cache, the one kernel that reads an fp16 cache "
                                 f"in place (any other decoding step would convert the whole cache at every step); "
                                 f"the attention at {node.scope or node.name} decodes otherwise ({why}): keep the "
                                 f"default cache")
            if g.type_of(node.inputs[0]).dtype != "f32":
                raise CacheError(f"--kv-cache-dtype fp16 lowers the cache of an fp32 model; this one computes in "
                                 f"{g.type_of(node.inputs[0]).dtype}")

    def run(self, g: Graph) -> PassResult:
        low = self.dtype
        pasts = [i for i in g.inputs if i.startswith(("past_key.", "past_value."))]
        for past in pasts:
            t = g.type_of(past)
            users = g.consumers(past)
            g.values[past].type = TensorType(low, t.shape)
            cast = g.add_node("cast", [past], [TensorType("f32", t.shape)], {"dtype": "f32"}, "", None,
                              name=past + TO_F32, first=True)
            g.replace_uses(past, cast.outputs[0], users)
        for out in g.outputs[1:]:  # the new columns (buffer mode): identities of the new keys and values
            node = g.producer(out)
            if node is None or node.op != "identity":
                raise CacheError(f"{self.name}: the cache output {out} is not an identity of the new keys or values")
            node.op, node.attrs = "cast", {"dtype": low}
            g.values[out].type = TensorType(low, g.type_of(out).shape)
        g.reindex()
        return PassResult(g, True, [f"KV cache stored at {low}: {len(pasts)} past inputs read through a cast to f32"])
