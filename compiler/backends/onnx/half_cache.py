"""The lowerings' helpers for a KV cache stored at fp16 beside an fp32 model (``--kv-cache-dtype fp16``).

Why a module of its own: cached_attention.py and mixed_attention.py both use them (cached_attention imports
mixed_attention, so these cannot live in either without a cycle), and compiler/passes/kv_cache_dtype.py,
which types the cache, names the cast it inserts (``TO_F32``) from here (passes sit above the backends).
The rule they implement: the cache input is the f16 buffer; GroupQueryAttention reads it in place in fp16
(its queries, new keys and values and bias cast to fp16, its output back); every other reader converts
what it reads inside its own branch; the new keys and values go out as the cache holds them.
"""

from __future__ import annotations

from tessera.compiler.backends.onnx.floats import onnx_float as _onnx_float

# onnx is imported where a node is made, not here: passes/kv_cache_dtype.py imports TO_F32, and the pipelines
# that import it run in `tessera report`, which must not load onnx (tests/project/test_cli_help.py)

TO_F32 = "/to_f32"  # the suffix of the IR's cast of a past to the model's precision (passes/kv_cache_dtype.py)


def stored_past(g, value: str) -> str:
    """The cache input a past value reads: ``value`` itself, or the f16 input its ``cast`` reads."""
    p = g.producer(value)
    if p is not None and p.op == "cast" and p.name.endswith(TO_F32) and p.inputs[0] in g.inputs:
        return p.inputs[0]
    return value


def as_compute(b, x: str, like: str) -> str:
    """``x`` (a past as stored: an IR value) at the precision of ``like`` (the queries): a Cast where the
    cache is stored below the model's precision, else ``x`` itself."""
    have, want = b.graph.type_of(x).dtype, b.graph.type_of(like).dtype
    return x if have == want else b.node("Cast", [x], to=_onnx_float(want))[0]


def half_cache(b, past: str, q: str) -> bool:
    """Whether the cache is stored at f16 below an f32 model (GroupQueryAttention then runs in fp16: its
    queries and new keys and values cast to fp16, its output back)."""
    return b.graph.type_of(past).dtype == "f16" and b.graph.type_of(q).dtype == "f32"


def to_half(b, xs: list[str]) -> list[str]:
    """Casts to fp16 ("" stays: an absent optional input)."""
    return [b.node("Cast", [x], to=_onnx_float("f16"))[0] if x else x for x in xs]


def half_bias(b, bias: str) -> str:
    """GroupQueryAttention's attention_bias at fp16 (its type is the queries'), cast once in the main graph
    (called while the main graph is being built: before a site's branches)."""
    if not bias:
        return bias
    key = ("half_bias", bias)
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            b.shared[key] = b.node("Cast", [bias], [b.fresh("gqa/attention_bias_f16")], to=_onnx_float("f16"))[0]
        finally:
            b.current = saved
    return b.shared[key]


def new_columns(b, past: str, new: str, out: str) -> None:
    """The new keys or values as the cache outputs hold them, into ``out``: at the stored past's precision
    (an fp16 cache: a Cast), else an Identity."""
    want = b.graph.type_of(past).dtype
    if want != b.graph.type_of(new).dtype:
        b.node("Cast", [new], [out], to=_onnx_float(want))
    else:
        b.node("Identity", [new], [out])
