"""Weight quantisation: each ``linear`` whose weight is a parameter becomes a quantised linear, its
weight replaced by derived parameters (compiler/reference/quant.py):

- schemes ``int8`` and ``int4``: ``linear_nbits`` (onnxruntime's com.microsoft.MatMulNBits), the
  packed values and their block-wise scales. Activations are stored in float; by default
  MatMulNBits quantises them to int8 on the fly inside the product (accuracy_level 4,
  ``activations="int8"``), ``activations="float"`` keeps the product in fp32 (accuracy_level 0);
- scheme ``int4-asym``: ``linear_nbits`` with zero points: asymmetric blocks, all 16 levels over each
  block's [min, max] and the scale searched per block for the least squared error
  (compiler/reference/quant.py ``quantize_zp``);
- scheme ``w8a8``: ``linear_int8``, int8 values with one scale per output row; at run time each
  row (token) of the activations is quantised to int8 with a scale of its own, and the product runs
  in onnxruntime's integer GEMM (com.microsoft.MatMulIntegerToFloat: VNNI, AMX where the CPU has
  them). Per row, not per tensor: a token's result must not depend on the rest of its batch.

Why: decoding reads every weight once per token, so its time is the weight bytes (4x fewer with
int8, 8x with int4, plus the scales). A batch of rows or a prompt is bound by arithmetic instead,
and there the integer GEMM of ``w8a8`` is several times fp32's, where MatMulNBits' int8 path is not
(docs/benchmarks/log.md "Serving with w8a8"); its activations carry one scale per row, coarser than
MatMulNBits' per block of 32.

The output head (a linear whose result is a model output, through views or not, or whose weight is
also an embedding table, GPT-2's tied head) has bits of its own (``head``, --quantize-head): its
errors go straight into the logits. Under ``int4``, ``int4-asym`` and ``int8`` it is quantised at 8
bits by default (``auto``), llama.cpp's layout (its Q4_0/Q4_1/Q4_K_M files keep the output at Q6_K or
Q8_0, its Q8_0 files at Q8_0): for SmolLM2-135M, whose tied head is two thirds of the bytes a decoding
step reads at int4, a float head kept decoding slow and a 4-bit one cost a third more perplexity
(issue 42); under int8 the 8-bit head decodes 1.24-1.29x faster than a float one for +0.25 % perplexity
(x1.0048 of fp32's on the file's weights, x1.0012 off their grid: docs/benchmarks/log.md run qs4).
8 bits: symmetric under ``int4`` and ``int8`` (max|w| / 127 per block), with zero points under
``int4-asym``. Under ``w8a8`` ``auto`` keeps it float, as before. ``float``, ``8``
and ``4`` ask for one; ``on`` (the old ``--quantize-head`` alone) is the scheme's head bits
(``HEAD_BITS``: int4 4, the others 8).

The token embedding tables have bits of their own too (``embedding``, --quantize-embedding): under
the 4-bit schemes they are stored at 8 bits by default (``auto``), as codes in MatMulNBits' 8-bit
layout with a scale per block of ``block_size`` along the row (and a zero point under ``int4-asym``),
gathered and dequantised by ``embedding_nbits`` (onnxruntime's GatherBlockQuantized, which reads
that layout: uint8 codes, the blocks along the row). Why: a gather reads one row per token, so the
codes save no time, but the fp32 table is most of a small model's bytes once its linears are int4
(SmolLM2-135M: 113 MB against 66 MB); SmolLM2's own Q4_1 file stores it in Q8_0. A tied head at the
same bits reads the same codes (one set of parameters: the recipe, hence the name, is the same), so
the float table is gone; where the tied head reads a GGUF file's own 8-bit codes (Q8_0, Q5_0:
compiler/passes/stored_codes.py) the embedding gathers those, the file's values exactly. A tied head
left float keeps the table float under ``auto`` too (codes beside it would only add bytes; ``8``
stores them anyway). ``float`` keeps the table; under ``int8`` ``auto`` stores a table at 8 bits
only where the 8-bit head is tied to it (one set of codes, llama.cpp's Q8_0 layout) and keeps any
other table float, as before (an encoder's table: codes would save bytes, not time);
``w8a8`` takes no ``8`` (its codes are int8 with one scale per row, a layout GatherBlockQuantized
does not read). Position tables (an embedding of computed ids, GPT-2's ``wpe``) stay float: the
KV-cache pass re-indexes them, and they are small.

Which linears: every one whose weight is a parameter (the head at its own bits, or left float), except
- linears with fewer than ``block_size`` input features or fewer than 16 outputs (a Mixtral
  router: tiny, and its top-k choice is brittle);
Every linear and embedding table left in float gets a note saying why.

The derived parameters are computed from the original weight when the model is written, one
weight at a time; the original parameter is dropped when nothing else reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.compiler import ops
from tessera.compiler.passes import activations as act
from tessera.compiler.passes.activations import is_output as _is_output
from tessera.compiler.ir.graph import DTYPES, Graph, Param
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.passes.stored_codes import TAG as STORED, is_stored
from tessera.compiler.reference.quant import BITS, ROWS, blocks, packed_shape, zeros_shape

SCHEMES = {"int8": 8, "int4": 4, "w8a8": 8, "int4-asym": 4}
ROW_SCHEMES = ("w8a8",)  # one scale per output row and per activation row (linear_int8)
ZERO_POINT_SCHEMES = ("int4-asym",)  # asymmetric blocks with zero points, the scale searched (quantize_zp)
HEAD_BITS = {"int4-asym": 8}  # the output head's bits under head "on" (the old --quantize-head), where not the scheme's
# --quantize-head: auto (8 bits under int4, int4-asym and int8, float under w8a8), float, 8, 4, or on (HEAD_BITS)
HEADS = ("auto", "float", "8", "4", "on")
# --quantize-embedding: auto (8 bits under int4 and int4-asym; under int8 where a tied 8-bit head shares the
# codes; float under w8a8), float or 8
EMBEDDINGS = ("auto", "float", "8")
EMBEDDING_BITS = 8  # the one width embedding_nbits stores
# MatMulNBits' accuracy_level per kind of linear (--quantize-activations: compiler/passes/activations.py):
# 0 computes in fp32 from dequantised weights; 4 quantises each block of activations to int8 at run time
# and uses onnxruntime's integer kernels (3-4x faster for one token at a time on this CPU: docs/benchmarks/log.md).
DEFAULT_BLOCK = 32
MIN_OUTPUTS = 16


@dataclass(frozen=True)
class QuantConfig:
    """What --quantize asks for: the scheme (int8 or int4), the block size along the input
    features, and the output head's bits (``head``, one of HEADS: ``head_bits``)."""

    scheme: str
    block_size: int = DEFAULT_BLOCK
    head: str = "auto"
    activations: str = "int8"  # int8, float or float:KIND[,KIND] (compiler/passes/activations.py): accuracy_level per kind
    embedding: str = "auto"  # the token embedding tables' bits (EMBEDDINGS: embedding_bits)

    def __post_init__(self):
        """``head`` as a bool (the old field: True quantised it at the scheme's head bits, False kept it
        float) or the bits as an int, spelled as HEADS spells them."""
        if isinstance(self.head, bool):
            object.__setattr__(self, "head", "on" if self.head else "float")
        elif isinstance(self.head, int) and not isinstance(self.head, bool):
            object.__setattr__(self, "head", str(self.head))
        if isinstance(self.embedding, int) and not isinstance(self.embedding, bool):
            object.__setattr__(self, "embedding", str(self.embedding))

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def per_row(self) -> bool:
        return self.scheme in ROW_SCHEMES

    @property
    def zero_points(self) -> bool:
        return self.scheme in ZERO_POINT_SCHEMES

    @property
    def head_bits(self) -> int | None:
        """The output head's bits, None for float."""
        if self.head == "auto":
            return None if self.per_row else 8
        if self.head == "on":
            return HEAD_BITS.get(self.scheme, self.bits)
        return None if self.head == "float" else int(self.head)

    @property
    def embedding_bits(self) -> int | None:
        """The token embedding tables' bits, None for float."""
        if self.embedding == "auto":
            return None if self.per_row else EMBEDDING_BITS
        return None if self.embedding == "float" else int(self.embedding)

    def describe(self) -> str:
        """The quantisation in words (generate's --explain: what the compiled decoder holds, hit or miss)."""
        return f"{self.scheme}, {self.granularity}; {self.head_words()}; {self.embedding_words()}" + \
            ("" if self.per_row else f"; {self.activation_words()}")

    def activation_words(self) -> str:
        """Which products round their activations to int8, in words (--quantize-activations)."""
        floats = act.float_kinds(self.activations)
        if not floats:
            return "int8 activations in every product"
        if floats == frozenset(act.KINDS):
            return "fp32 activations in every product (--quantize-activations float)"
        return (f"fp32 activations in {', '.join(k for k in act.KINDS if k in floats)} (--quantize-activations "
                f"{self.activations}), int8 in the rest")

    def embedding_words(self) -> str:
        """The embedding tables' treatment in words, for --explain and the report."""
        if self.embedding_bits is None:
            return "the embedding float, " + ("as --quantize-embedding float asks" if self.embedding == "float" else
                                              f"{self.scheme}'s default (--quantize-embedding 8 quantises it)")
        if self.embedding == "auto" and self.bits == 8:
            return "the embedding at 8 bits where the 8-bit head is tied to it (one set of codes), else float: " \
                   "int8's default"
        return f"the embedding at {self.embedding_bits} bits" + (
            ", the 4-bit schemes' default" if self.embedding == "auto" else
            f" as --quantize-embedding {self.embedding} asks")

    def head_words(self) -> str:
        """The head's treatment in words, for --explain and the report."""
        bits = self.head_bits
        if bits is None:
            return "the output head float, " + ("as --quantize-head float asks" if self.head == "float" else
                                                f"{self.scheme}'s default (--quantize-head 8 quantises it)")
        how = {"auto": ", the default of int4, int4-asym and int8", "on": ", the scheme's (--quantize-head alone)"}
        return f"the output head at {bits} bits" + how.get(self.head, f" as --quantize-head {self.head} asks")

    @property
    def granularity(self) -> str:
        """What one scale covers, in words: "per row" (w8a8) or "block 32"."""
        return "per row" if self.per_row else f"block {self.block_size}"

    def check(self) -> None:
        if self.scheme not in SCHEMES:
            raise PassError(f"quantize must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.head not in HEADS:
            raise PassError(f"quantize head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.embedding not in EMBEDDINGS:
            raise PassError(f"quantize embedding must be one of {', '.join(EMBEDDINGS)}, got {self.embedding!r}")
        if self.per_row and self.embedding_bits is not None:
            raise PassError(f"{self.scheme} stores int8 codes with one scale per row, a layout onnxruntime's "
                            f"GatherBlockQuantized does not read: its embedding stays float (--quantize-embedding "
                            f"8 needs int8, int4 or int4-asym)")
        if self.per_row and self.head_bits not in (None, 8):
            raise PassError(f"{self.scheme} quantises per output row to int8: its output head is 8 bits or float, "
                            f"not {self.head_bits}")
        if self.per_row:
            if self.block_size != ROWS or self.activations != "int8":
                raise PassError(f"{self.scheme} has one scale per output row and quantises the activations per "
                                f"row: the block size and the activations' precision are int8/int4's "
                                f"(drop --quantize-block and --quantize-activations)")
            return
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
            raise PassError(f"the quantisation block size must be a power of two of at least 16 "
                            f"(MatMulNBits' rule), got {b!r}")
        try:
            act.check(self.activations)
        except ValueError as e:
            raise PassError(f"quantize {e}") from None


@dataclass(frozen=True)
class QuantNote:
    """One linear: quantised or not, and why not."""

    node: str
    weight: str
    quantized: bool
    reason: str = ""
    bits: int = 0  # where quantised
    head: bool = False  # the output head (a model output, or tied to an embedding table)
    embedding: bool = False  # an embedding's table (``weight``), not a linear

    def describe(self) -> str:
        what = "the table " if self.embedding else ""
        also = {"float kept": "; its float table kept too, which the output head reads",
                "stored": ": the checkpoint's own codes, which the tied head reads"}.get(self.reason, "")
        return f"{self.node} ({self.weight}): " + (f"{what}quantised at {self.bits} bits{also}" if self.quantized
                                                   else f"{what}kept in float: {self.reason}")


class QuantizeWeights(Pass):
    name = "quantize-weights"

    def __init__(self, config: QuantConfig):
        config.check()
        self.config = config
        self._tied_heads: set[str] = set()

    def requires(self, graph: Graph) -> None:
        done = next((n.name for n in graph.nodes.values() if ops.has_trait(n.op, "quantized")
                     and not (len(n.inputs) > 1 and is_stored(graph, n.inputs[1]))), None)  # a file's own codes
        if done:
            raise PassError(f"the graph is already quantised (node {done})")

    def _why_not(self, graph: Graph, node) -> str | None:
        w = node.inputs[1]
        if graph.values[w].kind != "param":
            return "its weight is computed, not a parameter"
        p = graph.params[w]
        if p.dtype != "f32":
            return f"its weight is {p.dtype}; quantisation starts from f32 weights"
        n, k = p.shape
        if self.config.head_bits is None:
            why = "--quantize-head float" if self.config.head == "float" else "--quantize-head 8 quantises it"
            if any(c.op == "embedding" for c in graph.consumers(w)):
                return f"the output head, tied to the embedding ({why})"
            if _is_output(graph, node.outputs[0]):
                return f"the output head ({why})"
        if self.config.per_row:
            if graph.type_of(node.inputs[0]).dtype != "f32":
                return "its input is not f32 (the integer product takes f32 activations)"
        elif k < self.config.block_size:
            return f"{k} input features, fewer than the block size {self.config.block_size}"
        if n < MIN_OUTPUTS:
            return f"{n} outputs, fewer than {MIN_OUTPUTS} (too small to gain; a router's choice is brittle)"
        return None

    def _replace(self, graph: Graph, node, n: int, k: int, head: bool = False) -> None:
        """``node`` (a linear over the weight [n, k]) as the scheme's quantised linear (``head``: the
        output head, at the scheme's head bits)."""
        bits, w = self.config.head_bits if head else self.config.bits, node.inputs[1]
        if self.config.per_row:
            op, attrs = "linear_int8", {}
        else:
            op = "linear_nbits"
            attrs = {"bits": bits, "block_size": self.config.block_size, "K": k, "N": n,
                     "accuracy_level": act.level(self.config.activations, node.name, head)}
            if self.config.zero_points:
                attrs["zero_points"] = 1
        names = self._codes(graph, w, bits)
        graph.replace_node(node.name, op, [node.inputs[0], names["packed"], names["scales"],
                                           *([names["zeros"]] if "zeros" in names else []), *node.inputs[2:]], attrs)

    def _codes(self, graph: Graph, w: str, bits: int) -> dict[str, str]:
        """The derived parameters (packed codes, scales, and zero points under int4-asym) of weight ``w``
        [n, k] at ``bits``, declared once: a weight read by two linears, or a tied table read by the
        head and the embedding at the same bits, is quantised once and stored once (the same recipe
        gives the same paths)."""
        p = graph.params[w]
        n, k = p.shape
        kind = "quantize"
        if self.config.per_row:
            block = ROWS
            parts = (("packed", (n, k), "i8"), ("scales", (n,), "f32"))
        else:
            block = self.config.block_size
            parts = (("packed", packed_shape(n, k, bits, block), "u8"), ("scales", (n, blocks(k, block)), "f32"))
            if self.config.zero_points:
                kind = "quantize_zp"
                parts += (("zeros", zeros_shape(n, k, bits, block), "u8"),)
        names = {}
        tag = self.config.scheme.replace("-", "_") + (f"_{bits}bit" if bits != self.config.bits else "")
        for part, shape, dtype in parts:
            path = f"{w}.{tag}_{part}"  # a parameter path: no '/' (constants have one)
            if path not in graph.params:
                graph.add_param(Param(path, shape, dtype, "derived", 0.0, p.pos, (kind, w, bits, block, part)))
            names[part] = path
        return names

    def _why_float_table(self, graph: Graph, node) -> str | None:
        """Why an embedding's table stays float, or None to store it at embedding_bits."""
        table, ids = node.inputs[1], node.inputs[0]
        if self.config.embedding_bits is None:
            return "--quantize-embedding float" if self.config.embedding == "float" else \
                f"{self.config.scheme}'s default (--quantize-embedding 8 quantises it)"
        if graph.values[table].kind != "param":
            return "its table is computed, not a parameter"
        if graph.params[table].dtype != "f32":
            return f"its table is {graph.params[table].dtype}; quantisation starts from f32 weights"
        if ids not in graph.inputs:
            return "its ids are computed, not a model input (a position table: small, and the KV-cache pass " \
                   "re-indexes it)"
        if self.config.embedding == "auto" and any(c.op != "embedding" for c in graph.consumers(table)):
            return "tied to the float output head, which keeps the float table: codes beside it would add " \
                   "bytes (--quantize-embedding 8 stores them anyway)"
        if self.config.embedding == "auto" and self.config.bits == 8 and table not in self._tied_heads:
            return "int8's default keeps a table no 8-bit head shares float (a gather reads one row a token: " \
                   "codes would save bytes, not time; --quantize-embedding 8 stores them)"
        return None

    def _quantize_table(self, graph: Graph, node) -> QuantNote:
        """``node`` (an embedding of a model input's ids) as embedding_nbits over the table's 8-bit codes."""
        table = node.inputs[1]
        k = graph.params[table].shape[1]
        bits = self.config.embedding_bits
        names, block = _stored_codes(graph, table, bits), None
        if names is not None:  # a GGUF file's own 8-bit codes, which the tied head reads: exact, and shared
            block = graph.params[names["packed"]].derive[3]
        else:
            names, block = self._codes(graph, table, bits), self.config.block_size
        attrs = {"bits": bits, "block_size": block, "K": k}
        if "zeros" in names:
            attrs["zero_points"] = 1
        graph.replace_node(node.name, "embedding_nbits", [node.inputs[0], *names.values()], attrs)
        shared = any(c.op != "embedding_nbits" for c in graph.consumers(names["packed"]))
        float_kept = bool(graph.consumers(table))
        if not float_kept:
            graph.remove_param(table)
        how = "stored" if is_stored(graph, names["packed"]) else "shared" if shared else ""
        return QuantNote(node.name, table, True, "float kept" if float_kept else how, bits=bits, embedding=True)

    def run(self, graph: Graph) -> PassResult:
        assert self.config.bits in BITS
        notes = []
        self._tied_heads = set()  # tables whose tied head now reads codes (int8's auto table follows them)
        for node in list(graph.nodes.values()):
            if node.op != "linear":
                continue
            reason = self._why_not(graph, node)
            w = node.inputs[1]
            if reason is not None:
                notes.append(QuantNote(node.name, w, False, reason))
                continue
            n, k = graph.params[w].shape
            head = any(c.op == "embedding" for c in graph.consumers(w)) or _is_output(graph, node.outputs[0])
            self._replace(graph, node, n, k, head)
            if not graph.consumers(w):
                graph.remove_param(w)
            tied = head and w in graph.params and any(c.op == "embedding" for c in graph.consumers(w))
            if tied:
                self._tied_heads.add(w)
            notes.append(QuantNote(node.name, w, True, "tied" if tied else "",
                                   bits=self.config.head_bits if head else self.config.bits, head=head))
        for node in list(graph.nodes.values()):  # after the linears: a tied head's codes are declared
            if node.op != "embedding":
                continue
            reason = self._why_float_table(graph, node)
            notes.append(QuantNote(node.name, node.inputs[1], False, reason, embedding=True) if reason is not None
                         else self._quantize_table(graph, node))
        return PassResult(graph, any(n.quantized for n in notes), notes)


def linear_notes(notes: list) -> list:
    """The notes of the linears (the pass's notes less the embedding tables')."""
    return [n for n in notes if not n.embedding]


def table_notes(notes: list) -> list:
    """The notes of the embedding tables."""
    return [n for n in notes if n.embedding]


def head_line(config: QuantConfig, notes: list) -> str:
    """--explain's and the report's words for the output head: its bits, and where it is tied, what
    the embedding gathers from (the head's own codes, codes of its own, or the float table)."""
    if not any(n.head and n.quantized for n in notes):
        return config.head_words()
    if not any(n.quantized and n.head and n.reason == "tied" for n in notes):
        return config.head_words()
    tables = [n for n in table_notes(notes) if n.quantized]
    if any(n.reason in ("shared", "stored") for n in tables):
        tied = " (tied: the head and the embedding read one set of 8-bit codes)"
    elif tables:
        tied = " (tied: the head reads its codes, the embedding 8-bit codes of its own)"
    else:
        tied = " (tied: the embedding gathers from its float table, the head reads the codes)"
    return config.head_words() + tied


def embedding_line(config: QuantConfig, notes: list) -> str:
    """--explain's line for the embedding tables: how many are stored at 8 bits, and the others' reasons."""
    tables = table_notes(notes)
    done = [n for n in tables if n.quantized]
    lines = [f"embedding tables at {config.embedding_bits or 8} bits: {len(done)} of {len(tables)} "
             f"({config.embedding_words()})"]
    lines += [f"  {n.describe()}" for n in tables if not n.quantized or n.reason in ("float kept", "stored")]
    return "\n".join(lines)


def _stored_codes(graph: Graph, table: str, bits: int) -> dict[str, str] | None:
    """The checkpoint's own codes of ``table`` that compiler/passes/stored_codes.py declared for the tied
    head, where they are ``bits`` wide with the default zero point and no offsets (a GGUF file's Q8_0,
    Q5_0): the embedding gathers them as they are; else None."""
    names = {part: f"{table}.{STORED}_{part}" for part in ("packed", "scales")}
    if not all(graph.params.get(p) is not None and is_stored(graph, p) and p in graph.values
               and graph.consumers(p) for p in names.values()):
        return None
    if f"{table}.{STORED}_zeros" in graph.params or graph.params[names["packed"]].derive[2] != bits:
        return None
    return names


def quantized_bytes(graph: Graph) -> int:
    """Bytes of all parameters of a (quantised) graph, at their own dtypes."""
    return sum(p.numel * np.dtype(DTYPES[p.dtype] or np.float32).itemsize for p in graph.params.values())
