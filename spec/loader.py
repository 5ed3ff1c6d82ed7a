"""Load a spec file with everything it ``use``s, plus the standard library.

``use "file"`` paths are relative to the file that says them. A cycle of
uses is an error at the ``use`` that closes it. The standard library
(``stdlib/*.tsr`` beside this module) is visible to every file, and a file's
own blocks may shadow it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from . import ast
from .diagnostics import SpecError, register_source
from .ast_cache import parse as parse_text  # lark only when the cache misses


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


@lru_cache(maxsize=4)
def _stdlib_blocks(files: tuple[tuple[str, str], ...]) -> tuple[ast.BlockDef, ...]:
    """The standard library's blocks, parsed once a process for each text of its files (keyed by the
    texts, so an edited file is parsed afresh). Why: every ``load_program`` needs them, and even a hit
    of the AST cache costs an unpickle of the whole library (about 6 ms of the 6.5 ms a small spec's
    load took, measured), once per model built: thousands of times in the test suite. Sharing is safe:
    the AST is frozen dataclasses and tuples (spec/ast.py), which the elaborator only reads."""
    return tuple(b for name, text in files for b in parse_text(text, name).blocks)


# A spec is a page or two of text; a bigger file is a mistake (and slow to parse).
MAX_SPEC_BYTES = 1024 * 1024


def read_spec_text(path: Path, display: str, pos=None, need_suffix: bool = False) -> str:
    """The text of a spec file, refusing anything that is not a regular UTF-8 file of at most
    MAX_SPEC_BYTES (a FIFO or device would hang or never end), before reading any of it, so
    nothing of another file's contents is ever echoed back."""
    if need_suffix and not str(path).endswith(".tsr"):
        raise SpecError(f"'use' takes spec files ending in .tsr, not '{display}'", pos)
    try:
        st = os.stat(path)
    except ValueError:  # a NUL byte in the name
        raise SpecError(f"invalid file name {display!r}", pos) from None
    except FileNotFoundError:
        raise SpecError(f"spec file not found: {display}", pos) from None
    except OSError as e:
        raise SpecError(f"cannot read {display}: {e.strerror}", pos) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise SpecError(f"spec path {display} is {kind}", pos)
    if st.st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{display} is {st.st_size:,} bytes; spec files are at most {MAX_SPEC_BYTES:,}", pos)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read {display}: {e.strerror}", pos) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(f"{display} is over {MAX_SPEC_BYTES:,} bytes; spec files are at most that", pos)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{display} is not UTF-8 text (byte {e.start}: {e.reason})", pos) from None


def load_program(path: str | Path) -> Program:
    """Parse ``path`` and its uses into a Program. Raises SpecError."""
    path = Path(path)
    display = str(path)
    prog = Program(display)
    files = tuple(_stdlib_files())
    for name, text in files:
        register_source(name, text)  # diagnostics quote the library's source, as parse_text does
    for b in _stdlib_blocks(files):
        prog.blocks[b.name] = b
    stdlib_names = set(prog.blocks)
    seen_files: dict[Path, str] = {}
    text = read_spec_text(path, display)
    main = _load_file(path.resolve(), display, prog, stdlib_names, [], seen_files, text)
    if main.models:
        prog.main_model = main.models[0]
    return prog


def _load_file(real: Path, display: str, prog: Program, stdlib: set[str],
               stack: list[Path], seen: dict[Path, str], text: str) -> ast.SpecFile:
    spec = parse_text(text, display)
    stack = stack + [real]
    for use in spec.uses:
        shown = str(Path(display).parent / use.path)
        if "\0" in use.path:
            raise SpecError(f"invalid file name {use.path!r}", use.pos)
        try:
            target = (real.parent / use.path).resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop, a name too long
            raise SpecError(f"cannot read '{use.path[:60]}': {getattr(e, 'strerror', None) or e}", use.pos) from None
        if target in stack:
            chain = " -> ".join(p.name for p in stack[stack.index(target):] + [target])
            raise SpecError(f"cyclic use: {chain}", use.pos)
        if target in seen:
            continue
        try:
            exists = target.exists()
        except OSError as e:
            raise SpecError(f"cannot read '{use.path}': {e.strerror}", use.pos) from None
        if not exists and str(target).endswith(".tsr"):
            raise SpecError(f"used file not found: '{use.path}' (looked in {real.parent})", use.pos)
        used_text = read_spec_text(target, shown, use.pos, need_suffix=True)
        seen[target] = use.path
        _load_file(target, shown, prog, stdlib, stack, seen, used_text)
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
