"""The runtime's error for a bad option value, in a module of its own.

Why apart from runtime/pipeline.py (which re-exports it): io/, generation/ and options raise it,
and pipeline.py imports io/; with the class in pipeline.py the runtime's packages would import
each other in a cycle (pyproject.toml's contracts forbid it)."""


class UsageError(Exception):
    """A bad command-line value (not a spec error)."""


class ModelFileError(Exception):
    """An ONNX file that cannot be read, that onnxruntime refuses to load, or whose Tessera metadata is
    not what this version writes (runtime/session.py and runtime/metadata.py raise it)."""
