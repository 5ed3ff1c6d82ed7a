"""Which block-quantised products round their activations to int8 and which keep them in fp32, per kind
of linear (--quantize-activations; compiler/passes/quantize.py and stored_codes.py ask ``level``).

MatMulNBits' ``accuracy_level`` 4 rounds each block of 32 activations to int8 (scale max|x| / 127) and
runs onnxruntime's integer kernels; 0 keeps the activations in fp32 and dequantises the weights inside
the kernel. On the AVX2 EPYC without VNNI (onnxruntime 1.31.1, bench/matmul_nbits_choice.py,
docs/benchmarks/log.md "One row, one kernel"), at one row (decoding) 4 is 3-4x faster than 0 for every
SmolLM2-135M product at 4 bits and 10-100x at 8 bits (0 dequantises the whole 8-bit matrix each call),
and faster than an fp32 MatMul too; at 128 rows the two are within the machine's noise. So int8 is the
default for every kind; a kind can be kept in fp32 for accuracy, at that cost.

The value: ``int8`` (every product), ``float`` (every product in fp32), or ``float:KIND[,KIND...]``: the
kinds named in fp32, the rest int8. The kinds, from the linear's name as the model's spec writes it
(spec/stdlib/nn.tsr: q, k, v, o, gate, up, down; Hugging Face's q_proj ... as well) and, for the head,
from the graph (a model output, or tied to an embedding table):

- ``qkv``: the attention's input projections (q, k, v; fused into one later);
- ``o``: the attention's output projection;
- ``gate-up``: the MLP's input projections (gate, up, fc1; fused into one later);
- ``down``: the MLP's output projection (down, fc2), whose inputs carry the largest outliers;
- ``head``: the output head;
- ``other``: any other linear (a name not listed here).

q, k and v share one kind (and gate and up), so the linears that fusion joins share their level.
"""

from __future__ import annotations

from tessera.compiler import ops

KINDS = ("qkv", "o", "gate-up", "down", "head", "other")
LEVELS = {"int8": 4, "float": 0}  # MatMulNBits accuracy_level
NAME_KINDS = {"q": "qkv", "k": "qkv", "v": "qkv", "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv": "qkv",
              "o": "o", "o_proj": "o", "out_proj": "o",
              "gate": "gate-up", "up": "gate-up", "gate_proj": "gate-up", "up_proj": "gate-up", "fc1": "gate-up",
              "down": "down", "down_proj": "down", "fc2": "down"}
DEFAULT = "int8"


def float_kinds(value: str | None) -> frozenset[str]:
    """The kinds ``value`` keeps in fp32; ValueError naming the bad part where it is not a value."""
    value = DEFAULT if value is None else value
    if value in LEVELS:
        return frozenset(KINDS) if value == "float" else frozenset()
    head, sep, rest = value.partition(":")
    kinds = [k.strip() for k in rest.split(",")] if sep else []
    bad = [k for k in kinds if k not in KINDS]
    if head != "float" or not kinds or bad:
        raise ValueError(f"activations must be int8, float or float:KIND[,KIND...] with KIND one of "
                         f"{', '.join(KINDS)}, got {value!r}" + (f" ({', '.join(map(repr, bad))} unknown)" if bad else ""))
    return frozenset(kinds)


def check(value: str | None) -> None:
    float_kinds(value)


def kind(name: str, head: bool) -> str:
    """The kind of the linear node ``name`` (``head``: it is the output head)."""
    return "head" if head else NAME_KINDS.get(name.rsplit(".", 1)[-1], "other")


def level(value: str | None, name: str, head: bool) -> int:
    """MatMulNBits' accuracy_level for the linear ``name`` under ``value``."""
    return LEVELS["float"] if kind(name, head) in float_kinds(value) else LEVELS["int8"]


def describe(levels: dict[str, int]) -> str:
    """{node kind: level} of a compiled graph in words, for --explain and the report."""
    by = {lv: sorted({k for k, v in levels.items() if v == lv}, key=KINDS.index) for lv in set(levels.values())}
    words = {4: "int8 activations", 0: "fp32 activations"}
    return "; ".join(f"{words.get(lv, f'accuracy_level {lv}')}: {', '.join(ks)}" for lv, ks in sorted(by.items(), reverse=True))


def is_output(graph, value: str) -> bool:
    """Whether ``value`` is a model output, directly or through views and casts (``logits = head``
    is an identity node)."""
    seen, stack = set(), [value]
    while stack:
        v = stack.pop()
        if v in graph.outputs:
            return True
        for c in graph.consumers(v):
            if (c.op in ("identity", "cast") or ops.has_trait(c.op, "alias")) and c.outputs[0] not in seen:
                seen.add(c.outputs[0])
                stack.append(c.outputs[0])
    return False


def is_head(graph, node) -> bool:
    """Whether the linear ``node`` is the output head: a model output (through views) or tied to an
    embedding table (the rule compiler/passes/quantize.py gives the head its own bits by)."""
    return is_output(graph, node.outputs[0]) or any(c.op == "embedding" for c in graph.consumers(node.inputs[1]))
