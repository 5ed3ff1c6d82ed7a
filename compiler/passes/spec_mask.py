"""A decoder's own key padding mask input, which the KV cache's ``attention_mask`` replaces.

Why: a decoder spec may take a padding mask beside its token ids (``in mask: i64[B, T]``, 1 for a
real token, 0 for padding, as transformers' attention_mask) and hand it to its attention as key
padding (``attention(..., mask=mask)``, ``sdpa(..., mask=mask)`` or ``padding_mask(s, mask)``). The
cached decoder already takes such a mask: ``attention_mask`` [B, P+T] over the past and new columns,
which the runtime builds for left-padded prompts and a buffer's unfilled slots, and which every cache
site reads as its key padding. So the spec's mask has a cached form exactly when it reaches the scores
as nothing but that: every use of it is the padding-mask operand of a fused attention (a [B, Tk] mask
over the key axis, broadcast over the queries and heads). Then kv-cache-layers puts ``attention_mask``
in its place and the input goes; the runtime feeds nothing new.

Anything else is refused with the node and the reason (``CacheError``): a mask read by another op (a
query mask multiplied into activations, positions counted from it, an additive bias or ALiBi built from
it: each would need the cache's mask transformed, which is not derived here), an attention that was not
fused (its mask is still a ``padding_mask`` over unfused scores), or an extra input that is not a mask
at all (a second per-token input the runtime has nothing to feed from).
"""

from __future__ import annotations

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.passes.cache_parts import CacheError

FUSED = "fused_attention"
MASK_DTYPES = ("i64", "i32", "bool")
SUPPORTED = ("a key padding mask has a cached form when it reaches the scores only as an attention's mask over "
             "the key axis: attention(..., mask=m), sdpa(..., mask=m) or padding_mask(scores, m), m the input itself")


def _where(node: Node) -> str:
    return f"{node.op} at {node.scope or node.name}" + (f" ({node.origin})" if node.origin else "")


def is_key_padding_of(node: Node, value: str) -> bool:
    """Whether ``node`` is a fused attention reading ``value`` as its padding mask, and only so."""
    return node.op == FUSED and bool(node.attrs.get("padding")) and node.inputs[3] == value and \
        value not in node.inputs[:3] + node.inputs[4:]


def key_padding_problem(g: Graph, name: str, t_dim) -> str | None:
    """Why the input ``name`` is not a key padding mask the cache can replace (None: it is one)."""
    t = g.type_of(name)
    if t.dtype not in MASK_DTYPES or t.rank != 2 or not dims.equal(dims.dim(t.shape[1]), t_dim):
        return f"it is {t}, not a mask [B, {dims.fmt(t_dim)}] of integers or bool over the tokens"
    users = g.consumers(name)
    if not users:
        return "no node reads it"
    if name in g.outputs:
        return "it is an output of the model"
    for u in users:
        if u.op == "padding_mask":
            return (f"it reaches the scores through {_where(u)}, an attention that was not fused (--explain says "
                    f"why), so the cache has no site to give its mask")
        if not is_key_padding_of(u, name):
            how = "the attention's keys, values, queries or score bias" if u.op == FUSED else "its operand"
            return f"{_where(u)} reads it as {how}, not as a key padding mask; {SUPPORTED}"
        keys = g.type_of(u.inputs[1]).shape[-2]
        if not dims.equal(dims.dim(keys), t_dim):
            return f"{_where(u)} reads it as the padding of keys [{dims.fmt(keys)}], not of the tokens' own keys"
    return None


def token_and_masks(g: Graph) -> tuple[str, list[str]]:
    """A decoder's token ids and its key padding mask inputs, or a CacheError naming the input that is
    neither. The token ids are the one integer [B, T] input an ``embedding`` reads as its ids."""
    ids = [i for i in g.inputs if g.type_of(i).dtype in ("i64", "i32") and g.type_of(i).rank == 2
           and any(u.op == "embedding" and u.inputs[0] == i for u in g.consumers(i))]
    if len(ids) != 1:
        why = (f"the inputs {', '.join(ids)} are all read by an embedding as ids, and the runtime feeds one input of "
               f"token ids (and the cache's attention mask), nothing to the others" if ids else
               "no input is read by an embedding as token ids")
        raise CacheError(f"generation needs a decoder-only model whose inputs are token ids [B, T] and, beside them, "
                         f"only key padding masks; {g.name} takes "
                         + ", ".join(f"{i}: {g.type_of(i)}" for i in g.inputs) + f": {why}")
    tokens = ids[0]
    t_dim = g.type_of(tokens).shape[1]
    masks = []
    for name in g.inputs:
        if name == tokens:
            continue
        problem = key_padding_problem(g, name, t_dim)
        if problem:
            raise CacheError(f"generation feeds a decoder its token ids ({tokens}) and the cache's attention mask; "
                             f"the input {name} of {g.name} has no cached form: {problem}")
        masks.append(name)
    return tokens, masks


def spec_masks(g: Graph, sites: list[Node]) -> list[str]:
    """The graph inputs the cache sites read as their padding mask (the spec's own masks)."""
    return sorted({n.inputs[3] for n in sites if n.attrs.get("padding") and n.inputs[3] in g.inputs})


def drop_spec_masks(g: Graph, masks: list[str], tokens: str) -> None:
    """Remove the spec's mask inputs no node reads any more (kv-cache-layers read the cache's mask in their
    place); a symbol read from one (T, B) is read from the token ids instead, at the same axis."""
    for name in masks:
        if g.consumers(name):
            raise CacheError(f"the mask input {name} is still read by "
                             + ", ".join(_where(u) for u in g.consumers(name)))
        for sym, src in list(g.symbols.items()):
            if src.input == name:
                g.symbols[sym] = type(src)(tokens, src.axis)
        g.remove_input(name)
