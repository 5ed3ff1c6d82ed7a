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
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from tessera.runtime.errors import UsageError
from tessera.runtime.options import EngineOptions

if TYPE_CHECKING:  # the engine (and onnxruntime behind it) is imported when a batch runs, not for --help
    from .engine import Engine, Handle, Request

ROW_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "min_p",
              "no_repeat_ngram_size", "min_tokens")

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

    def check(self) -> None:
        super().check()
        for name, low in (("max_tokens", 1), ("concurrency", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value}")
        if (self.concurrency != 1 or self.address) and not self.ray:
            raise UsageError("--concurrency and --address apply with --ray")
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
        raise RowError(f"{name} must be an integer" + (f" >= {low}" if low is not None else "") + f", got {v!r}")
    return v


def _number(row: dict, name: str, default: float) -> float:
    v = row.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise RowError(f"{name} must be a number, got {v!r}")
    return float(v)


def row_request(row: dict, engine: Engine, default_max_tokens: int) -> Request:
    """The engine Request for one input row (RowError for a bad field); the engine's own checks
    (context, vocabulary, sampling values) run at submission."""
    from .engine import Request
    from .model import Sampling, encode_prompts, stop_token_ids

    unknown = sorted(set(row) - set(ROW_FIELDS))
    if unknown:
        raise RowError(f"unknown field {unknown[0]!r} (a row takes {', '.join(ROW_FIELDS)})")
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
        raise RowError(f"stop must be a string or a list of strings, got {stop!r}")
    if stops and tokenizer is None:
        raise RowError("stop strings need --tokenizer")
    max_tokens = _whole(row, "max_tokens", 1)
    sampling = Sampling(_number(row, "temperature", 0.0),
                        _whole(row, "top_k", 0) or 0, _number(row, "top_p", 1.0),
                        _number(row, "repetition_penalty", 1.0), _whole(row, "seed"), _number(row, "min_p", 0.0),
                        _whole(row, "no_repeat_ngram_size", 0) or 0, _whole(row, "min_tokens", 0) or 0)
    return Request(ids, max_tokens if max_tokens is not None else default_max_tokens, sampling,
                   tuple(stop_token_ids(tokenizer, stops)), tuple(s for s in stops if s))


# ---------------------------------------------------------------------------------------- results


def result_of(handle: Handle, engine: Engine) -> dict:
    """A finished request's output line: text as the completion route gives it (a final stop or
    end-of-sequence token left out, cut at a stop string), all new token ids, the finish reason."""
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
        cut = min((text.find(s) for s in req.stop_strings if s in text), default=-1)
        out["text"] = text[:cut] if cut >= 0 else text
    out["tokens"] = tokens
    out["finish_reason"] = handle.finish_reason
    return out


def run_rows(engine: Engine, rows: list[dict], default_max_tokens: int) -> list[dict]:
    """Every row through a started engine, one result per row in row order. Rows are submitted as
    fast as the engine's bounds allow: past them (Overloaded), wait for the oldest row in flight."""
    from .engine import Overloaded, RequestError, Unavailable

    results: list[dict | None] = [None] * len(rows)
    in_flight: collections.deque[tuple[int, Handle]] = collections.deque()

    def settle_oldest() -> None:
        i, h = in_flight.popleft()
        h.wait()
        results[i] = result_of(h, engine)

    for i, row in enumerate(rows):
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
            results[i] = {"error": str(e)}
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
    from tessera.runtime import driver

    from . import model as serving_model
    from .row_engine import engine_for

    tokenizer_path = serving_model.tokenizer_path(opts.tokenizer, opts.spec)
    tokenizer = serving_model.load_tokenizer(tokenizer_path) if tokenizer_path else None
    model = driver.serve_model(opts.model, opts)
    start = serving_model.decoder_start(tokenizer_path, opts.spec, opts.weights) if hasattr(model, "s2s") else None
    return engine_for(model, opts.max_batch, opts.max_queue, opts.max_context, opts.prefill_chunk,
                                    tokenizer, serving_model.eos_ids(tokenizer, tokenizer_path, opts.spec,
                                                                     opts.weights), start)


def run_local(opts: BatchOptions, rows: list[dict]) -> list[dict]:
    engine = load_engine(opts).start()
    try:
        return run_rows(engine, rows, opts.max_tokens)
    finally:
        engine.close()


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
