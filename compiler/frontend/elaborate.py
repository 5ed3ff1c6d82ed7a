"""Elaboration: run a model's AST with concrete hyperparameters to build the IR graph.

The elaborator is an interpreter over the AST. Hyperparameters, ``let``s and
loop counters are Python values; batch and sequence dimensions are sympy
symbols; tensors are references into the graph being built. Block calls open
a name scope (``layers.3.attn``), so parameter paths follow the structure of
the spec. Every error is a SpecError at the position that caused it.
"""

from __future__ import annotations

import math
import operator
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy

from tessera.spec import Pos, Program, SpecError, ast, did_you_mean

from tessera.compiler.ir import dims

from tessera.compiler import ops
from tessera.compiler.frontend.builtins import BUILTINS
from tessera.compiler.frontend import shadowing
from tessera.compiler.ir.graph import DTYPES, Graph, Param, SymbolSource, TensorType
from tessera.compiler.frontend.values import REQUIRED, BlockRef, Builtin, Tensor, describe

# Budgets that turn a runaway spec (a typo'd layer count, a huge power) into an error at once.
# IR nodes. GPT-3 175B elaborates to 2,023 and Mixtral 8x7B to 2,788. `report` costs about 0.5 ms of CPU
# per node (`report vit --set layers=1000`, 20,012 nodes: 10.9 s; layers=2000: 19.4 s), so 25,000 keeps
# every spec under the 20 s per case of the fuzz harness (tests/fuzz_specs.py).
NODE_BUDGET = 25_000
INT_BITS = 63            # compile-time integers are sizes and counts: they fit an int64

_UNSET = _UNSET_ARG = object()
_SCALAR_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "block": BlockRef}


class _Return(Exception):
    def __init__(self, value):
        self.value = value


class Env:
    """A variable scope. Block and model bodies each get one whose parent is the globals."""

    def __init__(self, parent: "Env | None" = None):
        self.vars: dict[str, Any] = {}
        self.parent = parent
        # a `let` in a repeat body binds afresh on each iteration: names let-bound by the last one
        self.loop_lets: set[str] = set()
        self.lets_this_iteration: set[str] = set()

    def lookup(self, name: str):
        env = self
        while env is not None:
            if name in env.vars:
                return env.vars[name]
            env = env.parent
        raise KeyError(name)

    def has_local(self, name: str) -> bool:
        return name in self.vars

    def all_names(self) -> set[str]:
        names, env = set(), self
        while env is not None:
            names |= set(env.vars)
            env = env.parent
        return names


@dataclass
class ModelInfo:
    """What elaboration learned besides the graph: the model, variant and final hyperparameters."""

    model: str
    variant: str | None
    hyperparams: dict[str, Any]


class Elaborator:
    def __init__(self, program: Program):
        self.program = program
        self.graph: Graph | None = None
        self.outer_graphs: list[Graph] = []  # graphs around a scan body being elaborated (frontend/recurrence.py)
        self.scope: list[str] = []
        self.call_stack: list[Pos] = []  # positions of the block calls being elaborated
        self.block_stack: list[str] = []  # names of the blocks being elaborated, to refuse recursion
        self.node_budget = NODE_BUDGET
        self._used: dict[str, set[str]] = {}
        # share= calls being elaborated, innermost last: (the scope the call was made in, the path its
        # parameters are shared under); see new_param
        self.shares: list[tuple[str, str]] = []
        self.globals = Env()
        for name, b in BUILTINS.items():
            self.globals.vars[name] = b
        for name, block in program.blocks.items():
            self.globals.vars[name] = BlockRef(block)
            shadowing.check(block, "block", BUILTINS)
        for model in program.models.values():
            shadowing.check(model, "model", BUILTINS)

    # ================================================================ model
    def elaborate(self, variant: str | None = None, overrides: dict[str, Any] | None = None,
                  override_pos: dict[str, Pos] | None = None) -> tuple[Graph, ModelInfo]:
        model = self.program.main_model
        if model is None:
            raise SpecError(f"{self.program.path} defines no model")
        vargs: dict[str, tuple[Any, Pos]] = {}
        if variant is not None:
            if variant not in self.program.variants:
                known = ", ".join(self.program.variants) or "none"
                raise SpecError(f"unknown variant '{variant}'{did_you_mean(variant, self.program.variants)} "
                                f"(variants of {model.name}: {known})")
            vdef = self.program.variants[variant]
            if vdef.model != model.name:
                raise SpecError(f"variant '{vdef.name}' refers to model '{vdef.model}', but this file defines "
                                f"'{model.name}'", vdef.pos)
            if vdef.args:
                raise SpecError("variant arguments must be named (name=value)", vdef.args[0].pos)
            for kw in vdef.kwargs:
                vargs[kw.name] = (self.eval(kw.value, self.globals), kw.pos)
        for k, v in (overrides or {}).items():
            vargs[k] = (v, (override_pos or {}).get(k))

        self.graph = Graph(model.name)
        env = Env(self.globals)
        hyper = self._bind_hyperparams(model, vargs, env)
        outs: dict[str, ast.OutDecl] = {}
        self._model_outs = outs
        try:
            self.exec_body(model.body, env, in_model=True)
        except _Return:  # pragma: no cover - grammar allows it, semantics do not
            raise SpecError("'return' is only allowed in a block") from None
        for name, decl in outs.items():
            if not env.has_local(name):
                raise SpecError(f"output '{name}' is declared but never assigned", decl.pos)
            value = env.vars[name]
            if not isinstance(value, Tensor):
                raise SpecError(f"output '{name}' must be a tensor, got {describe(value)}", decl.pos)
            self._check_declared(decl.type, value, env, f"output '{name}'", decl.pos)
            self._set_output(name, value, decl.pos)
        if not outs:
            raise SpecError(f"model {model.name} declares no outputs (add 'out NAME: dtype[...]')", model.pos)
        return self.graph, ModelInfo(model.name, variant, hyper)

    def _bind_hyperparams(self, model: ast.ModelDef, given: dict[str, tuple[Any, Pos | None]], env: Env):
        names = [p.name for p in model.params]
        for k, (_, pos) in given.items():
            if k not in names:
                raise SpecError(f"unknown hyperparameter '{k}' for model {model.name}{did_you_mean(k, names)} "
                                f"(it has: {', '.join(names)})", pos)
        hyper = {}
        for p in model.params:
            default = self.eval(p.default, env) if p.default is not None else _UNSET
            if p.name in given:
                value, pos = given[p.name]
            elif p.default is not None:
                value, pos = default, p.default.pos
            else:
                raise SpecError(f"hyperparameter '{p.name}' has no default and no value was given", p.pos)
            value = self._check_scalar_type(p, value, pos, model.name, default)
            if _kind_of_value(value) == "int" and value < 0 and not (isinstance(default, int) and default < 0):
                raise SpecError(f"'{p.name}' of {model.name} must not be negative, got {value}", pos or p.pos)
            env.vars[p.name] = value
            hyper[p.name] = value
        return hyper

    def _check_scalar_type(self, p: ast.Param, value, pos, owner: str, default_value=_UNSET_ARG):
        """Check a hyperparameter's value against its declared type (or its default's type)."""
        if isinstance(p.type, ast.TensorType):
            return value
        if isinstance(p.type, ast.ScalarType):
            if p.type.name not in _SCALAR_TYPES:
                raise SpecError(f"unknown type '{p.type.name}'{did_you_mean(p.type.name, _SCALAR_TYPES)}", p.type.pos)
            want = p.type.name
        elif p.default is not None:
            want = _kind_of_default(p.default)
            if want is None and default_value is not _UNSET:
                want = _kind_of_value(default_value)
        else:
            return value
        if want is None:
            return value
        if want == "block" and isinstance(value, str) and value in self.program.blocks:
            value = BlockRef(self.program.blocks[value])  # --set ffn=swiglu
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "block": isinstance(value, BlockRef),
        }[want]
        if not ok:
            raise SpecError(f"'{p.name}' of {owner} must be {want}, got {describe(value)}", pos or p.pos)
        if want == "float":
            value = float(value)
        return value

    # ================================================================ statements
    def exec_body(self, stmts, env: Env, in_model: bool = False) -> None:
        for s in stmts:
            self.exec_stmt(s, env, in_model)

    def exec_stmt(self, s: ast.Stmt, env: Env, in_model: bool) -> None:
        if isinstance(s, ast.Let):
            if env.has_local(s.name) and s.name not in env.loop_lets:
                raise SpecError(f"'{s.name}' is already defined", s.pos)
            value = self.eval(s.value, env)
            if isinstance(value, Tensor):
                raise SpecError(f"'let' binds compile-time values; '{s.name}' would be a tensor "
                                f"(write '{s.name} = ...' instead)", s.pos)
            env.vars[s.name] = value
            env.loop_lets.discard(s.name)
            env.lets_this_iteration.add(s.name)
        elif isinstance(s, ast.Assign):
            value = self.eval(s.value, env)
            env.vars[s.name] = value
        elif isinstance(s, ast.AugAssign):
            try:
                current = env.lookup(s.name)
            except KeyError:
                raise SpecError(f"'{s.name}' is not defined{did_you_mean(s.name, env.all_names())}", s.pos) from None
            rhs = self.eval(s.value, env)
            env.vars[s.name] = self.binop(s.op, current, rhs, s.pos)
        elif isinstance(s, ast.Assert):
            cond = self.eval(s.cond, env)
            if not isinstance(cond, bool):
                raise SpecError(f"assert needs a true/false condition, got {describe(cond)}", s.cond.pos)
            if not cond:
                if s.message:
                    raise SpecError(f"assertion failed: {self._interpolate(s.message, env, s.pos)}", s.pos)
                raise SpecError("assertion failed", s.pos)
        elif isinstance(s, ast.InDecl):
            if not in_model:
                raise SpecError("'in' declarations belong to a model, not a block", s.pos)
            self._declare_input(s, env)
        elif isinstance(s, ast.OutDecl):
            if not in_model:
                raise SpecError("'out' declarations belong to a model, not a block", s.pos)
            if s.name in self._model_outs:
                raise SpecError(f"output '{s.name}' is declared twice", s.pos)
            self._model_outs[s.name] = s
        elif isinstance(s, ast.Repeat):
            self._repeat(s, env, in_model)
        elif isinstance(s, ast.If):
            cond = self.eval(s.cond, env)
            if not isinstance(cond, bool):
                raise SpecError(f"'if' needs a true/false condition, got {describe(cond)}", s.cond.pos)
            self.exec_body(s.then if cond else s.orelse, env, in_model)
        elif isinstance(s, ast.Return):
            if in_model:
                raise SpecError("'return' is only allowed in a block; a model assigns its outputs", s.pos)
            raise _Return(self.eval(s.value, env))
        else:  # pragma: no cover
            raise SpecError(f"unsupported statement {type(s).__name__}", s.pos)

    def _repeat(self, s: ast.Repeat, env: Env, in_model: bool) -> None:
        count = self.eval(s.count, env)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise SpecError(f"repeat needs a non-negative int count, got {describe(count)}", s.count.pos)
        if count > self.node_budget:
            raise SpecError(f"repeat {count:,} times is past the elaboration budget of {self.node_budget:,} "
                            f"IR nodes", s.count.pos)
        segment = s.count.id if isinstance(s.count, ast.Name) else "repeat"
        segment = self._claim(segment, None, s.pos)
        outer_lets = env.lets_this_iteration
        for i in range(count):
            env.vars[s.var] = i
            env.lets_this_iteration = set()
            before = len(self.graph.nodes)
            with self._scoped(segment, str(i)):
                self.exec_body(s.body, env, in_model)
            env.loop_lets |= env.lets_this_iteration
            projected = len(self.graph.nodes) + (len(self.graph.nodes) - before) * (count - 1 - i)
            if projected > self.node_budget:  # refuse now rather than after unrolling every iteration
                raise SpecError(f"repeat {count:,} times would make about {projected:,} IR nodes, past the "
                                f"elaboration budget of {self.node_budget:,}", s.count.pos)
        env.lets_this_iteration = outer_lets | env.loop_lets

    def _declare_input(self, s: ast.InDecl, env: Env) -> None:
        g = self.graph
        if s.type.dtype is None:
            raise SpecError(f"input '{s.name}' needs a dtype, e.g. i64[B, T]", s.type.pos)
        if s.type.dtype not in DTYPES:
            raise SpecError(f"unknown dtype '{s.type.dtype}'{did_you_mean(s.type.dtype, DTYPES)}", s.type.pos)
        if s.name in g.values or env.has_local(s.name):
            raise SpecError(f"'{s.name}' is already defined", s.pos)
        shape = []
        for axis, d in enumerate(s.type.dims):
            if isinstance(d, ast.Name) and not _bound(env, d.id):
                sym = dims.symbol(d.id)
                env.vars[d.id] = sym
                g.symbols[d.id] = SymbolSource(s.name, axis)
                shape.append(sym)
            else:
                shape.append(self._eval_dim(d, env))
        v = g.add_input(s.name, TensorType(s.type.dtype, tuple(shape)))
        env.vars[s.name] = Tensor(v.name, v.type)

    def _set_output(self, name: str, value: Tensor, pos: Pos) -> None:
        g = self.graph
        node = g.add_node("identity", [value.name], [value.type], {}, "", pos, name=name)
        if node.name != name:
            raise SpecError(f"output name '{name}' collides with another graph value", pos)
        g.outputs.append(node.outputs[0])

    def _interpolate(self, msg: str, env: Env, pos: Pos) -> str:
        def sub(m):
            try:
                v = env.lookup(m.group(1))
            except KeyError:
                raise SpecError(f"assert message refers to unknown name '{m.group(1)}'", pos) from None
            return str(v).lower() if isinstance(v, bool) else str(v)
        return re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", sub, msg)

    # ================================================================ expressions
    def eval(self, e: ast.Expr, env: Env):
        if isinstance(e, ast.Number):
            return e.value
        if isinstance(e, ast.String):
            return e.value
        if isinstance(e, ast.Bool):
            return e.value
        if isinstance(e, ast.NoneLit):
            return None
        if isinstance(e, ast.Name):
            try:
                return env.lookup(e.id)
            except KeyError:
                raise SpecError(f"unknown name '{e.id}'{did_you_mean(e.id, env.all_names())}", e.pos) from None
        if isinstance(e, ast.ListLit):
            return [self.eval(x, env) for x in e.items]
        if isinstance(e, ast.UnaryOp):
            v = self.eval(e.operand, env)
            if e.op == "not":
                if isinstance(v, Tensor):  # elementwise on a bool tensor
                    return self.emit("logical_not", [v], {}, e.pos)
                if not isinstance(v, bool):
                    raise SpecError(f"'not' needs true/false, got {describe(v)}", e.pos)
                return not v
            if isinstance(v, Tensor):
                return self.emit("neg", [v], {}, e.pos)
            if isinstance(v, (int, float, sympy.Expr)) and not isinstance(v, bool):
                return -v
            raise SpecError(f"cannot negate {describe(v)}", e.pos)
        if isinstance(e, ast.BinOp):
            if e.op in ("and", "or"):
                left = self.eval(e.left, env)
                if isinstance(left, Tensor):  # elementwise on bool tensors: both sides are evaluated
                    right = self.eval(e.right, env)
                    if not isinstance(right, Tensor):
                        raise SpecError(f"'{e.op}' of a tensor with {describe(right)}: both sides must be bool "
                                        f"tensors", e.right.pos)
                    return self.emit(f"logical_{e.op}", [left, right], {}, e.pos)
                if not isinstance(left, bool):
                    raise SpecError(f"'{e.op}' needs true/false, got {describe(left)}", e.left.pos)
                if (e.op == "and" and not left) or (e.op == "or" and left):
                    return left
                right = self.eval(e.right, env)
                if not isinstance(right, bool):
                    raise SpecError(f"'{e.op}' needs true/false, got {describe(right)}", e.right.pos)
                return right
            return self.binop(e.op, self.eval(e.left, env), self.eval(e.right, env), e.pos)
        if isinstance(e, ast.Call):
            return self.eval_call(e, env)
        if isinstance(e, ast.Attr):
            v = self.eval(e.value, env)
            if isinstance(v, Tensor):
                if e.name == "shape":
                    return [_py_dim(d) for d in v.type.shape]
                if e.name == "rank":
                    return v.type.rank
                if e.name == "dtype":
                    return v.type.dtype
            raise SpecError(f"{describe(v)} has no attribute '{e.name}'"
                            f"{did_you_mean(e.name, ['shape', 'rank', 'dtype']) if isinstance(v, Tensor) else ''}",
                            e.pos)
        if isinstance(e, ast.Index):
            v = self.eval(e.value, env)
            i = self.eval(e.index, env)
            if isinstance(v, list) and isinstance(i, int) and not isinstance(i, bool):
                if not -len(v) <= i < len(v):
                    raise SpecError(f"index {i} is out of range for a list of {len(v)}", e.index.pos)
                return v[i]
            raise SpecError(f"cannot index {describe(v)} with {describe(i)} "
                            f"(use slice() or select() on tensors)", e.pos)
        raise SpecError(f"unsupported expression {type(e).__name__}", e.pos)  # pragma: no cover

    def binop(self, op: str, a, b, pos: Pos):
        if op in ("==", "!=") and (a is None or b is None):
            return (a is b) == (op == "==")
        if isinstance(a, Tensor) or isinstance(b, Tensor):
            return self._tensor_binop(op, a, b, pos)
        if isinstance(a, list) or isinstance(b, list):
            if op == "+" and isinstance(a, list) and isinstance(b, list):
                return a + b
            if op in ("==", "!=") and isinstance(a, list) and isinstance(b, list) and \
                    not any(isinstance(v, Tensor) for v in a + b):  # `if kinds != [] { ... }`
                eq = len(a) == len(b) and all(self.binop("==", x, y, pos) for x, y in zip(a, b))
                return eq if op == "==" else not eq
            raise SpecError(f"unsupported operation: {describe(a)} {op} {describe(b)}", pos)
        if op in ("==", "!="):
            eq = _values_equal(a, b)
            return eq if op == "==" else not eq
        numeric = (int, float, sympy.Expr)
        if not (isinstance(a, numeric) and isinstance(b, numeric)) or isinstance(a, bool) or isinstance(b, bool):
            raise SpecError(f"unsupported operation: {describe(a)} {op} {describe(b)}", pos)
        if op in ("<", "<=", ">", ">="):
            r = {"<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b}[op]()
            if isinstance(r, (bool, sympy.logic.boolalg.BooleanAtom)):
                return bool(r)
            raise SpecError(f"cannot decide {a} {op} {b}: it depends on symbolic dimensions", pos)
        if op in ("+", "-", "*", "**"):
            return _checked(op, a, b, pos)
        if op in ("/", "//", "%") and _is_zero(b):
            raise SpecError(f"division by zero: {a} {op} {b}", pos)
        if op == "/":
            if isinstance(a, float) or isinstance(b, float):
                return _checked(op, a, b, pos)
            if isinstance(a, int) and isinstance(b, int):
                if a % b:
                    raise SpecError(f"inexact division: {a} / {b} leaves remainder {a % b} "
                                    f"(use // to round down)", pos)
                return a // b
            q = sympy.cancel(sympy.sympify(a) / b)
            if sympy.Mod(a, b) != 0:
                raise SpecError(f"inexact division: {a} / {b} is not a whole number", pos)
            return q
        if op == "//":
            return a // b
        if op == "%":
            return a % b
        raise SpecError(f"unsupported operator {op}", pos)  # pragma: no cover

    def _tensor_binop(self, op: str, a, b, pos: Pos):
        opname = {"+": "add", "-": "sub", "*": "mul", "/": "div", "**": "pow", "//": "floordiv",
                  "<": "less", "<=": "less_equal", ">": "greater", ">=": "greater_equal", "==": "equal",
                  "!=": "not_equal"}.get(op)
        if opname is None:
            raise SpecError(f"operator '{op}' is not defined on tensors", pos)
        if op == "+" and _is_zero(a) and isinstance(b, Tensor):
            return b  # accumulators start from 0: "y = 0.0" then "y += f(x)"
        if op in ("+", "-") and _is_zero(b) and isinstance(a, Tensor):
            return a
        ref = a if isinstance(a, Tensor) else b
        other = b if ref is a else a
        if isinstance(other, float) and ref.type.dtype not in ("f32", "f16", "bf16"):
            raise SpecError(f"{describe(a)} {op} {describe(b)}: a float with a {ref.type.dtype} tensor would be "
                            f"truncated; cast the tensor first, e.g. cast(x, \"f32\")", pos)
        if isinstance(other, bool):
            raise SpecError(f"unsupported operation: {describe(a)} {op} {describe(b)}", pos)
        a = self.as_tensor(a, pos, ref.type.dtype)
        b = self.as_tensor(b, pos, ref.type.dtype)
        return self.emit(opname, [a, b], {}, pos)

    def _eval_dim(self, e: ast.Expr, env: Env):
        v = self.eval(e, env)
        if isinstance(v, bool) or not isinstance(v, (int, sympy.Expr)):
            raise SpecError(f"a dimension must be an int or a symbol, got {describe(v)}", e.pos)
        return dims.dim(v)

    # ================================================================ calls
    def eval_call(self, e: ast.Call, env: Env):
        func = self.eval(e.func, env)
        args = [(self.eval(a, env), a.pos) for a in e.args]
        kwargs = {k.name: (self.eval(k.value, env), k.pos) for k in e.kwargs}
        explicit_name = None
        if "name" in kwargs:
            nv, npos = kwargs.pop("name")
            if not isinstance(nv, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", nv):
                raise SpecError(f"name= must be a plain identifier string, got {describe(nv)}", npos)
            explicit_name = (nv, npos)
        share = None
        if "share" in kwargs and isinstance(func, (BlockRef, Builtin)):
            sv, spos = kwargs.pop("share")
            if not isinstance(sv, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", sv):
                raise SpecError(f"share= must be a parameter path prefix such as \"layer\" or \"enc.layer\", "
                                f"got {describe(sv)}", spos)
            share = sv
        called_as = e.func.id if isinstance(e.func, ast.Name) else None
        if share is not None:
            self.shares.append((self.scope_path(), share))
        try:
            if isinstance(func, Builtin):
                return self.call_builtin(func, args, kwargs, e.pos, explicit_name)
            if isinstance(func, BlockRef):
                return self.call_block(func.block, args, kwargs, e.pos, explicit_name, called_as)
        finally:
            if share is not None:
                self.shares.pop()
        raise SpecError(f"{describe(func)} is not callable", e.func.pos)

    def _bind_args(self, what: str, params: list[tuple[str, Any]], args, kwargs, pos: Pos):
        """Match positional and keyword arguments to parameters. Returns {name: (value, pos)}."""
        names = [p for p, _ in params]
        bound: dict[str, tuple[Any, Pos]] = {}
        if len(args) > len(params):
            raise SpecError(f"{what} takes {len(params)} positional argument(s), got {len(args)}", args[len(params)][1])
        for (pname, _), a in zip(params, args):
            bound[pname] = a
        for k, v in kwargs.items():
            if k not in names:
                raise SpecError(f"unknown argument '{k}' for {what}{did_you_mean(k, names)} "
                                f"(it takes: {', '.join(names)})", v[1])
            if k in bound:
                raise SpecError(f"argument '{k}' of {what} given twice", v[1])
            bound[k] = v
        return bound

    def call_builtin(self, fn: Builtin, args, kwargs, pos: Pos, explicit_name):
        bound = self._bind_args(fn.name, list(fn.params), args, kwargs, pos)
        values = {}
        for pname, default in fn.params:
            if pname in bound:
                values[pname] = bound[pname]
            elif default is REQUIRED:
                raise SpecError(f"{fn.name}() is missing argument '{pname}'", pos)
            else:
                values[pname] = (default, pos)
        call = BuiltinCall(self, fn.name, pos, explicit_name)
        return fn.fn(call, **values)

    def call_block(self, block: ast.BlockDef, args, kwargs, pos: Pos, explicit_name, called_as):
        if block.name in self.block_stack:
            chain = " -> ".join(self.block_stack[self.block_stack.index(block.name):] + [block.name])
            raise SpecError(f"block {block.name} calls itself ({chain}): blocks cannot be recursive; "
                            f"use 'repeat' to stack layers", pos)
        params = [(p.name, REQUIRED if p.default is None else p.default) for p in block.params]
        what = f"block {block.name}"
        bound = self._bind_args(what, params, args, kwargs, pos)
        env = Env(self.globals)
        for p in block.params:
            if p.name in bound and not isinstance(p.type, ast.TensorType):
                env.vars[p.name] = self._check_scalar_type(p, bound[p.name][0], bound[p.name][1], what)
        for p in block.params:
            if p.name in bound:
                value, vpos = bound[p.name]
                if isinstance(p.type, ast.TensorType):
                    value = self.as_tensor(value, vpos) if isinstance(value, list) else value
                    self._check_declared(p.type, value, env, f"argument '{p.name}' of {what}", vpos, bind=True)
                    env.vars[p.name] = value
            elif p.default is not None:
                env.vars[p.name] = self._check_scalar_type(p, self.eval(p.default, env), p.default.pos, what)
            else:
                raise SpecError(f"{what} is missing argument '{p.name}'", pos)
        segment = self._claim(called_as or block.name, explicit_name, pos)
        with self._scoped(segment):
            self.call_stack.append(pos)
            self.block_stack.append(block.name)
            try:
                self.exec_body(block.body, env)
            except _Return as r:
                result = r.value
            except SpecError as err:
                err.notes.append(f"in block {block.name}, called at {pos}")
                raise
            else:
                raise SpecError(f"block {block.name} ends without 'return'", block.pos)
            finally:
                self.call_stack.pop()
                self.block_stack.pop()
        if block.result is not None:
            if isinstance(block.result, ast.TensorType):
                if not isinstance(result, Tensor):
                    raise SpecError(f"block {block.name} must return a tensor, got {describe(result)}", block.pos)
                self._check_declared(block.result, result, env, f"result of {what}", pos, bind=True)
        return result

    def _check_declared(self, ann: ast.TensorType, value, env: Env, what: str, pos: Pos, bind: bool = False):
        """Check a tensor against a declared type; unbound dimension names are bound (pattern variables)."""
        if not isinstance(value, Tensor):
            raise SpecError(f"{what} must be a tensor, got {describe(value)}", pos)
        t = value.type
        if ann.dtype is not None and ann.dtype != t.dtype:
            raise SpecError(f"{what} must be {ann.dtype}, got {t}", pos)
        if len(ann.dims) != t.rank:
            want = "[" + ", ".join(_src(d) for d in ann.dims) + "]"
            raise SpecError(f"{what} must have rank {len(ann.dims)} {want}, got {t}", pos)
        for axis, (d, actual) in enumerate(zip(ann.dims, t.shape)):
            if bind and isinstance(d, ast.Name) and not env.has_local(d.id):
                env.vars[d.id] = _py_dim(actual)
                continue
            expected = self._eval_dim(d, env)
            if not dims.equal(expected, actual):
                label = f"{_src(d)} = {dims.fmt(expected)}" if not isinstance(d, ast.Number) else dims.fmt(expected)
                raise SpecError(f"{what}: dimension {axis} is {dims.fmt(actual)}, expected {label} "
                                f"(type {t})", pos)

    # ================================================================ graph building (used by builtins)
    @contextmanager
    def _scoped(self, *segments: str):
        self.scope.extend(segments)
        try:
            yield
        finally:
            del self.scope[len(self.scope) - len(segments):]

    def _claim(self, default: str, explicit, pos: Pos) -> str:
        """Reserve a scope segment in the current scope: the explicit name, or default, default_1, ..."""
        key = ".".join(self.scope)
        used = self._used.setdefault(key, set())
        if explicit is not None:
            name, npos = explicit
            if name in used:
                raise SpecError(f"name '{name}' is already used in scope '{key or '<model>'}'", npos)
            used.add(name)
            return name
        name, i = default, 1
        while name in used:
            name = f"{default}_{i}"
            i += 1
        used.add(name)
        return name

    def scope_path(self, *extra: str) -> str:
        return ".".join([*self.scope, *extra])

    def emit(self, op: str, inputs: list[Tensor], attrs: dict, pos: Pos, n_out: int = 1,
             name: str | None = None):
        if len(self.graph.nodes) >= self.node_budget:
            raise SpecError(f"the model needs more than {self.node_budget:,} IR nodes (the elaboration budget); "
                            f"check the layer counts and 'repeat' counts", pos)
        types = [t.type for t in inputs]
        try:
            out_types = ops.infer(op, types, attrs)
        except ops.ShapeError as err:
            msg = str(err)
            raise SpecError(msg if msg.startswith(op) else f"{op}: {msg}", pos) from None
        origin = next((p for p in reversed([*self.call_stack, pos]) if p and not p.file.startswith("<stdlib>")), pos)
        node = self.graph.add_node(op, [t.name for t in inputs], out_types, attrs, self.scope_path(), pos, name,
                                   origin)
        outs = [Tensor(v, t) for v, t in zip(node.outputs, out_types)]
        return outs[0] if n_out == 1 else outs

    def _shared_path(self, path: str) -> str | None:
        """Where a parameter made under a share= call lives: the call's own segment (the first one
        after the scope it was made in) replaced by the shared prefix. None outside such calls."""
        if not self.shares:
            return None
        outer, prefix = self.shares[-1]
        rest = path[len(outer) + 1:] if outer else path
        if outer and not path.startswith(outer + "."):
            return None
        _, _, local = rest.partition(".")
        return f"{prefix}.{local}" if local else prefix

    def new_param(self, path: str, shape: tuple, init: str, pos: Pos, std: float = 0.02, dtype: str = "f32",
                  buffer: bool = False):
        shared = self._shared_path(path)
        reuse = shared is not None and shared in self.graph.params  # share=: made by the first call
        path = shared if shared is not None else path
        if not reuse and any(path in g.params for g in [self.graph, *self.outer_graphs]):
            raise SpecError(f"parameter '{path}' is defined twice", pos)
        int_shape = []
        for d in shape:
            d = dims.dim(d) if not isinstance(d, sympy.Expr) else d
            if not dims.is_static(d):
                raise SpecError(f"parameter '{path}' would have a symbolic dimension {dims.fmt(d)}; "
                                f"parameters must have fixed sizes", pos)
            if int(d) <= 0:
                raise SpecError(f"parameter '{path}' would have a non-positive dimension {int(d)}", pos)
            int_shape.append(int(d))
        if reuse:
            have = self.graph.params[path]
            if have.shape != tuple(int_shape) or have.dtype != dtype:
                raise SpecError(f"shared parameter '{path}' is {have.dtype}{list(have.shape)} where it was first "
                                f"made, but this call needs {dtype}{int_shape}", pos)
            v = self.graph.values[path]
            return Tensor(v.name, v.type)
        v = self.graph.add_param(Param(path, tuple(int_shape), dtype, init, std, pos, buffer=buffer))
        return Tensor(v.name, v.type)

    def as_tensor(self, value, pos: Pos, dtype: str = "f32", hint: str = "const", scope: str | None = None) -> Tensor:
        """Turn a tensor, number or literal (nested list) into a graph tensor."""
        if isinstance(value, Tensor):
            return value
        if isinstance(value, bool) or value is None:
            raise SpecError(f"expected a tensor, got {describe(value)}", pos)
        if isinstance(value, (int, float)) or isinstance(value, list):
            np_dtype = DTYPES.get(dtype) or np.float32
            try:
                arr = np.array(value, dtype=np_dtype)
            except (ValueError, TypeError):
                raise SpecError("a literal tensor must be a rectangular list of numbers", pos) from None
            if arr.dtype == object:
                raise SpecError("a literal tensor must be a rectangular list of numbers", pos)
            # constants carry a "/" in their names, parameters never do: an ONNX reader can tell them apart
            scope = self.scope_path() if scope is None else scope
            base = f"{scope}/{hint}" if scope else f"const/{hint}"
            v = self.graph.add_const(base, arr, dtype if dtype in DTYPES else "f32")
            return Tensor(v.name, v.type)
        if isinstance(value, sympy.Expr):
            raise SpecError(f"symbolic dimension {value} cannot be used as a tensor value here", pos)
        raise SpecError(f"expected a tensor, got {describe(value)}", pos)


class BuiltinCall:
    """What a builtin sees of the elaborator: emit nodes, make parameters, open its scope."""

    def __init__(self, elab: Elaborator, fn_name: str, pos: Pos, explicit_name):
        self.elab = elab
        self.fn_name = fn_name
        self.pos = pos
        self.explicit_name = explicit_name
        self._segment: str | None = None

    @property
    def graph(self) -> Graph:
        return self.elab.graph

    def error(self, message: str, pos: Pos | None = None) -> SpecError:
        return SpecError(f"{self.fn_name}: {message}", pos or self.pos)

    def segment(self) -> str:
        """The scope segment of this call (claimed once): its name= or the op name, deduplicated."""
        if self._segment is None:
            self._segment = self.elab._claim(self.fn_name, self.explicit_name, self.pos)
        return self._segment

    def param(self, local: str, shape, init: str, std: float = 0.02) -> Tensor:
        return self.elab.new_param(self.elab.scope_path(self.segment(), local), tuple(shape), init, self.pos, std)

    def raw_param(self, default_name: str, shape, init: str, std: float, buffer: bool = False) -> Tensor:
        name = self.segment() if self.explicit_name else self.elab._claim(default_name, None, self.pos)
        return self.elab.new_param(self.elab.scope_path(name), tuple(shape), init, self.pos, std, buffer=buffer)

    def emit(self, op: str, inputs: list[Tensor], attrs: dict | None = None, n_out: int = 1):
        if self.explicit_name and self._segment is None:
            self.segment()
        # A call that owns a scope (name= or parameters) names its node after it: layers.0.attn.q
        name = self.elab.scope_path(self._segment) if self._segment else None
        if name is not None and name in self.graph.values:
            name = None
        return self.elab.emit(op, inputs, attrs or {}, self.pos, n_out, name)

    def tensor(self, value, pos: Pos | None = None, dtype: str = "f32", what: str = "const") -> Tensor:
        scope = self.elab.scope_path(self.segment()) if self.explicit_name else None
        return self.elab.as_tensor(value, pos or self.pos, dtype, what, scope)

    def lookup_param(self, path: str, pos: Pos) -> Tensor:
        """A parameter by its full path, or relative to the current block's scope: "./k.weight" in
        the block instance layers.0.attn is layers.0.attn.k.weight, each "../" one scope up."""
        g = self.graph
        if path.startswith(("./", "../")):
            scope, rest = list(self.elab.scope), path
            while rest.startswith(("./", "../")):
                if rest.startswith("../"):
                    if not scope:
                        raise SpecError(f"'{path}' goes above the model's top scope (the current scope is "
                                        f"'{self.elab.scope_path() or '<model>'}')", pos)
                    scope.pop()
                    rest = rest[3:]
                else:
                    rest = rest[2:]
            path = ".".join([*scope, rest])
        if path not in g.params:
            raise SpecError(f"no parameter '{path}'{did_you_mean(path, g.params)}", pos)
        v = g.values[path]
        return Tensor(v.name, v.type)


def _checked(op: str, a, b, pos: Pos):
    """Compile-time arithmetic that fails with a positioned error instead of hanging on a huge
    integer power or raising Python's ZeroDivisionError / OverflowError."""
    if op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 \
            and b * math.log2(abs(a)) > INT_BITS:
        raise SpecError(f"{a} ** {b} is too large: compile-time integers stay below 2**{INT_BITS}", pos)
    try:
        r = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
             "**": operator.pow}[op](a, b)
    except OverflowError:
        raise SpecError(f"{a} {op} {b} overflows (the result is too large for a float)", pos) from None
    except (ArithmeticError, ValueError) as e:
        raise SpecError(f"compile-time arithmetic failed: {a} {op} {b} ({e})", pos) from None
    if isinstance(r, complex):
        raise SpecError(f"{a} {op} {b} is not a real number", pos)
    if isinstance(r, float) and not math.isfinite(r):
        raise SpecError(f"{a} {op} {b} overflows (the result is not a finite number)", pos)
    if isinstance(r, int) and r.bit_length() > INT_BITS:
        raise SpecError(f"{a} {op} {b} is too large: compile-time integers stay below 2**{INT_BITS}", pos)
    return r


def _bound(env: Env, name: str) -> bool:
    try:
        env.lookup(name)
        return True
    except KeyError:
        return False


def _py_dim(d):
    return int(d) if dims.is_static(d) else d


def _is_zero(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


def _values_equal(a, b) -> bool:
    if isinstance(a, sympy.Expr) or isinstance(b, sympy.Expr):
        try:
            return dims.equal(dims.dim(a), dims.dim(b))
        except TypeError:
            return False
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                              and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _kind_of_value(v) -> str | None:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, BlockRef):
        return "block"
    return None


def _kind_of_default(e: ast.Expr) -> str | None:
    if isinstance(e, ast.Bool):
        return "bool"
    if isinstance(e, ast.Number):
        return "float" if isinstance(e.value, float) else "int"
    if isinstance(e, ast.String):
        return "str"
    return None


def _src(e: ast.Expr) -> str:
    """Short source-like text of a dimension expression."""
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Number):
        return str(e.value)
    if isinstance(e, ast.BinOp):
        return f"{_src(e.left)} {e.op} {_src(e.right)}"
    return "?"


def elaborate(program: Program, variant: str | None = None, overrides: dict | None = None,
              override_pos: dict | None = None) -> tuple[Graph, ModelInfo]:
    """Build the IR graph of the program's model (with a variant and overrides)."""
    return Elaborator(program).elaborate(variant, overrides, override_pos)
