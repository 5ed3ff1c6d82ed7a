"""Tessera: a declarative model compiler and graph runtime for transformers.

The package is laid out as three layers with one-way dependencies:
``tessera.spec`` (the language) -> ``tessera.compiler`` (IR, analysis, export)
-> ``tessera.runtime`` (weights, onnxruntime sessions, command line).
"""

__version__ = "0.1.0"


def __getattr__(name):
    """``tessera.load`` (runtime/api.py), imported on first use so ``import tessera.spec`` stays light."""
    if name == "load":
        from tessera.runtime.api import load

        return load
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")


__all__ = ["load", "__version__"]
