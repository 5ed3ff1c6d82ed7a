"""Parse spec text into the AST, turning lark's errors into SpecErrors."""

from __future__ import annotations

import re

import ast as pyast
import math
import os
import sys
from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from . import ast
from .cache_folder import cache_folder
from .diagnostics import Pos, SpecError, register_source

# Human names for the grammar's terminals, used in "expected ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "LPAR": "'('", "RPAR": "')'",
    "LSQB": "'['", "RSQB": "']'", "LBRACE": "'{'", "RBRACE": "'}'", "COMMA": "','", "COLON": "':'",
    "EQUAL": "'='", "DOT": "'.'", "AUGOP": "'+='", "ADDOP": "'+' or '-'", "MULOP": "'*' or '/'",
    "COMPOP": "a comparison", "VARIANT_NAME": "a variant name", "POW": "'**'", "MINUS": "'-'", "__ANON_0": "'->'", "$END": "end of file",
}

_KEYWORDS = {"use", "block", "model", "variant", "let", "assert", "in", "out", "repeat", "as",
             "if", "else", "return", "true", "false", "none", "and", "or", "not"}


@lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = resources.files(__package__).joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True, cache=_grammar_cache())


def _grammar_cache() -> str | bool:
    """Where lark keeps the analysed grammar between runs: building the LALR tables takes ~0.1 s of every
    command's start. A file in the user's cache folder (spec/cache_folder.py; not lark's default, a shared
    temporary folder, since lark unpickles it); lark checks the grammar's and its own version's hash before
    using it and rebuilds on any mismatch or read error. False (no cache) where that folder cannot be made."""
    folder = cache_folder()
    if folder is None:
        return False
    return os.path.join(folder, f"grammar-py{sys.version_info[0]}{sys.version_info[1]}.lark-cache")


def _expected(names: set[str]) -> str:
    words = []
    for n in sorted(names):
        if n in _TERMINAL_NAMES:
            words.append(_TERMINAL_NAMES[n])
        elif n.upper() == n and n.lower() in _KEYWORDS:
            words.append(f"'{n.lower()}'")
        else:
            words.append(n.lower())
    words = sorted(set(words))
    if len(words) > 6:
        words = words[:6] + ["..."]
    return ", ".join(words)


# Deeper parse trees are refused: the AST builder and the elaborator recurse once per level.
MAX_NESTING = 200
# Integer literals are sizes and counts; longer ones are typos (and Python refuses 4,300+ digits).
MAX_INT_DIGITS = 19


def parse_text(text: str, filename: str = "<spec>") -> ast.SpecFile:
    """Parse one spec file's text. Raises SpecError with the position of any syntax error."""
    register_source(filename, text)
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, filename, text) from None
    _check_nesting(tree, filename)
    try:
        return _ToAst(filename).transform(tree)
    except VisitError as e:  # a SpecError raised while building the AST (e.g. an argument given twice)
        if isinstance(e.orig_exc, SpecError):
            raise e.orig_exc from None
        raise


def _check_nesting(tree: Tree, filename: str) -> None:
    """Refuse trees deeper than MAX_NESTING (walked with an explicit stack, so this check itself
    cannot overflow Python's recursion limit) at the position where the limit is crossed."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            meta = node.meta
            pos = Pos(filename, meta.line, meta.column) if not getattr(meta, "empty", True) else Pos(filename, 1, 1)
            raise SpecError(f"nesting too deep (limit {MAX_NESTING} levels): split the expression with 'let' "
                            f"or intermediate assignments", pos)
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, Tree))


# The grammar's reserved words (grammar.lark's keyword literals): a name spelled as one is a syntax error,
# which says so.
KEYWORDS = frozenset({"and", "as", "assert", "block", "else", "false", "if", "in", "let", "model", "none", "not",
                      "or", "out", "repeat", "return", "true", "use", "variant"})


def _keyword_before(text: str | None, line: int, col: int) -> str | None:
    """The reserved word just before (line, col), when the word there is one: `out = x` fails at its '='."""
    if text is None:
        return None
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return None
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", lines[line - 1][:col - 1])
    before = lines[line - 1][:col - 1].rstrip()
    return words[-1] if words and before.endswith(words[-1]) and words[-1] in KEYWORDS else None


def _syntax_error(e: UnexpectedInput, filename: str, text: str | None = None) -> SpecError:
    line, col = max(getattr(e, "line", 1), 1), max(getattr(e, "column", 1), 1)
    if isinstance(e, UnexpectedCharacters):
        ch = e.char
        msg = f"unexpected character {ch!r}"
        return SpecError(msg, Pos(filename, line, col, line, col + 1))
    if isinstance(e, UnexpectedEOF):
        return SpecError(f"unexpected end of file; expected {_expected(set(e.expected))}", Pos(filename, line, col))
    if isinstance(e, UnexpectedToken):
        tok = e.token
        if tok.type == "$END":
            end_line = getattr(tok, "end_line", None) or line
            end_col = getattr(tok, "end_column", None) or col
            return SpecError(f"unexpected end of file; expected {_expected(set(e.expected))}",
                             Pos(filename, end_line, end_col))
        shown = tok.value if tok.value else tok.type
        width = len(str(tok.value)) if tok.value else 1
        msg = f"unexpected {shown!r}; expected {_expected(set(e.expected))}"
        keyword = _keyword_before(text, line, col)
        if keyword:
            msg += f" ({keyword!r} is a keyword and cannot be used as a name)"
        return SpecError(msg, Pos(filename, line, col, line, col + width))
    return SpecError(str(e), Pos(filename, line, col))  # pragma: no cover


@v_args(meta=True)
class _ToAst(Transformer):
    """lark Transformer building frozen AST nodes that carry positions."""

    def __init__(self, filename: str):
        super().__init__()
        self.file = filename

    # -- positions
    def _pos(self, meta) -> Pos:
        if getattr(meta, "empty", False):
            return Pos(self.file, 1, 1)
        return Pos(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, tok: Token) -> Pos:
        return Pos(self.file, tok.line, tok.column, tok.end_line, tok.end_column)

    # -- top level
    def start(self, meta, items):
        uses = tuple(i for i in items if isinstance(i, ast.Use))
        blocks = tuple(i for i in items if isinstance(i, ast.BlockDef))
        models = tuple(i for i in items if isinstance(i, ast.ModelDef))
        variants = tuple(i for i in items if isinstance(i, ast.VariantDef))
        return ast.SpecFile(self.file, uses, blocks, models, variants)

    def use_item(self, meta, c):
        return ast.Use(_unquote(c[0], self._tok(c[0])), self._pos(meta))

    def block_def(self, meta, c):
        name, params, result, body = c
        return ast.BlockDef(str(name), tuple(params or ()), result, body, self._tok(name))

    def model_def(self, meta, c):
        name, params, body = c
        return ast.ModelDef(str(name), tuple(params or ()), body, self._tok(name))

    def variant_def(self, meta, c):
        name, model, args = c
        pos_args, kw = args if args else ((), ())
        return ast.VariantDef(str(name), str(model), pos_args, kw, self._tok(name))

    def params(self, meta, c):
        return [p for p in c if p is not None]

    def param(self, meta, c):
        name, typ, default = c
        return ast.Param(str(name), typ, default, self._tok(name))

    def tensor_type(self, meta, c):
        dtype, dims = c
        return ast.TensorType(str(dtype) if dtype is not None else None, tuple(dims or ()), self._pos(meta))

    def scalar_type(self, meta, c):
        return ast.ScalarType(str(c[0]), self._tok(c[0]))

    def dims(self, meta, c):
        return [d for d in c if d is not None]

    def body(self, meta, c):
        return tuple(c)

    # -- statements
    def let_stmt(self, meta, c):
        return ast.Let(self._pos(meta), str(c[0]), c[1])

    def assign_stmt(self, meta, c):
        return ast.Assign(self._tok(c[0]), str(c[0]), c[1])

    def aug_stmt(self, meta, c):
        return ast.AugAssign(self._tok(c[0]), str(c[0]), str(c[1])[0], c[2])

    def assert_stmt(self, meta, c):
        cond, msg = c
        return ast.Assert(cond.pos, cond, _unquote(msg, self._tok(msg)) if msg is not None else None)

    def in_stmt(self, meta, c):
        return ast.InDecl(self._tok(c[0]), str(c[0]), c[1])

    def out_stmt(self, meta, c):
        return ast.OutDecl(self._tok(c[0]), str(c[0]), c[1])

    def repeat_stmt(self, meta, c):
        count, var, body = c
        return ast.Repeat(self._pos(meta), count, str(var), body)

    def if_stmt(self, meta, c):
        cond, then, orelse = c
        if orelse is None:
            orelse = ()
        elif isinstance(orelse, ast.If):
            orelse = (orelse,)
        return ast.If(self._pos(meta), cond, then, orelse)

    def return_stmt(self, meta, c):
        return ast.Return(self._pos(meta), c[0])

    # -- expressions
    def or_op(self, meta, c):
        return ast.BinOp(self._pos(meta), "or", c[0], c[1])

    def and_op(self, meta, c):
        return ast.BinOp(self._pos(meta), "and", c[0], c[1])

    def not_op(self, meta, c):
        return ast.UnaryOp(self._pos(meta), "not", c[0])

    def compare_op(self, meta, c):
        return ast.BinOp(self._pos(meta), str(c[1]), c[0], c[2])

    def binop(self, meta, c):
        return ast.BinOp(self._pos(meta), str(c[1]), c[0], c[2])

    def pow_op(self, meta, c):
        return ast.BinOp(self._pos(meta), "**", c[0], c[2])

    def neg(self, meta, c):
        return ast.UnaryOp(self._pos(meta), "-", c[0])

    def call(self, meta, c):
        func, args = c
        pos_args, kw = args if args else ((), ())
        return ast.Call(self._pos(meta), func, pos_args, kw)

    def attr(self, meta, c):
        return ast.Attr(self._pos(meta), c[0], str(c[1]))

    def index(self, meta, c):
        return ast.Index(self._pos(meta), c[0], c[1])

    def args(self, meta, c):
        pos_args, kwargs = [], []
        for a in c:
            if a is None:
                continue
            if isinstance(a, ast.KwArg):
                if any(k.name == a.name for k in kwargs):
                    raise SpecError(f"argument '{a.name}' given twice", a.pos)
                kwargs.append(a)
            else:
                if kwargs:
                    raise SpecError("positional argument after a keyword argument", a.pos)
                pos_args.append(a)
        return tuple(pos_args), tuple(kwargs)

    def pos_arg(self, meta, c):
        return c[0]

    def kw_arg(self, meta, c):
        return ast.KwArg(str(c[0]), c[1], self._tok(c[0]))

    def number(self, meta, c):
        text = str(c[0])
        pos = self._tok(c[0])
        if any(ch in text for ch in ".eE"):
            value = float(text)
            if not math.isfinite(value):
                raise SpecError(f"number {_clip(text)} is too large for a float", pos)
        else:
            if len(text.lstrip("0")) > MAX_INT_DIGITS:
                raise SpecError(f"integer {_clip(text)} is too large ({len(text)} digits; at most "
                                f"{MAX_INT_DIGITS})", pos)
            value = int(text)
        return ast.Number(pos, value)

    def string(self, meta, c):
        return ast.String(self._tok(c[0]), _unquote(c[0], self._tok(c[0])))

    def true(self, meta, c):
        return ast.Bool(self._pos(meta), True)

    def false(self, meta, c):
        return ast.Bool(self._pos(meta), False)

    def none(self, meta, c):
        return ast.NoneLit(self._pos(meta))

    def name(self, meta, c):
        return ast.Name(self._tok(c[0]), str(c[0]))

    def list_lit(self, meta, c):
        return ast.ListLit(self._pos(meta), tuple(x for x in c if x is not None))


def _unquote(tok, pos: Pos) -> str:
    """A string literal's value, with Python's escapes; a bad escape is a positioned error."""
    try:
        return pyast.literal_eval(str(tok))
    except (SyntaxError, ValueError) as e:
        reason = (getattr(e, "msg", None) or str(e)).removeprefix("(unicode error) ")
        raise SpecError(f"bad string literal: {reason.split(' (')[0]}", pos) from None


def _clip(text: str, n: int = 24) -> str:
    return text if len(text) <= n else f"{text[:n]}..."
