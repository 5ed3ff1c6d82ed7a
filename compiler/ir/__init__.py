"""The IR: a networkx graph of primitive ops over typed tensors with symbolic dimensions
(graph.py), the sympy dimensions themselves (dims.py) and a graph's run-time signature
(signature.py: inputs, their shapes, the limits a run is checked against)."""
