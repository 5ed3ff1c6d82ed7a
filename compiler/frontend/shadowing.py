"""Hyperparameters that hide a builtin: refused where they are defined.

Why: a model or block body looks names up innermost first, so a hyperparameter ``expand = 2``
makes ``expand(x, ...)`` in that body call the number 2 (``int 2 is not callable``), far from the
cause. A hyperparameter named like a builtin that the same body also calls is always this
mistake, so it is a SpecError at the hyperparameter's definition, with the call as a note. One
that is never called there hides nothing and is allowed (``max``, ``weight`` and ``float`` are
natural hyperparameter names)."""

from __future__ import annotations

import dataclasses

from tessera.spec import ast
from tessera.spec.diagnostics import SpecError


def _calls(node, name: str):
    """Every call ``name(...)`` in an AST node, in source order (a depth-first walk of its fields)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
        yield node
    if isinstance(node, (list, tuple)):
        for item in node:
            yield from _calls(item, name)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from _calls(getattr(node, f.name), name)


def check(definition, kind: str, builtins) -> None:
    """Raise a SpecError at the first hyperparameter of ``definition`` (a ModelDef or BlockDef) that
    has a builtin's name and whose body calls that name."""
    for p in definition.params:
        if p.name not in builtins:
            continue
        call = next(_calls(definition.body, p.name), None)
        if call is not None:
            raise SpecError(f"hyperparameter '{p.name}' of {kind} {definition.name} hides the builtin {p.name}(), "
                            f"which its body calls: rename the hyperparameter (e.g. '{p.name}_')", p.pos,
                            [f"{p.name}(...) is called at {call.pos}"])
