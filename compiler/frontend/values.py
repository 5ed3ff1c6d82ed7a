"""Values the elaborator computes with, besides plain Python ints, floats, bools and strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tessera.spec import ast

from tessera.compiler.ir.graph import TensorType

REQUIRED = object()


@dataclass(frozen=True)
class Tensor:
    """A reference to a value in the graph being built."""

    name: str
    type: TensorType

    def __str__(self) -> str:
        return f"tensor {self.type}"


@dataclass(frozen=True)
class BlockRef:
    block: ast.BlockDef

    def __str__(self) -> str:
        return f"block {self.block.name}"


@dataclass(frozen=True)
class Builtin:
    """A primitive the language provides, with its parameter list for argument checking."""

    name: str
    params: tuple[tuple[str, Any], ...]  # (name, default or REQUIRED)
    fn: Callable
    doc: str = ""

    def __str__(self) -> str:
        return f"builtin {self.name}"


def describe(value) -> str:
    """Say what kind of value this is, for error messages."""
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if isinstance(value, int):
        return f"int {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if value is None:
        return "none"
    if isinstance(value, list):
        return "list"
    return str(value)
