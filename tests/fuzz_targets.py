"""The long run of the hypothesis fuzz targets (issue 25): each case in a bounded worker.

tests/io/test_fuzz_inputs.py and tests/serving/test_fuzz_serve.py are hypothesis tests; in CI they run a few
dozen cases each inside pytest's own process. That is no place for a long run: a case that spins in
C (a regex, onnxruntime) cannot be interrupted, and one that allocates 100 GiB takes the whole run
down. Here the parent draws a target's cases with hypothesis (the test's own strategies, seeded),
and worker processes run them one at a time through the test's body (``inner_test``) with the same
fixtures, under the spec fuzzer's bounds (tests/fuzz_specs.py ``run_cases``): an address-space cap
(RLIMIT_AS, 4 GiB by default) and 20 s of CPU per case (or four times that in wall time, the machine
being shared). A case that overruns is a hang, a MemoryError or a dead worker a memory blow-up, and
any exception escaping the body (the bodies already accept the documented errors) a traceback.
Each failing case is kept with its reproducer -- its arguments, pickled and as ``repr`` -- and

    python tests/fuzz_targets.py --replay DIR/<target>-<id>.pickle

runs it again in this process, to see the traceback. The long run itself (docs/guarantees.md):

    nice -n 19 python tests/fuzz_targets.py --target mapping_files --cases 5000
"""

from __future__ import annotations

import argparse
import inspect
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import fuzz_specs  # noqa: E402

MODULES = ("test_fuzz_inputs", "test_fuzz_serve")


def targets() -> dict:
    """Every hypothesis test of MODULES by short name (``test_fuzz_`` or ``test_`` dropped)."""
    import importlib

    found = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, test in vars(module).items():
            if attr.startswith("test_") and hasattr(test, "hypothesis"):
                found[attr.removeprefix("test_").removeprefix("fuzz_")] = test
    return found


def draw_cases(test, n: int, seed: int) -> list[dict]:
    """``n`` argument sets drawn from ``test``'s own strategies (fewer if hypothesis runs out of
    distinct ones), each pickled as the worker will receive it."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    drawn: list[bytes] = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(**test.hypothesis._given_kwargs)  # the test's strategies (hypothesis keeps them here)
    def collect(**kwargs):
        drawn.append(pickle.dumps(kwargs))

    collect()
    return [{"id": k, "args": a} for k, a in enumerate(drawn)]


class _TmpFactory:
    """What the bodies use of pytest's ``tmp_path_factory``: numbered fresh folders under ``root``."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0

    def mktemp(self, name: str) -> Path:
        self.count += 1
        path = self.root / f"{name}{self.count}"
        path.mkdir(parents=True)
        return path

    def clear(self) -> None:
        for child in self.root.iterdir():
            shutil.rmtree(child, ignore_errors=True)


def _fixtures(names: list[str], stack: ExitStack, tmp: Path) -> dict:
    """The pytest fixtures a body takes, built from the same functions the test modules use."""
    import test_fuzz_inputs

    made: dict = {}
    for name in names:
        if name == "tmp_path_factory":
            made[name] = _TmpFactory(tmp / "cases")
            (tmp / "cases").mkdir()
        elif name in ("model", "cache_meta"):
            model = made.get("model") or test_fuzz_inputs.tiny_model()
            made[name] = model if name == "model" else test_fuzz_inputs.read_cache_meta(model, Path(
                tempfile.mkdtemp(dir=tmp)))
        elif name == "client":
            import test_fuzz_serve

            made[name] = stack.enter_context(test_fuzz_serve.serving_client(Path(tempfile.mkdtemp(dir=tmp))))
        else:
            raise SystemExit(f"fuzz_targets: no worker fixture named {name!r}")
    return made


def _run_one(body, fixtures: dict, case: dict) -> tuple[str, str]:
    import traceback

    try:
        if case.get("selftest"):  # the harness's own test makes a case fail on purpose
            exec(case["selftest"], {})
        body(**fixtures, **pickle.loads(case["args"]))
    except MemoryError:
        return "memory", traceback.format_exc()[-3000:]
    except BaseException:  # noqa: BLE001 - the bodies accept the documented errors; anything else is a bug
        return "traceback", traceback.format_exc()[-3000:]
    return "ok", ""


def _target_worker(conn, mem_bytes: int, target: str) -> None:
    import resource

    if mem_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    test = targets()[target]
    body = test.hypothesis.inner_test
    given = set(test.hypothesis._given_kwargs)
    tmp = Path(tempfile.mkdtemp(prefix="tessera-fuzz-"))
    try:
        with ExitStack() as stack:
            fixtures = _fixtures([p for p in inspect.signature(body).parameters if p not in given], stack, tmp)
            factory = fixtures.get("tmp_path_factory")
            while True:
                case = conn.recv()
                if case is None:
                    return
                status, detail = _run_one(body, fixtures, case)
                conn.send((status, None, detail))
                if factory:
                    factory.clear()
                if status == "memory":
                    return  # the heap may be fragmented near the cap; a fresh worker takes over
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_target(target: str, cases: list[dict], workers: int = 1, timeout: float = 20.0, mem_bytes: int = 4 << 30,
               progress=None, setup_allowance: float = 300.0) -> list[dict]:
    """fuzz_specs.run_cases with this module's worker: status ok, traceback, hang or memory per case.
    A worker's setup (imports, a compiled model, a server) gets ``setup_allowance`` seconds that its
    first case is not charged for (generous: under ``nice -n 19`` on a busy machine a worker gets a
    small share of a core, and a false hang would hide the real ones)."""
    return fuzz_specs.run_cases(cases, workers, timeout, mem_bytes, progress, worker=_target_worker,
                                worker_args=(target,), setup_allowance=setup_allowance)


def _keep(folder: Path, target: str, result: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{target}-{result['id']}"
    stem.with_suffix(".pickle").write_bytes(pickle.dumps({"target": target, "args": result["args"]}))
    args = pickle.loads(result["args"])
    stem.with_suffix(".txt").write_text(f"{target} case {result['id']}: {result['status']}\n"
                                        f"arguments: {args!r}\n{result['detail']}\n", errors="backslashreplace")
    return stem.with_suffix(".pickle")


def replay(path: Path) -> int:
    """Run one kept case in this process (no bounds), so its traceback shows."""
    kept = pickle.loads(path.read_bytes())
    test = targets()[kept["target"]]
    body = test.hypothesis.inner_test
    given = set(test.hypothesis._given_kwargs)
    print(f"{kept['target']}: {pickle.loads(kept['args'])!r}")
    tmp = Path(tempfile.mkdtemp(prefix="tessera-replay-"))
    try:
        with ExitStack() as stack:
            fixtures = _fixtures([p for p in inspect.signature(body).parameters if p not in given], stack, tmp)
            body(**fixtures, **pickle.loads(kept["args"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Long run of the hypothesis fuzz targets, each case in a bounded worker.")
    p.add_argument("--target", action="append", help="a target (repeatable; default: all, one after another)")
    p.add_argument("--list", action="store_true", help="list the targets and exit")
    p.add_argument("--cases", type=int, default=5000, help="cases per target (default 5000)")
    p.add_argument("--seed", type=int, default=1, help="hypothesis seed (default 1)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds of CPU per case before a hang (default 20)")
    p.add_argument("--mem-gib", type=float, default=4.0, help="address-space cap per worker (default 4 GiB)")
    p.add_argument("--keep", metavar="DIR", default="fuzz-failures",
                   help="where failing cases are written (default ./fuzz-failures)")
    p.add_argument("--replay", metavar="FILE", help="run one kept case (a .pickle from --keep) in this process")
    args = p.parse_args(argv)
    if args.replay:
        return replay(Path(args.replay))
    known = targets()
    if args.list:
        print("\n".join(known))
        return 0
    chosen = args.target or list(known)
    unknown = [t for t in chosen if t not in known]
    if unknown:
        p.error(f"unknown target {unknown[0]!r}; --list shows them")
    if args.cases < 1 or args.workers < 1 or args.timeout <= 0 or args.mem_gib <= 0:
        p.error("--cases, --workers, --timeout and --mem-gib must be positive")
    failed = 0
    for target in chosen:
        t0 = time.monotonic()
        cases = draw_cases(known[target], args.cases, args.seed)

        def progress(done, total, status):
            if done % 500 == 0 or status in fuzz_specs.FAILURES:
                print(f"  {target}: {done}/{total} ({time.monotonic() - t0:.0f} s)"
                      f"{'  ' + status if status in fuzz_specs.FAILURES else ''}", file=sys.stderr, flush=True)

        results = run_target(target, cases, args.workers, args.timeout, int(args.mem_gib * (1 << 30)), progress)
        counts = Counter(r["status"] for r in results)
        slowest = max((r["seconds"] for r in results), default=0.0)
        print(f"{target}: {len(results)} cases, seed {args.seed}, {time.monotonic() - t0:.0f} s, slowest case "
              f"{slowest:.1f} s: tracebacks {counts['traceback']}, hangs {counts['hang']}, "
              f"memory blow-ups {counts['memory']}, passed {counts['ok']}", flush=True)
        for r in (r for r in results if r["status"] in fuzz_specs.FAILURES):
            failed += 1
            kept = _keep(Path(args.keep), target, r)
            print(f"--- {target} case {r['id']} ({r['status']}): {kept}\n{r['detail'][-1200:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
