"""Every example of docs/python.md, generate.md, cli.md and docs/families/*.md runs (issue 21, item 7),
or its block is marked ``<!-- not checked: REASON -->`` on the line before it (a synopsis, a listing,
or an example that needs what a test machine lacks: a GPU, a real checkpoint).

- ```python blocks run in a folder holding ``models/`` and the files such examples name
  (``tokenizer.json``: a byte-level BPE of 300 ids trained here), one namespace per page, in
  order (a page's later examples use what its first one loaded);
- a block whose lines start with ``$ tessera`` (or ``$ NAME=...``, a shell variable) is a transcript:
  every command runs in that folder and must succeed, unless the document shows it failing (the
  next line starts with ``error:``, ``usage:`` or ``exit status``); then the first line of what it
  printed on stderr must be the document's ``error:`` line. Outputs with timings and sampled ids
  are not compared; docs/language.md's transcripts, compared line by line, are in tests/project/test_docs.py.

Every other block must carry the marker, so a new example cannot go unchecked.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_docs import SHELL_VARS, _run, parse_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / "python.md", ROOT / "docs" / "generate.md", ROOT / "docs" / "cli.md"] + \
    sorted((ROOT / "docs" / "families").glob("*.md"))


def _cases():
    out = []
    for path in DOCS:
        for block in parse_blocks(path.read_text(encoding="utf-8")):
            out.append(pytest.param(path, block, id=f"{path.relative_to(ROOT / 'docs')}:{block.line}"))
    return out


CASES = _cases()
NAMESPACES: dict[Path, dict] = {}  # one per page: its python blocks run in order, as a reader would


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """models/, tests/specs/, tokenizer.json and /tmp/tessera-docs (where cli.md's examples write)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("examples")
    (d / "models").symlink_to(ROOT / "models")
    (d / "tests").mkdir()
    (d / "tests" / "specs").symlink_to(ROOT / "tests" / "specs")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "A man is eating food. A man is eating a meal."] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    for shared, own in SHARED_FOLDERS.items():  # this run's own folder where a page writes under /tmp
        LOCAL[shared] = str(d / own)
    Path(LOCAL["/tmp/tessera-docs"]).mkdir(exist_ok=True)
    yield d


# The folders the pages write to, as a reader would type them: each run of the examples writes to its own
# (the test's temporary folder) instead, so two runs on one machine do not read or remove each other's files.
SHARED_FOLDERS = {"/tmp/tessera-docs": "tessera-docs", "/tmp/tfd": "tfd"}
LOCAL: dict[str, str] = {}


def _local(text: str) -> str:
    """``text`` (a block, a command, an expected line) with the pages' /tmp folders made this run's own."""
    for shared, own in LOCAL.items():
        text = text.replace(shared, own)
    return text


def _fails(following: list[str]) -> str | None:
    """The document's error line when it shows the command failing, else None."""
    if not following:
        return None
    first = following[0]
    if first.startswith(("usage:", "exit status")):
        return ""
    if first.startswith("error:") or ": error:" in first:
        return first
    return None


SCRIPT = re.compile(r"# (/\S+\.py)\b")  # a python block that is a file the page runs later: `$ python FILE`


def _shell(command: str, where: str) -> None:
    """A transcript's other commands: ``python FILE`` (a script the page showed) or ``python -c CODE``,
    run with this interpreter; they must succeed. A script runs in this process (``_script``); ``-c``
    code in a subprocess (the one real ``python`` process of the pages)."""
    import subprocess
    import sys

    argv = shlex.split(command)
    assert Path(argv[0]).name == "python", f"{where}: only tessera and python commands run here"
    if len(argv) == 2 and argv[1].endswith(".py"):
        _script(argv[1], where)
        return
    done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"


def _script(path: str, where: str) -> None:
    """``python FILE`` in this process, as ``__main__`` with its own argv: the families' scripts build
    small checkpoints with torch and transformers, whose import alone cost a subprocess several seconds
    (7 scripts). It must finish without an exception or a non-zero exit. torch's global RNG, which the
    scripts seed, is put back afterwards (when torch was loaded before) so that no later test sees their seed."""
    import runpy
    import sys
    import traceback

    torch = sys.modules.get("torch")
    rng = torch.random.get_rng_state() if torch is not None else None
    argv = sys.argv
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"{where} failed: exit status {e.code}"
    except Exception:  # noqa: BLE001 - any failure of the page's script fails the example, with its traceback
        pytest.fail(f"{where} failed:\n{traceback.format_exc()[-3000:]}")
    finally:
        sys.argv = argv
        if rng is not None:
            torch.random.set_rng_state(rng)


def _transcript(path: Path, block, variables: dict) -> None:
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line.rstrip())
    for command, following in steps:
        m = re.fullmatch(r'([A-Z_]+)=(".*"|\S+)', command.strip())
        if m:
            variables[m.group(1)] = m.group(2).strip('"')
            continue
        command = _local(re.sub(r"\$([A-Z_]+)", lambda v: variables.get(v.group(1), v.group(0)), command))
        where = f"{path.relative_to(ROOT)}:{block.line}: `{command}`"
        if command.strip() == "echo $?":
            continue  # the status of the command before, checked with it
        if not command.startswith("tessera "):
            _shell(command, where)
            continue
        for part in command.split(" && "):
            status = part.rstrip().endswith('echo "exit status $?"')
            lines = _run(part if status else part + '; echo "exit status $?"')
            rc = int(lines[-1].split()[-1])
            expected = _fails([_local(line) for line in following])
            if expected is None:
                assert rc == 0, f"{where} failed:\n" + "\n".join(lines)
            else:
                assert rc != 0, f"{where} succeeded, but the document shows it failing"
                if expected:
                    errors = [ln for ln in lines if ln.startswith("error:") or ": error:" in ln]
                    assert errors and errors[0] == expected, f"{where} printed\n" + "\n".join(lines)


@pytest.mark.parametrize("path,block", CASES)
def test_doc_example(path, block, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("NO_COLOR", "1")
    reason = block.marker("not checked")
    if reason is not None:
        assert reason.strip(), f"{path.relative_to(ROOT)}:{block.line}: 'not checked' needs a reason"
        pytest.skip(f"not checked: {reason}")
    text = _local(block.text)
    if block.lang == "python" and SCRIPT.match(text):
        target = Path(SCRIPT.match(text).group(1))  # written now, run by the transcript after it
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    elif block.lang == "python":
        code = compile(text, f"{path.name}:{block.line}", "exec")
        exec(code, NAMESPACES.setdefault(path, {"__name__": "__doc_example__"}))
    elif block.text.startswith("$ "):
        _transcript(path, block, dict(SHELL_VARS))
    else:
        pytest.fail(f"{path.relative_to(ROOT)}:{block.line}: a block that is neither run nor marked "
                    f"'<!-- not checked: REASON -->'")
