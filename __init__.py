"""Tessera: a declarative model compiler and graph runtime for transformers.

The package is laid out as three layers with one-way dependencies:
``tessera.spec`` (the language) -> ``tessera.compiler`` (IR, analysis, export)
-> ``tessera.runtime`` (weights, onnxruntime sessions, command line).
"""

__version__ = "0.1.0"
