"""The Tessera spec language: grammar, parser, AST, loader and diagnostics."""

from .diagnostics import Pos, SpecError, did_you_mean
from .loader import Program, load_program
from .parser import parse_text

__all__ = ["Pos", "SpecError", "did_you_mean", "Program", "load_program", "parse_text"]
