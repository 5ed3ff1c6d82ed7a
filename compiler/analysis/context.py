"""A graph bound for the report: its costs and structure, B, N and dtype, and how a polynomial
in its symbols becomes a number or a formula in B and N.

Its own module because both the report (costreport.py) and the deployment sections it adds
(deployment.py) bind graphs this way, and the report imports the deployment sections.
"""

from __future__ import annotations

from fractions import Fraction

from tessera.compiler.analysis import cost, memory
from tessera.compiler.analysis.poly import Poly, format_poly
from tessera.compiler.analysis.structure import Structure
from tessera.compiler.ir.graph import Graph

DTYPES = memory.DTYPE_BYTES


class Context:
    """The graph, its structure and costs, and how its symbols are bound."""

    def __init__(self, graph: Graph, batch: int = 1, seq: int = 1024, dtype: str = "fp32", analysed=None,
                 kv_cache_dtype: str = "auto"):
        self.graph = graph
        # analysed: (costs, structure) of this graph from an earlier Context (a sweep binds it many times)
        self.costs, self.st = analysed or cost.node_costs(graph)
        self.dtype = dtype
        self.bytes = DTYPES[dtype]
        # the KV cache's bytes per element: the model's, or --kv-cache-dtype's (fp16 on an fp32 model: 2)
        self.kv_bytes = self.bytes if kv_cache_dtype in (None, "auto") else DTYPES[kv_cache_dtype]
        self.batch_symbol = "B" if "B" in graph.symbols else None
        self.seq_symbols = [s for s in graph.symbols if s != "B"]
        self.batch, self.seq = batch, seq
        self.bindings = {"B": batch} if self.batch_symbol else {}
        self.bindings.update({s: seq for s in self.seq_symbols})
        self.rename = {s: "N" for s in self.seq_symbols}
        self.tokens_per_sequence = seq if self.seq_symbols else _static_tokens(self.st)
        self.tokens = (batch if self.batch_symbol else 1) * self.tokens_per_sequence

    # ------------------------------------------------------------ helpers
    def value(self, p: Poly):
        v = p.evaluate(self.bindings)
        return int(v) if isinstance(v, int) or (isinstance(v, Fraction) and v.denominator == 1) else float(v)

    def named(self, p: Poly) -> Poly:
        return p.rename(self.rename)

    def formula(self, p: Poly) -> str:
        return format_poly(self.named(p))

    def per_token(self, p: Poly) -> Poly | None:
        """p divided by the number of tokens (B·N), where that division is exact."""
        divisor = Poly({(): 1 if self.seq_symbols else self.tokens_per_sequence})
        if self.batch_symbol:
            divisor = divisor * Poly.symbol("B")
        if self.seq_symbols:
            divisor = divisor * Poly.symbol("N")
        try:
            return self.named(p) / divisor
        except ValueError:
            return None

    def per_token_value(self, p: Poly):
        v = Fraction(p.evaluate(self.bindings)) / self.tokens
        return int(v) if v.denominator == 1 else float(v)

    def per_token_formula(self, p: Poly) -> str:
        q = self.per_token(p)
        if q is None:
            return f"({self.formula(p)}) / ({'B·' if self.batch_symbol else ''}N)"
        return format_poly(q)


def _static_tokens(st: Structure) -> int:
    """Tokens per sequence of a graph without sequence symbols (ViT): the query length of its attention."""
    for a in st.attention:
        try:
            return int(a.tq)
        except TypeError:
            continue
    return 1
