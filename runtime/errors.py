"""The runtime's error for a bad option value, in a module of its own.

Why apart from runtime/pipeline.py (which re-exports it): io/, generation/ and options raise it,
and pipeline.py imports io/; with the class in pipeline.py the runtime's packages would import
each other in a cycle (pyproject.toml's contracts forbid it)."""


class UsageError(Exception):
    """A bad command-line value (not a spec error)."""
