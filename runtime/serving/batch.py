"""``tessera batch MODEL --input prompts.jsonl --output results.jsonl``: offline generation for a file
of prompts through the continuous-batching engine (locally, or on Ray Data with ``--ray``:
serving/ray_batch.py).

Input: JSON lines, each an object with ``prompt`` (text, which needs ``--tokenizer``, or a list of
token ids) and the completion route's optional fields (``ROW_FIELDS``). Output: one JSON line per
input line, in input order: ``tokens`` (the new token ids, a final stop token included, as the
route's ``token_ids``), ``finish_reason`` and, with a tokenizer, ``text`` -- or ``error`` for a row
that cannot run (a prompt past the context, a bad field). A bad row is reported on its line, not
fatal; a bad file (missing, a line that is not JSON or not an object) is a UsageError naming the
line before anything loads. The output is written atomically (a temporary file beside the target,
renamed over it), so an interrupted run leaves no half-written file.

Why rows go through the engine rather than ``generate``: rows of different lengths share every
decoding step and a finished row frees its slot at once -- the same reason the server batches.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from tessera.runtime.errors import UsageError
from tessera.runtime.options import EngineOptions

if TYPE_CHECKING:  # the engine (and onnxruntime behind it) is imported when a batch runs, not for --help
    from .engine import Engine, Handle, Request

ROW_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "min_p",
              "no_repeat_ngram_size", "min_tokens", "response_format", "guided_json", "guided_regex", "guided_grammar")

@dataclass(kw_only=True)
class BatchOptions(EngineOptions):
    """`tessera batch`'s options: the model, its compile, tokenizer and engine bounds as `tessera serve`
    takes them (options.EngineOptions), the files, the default of a row's max_tokens, and where it
    runs. Picklable: Ray Data's actors build their engines from it."""

    input: str = ""
    output: str = ""
    max_tokens: int = 16
    ray: bool = False
    concurrency: int = 1
    address: str | None = None
    resume: bool = False  # continue an interrupted run from its journal (JOURNAL_SUFFIX beside --output)

    def check(self) -> None:
        super().check()
        for name, low in (("max_tokens", 1), ("concurrency", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value}")
        if (self.concurrency != 1 or self.address) and not self.ray:
            raise UsageError("--concurrency and --address apply with --ray")
        if self.resume and self.ray:
            raise UsageError("--resume continues a local run from its journal; a --ray run keeps no journal")
        if not self.output or not isinstance(self.output, str) or "\0" in self.output:
            raise UsageError("--output must be a file path")
        if Path(self.output).resolve() == Path(self.input).resolve():
            raise UsageError("--output is the --input file; write the results elsewhere")


# ---------------------------------------------------------------------------------------- input


def read_rows(path: str) -> list[dict]:
    """The input file's rows; a UsageError naming the line for a line that is not a JSON object.
    Blank lines are skipped (they have no row, so they get no result line)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--input {path}: no such file")
    rows = []
    try:
        with p.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise UsageError(f"{path}:{number}: not a JSON line ({e})") from None
                except RecursionError:
                    raise UsageError(f"{path}:{number}: not a JSON line (arrays or objects nested too "
                                     f"deep)") from None
                if not isinstance(row, dict):
                    raise UsageError(f"{path}:{number}: a line must be a JSON object with a prompt, "
                                     f"got {type(row).__name__}")
                rows.append(row)
    except UnicodeDecodeError as e:
        raise UsageError(f"--input {path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise UsageError(f"--input {path}: cannot read it ({e.strerror or e})") from None
    if not rows:
        raise UsageError(f"--input {path}: no rows (one JSON object a line)")
    return rows


class RowError(Exception):
    """A row that cannot run; its message is the row's ``error``."""


def _whole(row: dict, name: str, low: int | None = None) -> int | None:
    v = row.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (low is not None and v < low):
        raise RowError(f"{name} must be an integer" + (f" >= {low}" if low is not None else "") + f", got {_shown(v)}")
    return v


def _number(row: dict, name: str, default: float) -> float:
    v = row.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise RowError(f"{name} must be a number, got {_shown(v)}")
    try:
        f = float(v)  # a 401-digit integer is past float's range
    except OverflowError:
        raise RowError(f"{name} must be a finite number, got an integer of {len(str(abs(v)))} digits") from None
    if not math.isfinite(f):
        raise RowError(f"{name} must be a finite number, got {v!r}")
    return f


def _shown(v, limit: int = 80) -> str:
    """``v`` for an error message: its repr, cut to ``limit`` characters (a row may hold megabytes)."""
    try:
        text = repr(v)
    except (RecursionError, ValueError):
        text = f"a {type(v).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


def _check_text(row: dict) -> None:
    """Every string of the row (keys too) valid Unicode: json.loads takes a lone surrogate
    ("\\ud800"), which the tokenizer cannot encode. Walked without recursion."""
    stack = [("", row)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and not _encodable(k):
                    raise RowError(f"a field name is not valid Unicode (a lone surrogate such as \\ud800)")
                stack.append((f"{where}.{k}" if where else str(k), item))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(v))
        elif isinstance(v, str) and not _encodable(v):
            raise RowError(f"{_shown(where, 40).strip(chr(39))}: the text is not valid Unicode (a lone surrogate "
                           f"such as \\ud800)")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def row_request(row: dict, engine: Engine, default_max_tokens: int) -> Request:
    """The engine Request for one input row (RowError for a bad field); the engine's own checks
    (context, vocabulary, sampling values) run at submission."""
    from .engine import Request  # loaded when a batch runs: the parsers import this module
    from .model import Sampling, encode_prompts, stop_token_ids

    _check_text(row)
    unknown = sorted(set(row) - set(ROW_FIELDS))
    if unknown:
        raise RowError(f"unknown field {_shown(unknown[0], 60)} (a row takes {', '.join(ROW_FIELDS)})")
    prompt, tokenizer = row.get("prompt"), engine.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RowError("a text prompt needs --tokenizer; give the prompt as token ids")
        try:
            ids = encode_prompts(tokenizer, [prompt])[0]
        except UsageError as e:
            raise RowError(str(e)) from None
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise RowError("prompt must be text or a list of token ids" if "prompt" in row else "the row has no prompt")
    if not ids:
        raise RowError("the prompt is empty: generation needs at least one token to start from")
    stop = row.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RowError(f"stop must be a string or a list of strings, got {_shown(stop)}")
    if stops and tokenizer is None:
        raise RowError("stop strings need --tokenizer")
    max_tokens = _whole(row, "max_tokens", 1)
    sampling = Sampling(_number(row, "temperature", 0.0),
                        _whole(row, "top_k", 0) or 0, _number(row, "top_p", 1.0),
                        _number(row, "repetition_penalty", 1.0), _whole(row, "seed"), _number(row, "min_p", 0.0),
                        _whole(row, "no_repeat_ngram_size", 0) or 0, _whole(row, "min_tokens", 0) or 0)
    return Request(ids, max_tokens if max_tokens is not None else default_max_tokens, sampling,
                   tuple(stop_token_ids(tokenizer, stops)), tuple(s for s in stops if s), grammar=row_grammar(row))


def row_grammar(row: dict):
    """Structured output as the server's routes take it: ``response_format`` ({"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"schema": ...}}), ``guided_json``, ``guided_regex``,
    ``guided_grammar`` (Lark); at most one. None: free text. Compiled by the engine at submission."""
    from tessera.runtime.generation.constraints import Grammar  # numpy: not for the parsers

    asked = []
    rf = row.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise RowError(f"response_format must be an object whose type is text, json_object or json_schema, "
                           f"got {_shown(rf)}")
        if rf["type"] == "json_object":
            asked.append(Grammar.json_object())
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise RowError("response_format of type json_schema needs json_schema.schema")
            asked.append(Grammar.json_schema(js["schema"]))
    if row.get("guided_json") is not None:
        asked.append(Grammar.json_schema(row["guided_json"]))
    for name, make in (("guided_regex", Grammar.regex), ("guided_grammar", Grammar.lark)):
        v = row.get(name)
        if v is not None:
            if not isinstance(v, str):
                raise RowError(f"{name} must be a string, got {_shown(v)}")
            asked.append(make(v))
    if len(asked) > 1:
        raise RowError("give one of response_format, guided_json, guided_regex and guided_grammar")
    return asked[0] if asked else None


# ---------------------------------------------------------------------------------------- results


def result_of(handle: Handle, engine: Engine) -> dict:
    """A finished request's output line: text as the completion route gives it (a final stop or
    end-of-sequence token left out, cut at a stop string), all new token ids, the finish reason."""
    from .model import StopStrings  # loaded when a batch runs: the parsers import this module

    if handle.finish_reason in ("error", "cancelled"):
        return {"error": handle.error or f"the request was {handle.finish_reason}"}
    out: dict = {}
    tokenizer, req, tokens = engine.tokenizer, handle.request, list(handle.tokens)
    if tokenizer is not None:
        shown = tokens
        if handle.finish_reason == "stop" and tokens and (tokens[-1] in req.stop_tokens or
                                                           tokens[-1] in engine.eos_ids):
            shown = tokens[:-1]
        text = tokenizer.decode(shown, skip_special_tokens=True)
        out["text"] = StopStrings(req.stop_strings).trim(text)
    out["tokens"] = tokens
    out["finish_reason"] = handle.finish_reason
    return out


def run_rows(engine: Engine, rows: list[dict], default_max_tokens: int, on_result=None,
             done: dict[int, dict] | None = None) -> list[dict]:
    """Every row through a started engine, one result per row in row order. Rows are submitted as
    fast as the engine's bounds allow: past them (Overloaded), wait for the oldest row in flight.
    ``on_result(i, result)`` is called as each row's result is known (the journal); rows in
    ``done`` (index -> result, from a journal) are not run again."""
    from .engine import Overloaded, RequestError, Unavailable  # not for the parsers (they import this module)

    done = done or {}
    results: list[dict | None] = [done.get(i) for i in range(len(rows))]
    in_flight: collections.deque[tuple[int, Handle]] = collections.deque()

    def settle(i: int, result: dict) -> None:
        results[i] = result
        if on_result is not None:
            on_result(i, result)

    def settle_oldest() -> None:
        i, h = in_flight.popleft()
        h.wait()
        settle(i, result_of(h, engine))

    for i, row in enumerate(rows):
        if i in done:
            continue
        try:
            req = row_request(row, engine, default_max_tokens)
            while True:
                try:
                    in_flight.append((i, engine.submit(req)))
                    break
                except Overloaded:
                    if not in_flight:
                        raise
                    settle_oldest()
        except (RowError, RequestError) as e:
            settle(i, {"error": str(e)})
        except UsageError as e:  # a value the engine's own checks refuse (Sampling.check): the row's error
            settle(i, {"error": str(e)})
        except Unavailable as e:
            raise UsageError(f"the engine stopped: {e}") from None
    while in_flight:
        settle_oldest()
    return results  # type: ignore[return-value]


def load_engine(opts: BatchOptions) -> Engine:
    """The engine (not started) for ``opts``'s model, tokenizer and bounds (the model loaded by the
    driver, runtime/driver.py ``serve_model``, as `tessera serve` loads it; row_engine.engine_for: the
    KV-cache Engine, or the RowEngine for recurrent state and encoder-decoders, whose decoder starts
    from the checkpoint's decoder_start_token_id)."""
    from tessera.runtime import driver  # loaded when a batch runs: the parsers import this module

    from . import model as serving_model
    from .row_engine import engine_for

    tokenizer_path = serving_model.tokenizer_path(opts.tokenizer, opts.spec)
    tokenizer = serving_model.load_tokenizer(tokenizer_path) if tokenizer_path else None
    model = driver.serve_model(opts.model, opts)
    start = serving_model.decoder_start(tokenizer_path, opts.spec, opts.weights) if hasattr(model, "s2s") else None
    return engine_for(model, opts.max_batch, opts.max_queue, opts.max_context, opts.prefill_chunk,
                                    tokenizer, serving_model.eos_ids(tokenizer, tokenizer_path, opts.spec,
                                                                     opts.weights), start,
                      prefix_cache_mb=opts.prefix_cache_mb)


def run_local(opts: BatchOptions, rows: list[dict], journal: "Journal | None" = None) -> list[dict]:
    engine = load_engine(opts).start()
    try:
        if journal is None:
            return run_rows(engine, rows, opts.max_tokens)
        return run_rows(engine, rows, opts.max_tokens, journal.add, journal.done)
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------- the output

JOURNAL_SUFFIX = ".journal"  # results.jsonl.journal: the finished rows of a run not yet written out
JOURNAL_VERSION = 1


def check_output(path: str) -> None:
    """--output can be written (checked before the model loads, so a bad path costs no work): a
    file name in an existing folder where a file can be created, not a folder, and not an existing
    non-regular file (a device, a FIFO)."""
    target = Path(path)
    if not path or target.name in ("", ".", ".."):
        raise UsageError(f"--output {path!r}: give a file name")
    if target.is_dir():
        raise UsageError(f"--output {path} is a folder; give a file name in it")
    if os.path.lexists(target) and not target.is_symlink() and not target.is_file():
        raise UsageError(f"--output {path} exists and is not a regular file")
    if not target.parent.is_dir():
        raise UsageError(f"--output {path}: the folder {target.parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".check", dir=target.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UsageError(f"--output {path}: cannot write there ({e.strerror or e})") from None


def journal_path(output: str) -> Path:
    return Path(output).with_name(Path(output).name + JOURNAL_SUFFIX)


def fingerprint(opts: BatchOptions, input_bytes: bytes) -> str:
    """What a journal's rows depend on: the input file's bytes and every option but --output and
    --resume (the same command, so a resumed run's rows equal an uninterrupted run's)."""
    settings = {k: v for k, v in asdict(opts).items() if k not in ("output", "resume", "input")}
    h = hashlib.sha256(input_bytes)
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()


class Journal:
    """The finished rows of a run, one JSON line each as it finishes (``{"row": i, "result": ...}``
    after a header naming the run's fingerprint), flushed at once, beside --output. A run that is
    interrupted keeps them; ``--resume`` reads them back (a last line cut short is dropped) and runs
    only the other rows. Removed once the output is written."""

    def __init__(self, opts: BatchOptions, rows: int):
        self.path = journal_path(opts.output)
        self.rows = rows
        self.fingerprint = fingerprint(opts, Path(opts.input).read_bytes())
        self.done: dict[int, dict] = {}
        if self.path.exists() and not opts.resume:
            raise UsageError(f"{self.path} holds the finished rows of an interrupted run: add --resume to continue "
                             f"it, or remove the file to start again")
        if opts.resume and self.path.exists():
            self.done, end = self._read()
            try:  # drop a last line cut short, then go on appending
                os.truncate(self.path, end)
                self._file = open(self.path, "a", encoding="utf-8")
            except OSError as e:
                raise UsageError(f"cannot write the journal {self.path} ({e.strerror or e})") from None
            return
        if opts.resume:
            print(f"--resume: no journal at {self.path}; running every row", file=sys.stderr)
        try:
            self._file = open(self.path, "w", encoding="utf-8")
            self._file.write(json.dumps({"tessera_batch_journal": JOURNAL_VERSION, "fingerprint": self.fingerprint,
                                         "rows": self.rows}) + "\n")
            self._file.flush()
        except OSError as e:
            raise UsageError(f"cannot write the journal {self.path} ({e.strerror or e})") from None

    def _read(self) -> tuple[dict[int, dict], int]:
        """The finished rows, and the length in bytes of the journal up to its last whole line."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise UsageError(f"--resume: cannot read {self.path} ({e.strerror or e})") from None
        lines = data.split(b"\n")
        try:
            header = json.loads(lines[0])
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict) or header.get("tessera_batch_journal") != JOURNAL_VERSION:
            raise UsageError(f"--resume: {self.path} is not a journal of `tessera batch`; remove it to start again")
        if header.get("fingerprint") != self.fingerprint or header.get("rows") != self.rows:
            raise UsageError(f"--resume: {self.path} is the journal of another run (a different input file or "
                             f"options); run the same command to resume it, or remove it to start again")
        done, end = {}, len(lines[0]) + 1
        for line in lines[1:-1]:  # the part after the last newline is a line being written when the run stopped
            end += len(line) + 1
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(entry, dict) and isinstance(entry.get("row"), int) and 0 <= entry["row"] < self.rows \
                    and isinstance(entry.get("result"), dict):
                done[entry["row"]] = entry["result"]
        return done, min(end, len(data))

    def add(self, i: int, result: dict) -> None:
        self._file.write(json.dumps({"row": i, "result": result}) + "\n")
        self._file.flush()
        self.done[i] = result

    @property
    def kept(self) -> bool:
        """Whether it holds any finished row (else an interrupted run leaves nothing behind)."""
        return bool(self.done)

    def close(self, finished: bool) -> None:
        self._file.close()
        if finished or not self.kept:
            self.path.unlink(missing_ok=True)


def write_atomically(path: str, results: list[dict]) -> None:
    """One JSON line per result, into a temporary file beside ``path`` renamed over it at the end."""
    target = Path(path)
    if not target.parent.is_dir():
        raise UsageError(f"--output {path}: the folder {target.parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise UsageError(f"--output {path}: cannot write there ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UsageError(f"--output {path}: cannot write it ({e.strerror or e})") from None
        raise
