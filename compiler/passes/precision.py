"""Lower the graph's floating-point precision (fp32 -> fp16 or bf16) for export.

Every f32 value becomes f16: parameters (converted when weights are written),
constants, and every node's result. The model's interface stays fp32: float
inputs are cast to fp16 where they enter and outputs are cast back to fp32 where
they leave, so callers feed and read the same arrays at either precision.
Integer tensors (token ids, masks, positions) are untouched. Values named in
``native`` cross the interface at the lower precision instead: a KV cache's past
inputs and present outputs, which the runtime holds in fp16 (half the bytes, and
no cast of the whole cache at every step); ``native`` may be a function of the graph
(passes/kv_cache.py ``cache_tensors``), so a declared pipeline names the rule, not the values.
"""

from __future__ import annotations

from typing import Callable

from tessera.compiler.ir.graph import Graph, TensorType, Value, numpy_dtype
from tessera.compiler.passes.base import Pass, PassError, PassResult

SUPPORTED = {"fp16": "f16", "bf16": "bf16"}


class LowerPrecision(Pass):
    name = "lower-precision"

    def __init__(self, dtype: str, native: tuple[str, ...] | set[str] | Callable[[Graph], set[str]] = (),
                 device: str = "cuda"):
        if dtype not in SUPPORTED:
            raise PassError(f"--dtype {dtype}: export supports fp32 and {', '.join(SUPPORTED)}")
        if dtype == "bf16" and device != "cuda":
            raise PassError("--dtype bf16: onnxruntime's CPU kernels take no bfloat16 (bf16 is exported for "
                            "--target cuda); use fp32 or fp16 on the CPU")
        self.dtype = SUPPORTED[dtype]
        self.native = native if callable(native) else set(native)

    def requires(self, graph: Graph) -> None:
        # the frontend makes every parameter f32: one at the lower precision means this pass ran already
        lowered = next((p.path for p in graph.params.values() if p.dtype == self.dtype), None)
        if lowered:
            raise PassError(f"the graph is already lowered to {self.dtype} (parameter {lowered})")
        int8 = next((n.name for n in graph.nodes.values() if n.op == "linear_int8"), None)
        if int8:
            raise PassError(f"--quantize w8a8 computes in fp32 (onnxruntime's integer product takes and gives fp32 "
                            f"activations; node {int8}): drop --dtype {'fp16' if self.dtype == 'f16' else self.dtype}, "
                            f"or quantise with int8 or int4")

    def run(self, graph: Graph) -> PassResult:
        low = self.dtype
        changed = False
        native = self.native(graph) if callable(self.native) else self.native

        def lower(t: TensorType) -> TensorType:
            return TensorType(low, t.shape) if t.dtype == "f32" else t

        # interface: float inputs enter through a cast
        for name in list(graph.inputs):
            if graph.type_of(name).dtype != "f32":
                continue
            if name in native:
                graph.values[name].type = lower(graph.type_of(name))
                changed = True
                continue
            users = graph.consumers(name)
            cast = graph.add_node("cast", [name], [lower(graph.type_of(name))], {"dtype": low}, "", None,
                                  name=f"{name}/to_{low}", first=True)  # at the front: the order stays topological
            graph.replace_uses(name, cast.outputs[0], users)
            changed = True
        for p in graph.params.values():
            if p.dtype == "f32":
                p.dtype = low
                graph.values[p.path] = Value(p.path, lower(graph.values[p.path].type), "param")
                changed = True
        for name, arr in graph.consts.items():
            if graph.type_of(name).dtype == "f32":
                graph.consts[name] = arr.astype(numpy_dtype(low))
                graph.values[name] = Value(name, lower(graph.type_of(name)), "const")
        outputs = set(graph.outputs)
        for node in graph.nodes.values():
            if node.op == "scan":
                _lower_body(node.attrs["body"].graph, low)
            if node.op == "cast" and node.attrs["dtype"] == "f32":
                node.attrs["dtype"] = low
            if node.op == "sinusoidal":
                node.attrs["dtype"] = low
            for o in node.outputs:
                v = graph.values[o]
                if o in outputs and v.type.dtype == "f32" and o not in native:
                    node.op, node.attrs = "cast", {"dtype": "f32"}  # the output identity casts back
                    continue
                v.type = lower(v.type)
        return PassResult(graph, changed)


def _lower_body(body: Graph, low: str) -> None:
    """A scan's step graph at the lower precision throughout: its inputs are the scan's (lowered)
    operands and its outputs feed the scan's (lowered) results, so no cast is needed at its edges."""
    for v in body.values.values():
        if v.type.dtype == "f32":
            v.type = TensorType(low, v.type.shape)
    for name, arr in body.consts.items():
        if arr.dtype == "float32":
            body.consts[name] = arr.astype(numpy_dtype(low))
    for node in body.nodes.values():
        if node.op in ("cast", "sinusoidal") and node.attrs.get("dtype") == "f32":
            node.attrs["dtype"] = low
        if node.op == "scan":
            _lower_body(node.attrs["body"].graph, low)
