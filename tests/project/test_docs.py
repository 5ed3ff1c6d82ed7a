"""docs/language.md matches the code: its builtins table is what docs/gen_builtins.py writes,
and every fenced block in it is checked or marked as not checkable, with a reason.

How each block is checked (marker comments are HTML comments on the lines just before a
block; the rendered page does not show them):

- a ```tsr block is saved to a file (``<!-- file: NAME -->``, or a first line ``# file: NAME``,
  else a name from its line number) and must load and elaborate, or, after
  ``<!-- error: MESSAGE -->``, fail with a spec error whose message contains MESSAGE; a file
  without a model (a library of blocks) must load;
- ``<!-- same as: PATH -->``: the block is that file of the repository, verbatim;
- ``<!-- derive: NAME from BASE; N: "TEXT"; ... -->`` (or ``; lines A-B``) writes NAME as BASE
  with line N replaced by TEXT (or only lines A to B), for the error examples;
- a block whose first line starts with ``$ tessera`` is a transcript: every command is run in
  a folder holding the saved files (and ``models/``), and its output must be the lines that
  follow, where a line ``...`` (indented or not) stands for any number of lines;
- ``<!-- first error lines -->``: each line ``FILE:L:C: error: ...`` is the first line that
  ``tessera ir FILE`` prints;
- ``<!-- params of: NAME -->``: the block lists the parameter paths of that saved spec;
- a ```toml block is a checkpoint mapping ([names] and/or [config]) and must load as one (runtime/io/weights.py);
- ``<!-- not checked: REASON -->``: skipped, for the reason given (syntax summaries, outputs of
  files the document does not show).

A block with none of these fails the test, so a new example cannot go unchecked.

Beyond language.md, every ``tessera`` command shown in a fenced block of docs/ (but
docs/architecture.md) and the README must parse with the command's own parser, and a spec it
names must exist (a file of the repository or a bundled spec).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tessera.compiler.frontend.elaborate import elaborate
from tessera.spec import SpecError, load_program

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "language.md"


# ---------------------------------------------------------------- the builtins table
def _generator():
    spec = importlib.util.spec_from_file_location("gen_builtins", ROOT / "docs" / "gen_builtins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_builtins_table_is_generated_from_BUILTINS():
    from tessera.compiler.frontend.builtins import BUILTINS

    gen = _generator()
    text = DOC.read_text(encoding="utf-8")
    assert gen.render(text) == text, "the builtins table in docs/language.md is stale: run python docs/gen_builtins.py"
    section = text.split(gen.BEGIN)[1].split(gen.END)[0]
    assert [m for m in re.findall(r"^\| `(\w+)` \|", section, re.M)] == list(BUILTINS)


def test_every_builtin_has_a_doc():
    from tessera.compiler.frontend.builtins import BUILTINS

    assert not [name for name, b in BUILTINS.items() if not b.doc.strip()]


# ---------------------------------------------------------------- the fenced blocks
@dataclass
class Block:
    line: int            # line of the opening fence
    lang: str
    text: str
    markers: list[tuple[str, str]] = field(default_factory=list)  # (kind, argument)

    def marker(self, kind: str) -> str | None:
        return next((arg for k, arg in self.markers if k == kind), None)

    @property
    def filename(self) -> str:
        named = self.marker("file")
        if named:
            return named
        m = re.match(r"# file: (\S+)", self.text)
        return m.group(1) if m else f"snippet_{self.line}.tsr"


MARKER = re.compile(r"<!-- ([a-z ]+?)(?:: (.*?))? -->$")


def parse_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            markers, j = [], i - 1
            while j >= 0 and MARKER.match(lines[j].strip()):
                kind, arg = MARKER.match(lines[j].strip()).groups()
                markers.insert(0, (kind, arg or ""))
                j -= 1
            end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            blocks.append(Block(i + 1, lines[i][3:].strip(), "\n".join(lines[i + 1:end]) + "\n", markers))
            i = end + 1
        else:
            i += 1
    return blocks


BLOCKS = parse_blocks(DOC.read_text(encoding="utf-8"))
KNOWN = {"file", "error", "same as", "derive", "first error lines", "params of", "not checked"}


def test_markers_are_known():
    bad = [(b.line, k) for b in BLOCKS for k, _ in b.markers if k not in KNOWN]
    assert not bad, f"unknown marker kinds (line, kind): {bad}"
    assert len(BLOCKS) > 30


def _derive(workdir: Path, spec: str) -> None:
    head, *edits = [s.strip() for s in spec.split(";")]
    m = re.fullmatch(r"(\S+) from (\S+)", head)
    assert m, f"bad derive marker: {spec}"
    name, base = m.groups()
    lines = (workdir / base).read_text().splitlines()
    for edit in edits:
        r = re.fullmatch(r"lines (\d+)-(\d+)", edit)
        if r:
            lines = lines[int(r.group(1)) - 1:int(r.group(2))]
            continue
        r = re.fullmatch(r"(\d+): (\".*\")", edit)
        assert r, f"bad derive edit: {edit}"
        lines[int(r.group(1)) - 1] = json.loads(r.group(2))
    (workdir / name).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with every tsr block saved under its name, the derived files, and models/."""
    d = tmp_path_factory.mktemp("doc")
    (d / "models").symlink_to(ROOT / "models")
    for b in BLOCKS:
        if b.lang == "tsr":
            (d / b.filename).parent.mkdir(parents=True, exist_ok=True)
            (d / b.filename).write_text(b.text)
    for b in BLOCKS:
        for kind, arg in b.markers:
            if kind == "derive":
                _derive(d, arg)
    return d


def _tessera(argv: list[str]) -> tuple[int, str, str]:
    from tessera.runtime.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def _run(command: str) -> list[str]:
    """One transcript command: ``tessera ARGS [| head -N | grep WORD] [; echo "exit status $?"]``."""
    echo = '; echo "exit status $?"'
    status = command.endswith(echo)
    command = command[: -len(echo)] if status else command
    command, _, pipe = command.partition(" | ")
    argv = shlex.split(command)
    assert argv[0] == "tessera", command
    rc, out, err = _tessera(argv[1:])
    lines = out.splitlines()
    if pipe:
        tool, arg = pipe.split(None, 1)
        if tool == "head":
            lines = lines[: int(arg.lstrip("-"))]
        elif tool == "grep":
            lines = [ln for ln in lines if arg in ln]
        else:
            raise AssertionError(f"unsupported pipe in the document: {pipe}")
    lines += err.splitlines()
    if status:
        lines.append(f"exit status {rc}")
    return [ln.rstrip() for ln in lines]


def _matches(actual: list[str], expected: list[str]) -> bool:
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(_matches(actual[i:], expected[1:]) for i in range(len(actual) + 1))
    return bool(actual) and actual[0] == expected[0] and _matches(actual[1:], expected[1:])


def _check_transcript(block: Block) -> None:
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line.rstrip())
    for command, expected in steps:
        actual = _run(command)
        assert _matches(actual, expected), (
            f"docs/language.md:{block.line}: `{command}` printed\n" + "\n".join(actual)
            + "\n---- but the document shows\n" + "\n".join(expected))


def _check_tsr(block: Block, workdir: Path) -> None:
    path = workdir / block.filename
    want_error = block.marker("error")
    try:
        program = load_program(path)
        if program.main_model is None and want_error is None:
            assert "model " not in block.text, "a model that did not load"
            return  # a library of blocks: loading it (parse, uses) is the check
        elaborate(program, None, {})
    except SpecError as e:
        assert want_error is not None, f"docs/language.md:{block.line}: unexpected error\n{e.render()}"
        assert want_error in e.message, f"docs/language.md:{block.line}: {e.message!r} lacks {want_error!r}"
        return
    assert want_error is None, f"docs/language.md:{block.line}: elaborated, but the document says it fails"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_language_reference_block(block, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("NO_COLOR", "1")
    reason = block.marker("not checked")
    if reason is not None:
        assert reason.strip(), f"docs/language.md:{block.line}: 'not checked' needs a reason"
        pytest.skip(f"not checked: {reason}")
    same = block.marker("same as")
    if same is not None:
        assert block.text == (ROOT / same).read_text(), f"docs/language.md:{block.line} differs from {same}"
    if block.lang == "tsr":
        _check_tsr(block, workdir)
    elif block.lang == "toml":
        from tessera.runtime.io.weights import NameMap

        path = workdir / f"mapping_{block.line}.hf.toml"
        path.write_text(block.text)
        mapping = NameMap.load(path)
        assert mapping.rules or mapping.config  # a [names] or a [config] table
    elif block.text.startswith("$ tessera"):
        _check_transcript(block)
    elif block.marker("first error lines") is not None:
        for line in block.text.splitlines():
            name = line.split(":", 1)[0]
            assert _run(f"tessera ir {name}")[0] == line
    elif block.marker("params of") is not None:
        program = load_program(workdir / block.marker("params of"))
        graph, _ = elaborate(program, None, {})
        assert block.text.split() == list(graph.params)
    elif same is None:
        pytest.fail(f"docs/language.md:{block.line}: a block that is neither checked nor marked "
                    f"'<!-- not checked: REASON -->'")


# ---------------------------------------------------------------- every documented command line
# cli.md defines $TINY in its prose; other shell variables are set in the blocks themselves ($ G="...").
SHELL_VARS = {"TINY": "--set layers=2 --set d=64 --set heads=4 --set vocab=1000 --set ctx=128"}
COMMAND_DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "architecture.md") + [ROOT / "README.md"]


def documented_commands() -> list[tuple[str, str, str]]:
    """(where, command, what the document shows next) for every ``tessera`` command in a fenced
    block of the docs and the README (``&&`` chains split, pipes and ``;`` tails cut, shell
    variables expanded). Synopses (``SPEC``, ``[--variant V]``) are left out."""
    found = []
    for path in COMMAND_DOCS:
        blocks = parse_blocks(path.read_text(encoding="utf-8"))
        variables = dict(SHELL_VARS)
        for block in blocks:  # NAME="..." sets a value; NAME=$(...) a path computed at run time
            for line in block.text.splitlines():
                m = re.fullmatch(r'([A-Z_]+)=(".*"|\$\(.*\)|\S+)', line.strip().removeprefix("$ "))
                if m:
                    value = m.group(2)
                    variables[m.group(1)] = value[1:-1] if value.startswith('"') else f"/{m.group(1).lower()}"
        for block in blocks:
            lines = block.text.splitlines()
            for i, line in enumerate(lines):
                text = line.strip().removeprefix("$ ")
                for part in text.split(" && "):
                    part = re.split(r" \| |; ", part.strip())[0]
                    words = part.split()
                    if not words or words[0] != "tessera" or (len(words) > 1 and words[1].endswith(":")):
                        continue  # not a command, or argparse's own error line
                    if any(w in ("SPEC", "MODEL") or w.startswith("[") for w in words):
                        continue  # a synopsis
                    part = re.sub(r"\$([A-Z_]+)", lambda v: variables.get(v.group(1), v.group(0)), part)
                    after = lines[i + 1] if i + 1 < len(lines) else ""
                    found.append((f"{path.relative_to(ROOT)}:{block.line + 1 + i}", part, after))
    return found


COMMANDS = documented_commands()


def test_documented_commands_were_found():
    assert len(COMMANDS) > 60
    assert any(c.startswith("tessera report gtp2") for _, c, _ in COMMANDS)  # an error example


@pytest.mark.parametrize("where,command,after", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_documented_command_parses(where, command, after, capsys):
    """Every option and choice a document shows exists (or the document shows argparse's usage
    error); a spec it names is a file of the repository or a bundled spec, unless the document
    shows the command failing or the file is one the document writes elsewhere."""
    from tessera.models import bundled_names
    from tessera.runtime.cli import make_parser

    argv = shlex.split(command)[1:]
    assert not [w for w in argv if w.startswith("$")], f"{where}: unknown shell variable in `{command}`"
    usage_error = after.startswith("usage: tessera")
    try:
        args = make_parser().parse_args(argv)
    except SystemExit as e:
        assert usage_error and e.code == 2, f"{where}: `{command}` is refused: {capsys.readouterr().err}"
        return
    assert not usage_error, f"{where}: the document shows a usage error, but `{command}` parses"
    if after.startswith("error:") or ": error:" in after:
        return  # an example of a failing command
    if not hasattr(args, "spec"):
        assert args.command == "cache", f"{where}: `{command}` names no model"  # the one command without one
        return
    spec = args.spec
    if spec.startswith("models/"):
        assert (ROOT / spec).exists(), f"{where}: {spec} is not in the repository"
    elif "/" not in spec and not spec.endswith((".tsr", ".onnx")):
        assert spec in bundled_names(), f"{where}: '{spec}' is neither a file nor a bundled spec"


# ---------------------------------------------------------------- family pages (issue 24)
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "mixtral", "transformer", "vit"])
def test_a_family_page_listing_its_whole_spec_shows_the_bundled_file(family):
    """These pages list the model as bundled (from `model` to the end); a hyperparameter added to the
    spec (ctx, rope_max_ctx) and not to the page was the error issue 24 found."""
    page = (ROOT / "docs" / "families" / f"{family}.md").read_text()
    src = (ROOT / "models" / f"{family}.tsr").read_text()
    listings = [b[b.index("model "):] for b in re.findall(r"```(?:tsr)?\n(.*?)```", page, re.S)
                if re.search(r"^model ", b, re.M)]
    assert listings == [src[src.index("model "):].rstrip("\n") + "\n"]


def test_the_mixtral_page_shows_the_stdlib_moe_block():
    page = (ROOT / "docs" / "families" / "mixtral.md").read_text()
    nn = (ROOT / "spec" / "stdlib" / "nn.tsr").read_text()
    start = nn.index("block moe(")
    assert nn[start:nn.index("\n}\n", start) + 3] in page


def test_cli_md_lists_every_bundled_spec():
    bundled = sorted(p.stem for p in (ROOT / "models").glob("*.tsr"))
    cli = (ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in cli.splitlines() if line.startswith("| `SPEC` |"))
    assert re.findall(r"`(\w+)`", row.split("(", 1)[1].split(":", 1)[0]) == bundled
    assert f"(bundled specs: {', '.join(bundled)})" in cli


# ---------------------------------------------------------------- links between the docs
def _anchors(path: Path) -> set[str]:
    """The fragments a page answers: its headings as GitHub names them (lower case, punctuation
    but ``-`` and ``_`` dropped, spaces to ``-``, repeats numbered) and its ``<a id="...">`` tags."""
    seen: dict[str, int] = {}
    out, in_code = set(), False
    text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out | set(re.findall(r'<a id="([^"]+)"', text))


def test_relative_links_in_the_docs_resolve():
    """Every relative link of docs/ and the README names a file of the repository and, with a
    fragment, a heading or anchor of that page (docs/BENCHMARKS.md's summary links into the run
    log under docs/benchmarks/ row by row)."""
    broken = []
    for path in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
        in_code = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code or line.startswith("```"):
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # a web address
                file, _, fragment = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                if not dest.exists() or (fragment and dest.suffix == ".md" and fragment not in _anchors(dest)):
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "\n".join(broken)
