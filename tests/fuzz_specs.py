"""Grammar-aware fuzzing of the spec front end through the command line.

Each case takes one of the bundled specs (models/*.tsr) or the standard library
(spec/stdlib/nn.tsr), cuts it into the grammar's tokens (names, numbers,
strings, operators, brackets, comments, whitespace) and applies one to three
token-level mutations: delete, duplicate or swap tokens, replace a number by a
huge, negative, zero or fractional value, replace a name by another name of the
same file, wrap an expression in deep nesting, insert a call of a random
builtin, duplicate or delete a line, or cut the file short. The mutated text
is written to a file and given to ``tessera ir`` and ``tessera report``.

Cases run in worker processes (each imports Tessera once) with an address-space
cap (RLIMIT_AS, 4 GiB by default) and a per-case time limit (20 s of CPU by
default, or four times that in wall time: the machine is shared, and a case
blocked on a read uses no CPU); a worker that overruns is killed and counted as a hang, a MemoryError or a
worker that dies is a memory blow-up, and an exception escaping ``main`` (or
the text "Traceback" on stderr) is a traceback. Every other case must exit
with status 0 (the mutation was harmless) or 2 (a user error).

The test suite runs a few hundred cases (tests/spec/test_fuzz.py); the long run is

    python tests/fuzz_specs.py --cases 5000 --seed 1

which prints the counts and the failing cases (saved under --keep DIR).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "models").glob("*.tsr")) + [ROOT / "spec" / "stdlib" / "nn.tsr"]

# The spec language's tokens (spec/grammar.lark), in the order they must be tried.
TOKEN = re.compile(r"""
    (?P<ws>\s+) | (?P<comment>\#[^\n]*) | (?P<string>"([^"\\\n]|\\.)*")
  | (?P<number>\d+(\.\d*)?([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>\*\*|//|==|!=|<=|>=|\+=|-=|\*=|/=|->|[-+*/%<>=,:.()\[\]{}])
  | (?P<other>.)
""", re.VERBOSE)

HOSTILE_NUMBERS = ["0", "-1", "-7", "1e308", "1e400", "0.5", "2147483648", "1000000000", "9" * 40,
                   "10 ** 10 ** 10", "1e-320", "0.0", "-0.0", "3.7", "65536", "1 / 0", "0 ** -1"]


@dataclass
class Token:
    kind: str
    text: str


def tokenize(text: str) -> list[Token]:
    return [Token(m.lastgroup, m.group()) for m in TOKEN.finditer(text)]


def _builtin_names() -> list[str]:
    from tessera.compiler.frontend.builtins import BUILTINS

    return sorted(BUILTINS)


def mutate(text: str, rng: random.Random, builtins: list[str]) -> tuple[str, list[str]]:
    """One to three mutations of ``text``; returns the new text and what was done."""
    toks = tokenize(text)
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        real = [i for i, t in enumerate(toks) if t.kind not in ("ws", "comment")]
        if not real:
            break
        kind = rng.choice(["delete", "duplicate", "swap", "number", "number", "name", "name", "nest",
                           "builtin", "line", "truncate", "string", "token"])
        i = rng.choice(real)
        names = [t.text for t in toks if t.kind == "name"]
        if kind == "delete":
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, Token(toks[i].kind, toks[i].text))
        elif kind == "swap":
            j = rng.choice(real)
            toks[i], toks[j] = toks[j], toks[i]
        elif kind == "number":
            nums = [k for k in real if toks[k].kind == "number"] or [i]
            k = rng.choice(nums)
            toks[k] = Token("number", rng.choice(HOSTILE_NUMBERS))
        elif kind == "name":
            ids = [k for k in real if toks[k].kind == "name"] or [i]
            toks[rng.choice(ids)] = Token("name", rng.choice(names) if names else "x")
        elif kind == "nest":
            depth = rng.choice([50, 300, 1000, 3000])
            opener, closer = rng.choice([("(", ")"), ("[", "]"), ("-", ""), ("sqrt(", ")"), ("not ", ""),
                                         ("min(1, ", ")")])
            toks[i] = Token("other", opener * depth + toks[i].text + closer * depth)
        elif kind == "builtin":
            b = rng.choice(builtins)
            args = ", ".join(rng.choice(names + ["1", "-1", "2.5", "[1, 2]", '"x"', "none"])
                             for _ in range(rng.randint(0, 4)))
            toks.insert(i, Token("other", f" {b}({args}) "))
        elif kind == "line":
            lines = "".join(t.text for t in toks).split("\n")
            j = rng.randrange(len(lines))
            if rng.random() < 0.5:
                lines.insert(j, lines[rng.randrange(len(lines))])
            else:
                del lines[j]
            toks = tokenize("\n".join(lines))
        elif kind == "truncate":
            toks = toks[:i]
        elif kind == "string":
            toks[i] = Token("string", rng.choice(['"\\x4"', '"\\N{bogus}"', '"{d}"', '"{', '"\\u12"',
                                                   '"' + "a" * 5000 + '"', '"\x1b[31m"', '""']))
        else:  # a token from elsewhere in the file
            toks.insert(i, Token("other", " " + toks[rng.choice(real)].text + " "))
        done.append(kind)
    return "".join(t.text for t in toks), done


def make_cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    builtins = _builtin_names()
    texts = {p: p.read_text(encoding="utf-8") for p in SOURCES}
    cases = []
    for k in range(n):
        src = rng.choice(SOURCES)
        text, done = mutate(texts[src], rng, builtins)
        if src.parent.name == "stdlib":
            # The standard library is loaded by every spec; a mutated copy is used by a small model
            # and shadows it, so its blocks are elaborated.
            text += ("\nmodel FuzzMain(d = 16, heads = 2, vocab = 10) {\n  in tokens: i64[B, T]\n"
                     "  out y: f32[B, T, d]\n  h = embedding(tokens, vocab, d)\n"
                     "  h += attention(layernorm(h), heads, causal=true, rope_theta=10000.0)\n"
                     "  y = mlp(h, 2 * d)\n}\n")
        cmd = rng.choice(["ir", "report"])
        argv = [cmd, "{spec}"]
        if cmd == "report" and rng.random() < 0.3:
            argv += rng.choice([["--seq", "1000000000000"], ["--batch", "100000000"], ["--format", "json"],
                                ["--seq", "1"], ["--format", "csv"]])
        cases.append({"id": k, "source": src.relative_to(ROOT).as_posix(), "mutations": done,
                      "text": text, "argv": argv})
    return cases


# ---------------------------------------------------------------- workers
def _worker(conn, mem_bytes: int) -> None:
    import resource

    if mem_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tessera.runtime.cli import main

    tmp = tempfile.mkdtemp(prefix="tessera-fuzz-")
    try:
        _serve_cases(conn, os.path.join(tmp, "case.tsr"), main)
    finally:  # a worker killed for a hang leaves its folder, which run_cases' folder holds and removes
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _serve_cases(conn, spec: str, main) -> None:
    import traceback

    while True:
        case = conn.recv()
        if case is None:
            return
        with open(spec, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(case["text"])
        out, err = io.StringIO(), io.StringIO()
        status, rc, detail = "ok", None, ""
        try:
            with redirect_stdout(out), redirect_stderr(err):
                if case.get("selftest"):  # the harness's own test makes a case fail on purpose
                    exec(case["selftest"], {})
                rc = main([a.replace("{spec}", spec) for a in case["argv"]])
        except MemoryError:
            status, detail = "memory", traceback.format_exc()[-3000:]
        except RecursionError:
            status, detail = "traceback", traceback.format_exc()[-3000:]
        except SystemExit as e:  # argparse
            rc = e.code
        except BaseException:  # noqa: BLE001 - every escape from main is a bug
            status, detail = "traceback", traceback.format_exc()[-3000:]
        text = err.getvalue()
        if status == "ok":
            if "Traceback" in text:
                status, detail = "traceback", text[-3000:]
            elif rc == 0:
                status = "ok"
            elif rc == 2:
                status = "user_error"
            else:
                status, detail = "bad_status", f"exit status {rc}\n{text[-3000:]}"
        conn.send((status, rc, detail))
        if status == "memory":
            return  # the heap may be fragmented near the cap; a fresh worker takes over


class _Worker:
    def __init__(self, ctx, mem_bytes: int, target=_worker, args: tuple = ()):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, mem_bytes, *args), daemon=True)
        self.proc.start()
        child.close()
        self.case = None
        self.started = 0.0
        self.warm = False
        self.cpu_at_start: float | None = None

    def kill(self):
        self.proc.kill()
        self.proc.join()


def run_cases(cases: list[dict], workers: int = 2, timeout: float = 20.0,
              mem_bytes: int = 4 << 30, progress=None, worker=_worker, worker_args: tuple = (),
              setup_allowance: float = 30.0) -> list[dict]:
    """Run every case; returns one result per case: status (ok, user_error, traceback, hang, memory,
    bad_status), rc and detail.

    ``worker(conn, mem_bytes, *worker_args)`` is the worker's main loop (the command line by default;
    tests/fuzz_targets.py passes its own, which runs hypothesis targets); a fresh worker's first
    ``setup_allowance`` seconds (imports, fixtures) are not counted against its first case."""
    # Workers make their folders under one folder of the run's (TMPDIR, read by a spawned worker's
    # tempfile): a worker killed for a hang or its memory cannot remove its own, this run does.
    root = tempfile.mkdtemp(prefix="tessera-fuzz-run-")
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = root
    try:
        return _run_cases(cases, workers, timeout, mem_bytes, progress, worker, worker_args, setup_allowance)
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _run_cases(cases, workers, timeout, mem_bytes, progress, worker, worker_args, setup_allowance) -> list[dict]:
    ctx = mp.get_context("spawn")
    pending = list(reversed(cases))
    results: dict[int, dict] = {}

    def fresh() -> _Worker:
        return _Worker(ctx, mem_bytes, worker, worker_args)

    pool = [fresh() for _ in range(min(workers, len(cases)))]
    import multiprocessing.connection as mpc

    def give(w: _Worker) -> None:
        if pending:
            w.case = pending.pop()
            w.started = time.monotonic()
            w.cpu_at_start = _cpu_seconds(w.proc.pid) if w.warm else None
            w.conn.send(w.case)
        else:
            w.case = None

    def finish(w: _Worker, status: str, rc, detail: str) -> None:
        results[w.case["id"]] = {**w.case, "status": status, "rc": rc, "detail": detail,
                                 "seconds": round(time.monotonic() - w.started, 2)}
        if progress:
            progress(len(results), len(cases), status)

    for w in pool:
        give(w)
    while any(w.case is not None for w in pool):
        busy = [w for w in pool if w.case is not None]
        # Workers are spawned fresh and import Tessera first, so the clock starts on the first send.
        ready = mpc.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=0.5)
        for i, w in enumerate(pool):
            if w.case is None:
                continue
            if w.conn in ready or w.conn.poll():
                try:
                    status, rc, detail = w.conn.recv()
                except EOFError:
                    status, rc, detail = "memory", None, f"worker died (exit code {w.proc.exitcode})"
                finish(w, status, rc, detail)
                w.warm = True
                if not w.proc.is_alive() or status in ("memory",):
                    w.proc.join()
                    pool[i] = w = fresh()
                give(w)
            elif not w.proc.is_alive():
                finish(w, "memory", None, f"worker died (exit code {w.proc.exitcode})")
                pool[i] = w = fresh()
                give(w)
            elif _overran(w, timeout, setup_allowance):
                w.kill()
                finish(w, "hang", None, f"over {timeout:g} s of CPU (or {WALL_FACTOR * timeout:g} s of wall time)")
                pool[i] = w = fresh()
                give(w)
    for w in pool:
        try:
            w.conn.send(None)
        except OSError:
            pass
        w.proc.join(timeout=5)
        if w.proc.is_alive():
            w.kill()
    return [results[c["id"]] for c in cases]


# The machine this runs on is shared: a case is a hang when it has used ``timeout`` seconds of CPU,
# or WALL_FACTOR times that in wall time (a case blocked on a FIFO uses no CPU at all).
WALL_FACTOR = 4


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _overran(w: _Worker, timeout: float, setup_allowance: float = 30.0) -> bool:
    """Whether the case in ``w`` is past its limit; a fresh worker's import of Tessera (its first
    ``setup_allowance`` seconds) is not counted."""
    if w.cpu_at_start is None:
        w.cpu_at_start = _cpu_seconds(w.proc.pid) if w.warm else 0.0
    allowance = 0.0 if w.warm else setup_allowance
    wall = time.monotonic() - w.started
    cpu = _cpu_seconds(w.proc.pid) - w.cpu_at_start
    return cpu > timeout + allowance or wall > WALL_FACTOR * timeout + allowance


FAILURES = ("traceback", "hang", "memory", "bad_status")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fuzz the spec front end through tessera ir / report.")
    p.add_argument("--cases", type=int, default=500, help="number of mutated specs (default 500)")
    p.add_argument("--seed", type=int, default=1, help="seed of the mutations (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per case before a hang (default 20)")
    p.add_argument("--mem-gib", type=float, default=4.0, help="address-space cap per worker (default 4 GiB)")
    p.add_argument("--keep", metavar="DIR", help="write each failing case's spec and detail into DIR")
    args = p.parse_args(argv)
    if args.cases < 1 or args.workers < 1 or args.timeout <= 0 or args.mem_gib <= 0:
        p.error("--cases, --workers, --timeout and --mem-gib must be positive")
    t0 = time.monotonic()
    cases = make_cases(args.cases, args.seed)

    def progress(done, total, status):
        if done % 250 == 0 or status in FAILURES:
            print(f"  {done}/{total} ({time.monotonic() - t0:.0f} s){'  ' + status if status in FAILURES else ''}",
                  file=sys.stderr, flush=True)

    results = run_cases(cases, args.workers, args.timeout, int(args.mem_gib * (1 << 30)), progress)
    counts = Counter(r["status"] for r in results)
    print(f"{len(results)} cases, seed {args.seed}, {time.monotonic() - t0:.0f} s: "
          f"tracebacks {counts['traceback']}, hangs {counts['hang']}, memory blow-ups {counts['memory']}, "
          f"other exit statuses {counts['bad_status']}, ok {counts['ok']}, user errors {counts['user_error']}")
    bad = [r for r in results if r["status"] in FAILURES]
    if args.keep and bad:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        for r in bad:
            (keep / f"case{r['id']}.tsr").write_text(r["text"], encoding="utf-8", errors="surrogateescape")
            (keep / f"case{r['id']}.txt").write_text(
                f"{r['status']} {r['source']} {r['mutations']} {' '.join(r['argv'])}\n{r['detail']}\n")
    for r in bad[:20]:
        print(f"--- case {r['id']} ({r['status']}, {r['source']}, {r['mutations']}, {' '.join(r['argv'])})\n"
              f"{r['detail'][-1200:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
