"""Primitive ops: each op's definition (type rule, reference semantics, ONNX lowering, cost,
traits), looked up by name by every consumer."""
