"""The abstract syntax tree of a spec file: frozen dataclasses with positions.

The tree is what the parser produces and what the compiler's elaborator
walks. It is deliberately plain: no evaluation or name resolution happens
here, so the same tree can be printed, checked or elaborated many times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .diagnostics import Pos


# ----------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Expr:
    pos: Pos


@dataclass(frozen=True)
class Number(Expr):
    value: int | float


@dataclass(frozen=True)
class String(Expr):
    value: str


@dataclass(frozen=True)
class Bool(Expr):
    value: bool


@dataclass(frozen=True)
class NoneLit(Expr):
    pass


@dataclass(frozen=True)
class Name(Expr):
    id: str


@dataclass(frozen=True)
class ListLit(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class BinOp(Expr):
    op: str  # + - * / // % ** == != < <= > >= and or
    left: Expr
    right: Expr


@dataclass(frozen=True)
class UnaryOp(Expr):
    op: str  # - not
    operand: Expr


@dataclass(frozen=True)
class KwArg:
    name: str
    value: Expr
    pos: Pos


@dataclass(frozen=True)
class Call(Expr):
    func: Expr
    args: tuple[Expr, ...]
    kwargs: tuple[KwArg, ...]


@dataclass(frozen=True)
class Attr(Expr):
    value: Expr
    name: str


@dataclass(frozen=True)
class Index(Expr):
    value: Expr
    index: Expr


# ------------------------------------------------------------------------ types
@dataclass(frozen=True)
class TensorType:
    dtype: str | None  # None: any dtype (block parameters)
    dims: tuple[Expr, ...]
    pos: Pos


@dataclass(frozen=True)
class ScalarType:
    name: str  # int, float, bool, str, block
    pos: Pos


TypeAnn = TensorType | ScalarType


# ------------------------------------------------------------------- statements
@dataclass(frozen=True)
class Stmt:
    pos: Pos


@dataclass(frozen=True)
class Let(Stmt):
    name: str
    value: Expr


@dataclass(frozen=True)
class Assign(Stmt):
    name: str
    value: Expr


@dataclass(frozen=True)
class AugAssign(Stmt):
    name: str
    op: str  # + - * /
    value: Expr


@dataclass(frozen=True)
class Assert(Stmt):
    cond: Expr
    message: str | None


@dataclass(frozen=True)
class InDecl(Stmt):
    name: str
    type: TensorType


@dataclass(frozen=True)
class OutDecl(Stmt):
    name: str
    type: TensorType


@dataclass(frozen=True)
class Repeat(Stmt):
    count: Expr
    var: str
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]


@dataclass(frozen=True)
class Return(Stmt):
    value: Expr


# ------------------------------------------------------------------- top level
@dataclass(frozen=True)
class Param:
    name: str
    type: TypeAnn | None
    default: Expr | None
    pos: Pos


@dataclass(frozen=True)
class BlockDef:
    name: str
    params: tuple[Param, ...]
    result: TypeAnn | None
    body: tuple[Stmt, ...]
    pos: Pos


@dataclass(frozen=True)
class ModelDef:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    pos: Pos


@dataclass(frozen=True)
class VariantDef:
    name: str
    model: str
    args: tuple[Expr, ...]
    kwargs: tuple[KwArg, ...]
    pos: Pos


@dataclass(frozen=True)
class Use:
    path: str
    pos: Pos


@dataclass(frozen=True)
class SpecFile:
    path: str
    uses: tuple[Use, ...]
    blocks: tuple[BlockDef, ...]
    models: tuple[ModelDef, ...]
    variants: tuple[VariantDef, ...] = field(default=())
