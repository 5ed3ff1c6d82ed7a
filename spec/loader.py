"""Load a spec file with everything it ``use``s, plus the standard library.

``use "file"`` paths are relative to the file that says them. A cycle of
uses is an error at the ``use`` that closes it. The standard library
(``stdlib/*.tsr`` beside this module) is visible to every file, and a file's
own blocks may shadow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import ast
from .diagnostics import SpecError
from .parser import parse_text


@dataclass
class Program:
    """Every block, model and variant visible to the main spec file."""

    path: str
    blocks: dict[str, ast.BlockDef] = field(default_factory=dict)
    models: dict[str, ast.ModelDef] = field(default_factory=dict)
    variants: dict[str, ast.VariantDef] = field(default_factory=dict)
    # The file's own model (the one variants and ``--variant`` refer to).
    main_model: ast.ModelDef | None = None


def _stdlib_files() -> list[tuple[str, str]]:
    root = resources.files(__package__).joinpath("stdlib")
    out = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".tsr"):
            out.append((f"<stdlib>/{entry.name}", entry.read_text()))
    return out


def load_program(path: str | Path) -> Program:
    """Parse ``path`` and its uses into a Program. Raises SpecError."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"spec file not found: {path}")
    if not path.is_file():
        raise SpecError(f"spec path is not a file: {path}")
    display = str(path)
    prog = Program(display)
    for name, text in _stdlib_files():
        spec = parse_text(text, name)
        for b in spec.blocks:
            prog.blocks[b.name] = b
    stdlib_names = set(prog.blocks)
    seen_files: dict[Path, str] = {}
    main = _load_file(path.resolve(), display, prog, stdlib_names, [], seen_files)
    if main.models:
        prog.main_model = main.models[0]
    return prog


def _load_file(real: Path, display: str, prog: Program, stdlib: set[str],
               stack: list[Path], seen: dict[Path, str]) -> ast.SpecFile:
    try:
        text = real.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{display} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise SpecError(f"cannot read {display}: {e.strerror}") from None
    spec = parse_text(text, display)
    stack = stack + [real]
    for use in spec.uses:
        target = (real.parent / use.path).resolve()
        if target in stack:
            chain = " -> ".join(p.name for p in stack[stack.index(target):] + [target])
            raise SpecError(f"cyclic use: {chain}", use.pos)
        if not target.exists():
            raise SpecError(f"used file not found: '{use.path}' (looked in {real.parent})", use.pos)
        if target in seen:
            continue
        seen[target] = use.path
        shown = str(Path(display).parent / use.path)
        _load_file(target, shown, prog, stdlib, stack, seen)
    if len(spec.models) > 1:
        raise SpecError(f"a spec file holds one model; '{spec.models[1].name}' is a second "
                        f"(write it as a variant or in its own file)", spec.models[1].pos)
    for b in spec.blocks:
        if b.name in prog.blocks and b.name not in stdlib:
            raise SpecError(f"block '{b.name}' is defined twice (first at {prog.blocks[b.name].pos})", b.pos)
        prog.blocks[b.name] = b
    for m in spec.models:
        prog.models[m.name] = m
    for v in spec.variants if len(stack) == 1 else ():
        if v.name in prog.variants:
            raise SpecError(f"variant '{v.name}' is defined twice", v.pos)
        prog.variants[v.name] = v
    return spec
