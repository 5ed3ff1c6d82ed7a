"""The Tessera spec language: grammar, parser, AST, loader and diagnostics."""

from .diagnostics import Pos, SpecError, did_you_mean
from .loader import Program, load_program

__all__ = ["Pos", "SpecError", "did_you_mean", "Program", "load_program", "parse_text"]


def __getattr__(name: str):
    """``parse_text`` on first use: it imports lark, which a spec found in the AST cache
    (spec/ast_cache.py) never needs."""
    if name == "parse_text":
        from .parser import parse_text

        return parse_text
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
